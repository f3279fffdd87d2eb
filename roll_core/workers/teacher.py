"""Teacher: the frozen model a student is distilled from. Knows nothing about Ray.

It holds no optimizer and computes no gradients (its memory is the weights alone). It returns
its next-token distributions at the positions the student trains on, full or top-k (see
roll_core/algorithms/distill.py), and greedy generations for the exact-match comparison. A
vision-language teacher gets each row's images from the batch (``pixel_values`` /
``image_grid_thw``, made once by the processor both models share), so it sees exactly the
student's inputs.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from roll_core.backends.train.base import TrainBackendSpec
from roll_core.backends.train.lm_head import LMHead, distribution_targets, head_forward
from roll_core.backends.train.packing import (
    check_packing_support,
    micro_batches,
    rope_module,
    scatter_rows,
)
from roll_core.backends.train.torch_backend import resolve_device
from roll_core.data import Batch
from roll_core.data.vision import VisionInputs, concat_vision, vision_model_inputs
from roll_core.engine import Worker
from roll_core.engine.worker import dispatch
from roll_core.models import load_causal_lm, load_tokenizer
from roll_core.models.vision import image_token_id

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class Teacher(Worker):
    """One rank of the teacher model."""

    def __init__(self, *, spec: TrainBackendSpec, **rank_info: Any) -> None:
        """`spec`: the model, dtype, device, precision, threads and micro-batching (packing,
        token budget) of the teacher; its optimizer fields are unused (it never trains)."""
        super().__init__(**rank_info)
        self.spec = spec
        self.model: Any = None

    @dispatch("all")
    def setup(self) -> dict[str, Any]:
        """Load the model (eval mode, no gradients); report its size and vocabulary."""
        spec = self.spec
        if spec.num_threads is not None:
            torch.set_num_threads(spec.num_threads)
        self.device = resolve_device(spec.device)
        use_bf16 = spec.precision == "bf16" or (
            spec.precision == "auto" and self.device.type == "cuda"
        )
        self.autocast_dtype = torch.bfloat16 if use_bf16 else None
        self.tokenizer = load_tokenizer(spec.tokenizer_path or spec.model_path)
        self.model = load_causal_lm(spec.model_path, dtype=_DTYPES[spec.dtype], device=self.device)
        self._varlen = check_packing_support(self.model, role="teacher") if spec.packing else False
        self._rope = rope_module(self.model) if spec.packing else None
        self._image_token = image_token_id(self.model.config)  # VLMs: 3-D rope positions
        self.model.eval()
        self.model.requires_grad_(False)
        return {
            "params": sum(p.numel() for p in self.model.parameters()),
            "device": str(self.device),
            "vocab_size": int(self.model.config.get_text_config().vocab_size),
        }

    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def _head(self, mb: Batch) -> LMHead:
        """The micro-batch's logits on demand (backends/train/lm_head.py)."""
        if self.model is None:
            raise RuntimeError("Teacher.setup() was not called")
        head, _ = head_forward(
            self.model,
            mb,
            self.device,
            chunk_tokens=self.spec.logit_chunk_tokens,
            autocast=self._autocast,
            packing=self.spec.packing,
            rope=self._rope,
            # image rows: the images the student sees, their token types (3-D rope positions)
            vision=vision_model_inputs(mb, self.device, image_token_id=self._image_token),
            varlen=self._varlen,
        )
        return head

    @dispatch("dp", collect="concat")
    @torch.no_grad()
    def targets(
        self, batch: Batch, *, temperature: float, top_k: int | None, vocab_size: int
    ) -> dict[str, torch.Tensor]:
        """The teacher's next-token targets at every trained position of ``batch`` (0 elsewhere).

        Returns ``teacher_logprobs`` ``[B, T-1, K]`` (see roll_core/algorithms/distill.py),
        ``teacher_top1`` ``[B, T-1]`` and, with ``top_k``, ``teacher_ids`` ``[B, T-1, k]``, on
        CPU. Logits beyond ``vocab_size`` (the shared tokenizer's size) are dropped.
        """
        parts: dict[str, list[tuple[list[int], torch.Tensor]]] = {}
        spec = self.spec
        for rows, mb in micro_batches(
            batch,
            micro_batch_size=spec.micro_batch_size,
            max_tokens=spec.max_tokens_per_micro_batch,
            packed=spec.packing,
        ):
            mask = mb.tensors["loss_mask"][:, 1:].bool()
            logp, ids = distribution_targets(
                self._head(mb.to(self.device)),
                mask.to(self.device),
                temperature=temperature,
                top_k=top_k,
                vocab_size=vocab_size,
            )
            fields = {"teacher_logprobs": logp, "teacher_top1": logp.argmax(-1)}
            if ids is not None:
                fields["teacher_ids"] = ids
                fields["teacher_top1"] = ids[:, 0]
            for key, value in fields.items():
                dense = torch.zeros((*mask.shape, *value.shape[1:]), dtype=value.dtype)
                dense[mask] = value.cpu()
                parts.setdefault(key, []).append((rows, dense))
        width = batch.tensors["input_ids"].shape[1] - 1
        return {key: scatter_rows(values, len(batch), width) for key, values in parts.items()}

    @dispatch("rank0")
    @torch.no_grad()
    def generate(
        self,
        prompts: list[list[int]],
        *,
        max_new_tokens: int,
        vision: list[VisionInputs | None] | None = None,
    ) -> list[list[int]]:
        """Greedy continuations (no prompt tokens, cut at the eos token); ``vision``: each
        prompt's images (vision-language models)."""
        if self.model is None:
            raise RuntimeError("Teacher.setup() was not called")
        pad, eos = self.tokenizer.pad_token_id, self.tokenizer.eos_token_id
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), pad, dtype=torch.long)
        attn = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):  # left padding, so every row continues at the end
            ids[i, width - len(p) :] = torch.tensor(p)
            attn[i, width - len(p) :] = 1
        with self._autocast():
            out = self.model.generate(
                **concat_vision(
                    vision or [],
                    device=self.device,
                    input_ids=ids if self._image_token is not None else None,
                    image_token_id=self._image_token,
                ),
                input_ids=ids.to(self.device),
                attention_mask=attn.to(self.device),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                eos_token_id=eos,
                pad_token_id=pad,
            )
        rows = out[:, width:].tolist()
        return [row[: row.index(eos)] if eos in row else row for row in rows]
