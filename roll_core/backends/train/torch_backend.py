"""The `torch` train backend: one process, CPU or one CUDA device.

AdamW, gradient accumulation over micro-batches, global-norm clipping, warmup + cosine/linear
LR, bfloat16 autocast on CUDA. Its checkpoint holds everything a bitwise-exact resume needs:
weights (Hugging Face format), optimizer and scheduler state, and every RNG it touches.
"""

from __future__ import annotations

import contextlib
import random
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from roll_core.backends.train.base import TrainBackendSpec, add_metrics
from roll_core.backends.train.lm_head import (
    LOG_PROB_CHUNK,
    LMHead,
    head_forward,
    log_probs_and_entropy,
    target_log_probs,
)
from roll_core.backends.train.packing import (
    check_packing_support,
    micro_batches,
    model_forward,
    pad_log_probs,
    rope_module,
)
from roll_core.backends.train.schedules import make_optimizer
from roll_core.data import Batch
from roll_core.data.vision import VisionInputs, concat_vision, vision_model_inputs
from roll_core.errors import CheckpointError
from roll_core.models import load_causal_lm, load_tokenizer
from roll_core.models.loading import is_vision_model
from roll_core.models.lora import (
    apply_lora,
    export_merged,
    iter_merged,
    load_adapter,
    save_adapter,
)
from roll_core.models.routing import router_replay_for
from roll_core.models.vision import image_token_id, load_processor, vision_token_ids

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        from roll_core.errors import ConfigError

        raise ConfigError(
            "actor_train.device is cuda but no CUDA device is visible.",
            hint="Set actor_train.device=cpu (or auto) on this machine.",
        )
    return torch.device(device)


Objective = Callable[[LMHead, Batch], tuple[torch.Tensor, dict[str, float]]]
"""A training loss on one micro-batch: (its logits [B, T, V] on demand, micro-batch) -> (loss
share, metric sums). Objectives live in roll_core/workers/objectives.py and call pure losses."""


