"""End-to-end: LoRA (`actor_train.lora`) through the real CLI on the built-in tiny model.

A LoRA SFT run checkpoints the adapters only, resumes bitwise after a SIGKILL (in the middle
of a checkpoint save), and its merged export computes the logits of base model + adapters.
A LoRA DPO run takes its reference log-probs from the policy with adapters disabled.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
LORA = {"rank": 4, "alpha": 8, "dropout": 0.1, "target_modules": ["q_proj", "v_proj", "down_proj"]}


def lora_sft(tiny_recipe, **sections: object) -> Path:
    return tiny_recipe(
        trainer={"max_steps": 8, "micro_batch_size": 8, "grad_accum_steps": 1},
        actor_train={"num_threads": 1, "optim": {"lr": 1e-2, "warmup_steps": 1}, "lora": LORA},
        eval={"batch_size": 32},
        checkpoint={"every_steps": 4, "keep_last": 3},
        **sections,
    )


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x]


@pytest.mark.filterwarnings("ignore::FutureWarning")  # peft calls a renamed transformers API
def test_lora_sft_adapters_only_bitwise_resume_and_merged_export(
    roll, tiny_recipe, cache_dir: Path, tmp_path: Path
) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    recipe = lora_sft(tiny_recipe)
    res = roll("sft", str(recipe), "--run-id", "lora-base-01")
    assert res.returncode == 0, res.stderr
    base = tmp_path / "runs" / "lora-base-01"

    # Checkpoints hold the adapters (and optimizer / scheduler / RNG), not the model.
    ckpt = base / "checkpoints" / "step-000004" / "actor_train" / "rank-0"
    assert not (ckpt / "model").exists()
    adapter = load_file(str(ckpt / "adapter" / "adapter_model.safetensors"))
    assert adapter and all(".lora_A." in k or ".lora_B." in k for k in adapter)
    # 2 layers x 3 targets, A (4 x in) + B (out x 4): q 128+128, v 128+64, down 384+128 -> x4 x2
    assert sum(t.numel() for t in adapter.values()) == 2 * 4 * (256 + 192 + 512)
    full = (base / "final" / "model.safetensors").stat().st_size
    assert (ckpt / "adapter" / "adapter_model.safetensors").stat().st_size < full / 20

    # The merged export is a plain HF model with the logits of base + adapters.
    merged = AutoModelForCausalLM.from_pretrained(base / "final").eval()
    base_dir = next((cache_dir / "builtin").glob("tiny-qwen3-v*"))
    adapted = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(base_dir), base / "final" / "adapter"
    ).eval()
    plain = AutoModelForCausalLM.from_pretrained(base_dir).eval()
    ids = torch.tensor([list(b"<|im_start|>user\nWhat is 12 + 30?")])
    with torch.no_grad():
        got, want, before = merged(ids).logits, adapted(ids).logits, plain(ids).logits
    assert (want - before).abs().max() > 1e-2  # the adapters learned something
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)

    # SIGKILL while saving step 8, then resume: the same losses and the same final bytes.
    res = roll("sft", str(recipe), "--run-id", "lora-kill-02", env={"ROLL_DEBUG_KILL_IN_SAVE": "8"})
    assert res.returncode == -signal.SIGKILL
    killed = tmp_path / "runs" / "lora-kill-02"
    res = roll("resume", "lora-kill-02", "--runs-dir", str(tmp_path / "runs"))
    assert res.returncode == 0, res.stderr
    assert "resumed from step-000004" in res.stderr
    assert [r["train/loss"] for r in metrics(killed)] == [r["train/loss"] for r in metrics(base)]
    for name in ("model.safetensors", "adapter/adapter_model.safetensors"):
        a, b = load_file(str(killed / "final" / name)), load_file(str(base / "final" / name))
        assert a.keys() == b.keys()
        assert all(torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)) for k in a), name


def test_lora_target_that_matches_nothing_lists_linear_layers(cache_dir: Path) -> None:
    # In-process (what `prepare` and the backend call): the message names the bad target and
    # the linear layers that exist, without loading any weights (meta device).
    from roll_core.errors import ConfigError
    from roll_core.models import resolve_model_path
    from roll_core.models.lora import check_lora_targets_from_config

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ROLL_CACHE_DIR", str(cache_dir))
        path = resolve_model_path("builtin:tiny-qwen3")
    with pytest.raises(ConfigError) as err:
        check_lora_targets_from_config(path, ["q_proj", "qkv"])
    message = str(err.value)
    assert "'qkv' matches no linear layer" in message
    assert "self_attn.q_proj, self_attn.k_proj, self_attn.v_proj, self_attn.o_proj" in message
    assert "mlp.gate_proj, mlp.up_proj, mlp.down_proj, lm_head (15 in all" in message
    check_lora_targets_from_config(path, ["q_proj", "mlp.down_proj"])  # suffixes match
    check_lora_targets_from_config(path, "all-linear")


def test_lora_dpo_uses_the_policy_with_adapters_disabled_as_reference(roll, tmp_path) -> None:
    import yaml

    pairs = ROOT / "data" / "tiny-arith-pairs"
    recipe = {
        "pipeline": "dpo",
        "runs_dir": str(tmp_path / "runs"),
        "model": {"path": "builtin:tiny-qwen3"},
        "data": {
            "train": {"path": str(pairs / "train.jsonl"), "max_rows": 16},
            "eval": {"path": str(pairs / "train.jsonl"), "max_rows": 16},
            "max_length": 64,
        },
        "trainer": {"max_steps": 4, "micro_batch_size": 8},
        "actor_train": {"num_threads": 1, "optim": {"lr": 1e-2}, "lora": LORA},
        "eval": {"batch_size": 16},
        "tracking": {"backends": ["jsonl"]},
    }
    path = tmp_path / "dpo-lora.yaml"
    path.write_text(yaml.safe_dump(recipe))
    res = roll("dpo", str(path), "--run-id", "dpo-lora-03")
    assert res.returncode == 0, res.stderr
    assert "(policy with adapters disabled)" in res.stderr
    rows = {r["step"]: r for r in metrics(tmp_path / "runs" / "dpo-lora-03") if "eval/loss" in r}
    # At step 0 the adapters are zero (B = 0): the policy is the reference to float precision.
    assert rows[0]["eval/rewards/margin"] == pytest.approx(0.0, abs=1e-6)
    assert rows[4]["eval/rewards/margin"] > 0 and rows[4]["eval/loss"] < rows[0]["eval/loss"]
    ckpt = tmp_path / "runs" / "dpo-lora-03" / "checkpoints" / "step-000004" / "actor_train"
    assert (ckpt / "rank-0" / "adapter" / "adapter_model.safetensors").is_file()
