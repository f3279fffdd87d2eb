"""RLVR reading real dataset layouts (issue 32, items 12 and 14): conversation prompts, verl's
parquet layout (`prompt` turns, `reward_model.ground_truth`, `data_source`), and the reward
domains of the data checked before a run. Unit tests on the built-in byte-level tokenizer
(token id == byte, so a prompt's ids are the bytes of its rendered chat text)."""

from __future__ import annotations

import json
from pathlib import Path

import datasets
import pytest

from roll_core.config.rlvr import RLVRConfig
from roll_core.data import encode_prompt
from roll_core.data.prompts import load_prompts
from roll_core.errors import ConfigError, DataError

QUESTION = "What is 2 + 3?"
START, END = 257, 258  # <|im_start|>, <|im_end|> of the built-in tokenizer


def chatml_ids(*turns: tuple[str, str]) -> list[int]:
    """ChatML by hand: <|im_start|>ROLE\nCONTENT<|im_end|>\n per turn, then the header."""
    ids: list[int] = []
    for role, content in turns:
        ids += [START, *f"{role}\n{content}".encode(), END, *b"\n"]
    return [*ids, START, *b"assistant\n"]


def verl_row(index: int, prompt: object, truth: str = "5") -> dict:
    """One row of verl's parquet layout (examples/data_preprocess/gsm8k.py)."""
    return {
        "data_source": "openai/gsm8k",
        "prompt": prompt,
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": truth},
        "extra_info": {"split": "train", "index": index},
    }


def write_parquet(path: Path, rows: list[dict]) -> str:
    datasets.Dataset.from_list(rows).to_parquet(str(path))
    return str(path)


def config(train: str, **data: object) -> RLVRConfig:
    return RLVRConfig.model_validate(
        {
            "model": {"path": "builtin:tiny-qwen3"},
            "data": {"train": {"path": train}, "max_prompt_length": 256, **data},
            "trainer": {"max_steps": 1},
        }
    )


@pytest.fixture(scope="module")
def tokenizer(cache_dir: Path):
    from roll_core.models import load_tokenizer, resolve_model_path

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ROLL_CACHE_DIR", str(cache_dir))
        return load_tokenizer(resolve_model_path("builtin:tiny-qwen3"))


@pytest.fixture(autouse=True)
def _datasets_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-datasets-cache")


def test_verl_layout_prompts_are_rendered_as_conversations(tokenizer, tmp_path: Path) -> None:
    turns = [{"role": "system", "content": "S"}, {"role": "user", "content": QUESTION}]
    path = write_parquet(
        tmp_path / "train.parquet",
        [verl_row(0, turns, "5"), verl_row(1, turns[1:], "7"), verl_row(2, [], "9")],
    )
    cfg = config(path, answer_key="reward_model.ground_truth")
    prompts, stats = load_prompts(cfg, tokenizer, cfg.data.train, "data.train.path")
    assert stats["rows"] == 3 and stats["dropped_empty"] == 1  # the row with no turns
    # [system S, user Q] renders exactly as the text prompt Q with system_prompt S
    assert prompts[0].prompt_ids == encode_prompt(tokenizer, QUESTION, system="S")
    assert prompts[0].prompt_ids == chatml_ids(("system", "S"), ("user", QUESTION))
    assert prompts[1].prompt_ids == encode_prompt(tokenizer, QUESTION)
    # the reward reads the ground truth as the row's answer; verl's other columns stay
    assert [p.row["answer"] for p in prompts] == ["5", "7"]
    assert prompts[0].row["extra_info"] == {"split": "train", "index": 0}


def test_prompt_table_reads_back_each_kept_row(tokenizer, tmp_path: Path) -> None:
    """The compact table (ids in one int32 array, rows left in the dataset) gives back what
    the rows say: the kept rows in order, each prompt's index its position, ids by hand."""
    rows = [
        {"question": "ab", "solution": "1", "n": 0},
        {"question": "", "solution": "2", "n": 1},  # empty: dropped
        {"question": "x" * 300, "solution": "3", "n": 2},  # too long: dropped
        {"question": "c", "solution": "4", "n": 3},
    ]
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = config(str(path), prompt_key="question", answer_key="solution", chat_template="none")
    prompts, stats = load_prompts(cfg, tokenizer, cfg.data.train, "data.train.path")
    assert (stats["rows"], stats["dropped_empty"], stats["dropped_too_long"]) == (4, 1, 1)
    assert len(prompts) == 2
    assert [p.index for p in prompts] == [0, 1]
    assert [p.prompt_ids for p in prompts] == [[97, 98], [99]]  # byte-level: a=97
    assert prompts[1].row == {"question": "c", "solution": "4", "n": 3, "answer": "4"}
    assert prompts[-1] == prompts[1] and prompts[0:2] == list(prompts)
    with pytest.raises(IndexError):
        prompts[2]


