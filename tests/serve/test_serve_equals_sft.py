"""SFT through `roll serve` and the `tinker` client equals `roll sft` on the same data and
hyper-parameters: the same tokens (roll's own SFT tokenisation), the same LoRA (rank, alpha,
layers, seed), AdamW with the same learning rate, betas, eps and no clipping, and Tinker's
summed cross-entropy with weights ``loss_mask / tokens of the batch`` (roll's token mean).
Every step's loss agrees within fp32 tolerance (seen: 1e-7 relative; a learning rate 1%
off is 2e-4 away)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests.conftest import ROOT, write_tiny_recipe
from tests.serve.test_serve_tinker import Server

tinker = pytest.importorskip(
    "tinker", reason="the tinker client is not installed (pip install tinker==0.38.0)"
)
from tinker import types  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::FutureWarning")]

ROWS, BATCH, STEPS = 8, 4, 3
LR, BETAS, EPS = 5e-3, (0.9, 0.95), 1e-8
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def test_serve_sft_equals_roll_sft(tmp_path, roll) -> None:
    recipe = write_tiny_recipe(
        tmp_path,
        data={
            "train": {"path": str(ROOT / "data/tiny-arith/train.jsonl"), "max_rows": ROWS},
            "max_length": 64,
            "shuffle": False,
        },
        trainer={"max_steps": STEPS, "micro_batch_size": BATCH, "grad_accum_steps": 1},
        actor_train={
            "num_threads": 1,
            "device": "cpu",
            "precision": "fp32",
            "packing": False,
            "optim": {
                "lr": LR,
                "betas": list(BETAS),
                "eps": EPS,
                "weight_decay": 0.0,
                "max_grad_norm": None,
                "scheduler": "constant",
                "warmup_steps": 0,
            },
            "lora": {"rank": 4, "alpha": 32.0, "target_modules": TARGETS},
        },
        eval={"every_steps": None, "exact_match": False},
        checkpoint={"every_steps": None, "keep_last": 1, "export_final": False},
    )
    res = roll("sft", str(recipe), "--run-id", "ref")
    assert res.returncode == 0, res.stderr
    lines = (tmp_path / "runs" / "ref" / "metrics.jsonl").read_text().splitlines()
    rows = [json.loads(x) for x in lines]
    expected = [r["train/loss"] for r in rows if "train/loss" in r]
    assert len(expected) == STEPS

    from roll_core.config import load_recipe
    from roll_core.models import load_tokenizer
    from roll_core.pipelines.sft import prepare_data

    cfg = load_recipe(recipe, [])
    examples = prepare_data(cfg, load_tokenizer("builtin:tiny-qwen3")).train
    assert len(examples) == ROWS

    srv = Server(tmp_path / "ckpt", tmp_path / "cache-serve")
    service = None
    try:
        service = tinker.ServiceClient(base_url=srv.url, api_key="tml-local")
        tc = service.create_lora_training_client(
            base_model="roll/tiny-qwen3",
            rank=4,
            seed=0,
            train_unembed=False,
        ).result()
        adam = types.AdamParams(
            learning_rate=LR, beta1=BETAS[0], beta2=BETAS[1], eps=EPS, grad_clip_norm=0.0
        )
        got = []
        for step in range(STEPS):
            start = (step * BATCH) % ROWS
            batch = examples[start : start + BATCH]
            tokens = sum(int(np.sum(e["loss_mask"][1:])) for e in batch)
            data = [_datum(e, tokens) for e in batch]
            got.append(tc.forward_backward(data, "cross_entropy").result().metrics["loss:sum"])
            tc.optim_step(adam).result()
    finally:
        if service is not None:
            service.close("success").result()  # its heartbeat thread ends with the session
        srv.stop()
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-7)
    assert got[-1] < got[0]


def _datum(example: dict, tokens: int) -> types.Datum:
    ids = [int(t) for t in example["input_ids"]]
    mask = np.asarray(example["loss_mask"], dtype=np.float32)
    return types.Datum(
        model_input=types.ModelInput.from_ints(ids[:-1]),
        loss_fn_inputs={
            "target_tokens": np.asarray(ids[1:], dtype=np.int64),
            "weights": mask[1:] / tokens,
        },
    )
