"""Runs inside vLLM's worker processes: the weight-sync entry point of the `vllm` backend.

vLLM mixes :class:`RollWorkerExtension` into its worker class (``worker_extension_cls``), so
``LLM.collective_rpc("roll_load_weights", args=(bucket,))`` calls it on every worker (every
tensor-parallel rank). A bucket is the bytes of a safetensors file holding some of the
policy's tensors under their Hugging Face names; the model's own ``load_weights`` maps them
onto vLLM's fused and sharded parameters in place. Nothing is read from disk.

CPU build only: vLLM repacks every linear weight for oneDNN (or its small-GEMM kernel) when
the model is loaded and drops the original tensor, so a later ``load_weights`` would write
into parameters the forward pass no longer reads (stale weights, a log-prob gap of ~2 nats
on the tiny models). Importing this module, which vLLM does before it builds the model,
replaces that dispatch with a plain ``F.linear`` on the live weight: in-place loads then
take effect exactly, at some cost in CPU matmul speed. The CUDA build needs no such patch.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

_PATCHED = False


def _linear_on_live_weight(x: torch.Tensor, weight: torch.Tensor, bias: Any) -> torch.Tensor:
    return F.linear(x, weight, bias)


def use_live_cpu_weights() -> bool:
    """On vLLM's CPU platform, make linear layers read their current weight (see the module
    docstring). Returns True if the patch is active. Idempotent."""
    global _PATCHED
    if _PATCHED:
        return True
    from vllm.model_executor.layers import utils as layer_utils
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return False
    original = layer_utils.dispatch_cpu_unquantized_gemm

    def dispatch(layer: torch.nn.Module, remove_weight: bool) -> None:
        weight = getattr(layer, "weight", None)
        if weight is None or weight.is_meta or weight.ndim != 2:
            original(layer, remove_weight)  # MoE experts, convolutions: vLLM's own path
            return
        layer.cpu_linear = _linear_on_live_weight  # type: ignore[assignment]

    # linear.py and vocab_parallel_embedding.py import the function at call time, so
    # replacing the module attribute is enough.
    layer_utils.dispatch_cpu_unquantized_gemm = dispatch
    _PATCHED = True
    return True


use_live_cpu_weights()


def _raw(t: torch.Tensor) -> bytes:
    return bytes(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())


class RollWorkerExtension:
    """Methods vLLM adds to its worker. Names start with `roll_`: vLLM's worker already has
    an `update_weights` of its own."""

    model_runner: Any
    vllm_config: Any

    def roll_load_weights(self, bucket: bytes) -> int:
        """Load the tensors of one safetensors-serialised bucket in place; returns how many."""
        from safetensors.torch import load
        from vllm.config import set_current_vllm_config

        tensors = load(bucket)
        with torch.no_grad(), set_current_vllm_config(self.vllm_config):
            self.model_runner.get_model().load_weights(weights=iter(tensors.items()))
        return len(tensors)

    # ---- the data-plane sync (roll_core/backends/sync_transport.py) -----------------------------
    def roll_sync_endpoint(self) -> dict[str, Any]:
        from roll_core.backends.sync_transport import endpoint

        return endpoint(next(self.model_runner.get_model().parameters()).device)

    def roll_sync_join(self, *, first_rank: int, **group: Any) -> None:
        """Join the weight-sync group as rank `first_rank` + this worker's rank."""
        from roll_core.backends.sync_transport import SyncGroup

        old = getattr(self, "_roll_sync_group", None)
        if old is not None:
            old.close()
        rank = first_rank + int(getattr(self, "rank", 0))
        self._roll_sync_group = SyncGroup(rank=rank, **group)

    def roll_sync_receive(self) -> dict[str, int]:
        """Receive every bucket from actor_train rank 0 and load it in place."""
        from vllm.config import set_current_vllm_config

        model = self.model_runner.get_model()
        loaded = 0

        def load(items: list[tuple[str, torch.Tensor]]) -> None:
            nonlocal loaded
            with torch.no_grad(), set_current_vllm_config(self.vllm_config):
                model.load_weights(weights=iter(items))
            loaded += len(items)

        stats = self._roll_sync_group.receive(load)
        return {**stats, "tensors": loaded}

    def roll_parameters(self) -> dict[str, tuple[str, list[int], bytes]]:
        """Every parameter of the served model by vLLM's name (fused layers fused) as
        (dtype, shape, raw bytes): lets a test compare the served weights with the trainer's
        bit for bit (raw bytes cross vLLM's RPC exactly)."""
        model = self.model_runner.get_model()
        return {
            n: (str(p.dtype).removeprefix("torch."), list(p.shape), _raw(p))
            for n, p in model.named_parameters()
        }

    def roll_weight_checksum(self) -> float:
        """Sum of every parameter of the served model (float64): lets a test see that a
        sync changed what the forward pass reads."""
        with torch.no_grad():
            return float(
                sum(p.detach().double().sum() for p in self.model_runner.get_model().parameters())
            )
