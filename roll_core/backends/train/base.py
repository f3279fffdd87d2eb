"""The TrainBackend interface (`torch`, `fsdp2`, `deepspeed` implement it) and the one typed
value every backend is built from, :class:`TrainBackendSpec`."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from roll_core.config.schema import (
    DeepSpeedConfig,
    FSDP2Config,
    LoraConfig,
    MegatronConfig,
    OptimConfig,
)
from roll_core.data import Batch
from roll_core.errors import ConfigError


@dataclass(frozen=True)
class TrainBackendSpec:
    """Everything a train backend (and the frozen models that share its code: the teacher) is
    built from: one picklable value, assembled from the recipe by :func:`spec_from_config`
    and passed as is to `get_train_backend(spec.backend)(spec)`."""

    model_path: str
    """Hugging Face checkpoint directory (or a builtin model name already resolved)."""
    backend: str = "torch"
    """`torch`, `fsdp2`, `deepspeed` or `megatron` (roll_core/backends/train/__init__.py)."""
    tokenizer_path: str | None = None
    """Tokenizer directory; None: `model_path`'s."""
    dtype: str = "float32"
    """Weights dtype: float32, bfloat16 or float16."""
    device: str = "auto"
    """auto, cpu or cuda."""
    precision: str = "auto"
    """auto (bf16 autocast on CUDA, fp32 on CPU), fp32 or bf16."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """AdamW and the LR schedule (unused by frozen models)."""
    total_steps: int = 1
    """Optimizer steps of the run: the LR schedule's length."""
    micro_batch_size: int = 8
    """Rows per forward/backward when `max_tokens_per_micro_batch` is None."""
    seed: int = 0
    num_threads: int | None = None
    """torch CPU threads in this process (None: torch's default)."""
    gradient_checkpointing: bool = False
    lora: LoraConfig | None = None
    """LoRA adapters (torch backend only)."""
    fsdp2: FSDP2Config | None = None
    """FSDP2 options (backend fsdp2 only)."""
    deepspeed: DeepSpeedConfig | None = None
    """DeepSpeed options (backend deepspeed only)."""
    megatron: MegatronConfig | None = None
    """The megatron layout: tp, pp, ep, sp, vpp (backend megatron only)."""
    packing: bool = True
    """Rows of a micro-batch concatenated into one sequence (per-row position ids, attention
    confined to each row): no compute on padding. False: right-padded micro-batches."""
    max_tokens_per_micro_batch: int | None = None
    """Token budget of a micro-batch (real tokens when packed, rows x longest row when
    padded); rows are grouped by length to fill it. None: `micro_batch_size` rows."""
    logit_chunk_tokens: int | None = None
    """Positions whose logits exist at a time (roll_core/backends/train/lm_head.py); None:
    about 16M logits per chunk; 0: the micro-batch's at once."""
    router_replay: str = "off"
    """`algorithm.router_replay`: ``r3`` replays the sampler's routed experts (the Batch's
    ``routed_experts``) in every forward of a mixture-of-experts model; ``off``."""
    frozen: bool = False
    """Log-prob passes only (the reference role on a sharded backend): no optimizer, no
    gradient buffers, no LR schedule. Backend megatron only (the other backends' frozen roles
    load the plain model: workers/reference.py, workers/teacher.py)."""

    def __post_init__(self) -> None:
        if self.micro_batch_size < 1:
            raise ConfigError(
                f"micro_batch_size must be at least 1, got {self.micro_batch_size}.",
                hint="Set trainer.micro_batch_size to a positive number of rows.",
            )
        budget = self.max_tokens_per_micro_batch
        if budget is not None and budget <= 0:
            raise ConfigError(
                f"actor_train.max_tokens_per_micro_batch must be positive, got {budget}.",
                hint="Set it to at least the longest row (prompt + response tokens), or "
                "remove it to count micro-batches in rows.",
            )
        if self.frozen and self.backend != "megatron":
            raise ConfigError(
                f"a frozen (log-prob only) {self.backend} train backend was asked for; only "
                "the megatron backend builds one.",
                hint="A bug in the caller: frozen roles of the other backends load the plain "
                "model (workers/reference.py).",
            )
        for name in ("fsdp2", "deepspeed", "megatron"):
            if getattr(self, name) is not None and self.backend != name:
                raise ConfigError(
                    f"{name} options are given to the {self.backend} train backend.",
                    hint=f"Set actor_train.backend: {name}, or remove the {name} section.",
                )


