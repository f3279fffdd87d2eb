"""End-to-end: `roll distill` (the real CLI in a subprocess) on built-in tiny models.

The test builds its own teacher, a Qwen3 model three times the student's size fine-tuned for a
few SFT steps, and distils it into builtin:tiny-qwen3 (0.43M parameters). The exactness test kills a run with
SIGKILL in the middle of a checkpoint save; the resumed run must end with the same bytes.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
ARITH = ROOT / "data" / "tiny-arith"


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x]


@pytest.fixture(scope="module")
def teacher(cache_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A teacher wider and deeper than the student (Qwen3, hidden 192, 3 layers, 1.4M
    parameters, the built-in tokenizer) after 8 SFT steps on arithmetic, built in-process."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from roll_core.backends.train.base import TrainBackendSpec
    from roll_core.backends.train.torch_backend import TorchTrainBackend
    from roll_core.config.schema import OptimConfig
    from roll_core.data import build_sft_dataset, collate_sft, load_rows
    from roll_core.models import get_builtin, load_tokenizer, resolve_model_path
    from roll_core.workers.objectives import get_objective

    root = tmp_path_factory.mktemp("teacher")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ROLL_CACHE_DIR", str(cache_dir))
        tokenizer = load_tokenizer(resolve_model_path("builtin:tiny-qwen3"))
        config = {**get_builtin("tiny-qwen3").config_dict(), "hidden_size": 192}
        config.update(num_hidden_layers=3, intermediate_size=576, num_attention_heads=6)
        torch.manual_seed(0)
        model = Qwen3ForCausalLM(
            Qwen3Config(
                **config, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id
            )
        )
        model.save_pretrained(root / "init")
        tokenizer.save_pretrained(root / "init")
        backend = TorchTrainBackend(
            TrainBackendSpec(
                model_path=str(root / "init"),
                optim=OptimConfig(lr=3e-3),
                total_steps=8,
                micro_batch_size=8,
            )
        )
        rows = load_rows(str(ARITH / "train.jsonl"), max_rows=64)
        examples, _ = build_sft_dataset(rows, tokenizer, fmt="prompt_response", max_length=64)
        for i in range(8):
            batch = collate_sft(examples[8 * i : 8 * (i + 1)], pad_id=tokenizer.pad_token_id)
            batch.meta["loss_tokens"] = int(batch.tensors["loss_mask"][:, 1:].sum())
            backend.train_step(batch, get_objective("sft"))
        backend.export(root / "final")
    return root / "final"


def distill_recipe(tmp_path: Path, teacher: Path) -> Path:
    recipe = {
        "pipeline": "distill",
        "runs_dir": str(tmp_path / "runs"),
        "model": {"path": "builtin:tiny-qwen3"},
        "teacher": {"path": str(teacher)},
        "data": {
            "train": {"path": str(ARITH / "train.jsonl"), "max_rows": 256},
            "eval": {"path": str(ARITH / "test.jsonl"), "max_rows": 16},
            "max_length": 64,
        },
        "distill": {"loss": "forward_kl", "temperature": 2.0, "top_k": 16},
        "trainer": {"max_steps": 8, "micro_batch_size": 8, "grad_accum_steps": 2},
        "actor_train": {"num_threads": 1, "optim": {"lr": 3.0e-3, "warmup_steps": 1}},
        "eval": {"every_steps": 4, "batch_size": 16, "exact_match": True, "max_new_tokens": 4},
        "checkpoint": {"every_steps": 4, "keep_last": 3},
        "tracking": {"backends": ["console", "jsonl"]},
    }
    path = tmp_path / "distill.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return path


def test_distill_lowers_kl_and_resumes_bitwise_after_sigkill(roll, teacher, tmp_path) -> None:
    recipe = distill_recipe(tmp_path, teacher)
    res = roll("distill", str(recipe), "--run-id", "distill-base-01")
    assert res.returncode == 0, res.stderr
    base = tmp_path / "runs" / "distill-base-01"
    rows = metrics(base)
    assert [r["step"] for r in rows] == list(range(0, 9))
    evals = {r["step"]: r for r in rows if "eval/kl" in r}
    assert sorted(evals) == [0, 4, 8]
    # The student's held-out KL to the teacher falls, and the two agree on more tokens.
    assert evals[0]["eval/kl"] > evals[4]["eval/kl"] > evals[8]["eval/kl"]
    assert evals[8]["eval/agreement"] > evals[0]["eval/agreement"]
    assert evals[0]["eval/teacher_exact_match"] == evals[8]["eval/teacher_exact_match"]
    assert 0.0 <= evals[8]["eval/exact_match"] <= 1.0
    train = [r for r in rows if "train/loss" in r]
    assert {"train/kl", "train/agreement", "train/grad_norm"} <= set(train[0])
    # temperature 2: the loss is tau^2 = 4 times a KL between softened distributions
    assert train[0]["train/loss"] == pytest.approx(4 * train[0]["train/kl"], rel=1e-5)

    res = roll(
        "distill", str(recipe), "--run-id", "distill-kill-02", env={"ROLL_DEBUG_KILL_IN_SAVE": "8"}
    )
    assert res.returncode == -signal.SIGKILL
    killed = tmp_path / "runs" / "distill-kill-02"
    res = roll("resume", "distill-kill-02", "--runs-dir", str(tmp_path / "runs"))
    assert res.returncode == 0, res.stderr
    assert "resumed from step-000004" in res.stderr
    assert [r.get("train/loss") for r in metrics(killed)] == [r.get("train/loss") for r in rows]
    a = load_file(str(killed / "final" / "model.safetensors"))
    b = load_file(str(base / "final" / "model.safetensors"))
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)) for k in a)


def test_teacher_with_another_vocabulary_is_refused(roll, teacher, tmp_path) -> None:
    import shutil

    from transformers import AutoTokenizer

    other = tmp_path / "other-teacher"  # the same model with one token more in its tokenizer
    shutil.copytree(teacher, other)
    tokenizer = AutoTokenizer.from_pretrained(other)
    tokenizer.add_tokens(["<extra>"])
    tokenizer.save_pretrained(other)
    res = roll("distill", str(distill_recipe(tmp_path, other)))
    assert res.returncode == 2
    assert "have different tokenizers: 260 and 259 tokens" in res.stderr
    assert "'<extra>'" in res.stderr and "Traceback" not in res.stderr
    assert not (tmp_path / "runs").exists()  # refused before a run directory was created