def test_system_prompt_goes_before_a_conversation_without_one(tokenizer, tmp_path) -> None:
    turns = [{"role": "user", "content": QUESTION}]
    own = [{"role": "system", "content": "own"}, *turns]
    path = write_parquet(tmp_path / "t.parquet", [verl_row(0, turns), verl_row(1, own)])
    cfg = config(path, answer_key="reward_model.ground_truth", system_prompt="Be brief.")
    prompts, _ = load_prompts(cfg, tokenizer, cfg.data.train, "data.train.path")
    assert prompts[0].prompt_ids == encode_prompt(tokenizer, QUESTION, system="Be brief.")
    assert prompts[1].prompt_ids == chatml_ids(("system", "own"), ("user", QUESTION))  # its own


@pytest.mark.parametrize(
    ("prompt", "error", "says"),
    [
        ([{"role": "robot", "content": "hi"}], DataError, "Row 1 of column 'prompt' in "),
        ([{"role": "user", "content": "hi"}, "hi"], DataError, "its item 1 is a str"),
    ],
)
def test_bad_conversations_name_the_row_and_column(
    tokenizer, tmp_path: Path, prompt: list, error: type, says: str
) -> None:
    good = [{"role": "user", "content": QUESTION}]
    path = tmp_path / "t.jsonl"
    import json

    path.write_text(
        "".join(json.dumps(verl_row(i, p)) + "\n" for i, p in enumerate([good, prompt]))
    )
    cfg = config(str(path), answer_key="reward_model.ground_truth")
    with pytest.raises(error) as err:
        load_prompts(cfg, tokenizer, cfg.data.train, "data.train.path")
    assert says in err.value.message and str(path) in err.value.message


def test_conversations_need_a_chat_template(tokenizer, tmp_path: Path) -> None:
    path = write_parquet(tmp_path / "t.parquet", [verl_row(0, [{"role": "user", "content": "q"}])])
    cfg = config(path, answer_key="reward_model.ground_truth", chat_template="none")
    with pytest.raises(ConfigError, match="holds conversations .* data.chat_template is none"):
        load_prompts(cfg, tokenizer, cfg.data.train, "data.train.path")


def test_missing_ground_truth_field_is_named(tokenizer, tmp_path: Path) -> None:
    path = write_parquet(tmp_path / "t.parquet", [verl_row(0, [{"role": "user", "content": "q"}])])
    cfg = config(path, answer_key="reward_model.answer")
    with pytest.raises(DataError, match="no field 'reward_model.answer'.*'style', 'ground_truth'"):
        load_prompts(cfg, tokenizer, cfg.data.train, "data.train.path")


# -- item 14: the reward domain of each row, known before the run ----------------------------


def test_one_reward_domain_is_the_default(tmp_path: Path) -> None:
    cfg = config("data.jsonl")
    assert cfg.reward.default_domain == "math"  # the only configured domain
    two = {"domains": {"math": "math", "code": {"rewards": [{"name": "code"}]}}}
    many = RLVRConfig.model_validate(
        {
            "model": {"path": "builtin:tiny-qwen3"},
            "data": {"train": {"path": "d.jsonl"}},
            "trainer": {"max_steps": 1},
            "reward": two,
        }
    )
    assert many.reward.default_domain is None


def test_rows_without_a_domain_are_a_validate_error_with_several_domains(tmp_path) -> None:
    from roll_core.pipelines.checks.rlvr import check_data_domains

    path = write_parquet(tmp_path / "t.parquet", [verl_row(0, [{"role": "user", "content": "q"}])])
    base = {
        "model": {"path": "builtin:tiny-qwen3"},
        "data": {"train": {"path": path}, "answer_key": "reward_model.ground_truth"},
        "trainer": {"max_steps": 1},
    }
    reward = {"domains": {"math": "math", "format": {"rewards": [{"name": "format"}]}}}
    cfg = RLVRConfig.model_validate({**base, "reward": reward})
    with pytest.raises(ConfigError) as err:
        check_data_domains(cfg)
    assert f"some rows of {path} (data.train.path, scored by reward)" in err.value.message
    assert "no 'domain' value and reward.default_domain is not set" in err.value.message
    # verl's `ability` column names the domain; `data_source` names a domain with no reward
    check_data_domains(
        RLVRConfig.model_validate({**base, "reward": {**reward, "domain_key": "ability"}})
    )
    with pytest.raises(ConfigError, match="domain\\(s\\) 'openai/gsm8k' with no reward"):
        check_data_domains(
            RLVRConfig.model_validate({**base, "reward": {**reward, "domain_key": "data_source"}})
        )
    check_data_domains(
        RLVRConfig.model_validate({**base, "reward": {**reward, "default_domain": "math"}})
    )
    # data that is not there yet (or on the hub) is left to the run
    base["data"]["train"]["path"] = str(tmp_path / "later.parquet")
    check_data_domains(RLVRConfig.model_validate({**base, "reward": reward}))
