"""Real dataset layouts through the real `roll` CLI (issue 32, items 12-14): verl's parquet
layout (conversation `prompt`, `reward_model.ground_truth`, `data_source`, `ability`), a
`datasets` save_to_disk folder, and reward domains checked by `roll validate`."""

from __future__ import annotations

import json
from pathlib import Path

import datasets
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]


def verl_parquet(path: Path, source: Path, rows: int) -> Path:
    """The tiny arithmetic rows in verl's layout (examples/data_preprocess/gsm8k.py)."""
    lines = source.read_text().splitlines()[:rows]
    out = []
    for i, line in enumerate(lines):
        row = json.loads(line)
        out.append(
            {
                "data_source": "openai/gsm8k",
                "prompt": [{"role": "user", "content": row["prompt"]}],
                "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": row["answer"]},
                "extra_info": {"split": "train", "index": i},
            }
        )
    datasets.Dataset.from_list(out).to_parquet(str(path))
    return path


def recipe(tmp_path: Path, train: Path, eval_path: Path | None = None, **sections) -> Path:
    data: dict = {
        "train": {"path": str(train)},
        "answer_key": "reward_model.ground_truth",
        "max_prompt_length": 64,
    }
    if eval_path is not None:
        data["eval"] = {"path": str(eval_path), "split": "test"}
    base: dict = {
        "pipeline": "rlvr",
        "runs_dir": str(tmp_path / "runs"),
        "model": {"path": "builtin:tiny-qwen3"},
        "data": data,
        "rollout": {"n": 2, "prompts_per_step": 4, "max_new_tokens": 4},
        "algorithm": {"preset": "grpo"},
        "trainer": {"max_steps": 1, "micro_batch_size": 8},
        "actor_train": {"num_threads": 1, "optim": {"lr": 1.0e-3}},
        "actor_infer": {"num_threads": 1},
        "checkpoint": {"every_steps": None},
        "tracking": {"backends": ["jsonl"]},
        **sections,
    }
    path = tmp_path / "rl.yaml"
    path.write_text(yaml.safe_dump(base, sort_keys=False))
    return path


def test_validate_checks_the_reward_domain_of_every_row(roll, tmp_path: Path) -> None:
    train = verl_parquet(tmp_path / "train.parquet", ROOT / "data/tiny-arith/train.jsonl", 16)
    two = {"domains": {"math": "math", "format": {"rewards": [{"name": "format"}]}}}
    res = roll("validate", str(recipe(tmp_path, train, reward=two)))
    assert res.returncode == 2, res.stdout + res.stderr
    assert "Traceback" not in res.stdout + res.stderr and "recipe is valid" not in res.stdout
    assert "no 'domain' value and reward.default_domain is not set" in res.stderr
    # verl's `ability` column names the domain: valid; `data_source` names none with a reward
    res = roll("validate", str(recipe(tmp_path, train, reward=two)), "reward.domain_key=ability")
    assert res.returncode == 0 and "recipe is valid" in res.stdout, res.stderr
    res = roll(
        "validate", str(recipe(tmp_path, train, reward=two)), "reward.domain_key=data_source"
    )
    assert res.returncode == 2 and "domain(s) 'openai/gsm8k' with no reward" in res.stderr


@pytest.mark.slow
def test_rlvr_trains_on_verl_parquet_and_a_save_to_disk_folder(roll, tmp_path: Path) -> None:
    train = verl_parquet(tmp_path / "train.parquet", ROOT / "data/tiny-arith/train.jsonl", 32)
    test = datasets.load_dataset("parquet", data_files=str(train), split="train")
    saved = tmp_path / "saved"
    datasets.DatasetDict(train=test, test=test.select(range(8))).save_to_disk(str(saved))
    path = recipe(tmp_path, train, saved, eval={"every_steps": 1})
    res = roll("train", "rlvr", str(path), "--run-id", "verl")
    assert res.returncode == 0, res.stdout + res.stderr
    out = res.stdout + res.stderr
    assert "data: 32 rows, 32 prompts used (0 too long, 0 empty); eval 8 prompts" in out
    logged = [
        json.loads(x) for x in (tmp_path / "runs/verl/metrics.jsonl").read_text().splitlines() if x
    ]
    step = next(r for r in logged if "rollout/reward_mean" in r)
    # the one configured domain scored every training sample, 4 prompts x 2 (rows carry no
    # `domain` column; the 8 eval samples are counted apart)
    assert step["reward/math/count"] == 8.0 and not step.get("reward/unknown_domain/count")
    assert any("eval/reward_mean" in r for r in logged)


def test_subset_picks_the_folder_of_a_hub_snapshot(roll, tmp_path: Path) -> None:
    """`<snapshot>/<config>/<split>-*.parquet` (issue 48, item 5): `subset` picks the folder,
    a subset the snapshot lacks is an error listing those it has."""
    snapshot = tmp_path / "gsm8k"
    for config, rows in (("main", 16), ("socratic", 4)):
        (snapshot / config).mkdir(parents=True)
        src = ROOT / "data/tiny-arith/train.jsonl"
        verl_parquet(snapshot / config / "train-00000-of-00001.parquet", src, rows)
    (snapshot / "README.md").write_text("card")
    path = recipe(tmp_path, snapshot)
    res = roll("validate", str(path), "data.train.subset=main")
    assert res.returncode == 0 and "recipe is valid" in res.stdout, res.stdout + res.stderr
    res = roll("validate", str(path), "data.train.subset=mian")
    err = " ".join(res.stderr.split())
    assert res.returncode == 2 and "Traceback" not in res.stdout + res.stderr, err
    assert f"data.train.subset='mian' names a subfolder of {str(snapshot)!r}" in err
    assert "its subfolders with data are 'main', 'socratic'" in err
    res = roll("validate", str(path))
    assert res.returncode == 2 and "set data.train.subset=main" in " ".join(res.stderr.split())
