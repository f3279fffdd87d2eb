"""The `deepspeed` train backend: DeepSpeed ZeRO stage 1, 2 or 3 (optional CPU offload).

One engine per rank; gradient accumulation is ours (`managed_gradient_accumulation: false`:
backward per micro-batch, one `engine.step()` per train step, which clips, steps AdamW and
the LR schedule). On CPU DeepSpeed runs with `DS_ACCELERATOR=cpu` over gloo (set here when
no GPU is visible). Checkpoints are DeepSpeed's own sharded files (`engine.save_checkpoint`)
plus every rank's RNG, and resume bit for bit; the export gathers the full model on rank 0
(ZeRO-3: `GatheredParameters`) and writes Hugging Face format.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from roll_core.backends.train.base import TrainBackendSpec
from roll_core.backends.train.schedules import adamw_kwargs, make_scheduler
from roll_core.backends.train.sharded import ShardedTrainBackend
from roll_core.config.schema import DeepSpeedConfig
from roll_core.errors import CheckpointError, ConfigError
from roll_core.models import load_causal_lm

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_TAG = "state"


def import_deepspeed() -> Any:
    """`deepspeed`, on the CPU accelerator when no GPU is visible; a clear error if missing."""
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        import deepspeed
    except ImportError:
        raise ConfigError(
            "actor_train.backend=deepspeed but DeepSpeed is not installed.",
            hint="Install it with `pip install -e '.[deepspeed]'` (CPU machines: add "
            "`-c constraints-cpu.txt`), or use actor_train.backend=fsdp2.",
        ) from None
    if not torch.cuda.is_available():
        # The shared-memory all-reduce op is a C++ extension DeepSpeed compiles on first use
        # (a minute, and a compiler); it only speeds up CPU inference, so leave it off.
        import deepspeed.ops

        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    return deepspeed


def ds_config(
    opts: DeepSpeedConfig,
    *,
    micro_batch_size: int,
    world_size: int,
    max_grad_norm: float | None,
    bf16: bool,
) -> dict[str, Any]:
    """The DeepSpeed config dict for these options (pure; unit-tested)."""
    zero: dict[str, Any] = {"stage": opts.zero_stage}
    if opts.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    if opts.offload_param:
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    if opts.zero_stage == 3:
        zero["stage3_gather_16bit_weights_on_model_save"] = False
    return {
        "train_micro_batch_size_per_gpu": micro_batch_size,
        "train_batch_size": micro_batch_size * world_size,
        "gradient_accumulation_steps": 1,
        "managed_gradient_accumulation": False,
        "gradient_clipping": max_grad_norm or 0.0,
        "zero_optimization": zero,
        "bf16": {"enabled": bf16},
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
        "zero_allow_untested_optimizer": True,
    }


class DeepSpeedTrainBackend(ShardedTrainBackend):
    """TrainBackend over a DeepSpeed engine, one instance per rank."""

    name = "deepspeed"

    def __init__(self, spec: TrainBackendSpec) -> None:
        self._init_common(spec)
        ds = import_deepspeed()
        self.opts = opts = spec.deepspeed or DeepSpeedConfig()
        optim, total_steps, micro_batch_size = spec.optim, spec.total_steps, spec.micro_batch_size
        model = load_causal_lm(spec.model_path, dtype=_DTYPES[spec.dtype], device="cpu")
        self._init_packing(model)
        if spec.gradient_checkpointing:
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False}
            )
        self._param_names = {n for n, _ in model.named_parameters()}
        self.optim_cfg = optim
        config = ds_config(
            opts,
            micro_batch_size=micro_batch_size,
            world_size=self.world_size,
            max_grad_norm=optim.max_grad_norm,
            bf16=self.use_bf16,
        )
        adam = adamw_kwargs(optim)
        if opts.offload_optimizer:  # DeepSpeed's CPU Adam steps the offloaded state
            if optim.fused:
                raise ConfigError(
                    "optim.fused picks torch's fused AdamW, but deepspeed.offload_optimizer "
                    "steps the optimizer with DeepSpeed's CPU Adam.",
                    hint="Remove optim.fused, or turn deepspeed.offload_optimizer off.",
                )
            config["optimizer"] = {"type": "AdamW", "params": {**adam, "betas": list(optim.betas)}}
            client_optim = None
        else:
            client_optim = torch.optim.AdamW(  # type: ignore[arg-type]
                model.parameters(),
                **adam,
                foreach=not optim.fused,
                fused=True if optim.fused else None,
            )

        def schedule(optimizer: Any) -> Any:
            return make_scheduler(optimizer, optim, total_steps)

        self.engine, self.optimizer, _, self.scheduler = ds.initialize(
            model=model,
            optimizer=client_optim,
            lr_scheduler=schedule,
            config=config,
            dist_init_required=False,
        )
        self.model = self.engine.module

    def _call_model(self, **kwargs: Any) -> Any:
        return self.engine(**kwargs)

    # ---- step -------------------------------------------------------------------------------
    def _zero_grad(self) -> None:
        self.engine.zero_grad()

    def _backward(self, loss: torch.Tensor) -> None:
        self.engine.backward(loss, scale_wrt_gas=False)

    def _lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])  # the schedule's, or an override

    def _optimizer_step(self) -> float:
        self.engine.step()
        norm = self.engine.get_global_grad_norm()
        return float(norm) if norm is not None else float("nan")

    # ---- weights ----------------------------------------------------------------------------
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        if self.opts.zero_stage == 3:
            ds = import_deepspeed()
            params = list(self.model.parameters())
            with ds.zero.GatheredParameters(params, modifier_rank=None):
                state = (
                    {k: v.detach().cpu().clone() for k, v in self.model.state_dict().items()}
                    if self.rank == 0
                    else {}
                )
            return state
        if self.rank != 0:
            return {}
        return {k: v.detach().cpu().clone() for k, v in self.model.state_dict().items()}

    @torch.no_grad()
    def sync_tensors(self, bucket_bytes: int) -> Iterator[tuple[str, torch.Tensor]]:
        """The weight-sync stream. ZeRO-3: the parameters are gathered a group of about one
        bucket at a time (``GatheredParameters``, a collective on every rank) and rank 0
        yields copies made inside the gather (the gathered memory is released when the group
        ends); at most about two buckets of full weights exist at once. ZeRO-1/2: every rank
        holds the full parameters; they are yielded as they are."""
        named = [(n, p) for n, p in self.model.named_parameters() if n in self._param_names]
        if self.opts.zero_stage != 3:
            for name, p in named:
                yield name, p.detach()
            return
        ds = import_deepspeed()
        group: list[tuple[str, torch.Tensor]] = []
        size = 0
        for i, (name, p) in enumerate(named):
            group.append((name, p))
            size += int(getattr(p, "ds_numel", p.numel())) * p.element_size()
            if size < bucket_bytes and i + 1 < len(named):
                continue
            with ds.zero.GatheredParameters([q for _, q in group], modifier_rank=None):
                gathered = [(n, q.detach().clone()) for n, q in group] if self.rank == 0 else []
            yield from gathered
            group, size = [], 0

    # ---- checkpoints ------------------------------------------------------------------------
    def save(self, path: Path) -> None:
        """DeepSpeed's sharded checkpoint (model, ZeRO optimizer partitions, LR schedule),
        written by every rank, plus every rank's RNG."""
        start = time.perf_counter()
        path.mkdir(parents=True, exist_ok=True)
        self.engine.save_checkpoint(str(path / "deepspeed"), tag=_TAG, save_latest=False)
        self._save_rng(path)
        dist.barrier()
        self.last_save_s = time.perf_counter() - start

    def load(self, path: Path) -> None:
        if not (path / "deepspeed" / _TAG).is_dir():
            raise CheckpointError(
                f"{path} holds no deepspeed checkpoint: was it saved by another "
                "actor_train.backend?",
                hint="Resume with the backend the run was saved with.",
            )
        loaded, _ = self.engine.load_checkpoint(
            str(path / "deepspeed"),
            tag=_TAG,
            load_optimizer_states=True,
            load_lr_scheduler_states=True,
        )
        if loaded is None:
            raise CheckpointError(f"cannot load deepspeed checkpoint {path}.")
        self._load_rng(path)
