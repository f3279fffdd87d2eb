"""Reference: the frozen initial policy, for KL. Built only when the recipe uses KL."""

from __future__ import annotations

from typing import Any

import torch

from roll_core.backends.train.torch_backend import resolve_device, token_log_probs
from roll_core.data import Batch
from roll_core.data.vision import vision_model_inputs
from roll_core.engine import Worker
from roll_core.engine.worker import dispatch
from roll_core.models import load_causal_lm


class Reference(Worker):
    """Log-probs of the reference model (no optimizer, no gradients)."""

    def __init__(
        self,
        *,
        model_path: str,
        device: str = "auto",
        micro_batch_size: int = 8,
        num_threads: int | None = None,
        **rank_info: Any,
    ) -> None:
        super().__init__(**rank_info)
        self.model_path = model_path
        self.device_name = device
        self.micro_batch_size = micro_batch_size
        self.num_threads = num_threads
        self.model: Any = None

    @dispatch("all")
    def setup(self) -> dict[str, Any]:
        if self.num_threads is not None:
            torch.set_num_threads(self.num_threads)
        self.device = resolve_device(self.device_name)
        self.model = load_causal_lm(self.model_path, device=self.device)
        self.model.eval()
        return {"device": str(self.device)}

    @dispatch("dp", collect="concat")
    @torch.no_grad()
    def log_probs(self, batch: Batch, *, temperature: float = 1.0) -> torch.Tensor:
        out = []
        for mb in batch.chunk(self.micro_batch_size):
            mb = mb.to(self.device)
            logits = self.model(
                input_ids=mb.tensors["input_ids"],
                attention_mask=mb.tensors["attention_mask"],
                use_cache=False,
                **vision_model_inputs(mb, self.device),  # VLM rows: their images
            ).logits
            ids = mb.tensors["input_ids"]
            out.append(token_log_probs(logits, ids, temperature=temperature).cpu())
        return torch.cat(out)
