"""Reference: the frozen initial policy, for KL. Built only when the recipe uses KL.

Two forms: one rank holding the plain Hugging Face model (beside actor_train's rank 0), or,
when actor_train is sharded by megatron, ranks of actor_train's own backend and layout built
frozen (`TrainBackendSpec.frozen`: the same model code, log-prob passes only), so the
reference is split over the GPUs exactly as the policy is."""

from __future__ import annotations

from typing import Any

import torch

from roll_core.backends.train import get_train_backend
from roll_core.backends.train.base import TrainBackendSpec
from roll_core.backends.train.lm_head import (
    LMHead,
    distribution_targets,
    head_forward,
    target_log_probs,
)
from roll_core.backends.train.packing import (
    check_packing_support,
    micro_batches,
    pad_log_probs,
    rope_module,
    scatter_rows,
)
from roll_core.backends.train.torch_backend import resolve_device
from roll_core.data import Batch
from roll_core.data.vision import vision_model_inputs
from roll_core.engine import Worker
from roll_core.engine.worker import dispatch
from roll_core.models import load_causal_lm
from roll_core.models.routing import router_replay_for
from roll_core.models.vision import image_token_id


class Reference(Worker):
    """Log-probs of the reference model (no optimizer, no gradients)."""

    def __init__(
        self,
        *,
        model_path: str,
        device: str = "auto",
        micro_batch_size: int = 8,
        num_threads: int | None = None,
        packing: bool = False,
        max_tokens_per_micro_batch: int | None = None,
        dtype: str = "float32",
        logit_chunk_tokens: int | None = None,
        spec: TrainBackendSpec | None = None,
        router_replay: str = "off",
        **rank_info: Any,
    ) -> None:
        """`dtype`: the weights' dtype (float32, bfloat16 or float16; e.g. a large teacher of
        on-policy distillation in bfloat16). ``spec``: a frozen sharded train backend
        (megatron) instead of the plain model; the other arguments are then unused (the spec
        carries them). `router_replay`: ``r3`` routes every token through the experts the
        sampler recorded (the Batch's ``routed_experts``; roll_core/models/routing.py)."""
        super().__init__(**rank_info)
        self.router_replay_mode = router_replay
        self.router_replay: Any = None
        self.dtype = dtype
        self.spec = spec
        self.backend: Any = None
        self.model_path = model_path
        self.device_name = device
        self.micro_batch_size = micro_batch_size
        self.num_threads = num_threads
        self.packing = packing  # as actor_train's (backends/train/packing.py)
        self.max_tokens = max_tokens_per_micro_batch
        self.logit_chunk_tokens = logit_chunk_tokens  # backends/train/lm_head.py
        self.model: Any = None

    @classmethod
    def needs_process_group(cls, world_size: int, kwargs: dict[str, Any]) -> bool:
        """The sharded form's ranks form a torch.distributed group, as actor_train's do."""
        return kwargs.get("spec") is not None

    @dispatch("all")
    def setup(self) -> dict[str, Any]:
        if self.spec is not None:
            self.backend = get_train_backend(self.spec.backend)(self.spec)
            return {"device": str(self.backend.device)}
        if self.num_threads is not None:
            torch.set_num_threads(self.num_threads)
        self.device = resolve_device(self.device_name)
        dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
        self.model = load_causal_lm(self.model_path, device=self.device, dtype=dtype[self.dtype])
        self._varlen = (
            check_packing_support(self.model, role="reference") if self.packing else False
        )
        self._rope = rope_module(self.model) if self.packing else None
        self._image_token = image_token_id(self.model.config)  # VLMs: 3-D rope positions
        self.router_replay = router_replay_for(self.model, self.router_replay_mode)
        self.model.eval()
        return {"device": str(self.device)}

    @dispatch("dp", collect="concat")
    @torch.no_grad()
    def log_probs(self, batch: Batch, *, temperature: float = 1.0) -> torch.Tensor:
        """Next-token log-probs [B, T-1] of this rank's rows (0 where a row has no next
        token)."""
        if self.backend is not None:  # sharded: this rank's rows, computed by its replica
            return self.backend.log_probs(batch, temperature=temperature)
        out = []
        for rows, mb in micro_batches(
            batch,
            micro_batch_size=self.micro_batch_size,
            max_tokens=self.max_tokens,
            packed=self.packing,
        ):
            mb = mb.to(self.device)
            head = self._head(mb)
            ids, valid = mb.tensors["input_ids"], mb.tensors["attention_mask"][:, 1:]
            logp = target_log_probs(head, ids, valid, temperature=temperature)
            out.append((rows, logp.cpu()))
        return pad_log_probs(out, batch)

    def _head(self, mb: Batch) -> LMHead:
        """The micro-batch's logits on demand (backends/train/lm_head.py)."""
        head, _ = head_forward(
            self.model,
            mb,
            self.device,
            chunk_tokens=self.logit_chunk_tokens,
            packing=self.packing,
            rope=self._rope,
            # VLM rows: their images and token types (the model's 3-D rope positions)
            vision=vision_model_inputs(mb, self.device, image_token_id=self._image_token),
            varlen=self._varlen,
            replay=self.router_replay,
        )
        return head

    @dispatch("dp", collect="concat")
    @torch.no_grad()
    def distributions(
        self, batch: Batch, *, temperature: float, top_k: int | None, vocab_size: int
    ) -> dict[str, torch.Tensor]:
        """On-policy distillation's `mode: full`: the next-token distributions at every
        response position of ``batch`` (``response_mask``; 0 elsewhere): ``logprobs``
        ``[B, T-1, K]`` and, with ``top_k``, ``ids`` ``[B, T-1, k]``, as
        :func:`~roll_core.algorithms.distill.teacher_targets` groups them (logits beyond
        ``vocab_size``, the shared tokenizer's size, dropped). The plain-model form only."""
        if self.backend is not None:
            raise NotImplementedError("a sharded reference computes sampled-token log-probs only")
        parts: dict[str, list[tuple[list[int], torch.Tensor]]] = {}
        for rows, mb in micro_batches(
            batch, micro_batch_size=self.micro_batch_size, max_tokens=self.max_tokens,
            packed=self.packing,
        ):  # fmt: skip
            mb = mb.to(self.device)
            mask = mb.tensors["response_mask"].bool()
            logp, ids = distribution_targets(
                self._head(mb), mask, temperature=temperature, top_k=top_k, vocab_size=vocab_size
            )
            for key, value in {"logprobs": logp, "ids": ids}.items():
                if value is None:
                    continue
                dense = torch.zeros((*mask.shape, value.shape[-1]), dtype=value.dtype)
                dense[mask.cpu()] = value.cpu()
                parts.setdefault(key, []).append((rows, dense))
        width = batch.tensors["input_ids"].shape[1] - 1
        return {key: scatter_rows(values, len(batch), width) for key, values in parts.items()}
