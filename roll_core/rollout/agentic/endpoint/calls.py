"""One model call of an agent, whatever API it came through, and its reply.

The three APIs the endpoint speaks (OpenAI Chat Completions, the OpenAI Responses API,
Anthropic Messages) are translated into one :class:`ChatCall`: the conversation as OpenAI
Chat Completions messages, the tools in OpenAI's function format, and the per-call
:class:`CallOptions` the session honours. The session answers with a :class:`Reply`, which each
API writes in its own shape (a JSON body or an event stream). A request the endpoint refuses is
an :class:`EndpointError`: an HTTP status, a message, and the error code the API's clients act on.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from roll_core.backends.infer import Completion
from roll_core.envs.tool_parsers import ToolCall


class EndpointError(Exception):
    """A request the endpoint refuses: HTTP ``status``, the message, the API's error ``code``
    (OpenAI's ``error.code``; the Anthropic route maps it to its error types), the request
    field it is about (``param``), and ``detail`` for a route that words it its own way (a
    context overflow: ``prompt_tokens``, ``max_tokens``, ``max_context``)."""

    def __init__(
        self,
        status: int,
        message: str,
        code: str = "invalid_request_error",
        *,
        param: str | None = None,
        detail: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.param = param
        self.detail = detail or {}

    @property
    def type(self) -> str:
        """OpenAI's ``error.type`` for this status."""
        if self.status == 404:
            return "not_found_error" if self.code != "model_not_found" else "invalid_request_error"
        if self.status == 429:
            return "rate_limit_error"
        if self.status >= 500:
            return "server_error"
        return "invalid_request_error"


class ClientGone(Exception):
    """The client hung up before it got the reply (it timed out, was cancelled, or died)."""


def openai_error(err: EndpointError) -> dict[str, Any]:
    """An error body in OpenAI's shape (what the openai client and litellm read)."""
    return {"error": {"message": str(err), "type": err.type, "param": err.param, "code": err.code}}


def bad(message: str, param: str | None = None) -> EndpointError:
    """HTTP 400 for a request field that is malformed or refused."""
    return EndpointError(400, message, param=param)


@dataclass(frozen=True)
class ToolChoice:
    """Which tool calls the reply may carry: ``auto`` (any or none), ``none`` (no tool call),
    ``required`` (a tool call), ``function`` (a call of the tool ``name``)."""

    mode: Literal["auto", "none", "required", "function"] = "auto"
    name: str | None = None


@dataclass(frozen=True)
class CallOptions:
    """What one call asks of its reply, beyond the conversation (every API maps its fields
    here; the session honours each of them exactly or refuses the call)."""

    max_tokens: int | None = None  # the call's own cap on generated tokens (None: the recipe's)
    stop: tuple[str, ...] = ()  # the reply ends at the first of these (not included in it)
    tool_choice: ToolChoice = ToolChoice()
    parallel_tool_calls: bool = True  # False: at most one tool call per reply
    logprobs: bool = False  # the sampled tokens' behaviour log-probs in the reply
    top_logprobs: int = 0  # and this many most likely alternatives per token
    sampling: dict[str, Any] = field(default_factory=dict)
    """Sampling fields the request set (``temperature``, ``top_p``, ``top_k``, penalties,
    ``logit_bias``, ``seed``), checked against the recipe's sampling by the session."""


@dataclass(frozen=True)
class ChatCall:
    """One call: the conversation (OpenAI Chat Completions messages), the tools (OpenAI's
    function format, or None), and the options."""

    messages: list[Any]
    tools: list[dict[str, Any]] | None = None
    options: CallOptions = CallOptions()


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token as text, its behaviour log-prob, and the top alternatives."""

    token: str
    logprob: float
    top: tuple[tuple[str, float], ...] = ()


@dataclass(frozen=True)
class Reply:
    """The answer to a call, before any API writes it."""

    content: str  # the text outside tool calls and reasoning (stop sequence excluded)
    reasoning: str | None  # the ``<think>`` block's text, where the model wrote one
    tool_calls: tuple[ToolCall, ...]  # each with its ``call_id``
    finish: Literal["stop", "length", "tool_calls"]
    stop_sequence: str | None  # the request's stop string that ended the reply
    completion: Completion  # the generated ids and behaviour log-probs
    prompt_tokens: int
    max_tokens: int  # the cap that applied to this call
    capped_from: int | None  # the call asked for more than the recipe allows: what it asked
    overridden: tuple[str, ...]  # sampling fields replaced by the recipe's (agent_sampling)
    call_index: int  # 1 for the episode's first call
    session: str  # the session's token (ids of the API objects derive from it)
    logprobs: tuple[TokenLogprob, ...] | None = None  # when the call asked for them

    @property
    def completion_tokens(self) -> int:
        return len(self.completion.response_ids)

    def notes(self) -> dict[str, Any]:
        """What roll changed about the call (returned under ``roll`` in every API's body)."""
        out: dict[str, Any] = {}
        if self.capped_from is not None:
            out["max_tokens"] = {
                "requested": self.capped_from,
                "applied": self.max_tokens,
                "reason": "capped by the recipe's rollout.max_new_tokens",
            }
        if self.overridden:
            out["sampling_overridden"] = list(self.overridden)
        return out


Render = Callable[[Reply], tuple[str, bytes]]
"""How a call's reply is written: ``render(reply) -> (content type, body bytes)``."""


class Api(Protocol):
    """One API the endpoint speaks (:mod:`.openai_chat`, :mod:`.responses`, :mod:`.anthropic`):
    its route under the session's base URL, how its request becomes a ChatCall (and how the
    reply will be written), and how its errors look."""

    name: str
    route: str  # e.g. "/v1/chat/completions"

    def parse(self, raw: Any, session: Any, model: str) -> tuple[ChatCall, Render]:
        """The call of request body ``raw`` (parsed JSON) on ``session``, and its renderer
        (``model``: the name the request used, echoed in the reply)."""
        ...

    def error_body(self, err: EndpointError) -> dict[str, Any]:
        """The JSON body of a refused request, in the API's error shape."""
        ...
