"""The output layer a chunk of positions at a time: no [tokens x vocabulary] tensor is held for
the backward.

A causal LM's forward ends with ``logits = lm_head(hidden)``: [tokens, vocabulary] values,
float32 copies of them in the log-softmax, and autograd keeps both until the backward. With
a 151,936-token vocabulary that is 0.6 MiB per token and copy, more than the rest of a small
model's activations. Here the model's forward stops at the last hidden states (the output
layer's own forward is made the identity for that call, so every wrapper around the model
still runs: packing, LoRA, FSDP2 / DeepSpeed hooks, a mixture-of-experts router's loss), and
:class:`LMHead` applies the output layer to the positions an objective needs, ``chunk_tokens``
of them at a time, under activation checkpointing: the forward keeps only the chunk's hidden
states, the backward recomputes the chunk's logits, takes their gradient and drops them
before the next chunk. The peak is one chunk's [chunk_tokens, vocabulary] copies, whatever
the micro-batch holds; log-probs, entropies and gradients are those of the whole computation
(summation order aside).

Peers do the same (verl's and prime-rl's chunked log-prob/entropy, Liger's fused linear
cross-entropy); this one is plain torch (CPU and GPU, any output layer a module computes),
not a fused kernel, so any per-position function of the logits works: the RL objective's
log-probs, entropy and full-distribution distillation term, SFT's cross-entropy, DPO's
sequence log-probs, the teacher's targets.

Models whose forward changes the output layer's result (Gemma's logit soft-capping, Cohere's
and Granite's logit scaling) keep the full logits (:func:`deferrable_head` says None).
megatron defers its own vocabulary-parallel output layer the same way
(megatron_backend.deferred_output): each tensor-parallel rank projects a chunk onto its
vocabulary shard and the ranks gather the chunk's logits.

DeepSpeed ZeRO-3 partitions the output layer and gathers it with a collective at every call
(and at every recompute in the backward), so every rank must make the same number of calls
even when its micro-batch has fewer positions: such a head is *collective*
(:func:`gathers_per_call`): each :meth:`LMHead.map` agrees on the largest chunk count of any
rank (one all-reduce) and the ranks with fewer positions call the layer on empty chunks; every
call is checkpointed, and the micro-batch's logits are never taken from the forward (that
shortcut is per rank). The sharded backends run every pass on their dummy micro-batches too.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

LOG_PROB_CHUNK = 2**26
"""Logit elements turned into float32 at a time by a no-grad pass over full logits
(:meth:`LMHead.from_logits`): at most 2 x 256 MiB of float32 copies."""

AUTO_CHUNK_ELEMENTS = 2**24
"""``chunk_tokens: None`` (auto): positions per chunk such that one chunk's logits hold about
this many elements (64 MiB in float32): 110 tokens of a 151,936-token vocabulary, the whole
micro-batch of a small one."""

_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling")
"""Config attributes of models whose forward changes the output layer's result."""

ChunkFn = Callable[..., Sequence[torch.Tensor]]
"""fn(logits [n, V], *per-position inputs [n, ...]) -> per-position outputs [n, ...]."""


def deferrable_head(model: Any) -> torch.nn.Module | None:
    """The model's output layer when its logits may be computed outside the forward (the
    forward returns them unchanged), else None."""
    config: Any = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    for attr in _LOGIT_TRANSFORMS:
        value = getattr(text, attr, None)
        if value not in (None, 1, 1.0):
            return None
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    if not isinstance(head, torch.nn.Module):
        return None
    return head


def gathers_per_call(layer: torch.nn.Module) -> bool:
    """Whether calling `layer` is a collective: DeepSpeed ZeRO-3 partitions its parameters
    and gathers them at every call, so every rank must call it the same number of times."""
    return any(hasattr(p, "ds_id") for p in layer.parameters())


