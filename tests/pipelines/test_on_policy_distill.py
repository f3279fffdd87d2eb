"""On-policy distillation's recipe checks and teacher batches (CPU, no model run)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from pydantic import ValidationError

from roll_core.config.rlvr import RLVRConfig
from roll_core.data import Batch
from roll_core.errors import ConfigError, DataError
from roll_core.pipelines.on_policy_distill import (
    check_recipe,
    check_same_tokenizer,
    teacher_batch,
    teacher_of_rows,
    teacher_prompt_text,
    teacher_prompts,
    to_student_positions,
)

ROOT = Path(__file__).resolve().parents[2]


def config(tmp_path: Path, opd: dict, **extra: object) -> RLVRConfig:
    train = tmp_path / "train.jsonl"
    train.write_text(json.dumps({"prompt": "What is 1 + 2?", "answer": "3"}) + "\n")
    return RLVRConfig.model_validate(
        {
            "model": {"path": "builtin:tiny-qwen3"},
            "data": {"train": {"path": str(train)}},
            "algorithm": {"kl": {"coef": 0.0}, "on_policy_distill": opd},
            "trainer": {"max_steps": 1},
            **extra,
        }
    )


def test_unknown_mode_suggests_the_close_one(tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match="unknown value 'tokens'; did you mean 'token'"):
        config(tmp_path, {"teacher": {"path": "builtin:tiny-qwen3"}, "mode": "tokens"})


def test_top_k_and_clip_belong_to_their_own_modes(tmp_path: Path) -> None:
    teacher = {"path": "builtin:tiny-qwen3"}
    with pytest.raises(ValidationError, match="mode full has no such advantage"):
        config(tmp_path, {"teacher": teacher, "mode": "full", "clip": 3.0})
    with pytest.raises(ValidationError, match="top_k bounds the teacher's distributions"):
        config(tmp_path, {"teacher": teacher, "mode": "token", "top_k": 64})
    with pytest.raises(ValidationError, match="divergence 'jsd' needs the whole distributions"):
        config(tmp_path, {"teacher": teacher, "divergence": "jsd"})
    cfg = config(tmp_path, {"teacher": teacher, "mode": "full", "top_k": 64})
    assert cfg.algorithm.on_policy_distill.top_k == 64


def test_a_teacher_identical_to_the_student_without_context_is_refused(tmp_path) -> None:
    with pytest.raises(ValidationError, match="advantage would stay 0"):
        config(tmp_path, {"teacher": {}})
    with pytest.raises(ValidationError, match="has no teacher"):
        config(tmp_path, {})


def test_template_placeholders_are_checked(tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match=r"unknown placeholder \{answer\}"):
        config(tmp_path, {"teacher": {"context_key": "answer", "context_template": "{answer}"}})
    with pytest.raises(ValidationError, match=r"no \{context\} placeholder"):
        config(tmp_path, {"teacher": {"context_key": "answer", "context_template": "{prompt}"}})


def test_privileged_column_missing_from_the_data_names_the_columns(tmp_path: Path) -> None:
    cfg = config(tmp_path, {"teacher": {"context_key": "solution"}})
    with pytest.raises(ConfigError, match="no column 'solution' \\(its columns: prompt, answer\\)"):
        check_recipe(cfg)
    cfg = config(tmp_path, {"teacher": {"context_key": "answr"}})
    with pytest.raises(ConfigError, match="Did you mean 'answer'"):
        check_recipe(cfg)
    check_recipe(config(tmp_path, {"teacher": {"context_key": "answer"}}))  # fine


def test_per_domain_teachers_name_reward_domains(tmp_path: Path) -> None:
    cfg = config(tmp_path, {"teachers": {"maths": {"path": "builtin:tiny-qwen3"}}})
    with pytest.raises(ConfigError, match="teachers.maths.*Did you mean 'math'"):
        check_recipe(cfg)
    cfg = config(
        tmp_path,
        {"teachers": {"math": {"path": "builtin:tiny-qwen3"}}},
        reward={"domains": {"math": "math", "code": "exact_match"}},
    )
    with pytest.raises(ConfigError, match="domain 'code' has no teacher"):
        check_recipe(cfg)


def test_pure_distillation_refuses_kl_in_the_reward(tmp_path: Path) -> None:
    cfg = RLVRConfig.model_validate(
        config(tmp_path, {"teacher": {"path": "builtin:tiny-qwen3"}}).model_dump()
        | {"algorithm": {"kl": {"coef": 0.1, "use_as": "reward"},
                         "on_policy_distill": {"teacher": {"path": "builtin:tiny-qwen3"}}}}
    )  # fmt: skip
    with pytest.raises(ConfigError, match="kl.use_as: loss"):
        check_recipe(cfg)


class Vocab:
    def __init__(self, vocab: dict[str, int]) -> None:
        self.vocab = vocab

    def get_vocab(self) -> dict[str, int]:
        return self.vocab


def test_different_tokenizers_name_the_first_differing_token() -> None:
    student = Vocab({"a": 0, "b": 1, "c": 2, "d": 3})
    teacher = Vocab({"a": 0, "b": 1, "x": 2, "y": 3, "z": 4})
    with pytest.raises(ConfigError) as err:
        check_same_tokenizer(student, teacher, student="S", teacher="T", key="k.teacher")
    message = str(err.value)
    assert "token id 2 is 'x' for the teacher and 'c' for the student" in message
    assert "the first of 3 ids that differ" in message
    check_same_tokenizer(student, Vocab(dict(student.vocab)), student="S", teacher="T", key="k")


def test_teacher_prompt_text_fills_the_template_or_the_last_user_turn() -> None:
    template = "{prompt} (answer: {context})"
    assert teacher_prompt_text("What is 1 + 2?", "3", template) == "What is 1 + 2? (answer: 3)"
    turns = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "1 + 2?"},
    ]
    out = teacher_prompt_text(turns, 3, template)
    assert out[3]["content"] == "1 + 2? (answer: 3)" and out[1]["content"] == "hi"
    assert turns[3]["content"] == "1 + 2?"  # the student's prompt is untouched


def test_teacher_prompts_need_the_column_in_every_row() -> None:
    cfg = RLVRConfig.model_validate(
        {
            "model": {"path": "builtin:tiny-qwen3"},
            "data": {"train": {"path": "x.jsonl"}},
            "algorithm": {"on_policy_distill": {"teacher": {"context_key": "answer"}}},
            "trainer": {"max_steps": 1},
        }
    ).algorithm.on_policy_distill
    assert cfg is not None
    ok = SimpleNamespace(index=0, row={"prompt": "p", "answer": "7"}, vision=None)
    ids = teacher_prompts(cfg, [ok], prompt_key="prompt", encode=lambda t: [len(t)], source="x")
    assert ids == {"teacher": {0: [len("p\n\nReference answer: 7")]}}
    bad = SimpleNamespace(index=1, row={"prompt": "p", "answer": ""}, vision=None)
    with pytest.raises(DataError, match="prompt 1.*column 'answer'"):
        teacher_prompts(cfg, [ok, bad], prompt_key="prompt", encode=lambda t: [0], source="x")


def rollout_batch() -> Batch:
    # row 0: prompt [5, 6], response [7, 8, 9]; row 1: prompt [5, 6, 6, 6], response [4]
    ids = torch.tensor([[5, 6, 7, 8, 9], [5, 6, 6, 6, 4]])
    resp = torch.tensor([[0.0, 1, 1, 1], [0, 0, 0, 1]])
    return Batch(
        tensors={
            "input_ids": ids,
            "attention_mask": torch.ones_like(ids),
            "response_mask": resp,
            "response_lengths": torch.tensor([3, 1]),
        },
        non_tensors={"domain": ["math", "code"], "prompt_index": [10, 11]},
        meta={},
    )


def test_teacher_batch_swaps_the_prompt_and_keeps_the_response() -> None:
    batch = rollout_batch()
    tb, plens = teacher_batch(batch, [0, 1], [[1, 2, 3], None], pad_id=0)
    # row 0: teacher prompt [1, 2, 3] + response [7, 8, 9]; row 1: its own prompt + [4]
    assert tb.tensors["input_ids"].tolist() == [[1, 2, 3, 7, 8, 9], [5, 6, 6, 6, 4, 0]]
    assert tb.tensors["attention_mask"].tolist() == [[1] * 6, [1, 1, 1, 1, 1, 0]]
    # target position t scores token t+1: responses start at prompt length - 1
    assert tb.tensors["response_mask"].tolist() == [[0, 0, 1, 1, 1], [0, 0, 0, 1, 0]]
    assert plens.tolist() == [3, 4]
    # teacher log-probs at the teacher's positions come back at the student's
    lp = torch.tensor([[9.0, 9.0, -1.0, -2.0, -3.0], [9.0, 9.0, 9.0, -4.0, 9.0]])
    back = to_student_positions(lp, plens, batch, [0, 1])
    assert back.tolist() == [[0.0, -1.0, -2.0, -3.0], [0.0, 0.0, 0.0, -4.0]]


def test_rows_go_to_their_domain_teacher_else_the_default() -> None:
    both = RLVRConfig.model_validate(
        {
            "model": {"path": "builtin:tiny-qwen3"},
            "data": {"train": {"path": "x.jsonl"}},
            "algorithm": {
                "on_policy_distill": {
                    "teacher": {"path": "builtin:tiny-qwen3"},
                    "teachers": {"code": {"path": "builtin:tiny-qwen3"}},
                }
            },
            "trainer": {"max_steps": 1},
        }
    ).algorithm.on_policy_distill
    assert both is not None
    assert teacher_of_rows(both, ["math", "code", "math"]) == {
        "teacher": [0, 2],
        "teacher_code": [1],
    }
    only_code = both.model_copy(update={"teacher": None})
    with pytest.raises(DataError, match="domain 'math' has no teacher"):
        teacher_of_rows(only_code, ["math", "code"])


def test_a_builtin_teacher_with_another_tokenizer_is_refused_at_validation(tmp_path) -> None:
    # builtin:tiny-qwen2.5-vl adds vision tokens after the 259 of builtin:tiny-qwen3
    cfg = config(tmp_path, {"teacher": {"path": "builtin:tiny-qwen2.5-vl"}})
    with pytest.raises(ConfigError, match="token id 259 is '<\\|vision_start\\|>' for the teacher"):
        check_recipe(cfg)
