"""End-to-end vision-language runs through the real CLI on builtin:tiny-qwen2.5-vl.

One SFT run on image rows (two bad images skipped and counted), then RLVR from its export:
trainer and sampler log-probs agree at every step (so the weights synced after each update,
checked by log-probs, not by the sync path), and a run stopped at step 2 and resumed equals
the straight run bitwise.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from roll_core.data.shapes import write_shapes_dataset

pytestmark = pytest.mark.slow


def _rows(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x]


@pytest.fixture
def shapes(tmp_path: Path) -> Path:
    data = tmp_path / "shapes"
    write_shapes_dataset(data, n_train=48, n_test=8, seed=1)
    (data / "images" / "broken.png").write_bytes(b"\x89PNG not really")
    bad = [
        {"images": ["images/missing.png"], "prompt": "How many squares?", "answer": "1"},
        {"images": "images/broken.png", "prompt": "How many squares?", "answer": "1"},
    ]
    with open(data / "train.jsonl", "a", encoding="utf-8") as f:
        for row in bad:
            f.write(json.dumps({**row, "response": "1", "domain": "math"}) + "\n")
    return data


def _write(path: Path, recipe: dict) -> Path:
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return path


def test_vlm_sft_then_rlvr_token_in_token_out_and_bitwise_resume(
    roll, shapes: Path, tmp_path: Path
) -> None:
    runs = tmp_path / "runs"
    sft = _write(
        tmp_path / "sft.yaml",
        {
            "pipeline": "sft",
            "runs_dir": str(runs),
            "model": {"path": "builtin:tiny-qwen2.5-vl"},
            "data": {
                "train": {"path": str(shapes / "train.jsonl")},
                "eval": {"path": str(shapes / "test.jsonl")},
                "max_length": 64,
            },
            # enough steps to answer with a digit (a reward that varies within groups)
            "trainer": {"max_steps": 20, "micro_batch_size": 8},
            "actor_train": {"num_threads": 1, "optim": {"lr": 3.0e-3}},
            "eval": {"every_steps": 20, "exact_match": True, "batch_size": 8, "max_new_tokens": 3},
            "tracking": {"backends": ["console", "jsonl"]},
        },
    )
    res = roll("sft", str(sft), "--run-id", "vl-sft")
    assert res.returncode == 0, res.stderr
    assert "48 used" in res.stdout + res.stderr and "2 with an unreadable image skipped" in (
        res.stdout + res.stderr
    )
    final = runs / "vl-sft" / "final"
    assert (final / "preprocessor_config.json").is_file()  # the export loads as a VLM
    assert "eval/exact_match" in _rows(runs / "vl-sft")[-1]

    def rl(max_steps: int) -> dict:
        return {
            "pipeline": "rlvr",
            "runs_dir": str(runs),
            "model": {"path": str(final)},
            "data": {
                "train": {"path": str(shapes / "train.jsonl")},
                "eval": {"path": str(shapes / "test.jsonl")},
                "max_prompt_length": 64,
            },
            "rollout": {
                "n": 4,
                "prompts_per_step": 3,
                "max_new_tokens": 3,
                # fixed batches: the resume below is bit-exact
                "deterministic": True,
                "chunk_size": 6,
            },
            "algorithm": {"preset": "grpo"},
            # recompute: the old log-probs come from their own forward, so the gap to the
            # sampler's is logged per token (train_infer/logprob_diff_max)
            "trainer": {
                "max_steps": max_steps,
                "micro_batch_size": 5,
                "old_log_probs": "recompute",
            },
            "actor_train": {
                "num_threads": 1,
                "optim": {"lr": 1.0e-3, "scheduler": "constant"},
            },
            "actor_infer": {"num_threads": 1},
            "eval": {"every_steps": 3},
            "checkpoint": {"every_steps": 2, "keep_last": 2},
            "tracking": {"backends": ["console", "jsonl"]},
        }

    res = roll("train", "rlvr", str(_write(tmp_path / "rl.yaml", rl(3))), "--run-id", "vl-rl")
    assert res.returncode == 0, res.stderr
    logged = _rows(runs / "vl-rl")
    assert [r["step"] for r in logged] == [0, 1, 2, 3]
    # sampler log-probs (hf generate, left-padded, images concatenated per chunk) equal the
    # trainer's (right-padded micro-batches of 5: image rows split across forwards), fp32;
    # from step 2 on this holds only if the updated weights reached the sampler
    for r in logged[1:]:
        assert r["train_infer/logprob_diff_max"] < 1e-4, r
    assert all(r["train/grad_norm"] > 0 for r in logged[1:3]), logged
    assert "eval/accuracy" in logged[0] and "eval/accuracy" in logged[-1]

    # stopped after step 2, resumed to 3: bitwise the straight run
    res = roll("train", "rlvr", str(_write(tmp_path / "rl2.yaml", rl(2))), "--run-id", "vl-rs")
    assert res.returncode == 0, res.stderr
    res = roll("resume", "vl-rs", "--runs-dir", str(runs), "trainer.max_steps=3")
    assert res.returncode == 0, res.stderr
    a = load_file(str(runs / "vl-rl" / "final" / "model.safetensors"))
    b = load_file(str(runs / "vl-rs" / "final" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert any("visual" in k for k in a)


def test_vlm_bad_inputs_are_clear_errors(roll, shapes: Path, tmp_path: Path) -> None:
    recipe = _write(
        tmp_path / "rl.yaml",
        {
            "pipeline": "rlvr",
            "runs_dir": str(tmp_path / "runs"),
            "model": {"path": "builtin:tiny-qwen3"},
            "data": {"train": {"path": str(shapes / "train.jsonl")}},
            "rollout": {"n": 2, "prompts_per_step": 2, "max_new_tokens": 2},
            "trainer": {"max_steps": 1},
        },
    )
    # a text-only model given image rows: names the model and the column
    res = roll("train", "rlvr", str(recipe))
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert "builtin:tiny-qwen3" in res.stderr and "'images'" in res.stderr
    assert not (tmp_path / "runs").exists()
    # a VLM with the vllm backend: refused at validation, naming the hf backend
    res = roll(
        "validate",
        str(recipe),
        "model.path=builtin:tiny-qwen2.5-vl",
        "actor_infer.backend=vllm",
    )
    assert res.returncode == 2 and "actor_infer.backend: hf" in res.stderr
    res = roll("validate", str(recipe), "model.path=builtin:tiny-qwen2.5-vl")
    assert res.returncode == 0, res.stderr
    # roll eval scores text prompts only: image data is refused, not silently read as text
    res = roll("eval", "builtin:tiny-qwen2.5-vl", "--data", str(shapes / "test.jsonl"))
    assert res.returncode == 2 and "'images'" in res.stderr and "Traceback" not in res.stderr


def test_roll_data_shapes(roll, tmp_path: Path) -> None:
    res = roll("data", "shapes", str(tmp_path / "s"), "--n-train", "6", "--n-test", "2")
    assert res.returncode == 0, res.stderr
    write_shapes_dataset(tmp_path / "ref", n_train=6, n_test=2)
    for name in ("train.jsonl", "test.jsonl", "images/test-00001.png"):
        assert (tmp_path / "s" / name).read_bytes() == (tmp_path / "ref" / name).read_bytes()
    # the shipped data set is the seed-0 default
    shipped = Path(__file__).resolve().parents[2] / "data" / "tiny-shapes"
    write_shapes_dataset(tmp_path / "default")
    for name in ("train.jsonl", "test.jsonl", "images/train-00999.png"):
        assert (shipped / name).read_bytes() == (tmp_path / "default" / name).read_bytes()
    res = roll("data", "shapes", str(tmp_path / "x"), "--max-count", "9")
    assert res.returncode == 2 and "--max-count" in res.stderr and "Traceback" not in res.stderr
