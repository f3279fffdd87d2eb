"""Reference: the frozen initial policy, for KL. Built only when the recipe uses KL."""

from __future__ import annotations

from typing import Any

import torch

from roll_core.backends.train.packing import (
    check_packing_support,
    micro_batches,
    model_forward,
    pad_log_probs,
    rope_module,
)
from roll_core.backends.train.torch_backend import resolve_device, token_log_probs
from roll_core.data import Batch
from roll_core.data.vision import vision_model_inputs
from roll_core.engine import Worker
from roll_core.engine.worker import dispatch
from roll_core.models import load_causal_lm
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
        **rank_info: Any,
    ) -> None:
        super().__init__(**rank_info)
        self.model_path = model_path
        self.device_name = device
        self.micro_batch_size = micro_batch_size
        self.num_threads = num_threads
        self.packing = packing  # as actor_train's (backends/train/packing.py)
        self.max_tokens = max_tokens_per_micro_batch
        self.model: Any = None

    @dispatch("all")
    def setup(self) -> dict[str, Any]:
        if self.num_threads is not None:
            torch.set_num_threads(self.num_threads)
        self.device = resolve_device(self.device_name)
        self.model = load_causal_lm(self.model_path, device=self.device)
        self._varlen = (
            check_packing_support(self.model, role="reference") if self.packing else False
        )
        self._rope = rope_module(self.model) if self.packing else None
        self._image_token = image_token_id(self.model.config)  # VLMs: 3-D rope positions
        self.model.eval()
        return {"device": str(self.device)}

    @dispatch("dp", collect="concat")
    @torch.no_grad()
    def log_probs(self, batch: Batch, *, temperature: float = 1.0) -> torch.Tensor:
        out = []
        for rows, mb in micro_batches(
            batch,
            micro_batch_size=self.micro_batch_size,
            max_tokens=self.max_tokens,
            packed=self.packing,
        ):
            mb = mb.to(self.device)
            logits = model_forward(
                self.model,
                mb,
                self.device,
                packing=self.packing,
                rope=self._rope,
                # VLM rows: their images and token types (the model's 3-D rope positions)
                vision=vision_model_inputs(mb, self.device, image_token_id=self._image_token),
                varlen=self._varlen,
            ).logits
            ids = mb.tensors["input_ids"]
            out.append((rows, token_log_probs(logits, ids, temperature=temperature).cpu()))
        return pad_log_probs(out, batch)
