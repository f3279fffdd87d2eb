"""Critic: the value model of PPO (``adv_estimator: gae``). Knows nothing about Ray.

The value model is the actor's architecture without its language-model head: the decoder's
last hidden state goes through a linear head to one scalar per position. It is initialised
from a causal-LM checkpoint (by default the actor's initial weights); the head starts at zero,
so the first values are 0 and no random number is drawn (the actor's RNG streams are not
disturbed by building a critic).

Values live in the batch's target space ``[B, T-1]`` (see roll_core/rollout/batch.py):
``values[:, t]`` is the value of the prefix ``input_ids[:, :t+1]``, the state in which token
``t+1`` is generated, i.e. the same position as ``log_probs[:, t]``. The critic is trained with
PPO's clipped value loss (:func:`roll_core.algorithms.value_loss`) towards the returns of
:func:`roll_core.algorithms.gae`.
"""

from __future__ import annotations

import contextlib
import hashlib
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from roll_core.algorithms import value_loss
from roll_core.backends.train.packing import (
    check_packing_support,
    micro_batches,
    packed_inputs,
    scatter_rows,
)
from roll_core.backends.train.schedules import make_optimizer
from roll_core.backends.train.torch_backend import resolve_device
from roll_core.config.schema import OptimConfig
from roll_core.data import Batch
from roll_core.engine import Worker
from roll_core.engine.worker import dispatch
from roll_core.errors import CheckpointError
from roll_core.models import load_causal_lm


