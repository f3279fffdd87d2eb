"""What the multi-rank train backends (`fsdp2`, `deepspeed`) share.

Each rank of actor_train runs one backend instance in its own process; the cluster has set up
the torch.distributed group (gloo on CPU, nccl on GPU) before the backend is built. The
driver gives every rank its own shard of the global batch; objectives normalise with the
global counts in `batch.meta`, so the gradient of the global batch is the *sum* of the ranks'
gradients. Both FSDP2 and DeepSpeed average gradients over ranks, so the loss is multiplied
by the world size before backward (exact in binary for power-of-two world sizes).

Collectives run inside every forward and backward (parameter all-gather, gradient
reduce-scatter), so every rank must run the same number of micro-batches: ranks with fewer
rows split theirs into smaller ones, and only when single rows are left run extra "dummy"
micro-batches (a copy of one of theirs, loss times zero, metrics dropped). The updates are
those of one big batch on one rank, up to float summation order.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from roll_core.backends.train.base import TrainBackendSpec, add_metrics
from roll_core.backends.train.packing import pad_log_probs, split_to_count
from roll_core.backends.train.torch_backend import (
    TorchTrainBackend,
    add_router_aux_loss,
    resolve_device,
)
from roll_core.data import Batch
from roll_core.errors import CheckpointError, ConfigError


def require_process_group(backend: str) -> tuple[int, int]:
    """(rank, world size) of the group this process belongs to."""
    if not dist.is_initialized():
        raise RuntimeError(
            f"the {backend} train backend needs a torch.distributed process group; build it "
            "through a Cluster (actor_train with backend "
            f"{backend}), which starts one process per rank and joins them."
        )
    return dist.get_rank(), dist.get_world_size()


def rank_device(device: str) -> torch.device:
    """This rank's device: its (only visible, or LOCAL_RANK-th) GPU, or the CPU."""
    resolved = resolve_device(device)
    if resolved.type == "cuda":
        import os

        index = int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count()
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return resolved


def seed_everything(seed: int) -> None:
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed % 2**32)


def rng_state() -> dict[str, Any]:
    return {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
    }


