"""ActorTrain: the role that trains the policy. Knows nothing about Ray.

Built by the executor with its settings; `setup()` loads the model (kept out of the
constructor so a load error surfaces as the user's error, not as an actor-creation failure).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from roll_core.backends.train import MULTI_RANK_BACKENDS, TrainBackend, get_train_backend
from roll_core.backends.train.base import TrainBackendSpec
from roll_core.data import Batch
from roll_core.engine import Worker
from roll_core.engine.worker import dispatch
from roll_core.workers.objectives import get_objective


class ActorTrain(Worker):
    """One rank of actor_train: forwards to the configured TrainBackend."""

    def __init__(self, *, spec: TrainBackendSpec, **rank_info: Any) -> None:
        super().__init__(**rank_info)
        self.spec = spec
        self.backend: TrainBackend | None = None
        self._sync_group: Any = None
        self.offloader: Any = None

    @classmethod
    def needs_process_group(cls, world_size: int, kwargs: dict[str, Any]) -> bool:
        """fsdp2 and deepspeed ranks form a torch.distributed group (even a group of one)."""
        spec = kwargs.get("spec")
        return world_size > 1 or getattr(spec, "backend", None) in MULTI_RANK_BACKENDS

    @dispatch("all")
    def setup(self) -> dict[str, Any]:
        self.backend = get_train_backend(self.spec.backend)(self.spec)
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

    @dispatch("dp", collect="metrics")
    def train_step(
        self, batch: Batch, objective: str = "sft", *, lr: float | None = None, **params: Any
    ) -> dict[str, float]:
        """One optimizer step on `batch` with the named objective (workers/objectives.py).

        `lr`: a step outside the learning-rate schedule, at this rate: the schedule neither
        applies nor advances (the agentic warm start, `warm_start.lr`, runs before RL's
        schedule starts).
        """
        backend: Any = self._resident()
        replay = getattr(backend, "router_replay", None)
        if replay is not None:  # MoE routing replay: the agreement of this step's forwards
            replay.reset_metrics()
        out = self._train_step(backend, batch, objective, lr, **params)
        if replay is not None:
            out |= replay.metrics(scale=1.0 / max(1, int(getattr(backend, "world_size", 1))))
        return out

    @staticmethod
    def _train_step(
        backend: Any, batch: Batch, objective: str, lr: float | None, **params: Any
    ) -> dict[str, float]:
        if lr is None:
            out: dict[str, float] = backend.train_step(batch, get_objective(objective, **params))
            return out
        groups, scheduler = backend.optimizer.param_groups, backend.scheduler
        schedule = scheduler.state_dict()
        for group in groups:
            group["lr"] = lr
        out = backend.train_step(batch, get_objective(objective, **params))
        scheduler.load_state_dict(schedule)  # undo the step's scheduler.step()
        for group, scheduled in zip(groups, scheduler.get_last_lr(), strict=True):
            group["lr"] = scheduled
        return out

    @dispatch("dp", collect="metrics")
    def evaluate(self, batch: Batch, objective: str = "sft", **params: Any) -> dict[str, float]:
        """Summed objective metrics on `batch`, no update."""
        return self._resident().evaluate(batch, get_objective(objective, **params))

    @dispatch("dp", collect="concat")
    def log_probs(self, batch: Batch, *, temperature: float = 1.0) -> torch.Tensor:
        """Next-token log-probs [B, T-1] under the current weights."""
        return self._resident(("params",)).log_probs(batch, temperature=temperature)

    @dispatch("dp", collect="concat")
    def token_stats(self, batch: Batch, *, temperature: float = 1.0) -> dict[str, torch.Tensor]:
        """Next-token ``log_probs`` and ``entropy``, each [B, T-1], under the current
        weights: the rollout record's."""
        backend: Any = self._resident(("params",))
        out: dict[str, torch.Tensor] = backend.token_stats(batch, temperature=temperature)
        return out

    @dispatch("rank0")
    def generate(
        self, prompts: list[list[int]], *, max_new_tokens: int, vision: list[Any] | None = None
    ) -> list[list[int]]:
        """Greedy continuations; ``vision``: each prompt's VisionInputs (VLM prompts)."""
        images = {"vision": vision} if vision else {}
        backend: Any = self._resident(("params",))
        if getattr(backend, "router_replay", None) is not None:
            backend.router_replay.set(None)  # generation routes itself: nothing was recorded
        out: list[list[int]] = backend.generate(prompts, max_new_tokens=max_new_tokens, **images)
        return out

    @dispatch("dp", collect="concat")
    def reference_log_probs(self, batch: Batch, *, temperature: float = 1.0) -> torch.Tensor:
        """Next-token log-probs [B, T-1] of the base model, LoRA adapters disabled: the
        reference policy under LoRA without a second model (needs actor_train.lora)."""
        backend = self._resident(("params",))
        with backend.adapters_disabled():  # type: ignore[attr-defined]
            return backend.log_probs(batch, temperature=temperature)

    # ---- weight sync (roll_core/engine/weight_sync.py) ----------------------------------------
    def sync_tensors(self, bucket_bytes: int) -> Iterator[tuple[str, torch.Tensor]]:
        """The weights to sync, one (name, tensor) at a time, as the plain model names them
        (LoRA merged in); every rank of a sharded backend iterates it (it gathers)."""
        return self._resident(("params",)).sync_tensors(bucket_bytes)  # type: ignore[attr-defined]

    @dispatch("rank0")
    def sync_endpoint(self) -> dict[str, Any]:
        """Where the sender (this rank) lives: host, process, device."""
        from roll_core.backends.sync_transport import endpoint

        return endpoint(self._b().device)

    @dispatch("rank0")
    def sync_join(self, *, group_rank: int, **group: Any) -> None:
        """Join the weight-sync group as its rank 0 (the sender); see SyncGroup."""
        from roll_core.backends.sync_transport import SyncGroup

        if self._sync_group is not None:
            self._sync_group.close()
        self._sync_group = SyncGroup(rank=group_rank, **group)
        shareable = getattr(self._b(), "shareable_parameters", None)
        if shareable is not None:  # shared_memory: receivers read the live CPU weights
            self._sync_group.adopt(shareable())

    @dispatch("all")
    def sync_send(self, bucket_bytes: int) -> dict[str, int]:
        """Stream the weights to the inference ranks (rank 0 sends; the other ranks of a
        sharded backend take part in gathering each tensor). Returns the sender's counts."""
        tensors = self.sync_tensors(bucket_bytes)
        if self.rank != 0:
            for _ in tensors:
                pass
            return {}
        if self._sync_group is None:
            raise RuntimeError("ActorTrain.sync_send before sync_join")
        return self._sync_group.send(tensors, bucket_bytes)

    @dispatch("rank0")
    def named_weights(self) -> dict[str, torch.Tensor]:
        """The weight-sync payload: every tensor of the plain model by name, detached CPU
        copies. Under LoRA the adapters are merged in (W + scale * B @ A), so the inference
        engine gets ordinary weights."""
        backend = self._resident(("params",))
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
        self._resident().save(target)

    @dispatch("all")
    def load(self, path: str) -> None:
        self._resident().load(self._state_dir(path))

    @dispatch("rank0")
    def export(self, path: str) -> None:
        self._resident(("params",)).export(Path(path))

    @dispatch("rank0")
    def state_digest(self) -> str:
        return self._resident(("params",)).state_digest()

    # ---- taking turns with a colocated role (roll_core/backends/train/offload.py) ----------
    def _offloader(self) -> Any:
        if self.offloader is None:
            from roll_core.backends.train.offload import TrainOffloader

            self.offloader = TrainOffloader(self._b())
        return self.offloader

    def _resident(self, parts: tuple[str, ...] = ("optimizer", "grads", "params")) -> TrainBackend:
        """The backend with `parts` of its state on the device: what is offloaded comes back
        first (the driver reloads explicitly at the start of the training turn; this guard
        keeps a call outside the turn order, e.g. an export, correct)."""
        backend = self._b()
        if self.offloader is not None and self.offloader.offloaded:
            self.offloader.reload(parts)
        return backend

    @dispatch("all")
    def offload(self, parts: list[str]) -> dict[str, float]:
        """Move `parts` of this rank's state off its device (`optimizer`, `grads`, `params`;
        see backends/train/offload.py); returns seconds, bytes per part and the device
        memory after, measured in this process."""
        from roll_core.backends.offload import device_memory

        start = time.perf_counter()
        offloader = self._offloader()
        moved = offloader.offload(list(parts))
        out = {f"bytes/{k}": v for k, v in moved.items()}
        out["seconds"] = time.perf_counter() - start
        out |= {f"held/{k}": float(offloader.held_bytes(k)) for k in parts}
        return out | {f"memory/{k}": v for k, v in device_memory(self._b().device).items()}

    @dispatch("all")
    def reload(self) -> dict[str, float]:
        """Everything `offload` moved back on the device; the same report."""
        from roll_core.backends.offload import device_memory

        start = time.perf_counter()
        moved = self._offloader().reload() if self.offloader is not None else {}
        out = {f"bytes/{k}": v for k, v in moved.items()}
        out["seconds"] = time.perf_counter() - start
        return out | {f"memory/{k}": v for k, v in device_memory(self._b().device).items()}

    @dispatch("all")
    def memory(self) -> dict[str, float]:
        """This rank's device memory now (GiB; see backends/offload.py `device_memory`)."""
        from roll_core.backends.offload import device_memory

        return device_memory(self._b().device)


def _numel(p: torch.Tensor) -> int:
    """Elements of the full parameter (ZeRO-3 keeps only a shard: `ds_numel`)."""
    return int(getattr(p, "ds_numel", p.numel()))
