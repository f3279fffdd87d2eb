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


@dataclass
class Request:
    """One response to generate (a prompt replicated n times is n requests)."""

    request_id: int
    prompt_ids: list[int]
    seed: int
    prefix_ids: list[int] = field(default_factory=list)
    vision: VisionInputs | None = None
    """The prompt's images as the model's processor made them (vision-language models): their
    ``<|image_pad|>`` tokens are already in ``prompt_ids``."""
    """Response tokens generated earlier (partial rollout): the backend continues from
    ``prompt_ids + prefix_ids`` and returns only the new tokens. Needs a backend listed in
    :data:`PREFIX_CONTINUATION_BACKENDS`."""


@dataclass
class Completion:
    """One generated response."""

    request_id: int
    response_ids: list[int]
    log_probs: list[float]
    finish_reason: str  # "stop" (eos or a stop string) or "length"
    policy_version: int
    timing: dict[str, float] = field(default_factory=dict)


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