class ValueModel(torch.nn.Module):
    """A causal LM's decoder with a scalar head: ``input_ids [B, T] -> values [B, T]``."""

    def __init__(self, causal_lm: Any) -> None:
        super().__init__()
        self.backbone = causal_lm.base_model  # the decoder, without the LM head
        self.value_head = torch.nn.Linear(causal_lm.config.hidden_size, 1)
        torch.nn.init.zeros_(self.value_head.weight)
        torch.nn.init.zeros_(self.value_head.bias)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Values ``[B, T]``; packed rows (``[1, S]``, see backends/train/packing.py) pass
        ``position_ids`` and no ``attention_mask``."""
        hidden = self.backbone(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=False,
        ).last_hidden_state
        return self.value_head(hidden).squeeze(-1).float()


def critic_loss(
    values: torch.Tensor, mb: Batch, *, clip: float | None
) -> tuple[torch.Tensor, dict[str, float]]:
    """The clipped value loss of one micro-batch as its share of the mini-batch's loss.

    `values` ``[B, T-1]`` are the critic's new predictions (with gradient); the micro-batch
    holds ``values`` (the predictions before this step's updates, no gradient), ``returns``
    and ``response_mask`` (all ``[B, T-1]``) and, in ``meta``, ``response_tokens``: the
    response tokens of the whole mini-batch. The loss is ``token-mean`` over the mini-batch
    (summed over micro-batches it is the mini-batch's loss); metrics are weighted by the
    micro-batch's share of the tokens, so their sums are mini-batch means.
    """
    t = mb.tensors
    mask = t["response_mask"]
    total = float(mb.meta["response_tokens"])
    loss, metrics = value_loss(
        values=values,
        old_values=t["values"],
        returns=t["returns"],
        response_mask=mask,
        clip=clip,
        agg_mode="token-mean",
        global_num_tokens=total,
    )
    share = float(mask.sum()) / max(1.0, total)
    return loss, {
        "critic/value_loss": float(loss.detach()),  # already this micro-batch's share
        "critic/vf_clipfrac": metrics["critic/vf_clipfrac"] * share,
        "critic/vpred_mean": metrics["critic/vpred_mean"] * share,
    }


class Critic(Worker):
    """One rank of the critic: values of a batch, clipped-value-loss updates, save/load."""

    def __init__(
        self,
        *,
        model_path: str,
        optim: OptimConfig,
        total_steps: int,
        micro_batch_size: int = 8,
        device: str = "auto",
        precision: str = "auto",
        num_threads: int | None = None,
        value_clip: float | None = 0.2,
        packing: bool = False,
        max_tokens_per_micro_batch: int | None = None,
        **rank_info: Any,
    ) -> None:
        super().__init__(**rank_info)
        self.model_path = model_path
        self.optim_cfg = optim
        self.total_steps = total_steps
        self.micro_batch_size = micro_batch_size
        self.device_name = device
        self.precision = precision
        self.num_threads = num_threads
        self.value_clip = value_clip
        self.packing = packing  # as actor_train's (backends/train/packing.py)
        self.max_tokens = max_tokens_per_micro_batch
        self.model: ValueModel | None = None

    @dispatch("all")
    def setup(self) -> dict[str, Any]:
        if self.num_threads is not None:
            torch.set_num_threads(self.num_threads)
        self.device = resolve_device(self.device_name)
        use_bf16 = self.precision == "bf16" or (
            self.precision == "auto" and self.device.type == "cuda"
        )
        self.autocast_dtype = torch.bfloat16 if use_bf16 else None
        causal_lm = load_causal_lm(self.model_path)
        self._varlen = check_packing_support(causal_lm, role="critic") if self.packing else False
        self.model = ValueModel(causal_lm).to(self.device)
        cfg = self.optim_cfg
        self.optimizer, self.scheduler = make_optimizer(
            self.model.parameters(), cfg, self.total_steps
        )
        params = sum(p.numel() for p in self.model.parameters())
        return {"params": params, "device": str(self.device)}

    def _m(self) -> ValueModel:
        if self.model is None:
            raise RuntimeError("Critic.setup() was not called")
        return self.model

    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def _forward(self, mb: Batch, *, every_position: bool = False) -> torch.Tensor:
        """Values in target space ``[B, T-1]``: position t is the state after token t.
        `every_position`: all ``T`` input positions (a micro-batch trimmed to its longest row
        keeps that row's last state, the ``T``-th)."""
        if self.packing:
            kwargs, layout = packed_inputs(mb, self.device, varlen=self._varlen)
            with self._autocast():
                packed = self._m()(kwargs["input_ids"], None, kwargs["position_ids"])
            values = layout.unpack(packed[..., None])[..., 0]
        else:
            with self._autocast():
                values = self._m()(mb.tensors["input_ids"], mb.tensors["attention_mask"])
        return values if every_position else values[:, :-1]

    def _micro_batches(self, batch: Batch) -> list[tuple[list[int], Batch]]:
        return micro_batches(
            batch,
            micro_batch_size=self.micro_batch_size,
            max_tokens=self.max_tokens,
            packed=self.packing,
        )

    @dispatch("dp", collect="concat")
    @torch.no_grad()
    def values(self, batch: Batch) -> torch.Tensor:
        """The critic's value of every position, ``[B, T-1]`` float32 on CPU."""
        self._m().eval()
        width = batch.tensors["input_ids"].shape[1] - 1
        out = [
            (rows, self._forward(mb.to(self.device), every_position=True)[:, :width].cpu())
            for rows, mb in self._micro_batches(batch)
        ]
        # 0 beyond each row's last token when packed (its padding is never computed)
        return scatter_rows(out, len(batch), width)

    @dispatch("dp", collect="metrics")
    def train_step(self, batch: Batch) -> dict[str, float]:
        """One optimizer step of the clipped value loss on `batch` (a mini-batch), accumulated
        over micro-batches. Needs ``values`` (old predictions), ``returns``, ``response_mask``
        and ``meta['response_tokens']``."""
        start = time.perf_counter()
        model = self._m()
        model.train()
        self.optimizer.zero_grad(set_to_none=True)
        sums: dict[str, float] = {}
        for _, mb in self._micro_batches(batch):
            mb = mb.to(self.device)
            loss, metrics = critic_loss(self._forward(mb), mb, clip=self.value_clip)
            loss.backward()
            for key, value in metrics.items():
                sums[key] = sums.get(key, 0.0) + value
        max_norm = self.optim_cfg.max_grad_norm
        grad_norm = torch.nn.utils.clip_grad_norm_(
            model.parameters(), max_norm if max_norm is not None else float("inf")
        )
        lr = float(self.scheduler.get_last_lr()[0])
        self.optimizer.step()
        self.scheduler.step()
        return {
            **sums,
            "critic/grad_norm": float(grad_norm),
            "critic/lr": lr,
            "perf/critic_train_s": time.perf_counter() - start,
        }

    # ---- state -----------------------------------------------------------------------------
    @dispatch("all")
    def save(self, path: str) -> None:
        """Write this rank's weights, optimizer and scheduler to `path/rank-<rank>/`."""
        target = Path(path) / f"rank-{self.rank}"
        target.mkdir(parents=True, exist_ok=True)
        state = {k: v.detach().contiguous().cpu() for k, v in self._m().state_dict().items()}
        save_file(state, str(target / "value_model.safetensors"))
        torch.save(self.optimizer.state_dict(), target / "optimizer.pt")
        torch.save(self.scheduler.state_dict(), target / "scheduler.pt")

    @dispatch("all")
    def load(self, path: str) -> None:
        source = Path(path) / f"rank-{self.rank}"
        try:
            state = load_file(str(source / "value_model.safetensors"), device=str(self.device))
            self._m().load_state_dict(state, strict=True)
            self.optimizer.load_state_dict(torch.load(source / "optimizer.pt", weights_only=True))
            self.scheduler.load_state_dict(torch.load(source / "scheduler.pt", weights_only=True))
        except (OSError, RuntimeError, KeyError) as err:
            raise CheckpointError(f"cannot load the critic checkpoint {source}: {err}") from None

    @dispatch("rank0")
    def state_digest(self) -> str:
        """sha256 over every parameter's bytes (exactness checks)."""
        h = hashlib.sha256()
        for name, p in sorted(self._m().state_dict().items()):
            h.update(name.encode())
            h.update(p.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
        return h.hexdigest()
