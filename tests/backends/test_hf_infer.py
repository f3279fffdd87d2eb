"""The hf infer backend's precision (`actor_infer.precision`) and the options that set it."""

from __future__ import annotations

import pytest
import torch

from roll_core.backends.infer import Request, SamplingParams, infer_backend_options
from roll_core.config.rlvr import ActorInferConfig


def test_precision_auto_follows_the_trainer() -> None:
    role = ActorInferConfig()
    opts = infer_backend_options(role, model_dtype="bfloat16", train_precision="bf16")
    assert opts == {"dtype": torch.bfloat16, "precision": "bf16"}
    forced = ActorInferConfig(precision="fp32")
    assert infer_backend_options(forced, model_dtype="float32", train_precision="bf16") == {
        "dtype": torch.float32,
        "precision": "fp32",
    }
    with pytest.raises(ValueError, match="vllm.dtype"):
        ActorInferConfig(backend="vllm", precision="bf16")


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    from roll_core.models.builtin import materialize_builtin

    return str(materialize_builtin("tiny-qwen3", tmp_path_factory.mktemp("cache")))


def test_bf16_generation_runs_under_autocast(model_path: str) -> None:
    """Greedy log-probs of the same tokens differ between fp32 and bf16 autocast (bf16 keeps
    8 bits of mantissa), and stay close: the precision took effect, nothing else changed."""
    from roll_core.backends.infer.hf import HFInferBackend

    params = SamplingParams(max_new_tokens=4, temperature=0)
    req = [Request(0, [5, 9, 11, 13], 7)]
    fp32 = HFInferBackend(model_path=model_path, device="cpu", num_threads=1, precision="fp32")
    bf16 = HFInferBackend(model_path=model_path, device="cpu", num_threads=1, precision="bf16")
    a, b = fp32.generate(req, params)[0], bf16.generate(req, params)[0]
    n = min(len(a.log_probs), len(b.log_probs))
    assert n > 0 and a.log_probs[:n] != b.log_probs[:n]
    assert max(abs(x - y) for x, y in zip(a.log_probs[:n], b.log_probs[:n], strict=True)) < 0.1