def set_rng_state(rng: dict[str, Any]) -> None:
    torch.set_rng_state(rng["torch"])
    random.setstate(rng["python"])
    np.random.set_state(rng["numpy"])
    if rng["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])


def digest(state: dict[str, torch.Tensor]) -> str:
    """sha256 over names and bytes, in name order (same recipe as TorchTrainBackend)."""
    h = hashlib.sha256()
    for name, p in sorted(state.items()):
        h.update(name.encode())
        h.update(p.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


class ShardedTrainBackend(TorchTrainBackend):
    """Base of the multi-rank backends. Reuses the torch backend's forward / generate /
    log-prob code; subclasses build the sharded model and optimizer and implement
    `_backward`, `_optimizer_step`, `_lr`, `full_state_dict` and the checkpoint methods."""

    name = "sharded"
    _param_names: set[str]
    """Parameter names of the unsharded model (tied weights once): the weight-sync keys."""
    checkpoint_layout = "shared"
    """`save(path)` gets one directory that every rank writes into (not one per rank)."""

    def _init_common(self, spec: TrainBackendSpec) -> None:
        """What both sharded backends set up before building their model; a ConfigError for
        LoRA (the torch backend's only)."""
        if spec.lora is not None:
            raise ConfigError(
                f"actor_train.lora is not supported with the {self.name} backend yet.",
                hint="Use actor_train.backend=torch for LoRA.",
            )
        self.spec = spec
        self.rank, self.world_size = require_process_group(self.name)
        if spec.num_threads is not None:
            torch.set_num_threads(spec.num_threads)
        seed_everything(spec.seed)
        self.device = rank_device(spec.device)
        precision = spec.precision
        use_bf16 = precision == "bf16" or (precision == "auto" and self.device.type == "cuda")
        self.use_bf16 = use_bf16
        self.autocast_dtype = None  # subclasses cast through their own mixed precision
        self.micro_batch_size = spec.micro_batch_size
        self._init_processors(spec.model_path, spec.tokenizer_path)
        self.lora = None

    # ---- lock-step micro-batches ------------------------------------------------------------
    def _max_over_ranks(self, value: int) -> int:
        t = torch.tensor([value], dtype=torch.long, device=self._comm_device())
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return int(t.item())

    def _comm_device(self) -> torch.device:
        return self.device if dist.get_backend() == "nccl" else torch.device("cpu")

    def aligned_chunks(
        self, batch: Batch, objective: Any = None
    ) -> list[tuple[list[int], Batch, bool]]:
        """This rank's micro-batches (see `micro_batches`) brought to the largest count of any
        rank: split (packing.split_to_count), then, when single rows are left, padded with
        dummies. Each entry is (row indices, micro-batch, is_dummy)."""
        chunks = self.micro_batches(batch, objective) if len(batch) else []
        n = self._max_over_ranks(len(chunks))
        if n and not chunks:
            raise RuntimeError("a rank got an empty shard; the batch has fewer rows than ranks")
        group = int(getattr(objective, "rows_per_group", 1))
        chunks = split_to_count(chunks, n, group=group)
        dummy = chunks[-1] if chunks else ([], batch)
        return [(r, c, False) for r, c in chunks] + [(*dummy, True)] * (n - len(chunks))

    # ---- the step ---------------------------------------------------------------------------
    def _backward(self, loss: torch.Tensor) -> None:
        raise NotImplementedError

    def _optimizer_step(self) -> float:
        """Clip, step the optimizer and the LR schedule; return the pre-clip global norm."""
        raise NotImplementedError

    def _lr(self) -> float:
        raise NotImplementedError

    def _zero_grad(self) -> None:
        raise NotImplementedError

    def train_step(self, batch: Batch, objective: Any) -> dict[str, float]:
        import time

        start = time.perf_counter()
        self.model.train()
        self._zero_grad()
        sums: dict[str, float] = {}
        seen_tokens = 0
        for _, mb, dummy in self.aligned_chunks(batch, objective):
            mb = mb.to(self.device)
            head, out = self.head(mb)
            loss, metrics = objective(head, mb)
            weight = len(mb) / len(batch) / self.world_size  # of the step, over all ranks
            loss, metrics = add_router_aux_loss(loss, metrics, out, self.model, weight)
            self._backward(loss * (0.0 if dummy else float(self.world_size)))
            if dummy:
                continue
            add_metrics(sums, metrics)
            seen_tokens += int(mb.tensors["attention_mask"].sum())
        lr = self._lr()
        grad_norm = self._optimizer_step()
        return {
            **sums,
            "train/grad_norm": float(grad_norm),
            "train/lr": lr,
            "perf/tokens": float(seen_tokens),
            "perf/train_s": time.perf_counter() - start,
        }

    @torch.no_grad()
    def evaluate(self, batch: Batch, objective: Any) -> dict[str, float]:
        self.model.eval()
        sums: dict[str, float] = {}
        for _, mb, dummy in self.aligned_chunks(batch, objective):
            mb = mb.to(self.device)
            _, metrics = objective(self.head(mb)[0], mb)
            if not dummy:
                add_metrics(sums, metrics)
        self._reshard()
        return sums

    def _reshard(self) -> None:
        """After passes without a backward: FSDP2's root (kept gathered from its forward to its
        backward, see fsdp2.py) is sharded again, so it is not held whole until the next
        update. Nothing to do for DeepSpeed."""
        reshard = getattr(self.model, "reshard", None)
        if callable(reshard):
            reshard()

    @torch.no_grad()
    def log_probs(self, batch: Batch, *, temperature: float = 1.0) -> torch.Tensor:
        from roll_core.backends.train.lm_head import target_log_probs

        self.model.eval()
        out = []
        for rows, mb, dummy in self.aligned_chunks(batch):
            mb = mb.to(self.device)
            # every rank runs the forward and the output layer (collectives inside: ZeRO-3
            # gathers the layer at each call), dummies too
            head, _ = self.head(mb)
            ids, valid = mb.tensors["input_ids"], mb.tensors["attention_mask"][:, 1:]
            logp = target_log_probs(head, ids, valid, temperature=temperature)
            if not dummy:
                out.append((rows, logp.cpu()))
        self._reshard()
        return pad_log_probs(out, batch)

    @torch.no_grad()
    def token_stats(self, batch: Batch, *, temperature: float = 1.0) -> dict[str, torch.Tensor]:
        """Log-probs and entropies (see TorchTrainBackend.token_stats)."""
        from roll_core.backends.train.lm_head import log_probs_and_entropy

        self.model.eval()
        parts: dict[str, list[tuple[list[int], torch.Tensor]]] = {"log_probs": [], "entropy": []}
        for rows, mb, dummy in self.aligned_chunks(batch):
            mb = mb.to(self.device)
            head, _ = self.head(mb)  # forward and output layer on every rank (see log_probs)
            ids, valid = mb.tensors["input_ids"], mb.tensors["attention_mask"][:, 1:]
            logp, ent = log_probs_and_entropy(head, ids, valid, temperature=temperature)
            if not dummy:
                parts["log_probs"].append((rows, logp.cpu()))
                parts["entropy"].append((rows, ent.cpu()))
        self._reshard()
        return {key: pad_log_probs(value, batch) for key, value in parts.items()}

    def adapters_disabled(self) -> Any:
        raise ValueError(f"the {self.name} backend does not support LoRA")

    # ---- full weights -----------------------------------------------------------------------
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every tensor of the unsharded model on CPU, on rank 0 ({} elsewhere). Collective:
        every rank must call it."""
        raise NotImplementedError

    def full_weights(self) -> dict[str, torch.Tensor]:
        """The weight-sync payload (parameters by name, tied weights once), on rank 0."""
        state = self.full_state_dict()
        return {n: t for n, t in state.items() if n in self._param_names}

    @torch.no_grad()
    def sync_tensors(self, bucket_bytes: int) -> Iterator[tuple[str, torch.Tensor]]:
        """The weight-sync stream, parameter by parameter, gathered one at a time
        (``DTensor.full_tensor()``: a collective every rank runs in the same order; only
        rank 0's tensors are sent). Never more than one unsharded parameter at a time."""
        for name, p in self.model.named_parameters():
            if name not in self._param_names:
                continue
            full = p.full_tensor() if hasattr(p, "full_tensor") else p
            yield name, full.detach()

    def shareable_parameters(self) -> list[torch.Tensor]:
        """None: sharded parameters are gathered into fresh tensors at each sync."""
        return []

    def state_digest(self) -> str:
        state = self.full_state_dict()
        return digest(state) if self.rank == 0 else ""

    def export(self, path: Path) -> None:
        state = self.full_state_dict()
        if self.rank == 0:
            path.mkdir(parents=True, exist_ok=True)
            self._hf_model().save_pretrained(path, state_dict=state, safe_serialization=True)
            self.tokenizer.save_pretrained(path)
        dist.barrier()

    def _hf_model(self) -> Any:
        return self.model

    # ---- per-rank RNG (the sharded state is the subclass's) -------------------------------
    def _save_rng(self, path: Path) -> None:
        torch.save(rng_state(), path / f"rng-rank{self.rank}.pt")

    def _load_rng(self, path: Path) -> None:
        file = path / f"rng-rank{self.rank}.pt"
        if not file.exists():
            raise CheckpointError(
                f"checkpoint {path} has no RNG state for rank {self.rank}: it was written with "
                "another actor_train.world_size.",
                hint="Resume with the world_size the run was saved with.",
            )
        set_rng_state(torch.load(file, weights_only=False))
