"""The `fsdp2` train backend: PyTorch FSDP2 (`torch.distributed.fsdp.fully_shard`).

Parameters, gradients and optimizer state are sharded over the ranks of actor_train: each
decoder layer (the model's `_no_split_modules`) is one FSDP unit, then the root. Options:
mixed precision (bf16 compute, fp32 gradient reduction and master weights), CPU offload of
the sharded parameters, gradients and optimizer state (`CPUOffloadPolicy`), activation
checkpointing (`model.gradient_checkpointing`). Checkpoints are sharded, written by every
rank through `torch.distributed.checkpoint` (DCP) and resume bit for bit; the final export
gathers a full state dict on rank 0 and writes Hugging Face format.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

from roll_core.backends.train.base import TrainBackendSpec
from roll_core.backends.train.schedules import make_optimizer
from roll_core.backends.train.sharded import ShardedTrainBackend
from roll_core.config.schema import FSDP2Config
from roll_core.errors import CheckpointError, ConfigError
from roll_core.models import load_causal_lm

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def shard_units(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules that become FSDP units: the model's `_no_split_modules` (decoder layers)."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    units = [m for m in model.modules() if type(m).__name__ in names]
    if not units:
        raise ConfigError(
            f"fsdp2: cannot find the decoder layers of {type(model).__name__} "
            "(no `_no_split_modules`).",
            hint="Use actor_train.backend=deepspeed for this model.",
        )
    return units


class FSDP2TrainBackend(ShardedTrainBackend):
    """TrainBackend over FSDP2, one instance per rank."""

    name = "fsdp2"

    def __init__(self, spec: TrainBackendSpec) -> None:
        opts = spec.fsdp2 or FSDP2Config()
        self._init_common(spec)
        model = load_causal_lm(spec.model_path, dtype=_DTYPES[spec.dtype], device="cpu")
        self._init_packing(model)
        if spec.gradient_checkpointing:
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False}
            )
        self._param_names = {n for n, _ in model.named_parameters()}
        mesh = dist.device_mesh.init_device_mesh(self.device.type, (self.world_size,))
        kwargs: dict[str, Any] = {"mesh": mesh, "reshard_after_forward": opts.reshard_after_forward}
        if self.use_bf16:
            kwargs["mp_policy"] = MixedPrecisionPolicy(
                param_dtype=torch.bfloat16, reduce_dtype=torch.float32
            )
        if opts.cpu_offload:
            kwargs["offload_policy"] = CPUOffloadPolicy()
        elif self.device.type == "cuda":
            model.to(self.device)  # type: ignore[arg-type]
        for unit in shard_units(model):
            fully_shard(unit, **kwargs)
        # The root (embeddings, final norm, output layer) stays gathered from its forward to
        # its backward: the output layer runs after the forward, a chunk of positions at a
        # time, and again in the backward (backends/train/lm_head.py). FSDP2's own default
        # for a root; its gradients are still reduce-scattered in its post-backward.
        fully_shard(model, **{**kwargs, "reshard_after_forward": False})
        self.model = model
        self.optim_cfg = spec.optim
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer, self.scheduler = make_optimizer(self.params, spec.optim, spec.total_steps)

    # ---- step -------------------------------------------------------------------------------
    def _zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def _backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def _lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])  # the schedule's, or an override

    def _optimizer_step(self) -> float:
        max_norm = self.optim_cfg.max_grad_norm
        norm = torch.nn.utils.clip_grad_norm_(
            self.params, max_norm if max_norm is not None else float("inf")
        )
        if hasattr(norm, "full_tensor"):
            norm = norm.full_tensor()
        self.optimizer.step()
        self.scheduler.step()
        return float(norm)

    # ---- weights ----------------------------------------------------------------------------
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        state = get_model_state_dict(self.model, options=options)
        return dict(state) if self.rank == 0 else {}  # type: ignore[arg-type]

    # ---- checkpoints ------------------------------------------------------------------------
    def save(self, path: Path) -> None:
        """Sharded model + optimizer (DCP, every rank writes its shard), the LR schedule
        (rank 0) and every rank's RNG."""
        start = time.perf_counter()
        path.mkdir(parents=True, exist_ok=True)
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(path / "dcp"))
        if self.rank == 0:
            torch.save(self.scheduler.state_dict(), path / "scheduler.pt")
        self._save_rng(path)
        dist.barrier()
        self.last_save_s = time.perf_counter() - start

    def load(self, path: Path) -> None:
        if not (path / "dcp").is_dir():
            raise CheckpointError(
                f"{path} holds no fsdp2 checkpoint (no dcp/ directory): was it saved by "
                "another actor_train.backend?",
                hint="Resume with the backend the run was saved with.",
            )
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        state = {"model": model_sd, "optim": optim_sd}
        try:
            dcp.load(state, checkpoint_id=str(path / "dcp"))
        except Exception as err:  # noqa: BLE001 - DCP raises several types
            raise CheckpointError(f"cannot load fsdp2 checkpoint {path}: {err}") from None
        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=state["model"],  # type: ignore[arg-type]
            optim_state_dict=state["optim"],  # type: ignore[arg-type]
        )
        self.scheduler.load_state_dict(torch.load(path / "scheduler.pt", weights_only=True))
        self._load_rng(path)
