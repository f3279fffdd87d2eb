"""ActorTrain: the role that trains the policy. Knows nothing about Ray.

Built by the executor with its settings; `setup()` loads the model (kept out of the
constructor so a load error surfaces as the user's error, not as an actor-creation failure).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from roll_core.backends.train import MULTI_RANK_BACKENDS, TrainBackend, get_train_backend
from roll_core.data import Batch
from roll_core.engine import Worker
from roll_core.engine.worker import dispatch
from roll_core.workers.objectives import get_objective


class ActorTrain(Worker):
    """One rank of actor_train: forwards to the configured TrainBackend."""

    def __init__(self, *, backend: str, backend_kwargs: dict[str, Any], **rank_info: Any) -> None:
        super().__init__(**rank_info)
        self.backend_name = backend
        self.backend_kwargs = backend_kwargs
        self.backend: TrainBackend | None = None

    @classmethod
    def needs_process_group(cls, world_size: int, kwargs: dict[str, Any]) -> bool:
        """fsdp2 and deepspeed ranks form a torch.distributed group (even a group of one)."""
        return world_size > 1 or kwargs.get("backend") in MULTI_RANK_BACKENDS

    @dispatch("all")
    def setup(self) -> dict[str, Any]:
        self.backend = get_train_backend(self.backend_name)(**self.backend_kwargs)
        params = list(self.backend.model.parameters())
        n_params = sum(_numel(p) for p in params)
        trainable = sum(_numel(p) for p in params if p.requires_grad)
        return {"params": n_params, "trainable": trainable, "device": str(self.backend.device)}

    @dispatch("all")
    def has_dropout(self) -> bool:
        """Whether a train-mode forward differs from an eval-mode one: a dropout module with
        p > 0 (LoRA dropout included) or a `*dropout*` rate > 0 in the model's config."""
        model = self._b().model
        if any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in model.modules()):
            return True
        config = getattr(model, "config", None)
        values = config.to_dict().items() if config is not None else []
        return any("dropout" in k and isinstance(v, float) and v > 0 for k, v in values)

    def _b(self) -> TrainBackend:
        if self.backend is None:
            raise RuntimeError("ActorTrain.setup() was not called")
        return self.backend

    @dispatch("dp")
    def train_step(
        self, batch: Batch, objective: str = "sft", *, lr: float | None = None, **params: Any
    ) -> dict[str, float]:
        """One optimizer step on `batch` with the named objective (workers/objectives.py).

        `lr`: a step outside the learning-rate schedule, at this rate: the schedule neither
        applies nor advances (the agentic warm start, `warm_start.lr`, runs before RL's
        schedule starts).
        """
        backend: Any = self._b()
        if lr is None:
            return backend.train_step(batch, get_objective(objective, **params))
        groups, scheduler = backend.optimizer.param_groups, backend.scheduler
        schedule = scheduler.state_dict()
        for group in groups:
            group["lr"] = lr
        out: dict[str, float] = backend.train_step(batch, get_objective(objective, **params))
        scheduler.load_state_dict(schedule)  # undo the step's scheduler.step()
        for group, scheduled in zip(groups, scheduler.get_last_lr(), strict=True):
            group["lr"] = scheduled
        return out

    @dispatch("dp")
    def evaluate(self, batch: Batch, objective: str = "sft", **params: Any) -> dict[str, float]:
        """Summed objective metrics on `batch`, no update."""
        return self._b().evaluate(batch, get_objective(objective, **params))

    @dispatch("dp")
    def log_probs(self, batch: Batch, *, temperature: float = 1.0) -> torch.Tensor:
        """Next-token log-probs [B, T-1] under the current weights."""
        return self._b().log_probs(batch, temperature=temperature)

    @dispatch("rank0")
    def generate(self, prompts: list[list[int]], *, max_new_tokens: int) -> list[list[int]]:
        return self._b().generate(prompts, max_new_tokens=max_new_tokens)

    @dispatch("dp")
    def reference_log_probs(self, batch: Batch, *, temperature: float = 1.0) -> torch.Tensor:
        """Next-token log-probs [B, T-1] of the base model, LoRA adapters disabled: the
        reference policy under LoRA without a second model (needs actor_train.lora)."""
        backend = self._b()
        with backend.adapters_disabled():  # type: ignore[attr-defined]
            return backend.log_probs(batch, temperature=temperature)

    @dispatch("rank0")
    def named_weights(self) -> dict[str, torch.Tensor]:
        """The weight-sync payload: every tensor of the plain model by name, detached CPU
        copies. Under LoRA the adapters are merged in (W + scale * B @ A), so the inference
        engine gets ordinary weights."""
        backend = self._b()
        if hasattr(backend, "full_weights"):  # sharded: gathered on rank 0 (collective)
            return dict(backend.full_weights())
        if getattr(backend, "lora", None) is not None:
            from roll_core.models.lora import merged_state_dict

            weights = merged_state_dict(backend.model)
        else:
            weights = dict(backend.model.named_parameters())
        return {n: t.detach().to("cpu", copy=True) for n, t in weights.items()}

    def _state_dir(self, path: str) -> Path:
        """`path/rank-<rank>/`, or `path/` itself for backends whose ranks write one sharded
        checkpoint together (fsdp2, deepspeed)."""
        if getattr(self._b(), "checkpoint_layout", "per_rank") == "shared":
            return Path(path)
        return Path(path) / f"rank-{self.rank}"

    @dispatch("all")
    def save(self, path: str) -> None:
        """Write this rank's state (see `_state_dir`)."""
        target = self._state_dir(path)
        target.mkdir(parents=True, exist_ok=True)
        self._b().save(target)

    @dispatch("all")
    def load(self, path: str) -> None:
        self._b().load(self._state_dir(path))

    @dispatch("rank0")
    def export(self, path: str) -> None:
        self._b().export(Path(path))

    @dispatch("rank0")
    def state_digest(self) -> str:
        return self._b().state_digest()

    @dispatch("all")
    def offload(self) -> dict[str, float]:
        """Free this rank's GPU for a colocated role: weights, grads and optimizer state to
        CPU memory (no-op on CPU). Call `reload` before the next forward."""
        from roll_core.backends.train.offload import offload

        return offload(self._b())

    @dispatch("all")
    def reload(self) -> None:
        from roll_core.backends.train.offload import reload

        reload(self._b())


def _numel(p: torch.Tensor) -> int:
    """Elements of the full parameter (ZeRO-3 keeps only a shard: `ds_numel`)."""
    return int(getattr(p, "ds_numel", p.numel()))
