"""The LM head a chunk of positions at a time: no ``[tokens, vocabulary]`` tensor lives through
the backward.

A causal LM's forward ends with ``logits = lm_head(hidden)``: ``[B, T, V]`` values (and their
float32 log-softmax) per micro-batch, kept for the backward, the largest tensors of a step with
a real vocabulary (151,936 for Qwen). Every pass that needs per-token quantities (the policy
update, old / reference / teacher log-probs, on-policy distillation's full distributions,
DPO, SFT, distillation) goes through :class:`HeadInput` instead: the model's forward runs
with its head deferred (:func:`deferred_head`: the forward returns the last hidden states
``[B, T, H]``), and :meth:`HeadInput.map` applies ``head`` then the caller's per-position
function to ``chunk_tokens`` positions at a time, each chunk under
``torch.utils.checkpoint`` (non-reentrant): only the chunk's inputs (a slice of the hidden
states; the head's weight, held anyway) are saved, and the backward recomputes one chunk's
logits at a time. The head's weight gets one gradient (the chunks' contributions are summed by
autograd before it is accumulated), so tied embeddings and sharded backends (FSDP2's root
group, DeepSpeed's module hooks) see the gradient of one ordinary forward.

Same approach as verl's and prime-rl's chunked log-prob / entropy and Liger's fused linear
cross-entropy, in plain torch (no compiled kernel): the head runs once more per chunk in the
backward (one extra LM-head matmul per micro-batch) in exchange for the memory.

The head is whatever module the model's ``get_output_embeddings()`` returns, called as a
module, so a LoRA-wrapped head (peft) or a head with a bias computes as in the model's own
forward. Models whose logits are not ``head(hidden)`` (a logit soft-cap, a logit scale) are
not deferred: :func:`deferral_blocker` names why, and their full logits are used, chunked the
same way for the float32 work.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from roll_core.algorithms.distill import teacher_targets

DEFAULT_CHUNK_TOKENS = 512
"""Positions whose logits exist at once (`actor_train.logit_chunk_tokens`' default): with
151,936 tokens, 512 x 151,936 float32 = 0.3 GB per copy (an update's chunk holds about 14
bytes per logit in bf16: 1.0 GiB)."""

LOG_PROB_CHUNK = 2**26
"""When full logits are given (:meth:`HeadInput.of`: the megatron backend, models whose head
cannot be deferred, `logit_chunk_tokens: 0` in log-prob passes), the positions per chunk are
this many logit elements over the vocabulary: the float32 copies stay at 256 MiB each
(engine/placement.py:LOGIT_CHUNK counts it)."""

_POST_HEAD_KEYS = ("final_logit_softcapping", "logit_scale", "logits_scaling")
"""Config keys of models whose forward transforms ``lm_head(hidden)`` further (Gemma 2/3,
Cohere, Granite): their logits are not ``head(hidden)``."""


def deferral_blocker(model: Any) -> str | None:
    """Why ``model``'s logits cannot be computed as ``head(last hidden state)`` outside its
    forward (None: they can)."""
    head = output_head(model)
    if head is None:
        return f"{type(model).__name__} has no output embeddings (get_output_embeddings)"
    config = getattr(model, "config", None)
    text = config.get_text_config() if config is not None else None
    for key in _POST_HEAD_KEYS:
        value = getattr(text, key, None)
        if value not in (None, 1, 1.0):
            return f"its config sets {key}={value}: the forward transforms the head's output"
    return None


def output_head(model: Any) -> torch.nn.Module | None:
    """The module that maps the last hidden states to the logits (a peft model's base head,
    wrapped with its adapters when LoRA targets it)."""
    get = getattr(model, "get_output_embeddings", None)
    return get() if callable(get) else None


def _pass_through(hidden: torch.Tensor) -> torch.Tensor:
    return hidden


@contextlib.contextmanager
def deferred_head(model: Any) -> Iterator[torch.nn.Module]:
    """Inside, ``model``'s forward returns its last hidden states in place of the logits (the
    head's ``forward`` passes its input through; hooks on it, e.g. DeepSpeed ZeRO-3's, still
    run); yields the head, whose own forward is back after the context. Raises ValueError when
    :func:`deferral_blocker` says no."""
    blocker = deferral_blocker(model)
    if blocker is not None:
        raise ValueError(f"cannot defer the LM head: {blocker}")
    head = output_head(model)
    assert head is not None
    head.forward = _pass_through  # type: ignore[method-assign]
    try:
        yield head
    finally:
        del head.forward  # the class's forward again


ChunkFn = Callable[..., Sequence[torch.Tensor]]
"""``fn(logits [n, V], *extras [n, ...]) -> tensors [n, ...]``: per-position quantities."""


@dataclass
class HeadInput:
    """What an objective gets for one micro-batch in place of logits ``[B, T', V]``: either
    the last hidden states ``values`` ``[B, T', H]`` and the ``head`` that maps them, or the
    logits themselves (``head`` None). ``T'``: the columns the backend computed (the last ones
    when it cut the prompt's, see ``logits_from``). Positions are read through :meth:`map`,
    ``chunk_tokens`` at a time (0: all at once, no recomputation: the unchunked path)."""

    values: torch.Tensor
    head: Callable[[torch.Tensor], torch.Tensor] | None
    chunk_tokens: int

    @classmethod
    def of(cls, logits: torch.Tensor | HeadInput) -> HeadInput:
        """``logits`` ``[B, T', V]`` as a HeadInput (a chunk: LOG_PROB_CHUNK elements)."""
        if isinstance(logits, HeadInput):
            return logits
        tokens = max(1, LOG_PROB_CHUNK // max(1, logits.shape[-1]))
        return cls(logits, None, tokens)

    @property
    def width(self) -> int:
        """``T'``: the columns of the micro-batch these values cover (the last ones)."""
        return int(self.values.shape[1])

    def logits(self) -> torch.Tensor:
        """All logits ``[B, T', V]`` at once (tests; callers that need every position)."""
        if self.head is None:
            return self.values
        return self.head(self.values)

    def map(
        self, fn: ChunkFn, select: torch.Tensor, *extras: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        """``fn`` on the logits of the positions ``select`` (bool ``[B, T']``, row-major order
        as boolean indexing gives them: ``N`` positions) and the matching rows of ``extras``
        (each ``[N, ...]``): its outputs, each ``[N, ...]``. Positions go ``chunk_tokens`` at a
        time; with autograd on, each chunk is checkpointed (its logits recomputed in the
        backward), so only one chunk's ``[n, V]`` exists at a time, forward and backward."""
        rows = self.values[select]
        return chunked_map(fn, rows, extras, head=self.head, chunk_tokens=self.chunk_tokens)


def chunked_map(
    fn: ChunkFn,
    rows: torch.Tensor,
    extras: Sequence[torch.Tensor],
    *,
    head: Callable[[torch.Tensor], torch.Tensor] | None,
    chunk_tokens: int,
) -> tuple[torch.Tensor, ...]:
    """``fn(head(rows), *extras)`` (``head`` None: ``rows`` are logits) a chunk of
    ``chunk_tokens`` rows at a time (0: one chunk, computed directly), outputs concatenated.
    See :meth:`HeadInput.map`."""
    n = rows.shape[0]

    def run(part: torch.Tensor, *more: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(fn(head(part) if head is not None else part, *more))

    if chunk_tokens <= 0 or n == 0:
        return run(rows, *extras)
    parts = []
    pieces = [rows.split(chunk_tokens), *(e.split(chunk_tokens) for e in extras)]
    grad = torch.is_grad_enabled()
    for args in zip(*pieces, strict=True):
        if grad:
            parts.append(checkpoint(run, *args, use_reentrant=False))
        else:
            parts.append(run(*args))
    return tuple(torch.cat(outs) for outs in zip(*parts, strict=True))


def head_input_of(
    model: Any,
    forward: Callable[[], Any],
    *,
    chunk_tokens: int,
    autocast: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext,
) -> HeadInput:
    """``forward()`` (the model's forward on one micro-batch, e.g. packing.model_forward)
    with the head deferred when ``chunk_tokens`` > 0 and the model allows it, as a
    HeadInput: the frozen models' form (reference, teacher) of the train backends'
    ``head_input``. The head's calls run under ``autocast()`` as the forward did."""
    if chunk_tokens > 0 and deferral_blocker(model) is None:
        with deferred_head(model) as head:
            out = forward()

        def call(hidden: torch.Tensor) -> torch.Tensor:
            with autocast():
                return head(hidden)

        return HeadInput(out.logits, call, chunk_tokens)
    logits = forward().logits
    if chunk_tokens > 0 or not torch.is_grad_enabled():
        return HeadInput.of(logits)
    return HeadInput(logits, None, 0)


def _grouped_targets(
    logits: torch.Tensor, *, vocab_size: int, temperature: float, top_k: int | None
) -> tuple[torch.Tensor, ...]:
    logp, ids = teacher_targets(logits[:, :vocab_size], temperature=temperature, top_k=top_k)
    return (logp,) if ids is None else (logp, ids)


def grouped_targets(
    inp: HeadInput, select: torch.Tensor, *, vocab_size: int, temperature: float, top_k: int | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A teacher's next-token distributions at the positions ``select`` (``[B, T']`` bool):
    :func:`~roll_core.algorithms.distill.teacher_targets` of the logits cut to ``vocab_size``,
    a chunk of positions at a time: the grouped log-probs ``[N, K]`` and, with ``top_k``, the
    ids ``[N, k]`` (only those outlive a chunk: with top-k no ``[N, V]`` tensor exists)."""
    fn = functools.partial(
        _grouped_targets, vocab_size=vocab_size, temperature=temperature, top_k=top_k
    )
    outs = inp.map(fn, select)
    return outs[0], outs[1] if len(outs) > 1 else None