def _max_over_ranks(value: int, device: torch.device) -> int:
    """The largest `value` of any rank (itself outside a process group)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return value
    on = device if dist.get_backend() == "nccl" else torch.device("cpu")
    t = torch.tensor([value], dtype=torch.long, device=on)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


@contextlib.contextmanager
def deferred(head: torch.nn.Module) -> Iterator[None]:
    """Inside: `head`'s forward returns its input (the model's forward returns its last hidden
    states as ``logits``); its hooks still run. The instance attribute shadows the class's
    forward and is removed on exit."""
    head.forward = _identity  # type: ignore[method-assign]
    try:
        yield
    finally:
        del head.forward


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


class LMHead:
    """Logits of a micro-batch, ``[B, W, V]``, computed on demand.

    Either the last hidden states ``[B, W, H]`` and the output layer (`project`: ``[n, H]
    -> [n, V]``, the layer under the forward's autocast), or logits a backend already has
    (:meth:`from_logits`: megatron's, or a model whose head cannot be deferred). Objectives
    ask for per-position functions of the logits with :meth:`map`. ``collective``: calling
    `project` is a collective (DeepSpeed ZeRO-3, see the module docstring)."""

    def __init__(
        self,
        hidden: torch.Tensor,
        project: Callable[[torch.Tensor], torch.Tensor] | None,
        *,
        vocab_size: int,
        chunk_tokens: int | None = None,
        collective: bool = False,
    ) -> None:
        self.hidden = hidden
        self.project = project
        self.vocab_size = vocab_size
        self.collective = collective and project is not None
        self.chunk_tokens = None if project is None else chunk_size(vocab_size, chunk_tokens)

    @classmethod
    def from_logits(cls, logits: torch.Tensor) -> LMHead:
        return cls(logits, None, vocab_size=int(logits.shape[-1]))

    def from_column(self, first: int) -> LMHead:
        """The head of columns ``first..`` (an objective that reads the response only)."""
        if first == 0:
            return self
        head = LMHead(self.hidden[:, first:], self.project, vocab_size=self.vocab_size)
        head.chunk_tokens, head.collective = self.chunk_tokens, self.collective
        return head

    @property
    def width(self) -> int:
        """Columns (positions) of the micro-batch this head covers."""
        return int(self.hidden.shape[1])

    @property
    def device(self) -> torch.device:
        return self.hidden.device

    def logits(self) -> torch.Tensor:
        """All of them, ``[B, W, V]`` (the memory this class exists to avoid: for tests,
        small vocabularies and code that needs every position)."""
        if self.project is None:
            return self.hidden
        rows, width, size = self.hidden.shape
        return self.project(self.hidden.reshape(rows * width, size)).view(rows, width, -1)

    def map(
        self, mask: torch.Tensor, fn: ChunkFn, *inputs: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        """``fn`` on the logits of the positions ``mask`` ([B, W'] bool, W' <= W: columns
        0..W'-1) picks, in row-major order, a chunk of positions at a time: ``fn(logits [n,
        V], *inputs)`` with each of `inputs` ([N, ...], one entry per picked position) cut
        to the chunk; returns its outputs concatenated over the chunks ([N, ...] each).
        Logits are in the forward's dtype (float32, or bfloat16 under autocast): cast inside
        `fn`. Gradients flow to the hidden states and the output layer; with gradients on,
        each chunk's logits are recomputed in the backward instead of being kept. A
        collective head makes as many calls as the rank with the most chunks (collective:
        every rank must call :meth:`map` the same number of times)."""
        rows = self.hidden[:, : mask.shape[1]][mask]
        total = int(rows.shape[0])
        grad = torch.is_grad_enabled()
        if self.project is None:  # logits already exist: chunk the float32 copies only
            step = total if grad else max(1, LOG_PROB_CHUNK // max(1, self.vocab_size))
        else:
            step = self.chunk_tokens or total
        step = max(1, step)
        count = max(1, -(-total // step))
        if self.collective:  # ranks with fewer chunks call the layer on empty ones
            count = _max_over_ranks(count, self.hidden.device)
        recompute = self.project is not None and grad and (count > 1 or self.collective)
        parts: list[Sequence[torch.Tensor]] = []
        for start in range(0, count * step, step):
            chunk = rows[start : start + step]
            extra = tuple(x[start : start + step] for x in inputs)
            if recompute:
                out = checkpoint(
                    self._apply, fn, chunk, *extra, use_reentrant=False, preserve_rng_state=False
                )
            else:
                out = self._apply(fn, chunk, *extra)
            parts.append(out)
        if len(parts) == 1:
            return tuple(parts[0])
        return tuple(torch.cat(list(group)) for group in zip(*parts, strict=True))

    def _apply(self, fn: ChunkFn, rows: torch.Tensor, *inputs: torch.Tensor) -> Sequence[Any]:
        logits = rows if self.project is None else self.project(rows)
        return tuple(fn(logits, *inputs))


def head_forward(
    model: Any,
    mb: Any,
    device: torch.device,
    *,
    chunk_tokens: int | None,
    autocast: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext,
    call: Callable[..., Any] | None = None,
    **forward_kwargs: Any,
) -> tuple[LMHead, Any]:
    """:func:`~roll_core.backends.train.packing.model_forward` of `model` (through `call`, its
    forward by default: DeepSpeed's engine) on micro-batch `mb`, the logits left to an
    :class:`LMHead` (``chunk_tokens`` at a time). The forward's own logits instead where
    chunks would not help: ``chunk_tokens`` 0, a head that cannot be deferred, or a
    micro-batch of at most one chunk of positions (the logits are then exactly those of
    the plain forward, bit for bit). Returns (head, the model's output without its
    logits)."""
    from roll_core.backends.train.packing import model_forward

    layer = deferrable_head(model) if chunk_tokens != 0 else None
    collective = layer is not None and gathers_per_call(layer)
    if layer is not None and not collective:
        # a micro-batch within one chunk: its logits as the forward makes them (a rank's own
        # choice, so not for a collective head: every rank must call it alike)
        rows, width = mb.tensors["input_ids"].shape
        positions = rows * (width - int(forward_kwargs.get("logits_from", 0)))
        if positions <= chunk_size(_out_features(layer, model), chunk_tokens):
            layer = None
    with autocast(), deferred(layer) if layer is not None else contextlib.nullcontext():
        out = model_forward(call or model, mb, device, **forward_kwargs)
    if layer is None:
        return LMHead.from_logits(out.logits), out
    hidden, out.logits = out.logits, None

    def project(rows: torch.Tensor) -> torch.Tensor:
        with autocast():
            return layer(rows)

    vocab = _out_features(layer, model)
    head = LMHead(
        hidden, project, vocab_size=vocab, chunk_tokens=chunk_tokens, collective=collective
    )
    return head, out


def _out_features(layer: torch.nn.Module, model: Any) -> int:
    """The output layer's width (the vocabulary, padding rows included)."""
    width = getattr(layer, "out_features", None)
    if width is None:
        config = model.config
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        width = text.vocab_size
    return int(width)


def chunk_size(vocab_size: int, chunk_tokens: int | None) -> int:
    """Positions per chunk: `chunk_tokens`, or for None AUTO_CHUNK_ELEMENTS // vocabulary."""
    if chunk_tokens is None:
        return max(1, AUTO_CHUNK_ELEMENTS // max(1, vocab_size))
    return chunk_tokens


def as_head(logits: LMHead | torch.Tensor) -> LMHead:
    """Objectives take an :class:`LMHead` or plain logits ``[B, W, V]`` (megatron, tests)."""
    return logits if isinstance(logits, LMHead) else LMHead.from_logits(logits)


def _log_prob_fn(temperature: float) -> ChunkFn:
    def fn(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor]:
        logp = torch.log_softmax(logits.float() / temperature, dim=-1)
        return (logp.gather(-1, targets[:, None]).squeeze(-1),)

    return fn


def picked_log_probs(
    head: LMHead | torch.Tensor,
    mask: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature: float = 1.0,
) -> torch.Tensor:
    """log p(targets[i] | its position) at `temperature`, at the positions ``mask`` ([B, W]
    bool) picks, in row-major order: ``[N]`` float32 for ``targets`` ``[N]`` (any target per
    position, not only the next input token: Tinker's ``target_tokens``)."""
    (values,) = as_head(head).map(mask.bool(), _log_prob_fn(temperature), targets)
    return values


def target_log_probs(
    head: LMHead | torch.Tensor,
    input_ids: torch.Tensor,
    mask: torch.Tensor,
    *,
    temperature: float = 1.0,
) -> torch.Tensor:
    """log p(input_ids[:, t+1] | prefix) / at `temperature` where ``mask`` ([B, T-1], target
    space) is set, 0 elsewhere: ``[B, T-1]`` float32 (a head covering all T columns)."""
    picked = mask.bool()
    values = picked_log_probs(head, picked, input_ids[:, 1:][picked], temperature=temperature)
    out = torch.zeros(picked.shape, dtype=torch.float32, device=values.device)
    return out.masked_scatter(picked, values)


def log_probs_and_entropy(
    head: LMHead | torch.Tensor,
    input_ids: torch.Tensor,
    mask: torch.Tensor,
    *,
    temperature: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`target_log_probs` and the entropy of each next-token distribution (at
    `temperature`), both ``[B, T-1]`` float32, 0 where ``mask`` is not set."""
    from roll_core.algorithms.entropy import entropy_from_logits

    def fn(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scaled = logits.float() / temperature
        logp = torch.log_softmax(scaled, dim=-1).gather(-1, targets[:, None]).squeeze(-1)
        return logp, entropy_from_logits(scaled)

    picked = mask.bool()
    values = as_head(head).map(picked, fn, input_ids[:, 1:][picked])
    out = []
    for v in values:
        dense = torch.zeros(picked.shape, dtype=torch.float32, device=v.device)
        out.append(dense.masked_scatter(picked, v))
    return out[0], out[1]


def distribution_targets(
    head: LMHead | torch.Tensor,
    mask: torch.Tensor,
    *,
    temperature: float,
    top_k: int | None,
    vocab_size: int,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A frozen model's next-token distributions at the positions ``mask`` ([B, T-1]) picks,
    cut to ``vocab_size`` (:func:`~roll_core.algorithms.distill.teacher_targets`: log-probs
    ``[N, K]`` and, with top-k, ids ``[N, k]``); a chunk of positions' logits at a time."""
    from roll_core.algorithms.distill import teacher_targets

    def fn(logits: torch.Tensor) -> tuple[torch.Tensor, ...]:
        logp, ids = teacher_targets(logits[:, :vocab_size], temperature=temperature, top_k=top_k)
        return (logp,) if ids is None else (logp, ids)

    out = as_head(head).map(mask.bool(), fn)
    return out[0], out[1] if len(out) > 1 else None