def spec_from_config(
    cfg: Any,
    *,
    model_path: str,
    tokenizer_path: str | None = None,
    total_steps: int,
    micro_batch_size: int,
) -> TrainBackendSpec:
    """The spec of actor_train as every pipeline builds it: `cfg.actor_train`'s backend and
    its options, LoRA, precision, threads, packing and token budget; `cfg.model`'s dtype and
    gradient checkpointing; `cfg.seed`."""
    role = cfg.actor_train
    return TrainBackendSpec(
        model_path=model_path,
        backend=role.backend,
        tokenizer_path=tokenizer_path,
        dtype=cfg.model.dtype,
        device=role.device,
        precision=role.precision,
        optim=role.optim,
        total_steps=total_steps,
        micro_batch_size=micro_batch_size,
        seed=cfg.seed,
        num_threads=role.num_threads,
        gradient_checkpointing=cfg.model.gradient_checkpointing,
        lora=role.lora,
        fsdp2=role.fsdp2 if role.backend == "fsdp2" else None,
        deepspeed=role.deepspeed if role.backend == "deepspeed" else None,
        megatron=role.megatron if role.backend == "megatron" else None,
        packing=role.packing,
        max_tokens_per_micro_batch=role.max_tokens_per_micro_batch,
        logit_chunk_tokens=role.logit_chunk_tokens,
        router_replay=getattr(getattr(cfg, "algorithm", None), "router_replay", "off"),
    )


def is_max_metric(key: str) -> bool:
    """Objective metrics named ``*_max`` are maxima: micro-batches and ranks combine them by
    max; every other objective metric is a sum (of shares of a global mean)."""
    return key.endswith("_max")


def add_metrics(sums: dict[str, float], metrics: dict[str, Any]) -> None:
    """Accumulate one micro-batch's objective metrics into ``sums`` (see :func:`is_max_metric`)."""
    for key, value in metrics.items():
        if is_max_metric(key) and key in sums:
            sums[key] = max(sums[key], float(value))
        else:
            sums[key] = sums.get(key, 0.0) + float(value)


class TrainBackend(Protocol):
    """Owns a model and its optimizer on one rank."""

    model: torch.nn.Module
    device: torch.device

    def train_step(self, batch: Batch, objective: Any) -> dict[str, float]:
        """One optimizer step over `batch`, accumulated in micro-batches.

        `objective(head, micro_batch) -> (loss share, metric sums)` (head: the micro-batch's
        logits on demand, roll_core/backends/train/lm_head.py) normalises with the
        global counts in `batch.meta` (e.g. `loss_tokens` over all ranks), so accumulation and
        data parallelism give the same update as one big batch.
        """
        ...

    def evaluate(self, batch: Batch, objective: Any) -> dict[str, float]:
        """Summed objective metrics on `batch` (no update)."""
        ...

    def log_probs(self, batch: Batch, *, temperature: float = 1.0) -> torch.Tensor:
        """Next-token log-probs [B, T-1] (float32, CPU)."""
        ...

    def generate(self, prompts: list[list[int]], *, max_new_tokens: int) -> list[list[int]]:
        """Greedy continuation token ids for each prompt (no prompt tokens, no padding)."""
        ...

    def save(self, path: Path) -> None:
        """Write the full training state (model in HF format, optimizer, scheduler, RNG)."""
        ...

    def load(self, path: Path) -> None:
        """Restore exactly what `save` wrote."""
        ...

    def export(self, path: Path) -> None:
        """Write the model and tokenizer in Hugging Face format."""
        ...

    def state_digest(self) -> str:
        """sha256 over every parameter's bytes (exactness checks)."""
        ...
