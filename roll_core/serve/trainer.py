"""One training client's model: a LoRA adapter on its own copy of a served base model, trained
by roll's torch backend, with Tinker's split of a step into ``forward_backward`` calls (each
adds its gradients) and one ``optim_step`` (Adam with the request's hyper-parameters, then the
gradients are cleared).
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from roll_core.algorithms.tinker_losses import INPUTS, TINKER_LOSSES, datum_loss
from roll_core.backends.train.base import TrainBackendSpec
from roll_core.backends.train.lm_head import picked_log_probs
from roll_core.backends.train.torch_backend import TorchTrainBackend
from roll_core.config.schema import LoraConfig, OptimConfig
from roll_core.config.serve import ServeConfig, ServedModel
from roll_core.data import Batch
from roll_core.models.lora import iter_merged, load_adapter, save_adapter

MICRO_BATCH_TOKENS = 4096
"""Padded tokens (rows x longest row) of one forward; a longer datum runs alone."""

ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")


class UserError(Exception):
    """A request the client got wrong (Tinker's ``category: user``): its message says what."""


@dataclass(frozen=True)
class AdamStep:
    """The ``adam_params`` of one ``optim_step``."""

    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0


def lora_targets(*, train_attn: bool, train_mlp: bool, train_unembed: bool) -> list[str]:
    """The linear layers of a Tinker ``LoraConfig``'s switches (Qwen/Llama layer names)."""
    targets = [*(ATTN if train_attn else ()), *(MLP if train_mlp else ())]
    if train_unembed:
        targets.append("lm_head")
    if not targets:
        raise UserError("lora_config trains no layer: set train_attn, train_mlp or train_unembed")
    return targets


class TrainedModel:
    """A training client's model. Calls are made one at a time (the server's queue)."""

    def __init__(
        self,
        cfg: ServeConfig,
        served: ServedModel,
        *,
        rank: int,
        targets: list[str],
        seed: int | None,
    ) -> None:
        self.served = served
        self.rank = rank
        self.targets = targets
        lora = LoraConfig(rank=rank, alpha=cfg.lora.alpha, dropout=0.0, target_modules=targets)
        spec = TrainBackendSpec(
            model_path=served.path,
            tokenizer_path=served.tokenizer,
            dtype=cfg.train.dtype,
            device=cfg.train.device,
            precision=cfg.train.precision,
            optim=OptimConfig(scheduler="constant"),
            seed=cfg.train.seed if seed is None else seed,
            num_threads=cfg.train.num_threads,
            lora=lora,
            packing=False,
            logit_chunk_tokens=cfg.train.logit_chunk_tokens,
        )
        with warnings.catch_warnings():  # a tied head's adapter: the sampler unties the head
            warnings.filterwarnings("ignore", message=".*tie_word_embeddings.*")
            self.backend = TorchTrainBackend(spec)
        self.model = self.backend.model
        self.params = self.backend.params
        self.vocab = int(self.model.config.vocab_size)
        self.optimizer = torch.optim.AdamW(self.params, lr=1e-4, betas=(0.9, 0.95), eps=1e-12)
        self.steps = 0

    # ---- forward / backward ------------------------------------------------------------------
    def forward_backward(
        self,
        data: list[Any],
        loss_fn: str,
        config: dict[str, float | str],
        *,
        backward: bool,
    ) -> tuple[list[dict[str, np.ndarray]], dict[str, float]]:
        """Run `loss_fn` on every datum (``wire.Datum``); add the gradients of their summed
        loss unless `backward` is False. Returns each datum's outputs (``logprobs`` of its
        target tokens, ``elementwise_loss``) and the metrics (``loss:sum``)."""
        if loss_fn not in TINKER_LOSSES:
            raise UserError(
                f"loss_fn {loss_fn!r} is not served by roll serve; served built-in losses: "
                f"{', '.join(TINKER_LOSSES)}"
            )
        if any(isinstance(v, str) for v in config.values()):
            raise UserError(f"loss_fn_config of {loss_fn} takes numbers only, got {config}")
        numbers = {k: float(v) for k, v in config.items()}
        checked = [self._check(i, d, loss_fn) for i, d in enumerate(data)]  # before any grad
        self.model.train(backward)
        outputs: list[dict[str, np.ndarray]] = []
        total = 0.0
        for group in _micro_batches([len(c[0]) for c in checked], MICRO_BATCH_TOKENS):
            with torch.set_grad_enabled(backward):  # forward only: no graph kept
                rows = self._logprobs(
                    [checked[j][0] for j in group], [checked[j][1] for j in group]
                )
                losses = []
                for j, logp in zip(group, rows, strict=True):
                    try:
                        per_token = datum_loss(
                            loss_fn, logprobs=logp, inputs=checked[j][2], config=numbers
                        )
                    except ValueError as err:
                        raise UserError(str(err)) from None
                    losses.append(per_token.sum())
                    outputs.append(
                        {
                            "logprobs": logp.detach().float().cpu().numpy(),
                            "elementwise_loss": per_token.detach().float().cpu().numpy(),
                        }
                    )
                loss = torch.stack(losses).sum()
            if backward:
                loss.backward()
            total += float(loss.detach())
        return outputs, {"loss:sum": total}

    def _check(
        self, i: int, datum: Any, loss_fn: str
    ) -> tuple[list[int], torch.Tensor, dict[str, torch.Tensor]]:
        """Datum `i`'s tokens, targets and loss inputs, or a UserError naming what is wrong."""
        tokens = datum.tokens
        n = len(tokens)
        if not tokens:
            raise UserError(f"datum {i} has no input tokens")
        if n > self.served.max_context_length:
            raise UserError(
                f"datum {i} has {n} tokens, more than max_context_length "
                f"{self.served.max_context_length} of {self.served.name}"
            )
        if "target_tokens" not in datum.inputs:
            raise UserError(f"datum {i}: loss_fn_inputs has no target_tokens")
        targets = torch.as_tensor(datum.inputs["target_tokens"], dtype=torch.long).reshape(-1)
        if targets.numel() != n:
            raise UserError(
                f"datum {i}: target_tokens has {targets.numel()} entries for {n} "
                "input tokens (one target per input position)"
            )
        ids = torch.as_tensor(tokens)
        if (
            min(int(ids.min()), int(targets.min())) < 0
            or max(int(ids.max()), int(targets.max())) >= self.vocab
        ):
            raise UserError(
                f"datum {i} holds token ids outside the vocabulary (0..{self.vocab - 1})"
            )
        inputs = {}
        for key in INPUTS[loss_fn]:
            value = datum.inputs.get(key)
            if value is None:
                raise UserError(f"datum {i}: {loss_fn} needs loss_fn_inputs[{key!r}]")
            t = torch.as_tensor(np.asarray(value, dtype=np.float32)).reshape(-1)
            if t.numel() != n:
                raise UserError(f"datum {i}: {key} has {t.numel()} entries for {n} input tokens")
            inputs[key] = t.to(self.backend.device)
        return list(tokens), targets, inputs

    def _logprobs(self, rows: list[list[int]], targets: list[torch.Tensor]) -> list[torch.Tensor]:
        """log p(targets[r][t] | rows[r][: t + 1]) for every row r and position t ([N_r] float32
        each), from one right-padded forward of the rows; the output layer runs a chunk of
        positions at a time (backends/train/lm_head.py: no [tokens x vocabulary] tensor is
        kept for the backward)."""
        device = self.backend.device
        width = max(len(r) for r in rows)
        ids = torch.zeros((len(rows), width), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for r, tokens in enumerate(rows):
            ids[r, : len(tokens)] = torch.as_tensor(tokens)
            mask[r, : len(tokens)] = 1
        mb = Batch(tensors={"input_ids": ids, "attention_mask": mask}).to(device)
        head, _ = self.backend.head(mb)
        values = picked_log_probs(head, mask.to(device).bool(), torch.cat(targets).to(device))
        return list(values.split([len(r) for r in rows]))

    # ---- optimizer ---------------------------------------------------------------------------
    def optim_step(self, adam: AdamStep) -> dict[str, float]:
        """AdamW (decoupled weight decay) with `adam`'s hyper-parameters on the accumulated
        gradients (clipped to ``grad_clip_norm`` when above 0), then clear them."""
        for group in self.optimizer.param_groups:
            group.update(
                lr=adam.learning_rate,
                betas=(adam.beta1, adam.beta2),
                eps=adam.eps,
                weight_decay=adam.weight_decay,
            )
        limit = adam.grad_clip_norm if adam.grad_clip_norm > 0 else float("inf")
        norm = torch.nn.utils.clip_grad_norm_(self.params, limit)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.steps += 1
        return {"grad_norm:mean": float(norm), "learning_rate:mean": adam.learning_rate}

    # ---- weights -----------------------------------------------------------------------------
    def save(self, path: Path, *, optimizer: bool = True) -> None:
        """The adapter (and the optimizer state) into `path`."""
        with warnings.catch_warnings():  # a tied head's adapter saves the embedding with it
            warnings.filterwarnings("ignore", message=".*save_embedding_layers.*")
            save_adapter(self.model, path / "adapter")
        if optimizer:
            torch.save(self.optimizer.state_dict(), path / "optimizer.pt")
        meta = {"base_model": self.served.name, "rank": self.rank, "targets": self.targets}
        (path / "meta.json").write_text(json.dumps(meta))

    def load(self, path: Path, *, optimizer: bool) -> None:
        load_adapter(self.model, path / "adapter")
        if optimizer:
            state = torch.load(path / "optimizer.pt", weights_only=True)
            self.optimizer.load_state_dict(state)
        self.optimizer.zero_grad(set_to_none=True)

    @torch.no_grad()
    def merged(self) -> dict[str, torch.Tensor]:
        """The base weights with the adapter folded in, on CPU (what a sampler loads)."""
        return {k: v.detach().to("cpu", copy=True) for k, v in iter_merged(self.model)}


def _micro_batches(lengths: list[int], budget: int) -> list[list[int]]:
    """Consecutive indices grouped so that rows x longest row stays within `budget`."""
    groups: list[list[int]] = []
    longest = 0
    for i, n in enumerate(lengths):
        if groups and max(longest, n) * (len(groups[-1]) + 1) <= budget:
            groups[-1].append(i)
            longest = max(longest, n)
        else:
            groups.append([i])
            longest = n
    return groups


def read_meta(path: Path) -> dict[str, Any]:
    return json.loads((path / "meta.json").read_text())