def token_log_probs(
    logits: torch.Tensor, input_ids: torch.Tensor, *, temperature: float = 1.0
) -> torch.Tensor:
    """log p(input_ids[:, t+1] | prefix) for every t: [B, T-1] float32 from logits [B, T, V]
    (any dtype) divided by `temperature`. Computed a chunk of positions at a time
    (`LOG_PROB_CHUNK` elements), so the float32 copies of a large vocabulary stay small; each
    position's value is the same as in one pass."""
    rows, width, vocab = logits.shape
    step = max(1, LOG_PROB_CHUNK // max(1, rows * vocab))
    parts = []
    for start in range(0, width - 1, step):
        end = min(start + step, width - 1)
        logp = torch.log_softmax(logits[:, start:end].float() / temperature, dim=-1)
        parts.append(logp.gather(-1, input_ids[:, start + 1 : end + 1].unsqueeze(-1)).squeeze(-1))
        del logp  # before the next chunk's copies, not after them
    if not parts:
        return torch.zeros((rows, 0), dtype=torch.float32, device=logits.device)
    return torch.cat(parts, dim=1)


def token_loss_sum(
    logits: torch.Tensor, input_ids: torch.Tensor, loss_mask: torch.Tensor
) -> torch.Tensor:
    """Summed next-token cross-entropy over masked positions.

    logits [B, T, V] predict input_ids[:, 1:]; loss_mask [B, T] marks trained *tokens*, so the
    target mask is loss_mask[:, 1:].
    """
    targets = input_ids[:, 1:]
    mask = loss_mask[:, 1:].to(torch.float32)
    per_token = F.cross_entropy(
        logits[:, :-1].float().reshape(-1, logits.size(-1)), targets.reshape(-1), reduction="none"
    )
    return (per_token.view_as(mask) * mask).sum()


ROUTER_AUX_METRIC = "actor/router_aux_loss"


def add_router_aux_loss(
    loss: torch.Tensor, metrics: dict[str, float], output: Any, model: Any, weight: float
) -> tuple[torch.Tensor, dict[str, float]]:
    """``loss`` plus the router's load-balancing loss of a mixture-of-experts forward, as
    transformers adds it to its own loss: ``config.router_aux_loss_coef * output.aux_loss``
    (Qwen3-MoE, Qwen2-MoE, Mixtral... return ``aux_loss`` when their config sets
    ``output_router_logits``); unchanged when the output has none.

    ``weight``: this micro-batch's share of the step (its rows over the rank's rows, over the
    ranks), so the terms of a step's micro-batches add up to their row-weighted mean, like the
    objective's share of the global loss; ``metrics`` gains ``actor/router_aux_loss`` (the
    unscaled ``aux_loss``, weighted the same way, so its sum over micro-batches and ranks is
    the step's mean).
    """
    aux = getattr(output, "aux_loss", None)
    if aux is None:
        return loss, metrics
    coef = float(getattr(model.config, "router_aux_loss_coef", 0.0) or 0.0)
    aux = aux.to(loss.device, torch.float32)
    metrics = {**metrics, ROUTER_AUX_METRIC: float(aux.detach()) * weight}
    return loss + coef * weight * aux, metrics


class TorchTrainBackend:
    """TrainBackend for a single process."""

    world_size = 1
    """Ranks that hold a part of the model (the sharded backends set theirs): above 1, every
    rank runs `generate` together, in lock step."""

    def __init__(self, spec: TrainBackendSpec) -> None:
        if spec.num_threads is not None:
            torch.set_num_threads(spec.num_threads)
        torch.manual_seed(spec.seed)
        random.seed(spec.seed)
        np.random.seed(spec.seed % 2**32)
        self.spec = spec
        self.device = resolve_device(spec.device)
        use_bf16 = spec.precision == "bf16" or (
            spec.precision == "auto" and self.device.type == "cuda"
        )
        self.autocast_dtype = torch.bfloat16 if use_bf16 else None
        self.micro_batch_size = spec.micro_batch_size
        self._init_processors(spec.model_path, spec.tokenizer_path)
        self.model = load_causal_lm(spec.model_path, dtype=_DTYPES[spec.dtype], device=self.device)
        self._init_packing(self.model)
        if spec.gradient_checkpointing:
            self.model.gradient_checkpointing_enable()
        self.lora = lora = spec.lora
        if lora is not None:  # only the adapters train; see roll_core/models/lora.py
            if spec.gradient_checkpointing:
                self.model.enable_input_require_grads()  # frozen embeddings still need grads
            self.model = apply_lora(
                self.model,
                rank=lora.rank,
                alpha=lora.alpha,
                dropout=lora.dropout,
                target_modules=lora.target_modules,
            )
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optim_cfg = spec.optim
        self.optimizer, self.scheduler = make_optimizer(self.params, spec.optim, spec.total_steps)

    def _init_packing(self, model: Any) -> None:
        """Packing settings from the spec; a ConfigError now (before the first step) when
        packing is on and the model's attention cannot isolate packed rows."""
        self.packing = self.spec.packing
        self.max_tokens = self.spec.max_tokens_per_micro_batch
        self._varlen = check_packing_support(model) if self.packing else False
        self._rope = rope_module(model) if self.packing else None
        self._image_token = image_token_id(model.config)  # VLMs: their mm_token_type_ids
        # MoE routing replay (algorithm.router_replay): hooks on the routers
        self.router_replay = router_replay_for(model, self.spec.router_replay)

    def micro_batches(self, batch: Batch, objective: Any = None) -> list[tuple[list[int], Batch]]:
        """(row indices, micro-batch) of `batch`: `micro_batch_size` rows, or the token budget
        (see backends/train/packing.py); an objective's `rows_per_group` (DPO: 2) keeps
        those rows together."""
        return micro_batches(
            batch,
            micro_batch_size=self.micro_batch_size,
            max_tokens=self.max_tokens,
            packed=self.packing,
            group=int(getattr(objective, "rows_per_group", 1)),
        )

    def _init_processors(self, model_path: str, tokenizer_path: str | None) -> None:
        """What `generate` and `export` need besides the model, set here for every backend
        (the sharded ones call it from their own setup): the tokenizer and, for a VLM, its
        image processor (exported with the model, so the export loads as a VLM)."""
        self.tokenizer = load_tokenizer(tokenizer_path or model_path)
        self.image_processor = (
            load_processor(model_path, self.tokenizer).image_processor
            if is_vision_model(model_path)
            else None
        )

    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def forward(self, mb: Batch, *, logits_from: int = 0) -> torch.Tensor:
        """Logits [B, T, V] of one micro-batch (train or eval mode as set by the caller; a
        vision-language model also gets the rows' images, see roll_core/data/vision.py);
        with `logits_from` > 0 only those of columns logits_from.. ([B, T - logits_from, V]:
        the LM head runs on those positions only)."""
        return self.model_output(mb, logits_from=logits_from).logits

    def model_output(self, mb: Batch, *, logits_from: int = 0) -> Any:
        """The model's whole output on one micro-batch (see :meth:`forward`): its `logits`,
        and the router's `aux_loss` of a mixture-of-experts model that returns one."""
        # VLM rows: their pixel_values, grids and token types (3-D rope positions)
        vision = vision_model_inputs(mb, self.device, image_token_id=self._image_token)
        with self._autocast():
            return model_forward(
                self._call_model,
                mb,
                self.device,
                packing=self.packing,
                rope=self._rope,
                logits_from=logits_from,
                vision=vision,
                varlen=self._varlen,
                replay=self.router_replay,
            )

    def head(self, mb: Batch, *, logits_from: int = 0) -> tuple[LMHead, Any]:
        """(The logits of one micro-batch on demand, the model's output without them: its
        router's `aux_loss`): as :meth:`model_output`, but the output layer runs later, on
        the positions an objective asks for, `logit_chunk_tokens` at a time
        (backends/train/lm_head.py)."""
        return head_forward(
            self.model,
            mb,
            self.device,
            chunk_tokens=self.spec.logit_chunk_tokens,
            autocast=self._autocast,
            call=self._call_model,
            packing=self.packing,
            rope=self._rope,
            logits_from=logits_from,
            vision=vision_model_inputs(mb, self.device, image_token_id=self._image_token),
            varlen=self._varlen,
            replay=self.router_replay,
        )

    def _call_model(self, **kwargs: Any) -> Any:
        """The model's forward (the DeepSpeed backend calls its engine instead)."""
        return self.model(**kwargs)

    def train_step(self, batch: Batch, objective: Objective) -> dict[str, float]:
        """One optimizer step: `objective` on each micro-batch, backward, clip, AdamW, LR.

        The objective returns each micro-batch's share of the global loss (normalised with
        the global counts in `batch.meta`), so accumulation equals one big batch. Its metrics
        are summed over micro-batches.
        """
        start = time.perf_counter()
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        sums: dict[str, float] = {}
        seen_tokens = 0
        for _, mb in self.micro_batches(batch, objective):
            mb = mb.to(self.device)
            logits_from = getattr(objective, "logits_from", None)
            first = logits_from(mb) if logits_from is not None else 0
            head, out = self.head(mb, logits_from=first)
            loss, metrics = objective(head, mb)
            loss, metrics = add_router_aux_loss(
                loss, metrics, out, self.model, len(mb) / len(batch)
            )
            loss.backward()
            add_metrics(sums, metrics)
            seen_tokens += int(mb.tensors["attention_mask"].sum())
        max_norm = self.optim_cfg.max_grad_norm
        grad_norm = torch.nn.utils.clip_grad_norm_(
            self.params, max_norm if max_norm is not None else float("inf")
        )
        lr = float(self.optimizer.param_groups[0]["lr"])  # the schedule's, or an override
        self.optimizer.step()
        self.scheduler.step()
        return {
            **sums,
            "train/grad_norm": float(grad_norm),
            "train/lr": lr,
            "perf/tokens": float(seen_tokens),
            "perf/train_s": time.perf_counter() - start,
        }

    @torch.no_grad()
    def evaluate(self, batch: Batch, objective: Objective) -> dict[str, float]:
        """Summed objective metrics over `batch`, no update."""
        self.model.eval()
        sums: dict[str, float] = {}
        for _, mb in self.micro_batches(batch, objective):
            mb = mb.to(self.device)
            _, metrics = objective(self.head(mb)[0], mb)
            add_metrics(sums, metrics)
        return sums

    @torch.no_grad()
    def log_probs(self, batch: Batch, *, temperature: float = 1.0) -> torch.Tensor:
        """Log-probability of every next token, [B, T-1] float32 on CPU (0 where padded)."""
        self.model.eval()
        out = []
        for rows, mb in self.micro_batches(batch):
            mb = mb.to(self.device)
            head, _ = self.head(mb)
            ids, valid = mb.tensors["input_ids"], mb.tensors["attention_mask"][:, 1:]
            logp = target_log_probs(head, ids, valid, temperature=temperature)
            out.append((rows, logp.cpu()))
        return pad_log_probs(out, batch)

    @torch.no_grad()
    def token_stats(self, batch: Batch, *, temperature: float = 1.0) -> dict[str, torch.Tensor]:
        """``log_probs`` (as :meth:`log_probs`) and ``entropy`` of every next-token
        distribution, each [B, T-1] float32 on CPU (0 where padded): the rollout record's."""
        self.model.eval()
        parts: dict[str, list[tuple[list[int], torch.Tensor]]] = {"log_probs": [], "entropy": []}
        for rows, mb in self.micro_batches(batch):
            mb = mb.to(self.device)
            head, _ = self.head(mb)
            ids, valid = mb.tensors["input_ids"], mb.tensors["attention_mask"][:, 1:]
            logp, ent = log_probs_and_entropy(head, ids, valid, temperature=temperature)
            parts["log_probs"].append((rows, logp.cpu()))
            parts["entropy"].append((rows, ent.cpu()))
        return {key: pad_log_probs(value, batch) for key, value in parts.items()}

    def adapters_disabled(self) -> contextlib.AbstractContextManager[Any]:
        """Inside this context the model computes as its base model (LoRA adapters off): the
        reference policy of DPO / KL penalties under LoRA, with no second copy of the model."""
        if self.lora is None:
            raise ValueError("adapters_disabled() needs actor_train.lora; this model has none")
        return self.model.disable_adapter()  # type: ignore[operator]

    @torch.no_grad()
    def generate(
        self,
        prompts: list[list[int]],
        *,
        max_new_tokens: int,
        vision: list[VisionInputs | None] | None = None,
    ) -> list[list[int]]:
        self.model.eval()
        pad = self.tokenizer.pad_token_id
        eos = self.tokenizer.eos_token_id
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), pad, dtype=torch.long)
        attn = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):  # left padding, so every row continues at the end
            ids[i, width - len(p) :] = torch.tensor(p)
            attn[i, width - len(p) :] = 1
        with self._autocast():
            out = self.model.generate(  # type: ignore[operator]
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
                suppress_tokens=(
                    vision_token_ids(self.model.config)
                    if self.image_processor is not None
                    else None
                ),
                eos_token_id=eos,
                pad_token_id=pad,
                # sharded: each forward gathers weights, so every rank runs until all are done
                synced_gpus=self.world_size > 1,
            )
        results = []
        for row in out[:, width:].tolist():
            results.append(row[: row.index(eos)] if eos in row else row)
        return results

    # ---- state -----------------------------------------------------------------------------
    def save(self, path: Path) -> None:
        if self.lora is not None:  # adapters only: the frozen base is re-read from model_path
            save_adapter(self.model, path / "adapter")
        else:
            self.export(path / "model")
        torch.save(self.optimizer.state_dict(), path / "optimizer.pt")
        torch.save(self.scheduler.state_dict(), path / "scheduler.pt")
        rng = {
            "torch": torch.get_rng_state(),
            "python": random.getstate(),
            "numpy": np.random.get_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
        }
        torch.save(rng, path / "rng.pt")

    def load(self, path: Path) -> None:
        try:
            if self.lora is not None:
                load_adapter(self.model, path / "adapter")
            else:
                self._load_full_weights(path)
            self.optimizer.load_state_dict(torch.load(path / "optimizer.pt", weights_only=True))
            self.scheduler.load_state_dict(torch.load(path / "scheduler.pt", weights_only=True))
            rng = torch.load(path / "rng.pt", weights_only=False)
        except (OSError, RuntimeError, KeyError) as err:
            raise CheckpointError(f"cannot load checkpoint {path}: {err}") from None
        torch.set_rng_state(rng["torch"])
        random.setstate(rng["python"])
        np.random.set_state(rng["numpy"])
        if rng["cuda"] is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(rng["cuda"])

    def _load_full_weights(self, path: Path) -> None:
        if self.image_processor is not None:
            # transformers saves a VLM under its hub checkpoint names (model.layers...), not the
            # module names (model.language_model.layers...): read it back through from_pretrained
            dtype = next(self.model.parameters()).dtype
            state = load_causal_lm(
                str(path / "model"), dtype=dtype, device=self.device
            ).state_dict()
        else:
            state = load_file(str(path / "model" / "model.safetensors"), device=str(self.device))
        missing, unexpected = self.model.load_state_dict(state, strict=False)
        tied = {k for k in missing if k.endswith("lm_head.weight")}
        if set(missing) - tied or unexpected:
            raise CheckpointError(
                f"checkpoint {path} does not match the model: missing "
                f"{sorted(set(missing) - tied)[:3]}, unexpected {sorted(unexpected)[:3]}."
            )
        if tied and not getattr(self.model.config, "tie_word_embeddings", False):
            raise CheckpointError(f"checkpoint {path} has no lm_head.weight.")

    def export(self, path: Path) -> None:
        """The model in Hugging Face format; under LoRA the adapters merged into the weights
        (plus the adapters alone in `path/adapter/`)."""
        path.mkdir(parents=True, exist_ok=True)
        if self.lora is not None:
            export_merged(self.model, path)
        else:
            self.model.save_pretrained(path, safe_serialization=True)
        self.tokenizer.save_pretrained(path)
        if self.image_processor is not None:
            self.image_processor.save_pretrained(path)

    @torch.no_grad()
    def sync_tensors(self, bucket_bytes: int) -> Iterator[tuple[str, torch.Tensor]]:
        """The weight-sync stream: every parameter of the plain model by name, the live
        tensors themselves (read before the next update; never copied here). Under LoRA each
        adapted layer's merged weight (W + scale * B @ A) is computed when it is reached, so
        at most one merged tensor exists at a time."""
        if self.lora is not None:
            yield from iter_merged(self.model)
            return
        for name, p in self.model.named_parameters():
            yield name, p.detach()

    def shareable_parameters(self) -> list[torch.Tensor]:
        """Parameters the weight sync may move into shared memory (sync_transport's
        ParameterArena): the CPU model's own, as `sync_tensors` yields them; none under LoRA
        (merged tensors are computed at each sync) or on CUDA (CUDA IPC instead)."""
        if self.lora is not None or self.device.type != "cpu":
            return []
        return list(self.model.parameters())

    def state_digest(self) -> str:
        """sha256 of every parameter's bytes, for exactness checks in tests and logs."""
        import hashlib

        h = hashlib.sha256()
        for name, p in sorted(self.model.state_dict().items()):
            h.update(name.encode())
            h.update(p.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
        return h.hexdigest()
