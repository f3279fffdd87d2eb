"""The InferBackend interface: token ids in, sampled token ids and their log-probs out.

Token-in/token-out: requests carry prompt token ids and completions carry the generated ids,
so what is trained is exactly what was generated. Every completion also carries the
behaviour log-probs (log softmax of logits / temperature, before top-p/top-k truncation, the
same quantity the trainer recomputes) and the policy version of the weights that produced it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from roll_core.data.vision import VisionInputs


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one response."""

    max_new_tokens: int = 32
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    """Token ids that end a response like eos does (kept in it). Honoured by the request-level
    engines (``generate_request``: hf_engine.py); the fixed-batch ``generate`` refuses them."""
    ignore_eos: bool = False
    """Keep generating after eos (until a stop or ``max_new_tokens``). Request-level engines
    only, as ``stop_token_ids``."""
    top_logprobs: int = 0
    """Also return this many most likely tokens (and their log-probs) at every generated
    position (``Completion.top_logprobs``); the same log softmax as the behaviour log-probs."""


@dataclass
class Request:
    """One response to generate (a prompt replicated n times is n requests)."""

    request_id: int
    prompt_ids: list[int]
    seed: int
    prefix_ids: list[int] = field(default_factory=list)
    """Response tokens generated earlier (partial rollout): the backend continues from
    ``prompt_ids + prefix_ids`` and returns only the new tokens. Needs a backend listed in
    :data:`PREFIX_CONTINUATION_BACKENDS`."""
    vision: VisionInputs | None = None
    """The prompt's images as the model's processor made them (vision-language models): their
    ``<|image_pad|>`` tokens are already in ``prompt_ids``."""
    adapter: int | None = None
    """A LoRA adapter to generate with, as the backend's ``add_adapter`` numbered it (the
    `vllm` backend built with ``max_lora_rank``); a backend that serves no adapters refuses a
    request that names one."""


@dataclass
class Completion:
    """One generated response."""

    request_id: int
    response_ids: list[int]
    log_probs: list[float]
    finish_reason: str  # "stop" (eos or a stop string), "length", or "abort" (partial)
    policy_version: int
    timing: dict[str, float] = field(default_factory=dict)
    top_logprobs: list[list[tuple[int, float]]] | None = None
    """Per generated token, the ``SamplingParams.top_logprobs`` most likely ``(id, log-prob)``
    (most likely first); None when not asked for."""
    routed_experts: Any = None
    """Mixture-of-experts routing replay (``algorithm.router_replay: r3``): the experts every
    input token was routed to, ``[N, L, K]`` small ints (roll_core/models/routing.py) for the
    first N tokens of prompt + prefix + response (N: every token the engine fed to the model,
    all but the last response token); None when the engine does not record."""


PREFIX_CONTINUATION_BACKENDS = frozenset({"hf", "vllm"})
"""Backends that can continue a response from its generated prefix (``Request.prefix_ids``),
which partial rollout (``rollout.partial_rollout``) and segmented async generation need."""


class InferBackend(Protocol):
    """Generates for a list of requests with the current weights."""

    def generate(self, requests: list[Request], params: SamplingParams) -> list[Completion]: ...

    def update_weights(self, named_tensors: dict[str, Any], *, version: int) -> None:
        """Load new weights in place (no reload from disk) and record their policy version."""
        ...

    def get_rng_state(self) -> Any: ...

    def set_rng_state(self, state: Any) -> None: ...

    def release(self, parts: list[str], *, level: int = 1) -> int:
        """Free `parts` (`weights`, `kv_cache`) for a colocated trainer's turn; bytes moved."""
        ...

    def restore(self, parts: list[str]) -> int:
        """Undo `release` for `parts` (weights before a sync, the KV cache after); bytes."""
        ...


class RequestEngine(Protocol):
    """Request-level serving on one inference rank (ARCHITECTURE.md "Rollout is a
    request-level service"; docs/rollout.md).

    Many threads call :meth:`generate_request` at once, one request each; the engine batches
    whatever is in flight continuously (a request joins at the next decoding step and leaves
    the moment it finishes), so a short response never waits for a long one. Thread-safe.
    """

    def generate_request(self, request: Request, params: SamplingParams) -> Completion:
        """Block until `request` finishes (``stop`` / ``length``) or is aborted; returns its
        response ids and behaviour log-probs (an aborted one: the tokens so far, with
        ``finish_reason="abort"``). The request's own seed decides its sampling."""
        ...

    def abort(self, request_ids: list[int]) -> None:
        """Finish these requests now: their waiting :meth:`generate_request` calls return the
        partial response. Ids not in flight (unknown, already finished): ignored."""
        ...

    def pause(self) -> None:
        """Run no decoding step until :meth:`resume`; returns once none is running (weights may
        then be replaced). Requests in flight stay where they are; new ones queue."""
        ...

    def resume(self) -> None:
        """Undo :meth:`pause`."""
        ...
