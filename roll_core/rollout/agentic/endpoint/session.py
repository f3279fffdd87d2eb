"""One episode's session on the endpoint: its calls stitched into one trajectory.

Each episode gets its own session (base URL ``http://127.0.0.1:PORT/s/<token>/v1``); whatever
API a call came through (:mod:`.openai_chat`, :mod:`.responses`, :mod:`.anthropic`), it reaches
:meth:`AgentSession.serve` as a :class:`~.calls.ChatCall` and is stitched into the trajectory
exactly as the env path builds one (token-in/token-out, :mod:`..chat`):

* the first call renders its messages (and tools, through the chat template's ``tools=``) into
  the first prompt;
* a later call that continues the conversation (the earlier messages, the assistant message
  this endpoint returned, then tool results, one user message, or tool results then one user
  message, as Claude-Code-style harnesses send them): its prompt is the
  trace so far (prompt ids + generated ids) plus the template's ids for the new messages only;
  nothing is re-rendered, so what is trained is exactly what the model was given plus what it
  generated. The assistant messages are compared on their text and tool calls: reasoning the
  client leaves out (or sends back) does not matter, the trace keeps the ids generated;
* a later call that does not continue it (it rewrites or drops earlier messages, changes the
  tools, or starts another conversation): with ``history="segment"``
  (``rollout.agent_history``, the default) it starts a new *segment* (``Trajectory.segments``)
  rendered as a first call, trained as its own sequence with the episode's return; with
  ``history="strict"`` it is refused (HTTP 400 naming what differs). Every turn's
  ``state_key`` is its prompt ids, hashed (GiGPO's anchor state);
* the reply carries the model's native tool calls (the ``hermes`` parser of
  :mod:`roll_core.envs.tool_parsers`). A call that names an undeclared tool, or cannot be read,
  is not returned as a tool call: the text comes back as content and the turn is an invalid
  action;
* a call changes the trajectory only once its reply was delivered: its prompt is computed
  aside, and the trajectory gets it after ``deliver(reply)`` returned. A refused call (HTTP
  4xx) or one whose client hung up (:class:`~.calls.ClientGone`, counted in ``undelivered``)
  leaves the trajectory exactly as it was, so neither it nor an agent's retries of it add a
  training row. A context refusal still ends the episode with status ``context``. The
  session's lock is held from the prompt to the record, so the agent's next call, and
  ``close_session``, wait until the reply is recorded.

What a call may ask (:class:`~.calls.CallOptions`), each honoured exactly or refused:

* ``max_tokens``: the call's cap, at most the recipe's ``rollout.max_new_tokens`` (a larger
  one is capped, and the reply says so under ``roll.max_tokens``); the context check uses it;
* ``stop``: the engine stops at the first stop string; the reply's text ends before it (the
  trained ids are the ids generated, the stop string's included);
* ``tool_choice``: ``none``: the reply carries no tool call (a call the model writes anyway
  comes back as content, an invalid action); ``required`` / a named function: roll writes the
  call's opening (``<tool_call>\\n``, and ``{"name": "NAME", "arguments": `` for a named one)
  into the prompt, so the model writes the rest; those ids are context (loss mask 0), and the
  log-probs of what the model generated are those of the distribution it was sampled from (no
  constrained decoding, nothing else forced); a call it does not finish readably comes back as
  content, an invalid action;
* ``parallel_tool_calls: false``: the engine stops at the first ``</tool_call>``;
* a tool declared with ``strict: true``: a call whose arguments do not satisfy its JSON Schema
  is not returned as a call (content, an invalid action), as a strict schema promises;
* ``logprobs`` / ``top_logprobs``: the behaviour log-prob of every generated token and the
  engine's top alternatives (log softmax of logits / temperature, as the trainer uses);
* sampling fields (``temperature``, ``top_p``, ``top_k``, penalties, ``logit_bias``,
  ``seed``): the samples must be the policy's, so a value other than the recipe's is refused
  (HTTP 400 naming the field), or with ``rollout.agent_sampling: recipe`` replaced by the
  recipe's (the reply lists them under ``roll.sampling_overridden``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import secrets
import threading
import time
from array import array
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from roll_core.backends.infer import Completion, SamplingParams
from roll_core.envs.base import ToolResult
from roll_core.envs.tool_parsers import ToolCall, parse_hermes, strip_reasoning
from roll_core.rollout.agentic.chat import ChatFormat
from roll_core.rollout.agentic.endpoint.calls import (
    CallOptions,
    ChatCall,
    ClientGone,
    EndpointError,
    Reply,
    TokenLogprob,
    bad,
)
from roll_core.rollout.agentic.episode import Trajectory, Turn

Generate = Callable[[list[int], int, Any, SamplingParams], Completion]
"""``generate(prompt_ids, turn, vision, params) -> Completion`` (params: this call's)."""
Deliver = Callable[[Reply], None]

CALL_OPEN = "<tool_call>\n"
CALL_CLOSE = "</tool_call>"

# sampling fields: the value that leaves the recipe's sampling as it is
_NEUTRAL: dict[str, Any] = {
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "repetition_penalty": 1.0,
    "min_p": 0.0,
    "logit_bias": {},
}


@dataclass(frozen=True)
class _Call:
    """What one call would add to the session, computed without changing it: the prompt the
    model is given, the ids the trace gets before the generated ones, and the conversation as
    the session knows it afterwards. Applied only once the reply reached the client."""

    prompt: list[int]
    context: list[int]
    new_segment: bool
    keys: list[tuple[Any, ...]]
    tools_key: str | None
    tool_names: frozenset[str]
    forced: str = ""  # the tool call's opening roll wrote (tool_choice required / named)
    strict: tuple[tuple[str, Any], ...] = ()  # (name, parameters) of tools with strict: true


@dataclass
class AgentSession:
    """One episode's conversation: the trajectory its calls are stitched into.

    ``sampling``: the recipe's sampling (None: the engine's defaults with ``max_new_tokens``);
    ``agent_sampling``: ``strict`` refuses a call whose sampling fields differ from it,
    ``recipe`` replaces them."""

    traj: Trajectory
    chat: ChatFormat
    generate: Generate
    max_new_tokens: int
    max_context: int
    model: str
    history: str = "segment"  # a call that does not continue: new segment | strict: HTTP 400
    sampling: SamplingParams | None = None
    agent_sampling: str = "strict"
    token: str = field(default_factory=lambda: secrets.token_hex(8))
    lock: threading.Lock = field(default_factory=threading.Lock)
    messages: list[tuple[Any, ...]] = field(default_factory=list)  # keys of what was sent
    tools_key: str | None = None
    tool_names: frozenset[str] = frozenset()
    after_eos: bool = False
    last_call: float = 0.0
    failure: BaseException | None = None  # a generation failure / cancel: the episode's end
    context_full: bool = False  # a call was refused for the context: the episode's end
    context_error: str = ""  # why (the refusal's text)
    closed: bool = False
    request: list[Any] = field(default_factory=list)  # the messages of the call being served
    undelivered: int = 0  # replies the client hung up before receiving (not recorded)
    calls: int = 0  # calls answered (delivered), for the API objects' ids
    opened: float = field(default_factory=time.perf_counter)  # when the episode's agent started
    first_call: float = 0.0  # when its first call arrived (perf_counter; 0: none yet)

    # ---- one call ------------------------------------------------------------------------------
    def serve(self, call: ChatCall, deliver: Deliver | None = None) -> Reply:
        """Serve one call: the reply, recorded in the trajectory once ``deliver(reply)``
        returned (``deliver`` raises ClientGone: nothing is recorded). A refused call (any
        EndpointError) leaves the session and its trajectory exactly as they were."""
        with self.lock:
            if self.closed or self.failure is not None:
                raise EndpointError(410, "this episode has ended; its session is closed.", "gone")
            params, capped_from, overridden = self._params(call.options)
            self.request = call.messages
            messages = [normalise(m, k) for k, m in enumerate(call.messages)]
            pending = self._prompt(messages, call.tools, call.options)
            self._check_context(len(pending.prompt), params.max_new_tokens)
            t0 = time.perf_counter()
            self.first_call = self.first_call or t0
            env_s = t0 - self.last_call if self.last_call else 0.0
            try:
                completion = self.generate(pending.prompt, len(self.traj.turns), None, params)
            except BaseException as err:  # cancelled, timed out, rank lost: ends the episode
                self.failure = err
                raise EndpointError(
                    503, f"generation stopped: {type(err).__name__}: {err}", "server_overloaded"
                ) from err
            done = time.perf_counter()
            reply, valid = self._reply(completion, pending, call.options, params)
            reply = dataclasses.replace(reply, capped_from=capped_from, overridden=overridden)
            if deliver is not None:
                try:
                    deliver(reply)
                except ClientGone:
                    self.undelivered += 1  # never seen by the agent: not trained
                    raise
            self._record(pending, completion, reply, valid, done - t0, env_s)
            self.last_call = done
            return reply

    def _params(self, options: CallOptions) -> tuple[SamplingParams, int | None, tuple[str, ...]]:
        """This call's sampling: the recipe's, with the call's cap and stop strings."""
        base = self.sampling or SamplingParams(max_new_tokens=self.max_new_tokens)
        overridden = self._check_sampling(options.sampling, base)
        cap = self.max_new_tokens
        capped_from = None
        if options.max_tokens is not None:
            if options.max_tokens > cap:
                capped_from = options.max_tokens
            cap = min(cap, options.max_tokens)
        stop = tuple(base.stop) + tuple(options.stop)
        if not options.parallel_tool_calls and options.tool_choice.mode != "none":
            stop += (CALL_CLOSE,)
        params = dataclasses.replace(
            base,
            max_new_tokens=cap,
            stop=stop,
            top_logprobs=options.top_logprobs if options.logprobs else 0,
        )
        return params, capped_from, overridden

    def _check_sampling(self, fields: dict[str, Any], base: SamplingParams) -> tuple[str, ...]:
        """The sampling fields that differ from the recipe's (refused under ``strict``)."""
        recipe: dict[str, Any] = {
            "temperature": base.temperature,
            "top_p": base.top_p,
            "top_k": base.top_k,
            **_NEUTRAL,
        }
        differ = []
        for name, value in fields.items():
            if value is None:
                continue
            if name == "seed":
                differ.append((name, value, "roll's own seed per request"))
                continue
            want = recipe[name]
            same = value == want
            if name == "top_k":
                same = (value if value > 0 else 0) == (want if want > 0 else 0)
            elif isinstance(want, float):
                same = math.isclose(float(value), want, rel_tol=0, abs_tol=1e-9)
            if not same:
                differ.append((name, value, f"{want!r}"))
        if differ and self.agent_sampling != "recipe":
            name, value, want = differ[0]
            raise bad(
                f"{name}={value!r}: roll samples every call with the recipe's sampling "
                f"({name} {want}) so that what it trains on is the policy's own samples; a call "
                "cannot change it. Leave the field out (or send the recipe's value), or set "
                "rollout.agent_sampling: recipe to answer such calls with the recipe's sampling "
                "(the reply lists the replaced fields under roll.sampling_overridden).",
                name,
            )
        return tuple(name for name, _, _ in differ)

    def _check_context(self, prompt: int, max_tokens: int) -> None:
        if prompt + max_tokens <= self.max_context:
            return
        self.context_full = True
        self.context_error = (
            f"the conversation ({prompt} tokens) plus max_tokens={max_tokens} does not fit "
            f"rollout.max_context={self.max_context}"
        )
        raise EndpointError(
            400,
            f"This model's maximum context length is {self.max_context} tokens. However, you "
            f"requested {prompt + max_tokens} tokens ({prompt} in the messages, {max_tokens} in "
            "the completion). Please reduce the length of the messages or completion. (roll: "
            "the episode ends here, with status `context`.)",
            "context_length_exceeded",
            param="messages",
            detail={"prompt_tokens": prompt, "max_tokens": max_tokens, "limit": self.max_context},
        )

    def _prompt(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        options: CallOptions,
    ) -> _Call:
        """The call's prompt and what it adds (see _Call); the session is not changed."""
        pending = self._conversation(messages, tools)
        strict = tuple(
            (str(t["function"]["name"]), t["function"].get("parameters") or {})
            for t in tools or []
            if t["function"].get("strict")
        )
        pending = dataclasses.replace(pending, strict=strict)
        forced = self._forced(options, pending.tool_names, tools)
        if not forced:
            return pending
        ids = self.chat.encode(forced)
        return dataclasses.replace(
            pending, prompt=pending.prompt + ids, context=pending.context + ids, forced=forced
        )

    def _forced(
        self, options: CallOptions, names: frozenset[str], tools: list[dict[str, Any]] | None
    ) -> str:
        """The opening of the tool call ``tool_choice`` demands ('' for auto / none)."""
        choice = options.tool_choice
        if choice.mode in ("auto", "none"):
            return ""
        if not tools:
            raise bad(f"tool_choice {choice.mode!r} needs `tools`.", "tool_choice")
        if choice.mode == "required":
            return CALL_OPEN
        if choice.name not in names:
            raise bad(
                f"tool_choice names the function {choice.name!r}, which is not among the "
                f"declared tools ({', '.join(sorted(names))}).",
                "tool_choice",
            )
        return CALL_OPEN + '{"name": ' + json.dumps(choice.name) + ', "arguments": '

    def _conversation(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
    ) -> _Call:
        keys = [_key(m) for m in messages]
        tools_key = json.dumps(tools, sort_keys=True) if tools else None
        if self.messages:
            problem = self._not_continued(messages, keys, tools_key)
            if problem is None:  # the conversation goes on: append the new messages' ids
                ids = self._continuation(messages[len(self.messages) :])
                prompt = [*self.traj.trace.ids, *ids]
                return _Call(prompt, ids, False, keys, self.tools_key, self.tool_names)
            if self.history == "strict":
                raise bad(problem, "messages")
        # the first call of a segment (history "segment": a call that does not continue the
        # conversation starts a new sequence): the template renders the whole conversation
        names = frozenset(str(t["function"]["name"]) for t in tools or [])
        if tools and tools_key != self.tools_key:
            self._check_tools(tools, names)
        ids = self.chat.prompt([m["render"] for m in messages], tools)
        return _Call(ids, ids, bool(self.messages), keys, tools_key, names)

    def _not_continued(
        self, messages: list[dict[str, Any]], keys: list[tuple[Any, ...]], tools_key: str | None
    ) -> str | None:
        """Why this call does not continue the segment's conversation (None: it does)."""
        if tools_key != self.tools_key:
            return (
                "the tools differ from the first call of this episode; with "
                "rollout.agent_history: strict one episode is one conversation with one set "
                "of tools."
            )
        n = len(self.messages)
        if keys[:n] != self.messages:
            pairs = enumerate(zip(keys, self.messages, strict=False))
            k = next((i for i, (a, b) in pairs if a != b), len(keys))
            return _rewrite_message(k, keys, self.messages)
        roles = [m["role"] for m in messages[n:]]
        if not roles or roles[-1] not in ("tool", "user"):
            return (
                "a call must add tool results or a user message after the assistant's last "
                f"answer (got {roles or 'nothing new'})."
            )
        if not all(r == "tool" for r in roles[:-1]):
            return (
                "after the assistant's last answer a call adds tool results, one user "
                f"message, or tool results then one user message, not {roles}."
            )
        return None

    def _continuation(self, new: list[dict[str, Any]]) -> list[int]:
        """The template's ids for the messages a continuing call adds (tool results, or one
        user message) after the assistant's last answer."""
        tools = [m for m in new if m["role"] == "tool"]
        user = new[-1]["content"] if new[-1]["role"] == "user" else None
        if not tools:
            return self.chat.env_message(str(user), after_eos=self.after_eos)
        results = [
            ToolResult(m["render"].get("name", ""), m["content"], m.get("call_id")) for m in tools
        ]
        return self.chat.tool_message(results, after_eos=self.after_eos, user=user)

    def count_tokens(self, call: ChatCall) -> int:
        """The prompt tokens ``call`` would be given (the session is not changed)."""
        with self.lock:
            messages = [normalise(m, k) for k, m in enumerate(call.messages)]
            return len(self._prompt(messages, call.tools, call.options).prompt)

    def _check_tools(self, tools: list[dict[str, Any]], names: frozenset[str]) -> None:
        from roll_core.data.chat import tool_support_problem

        problem = tool_support_problem(self.chat.tokenizer, tools)
        if problem:
            raise bad(
                f"the request declares tools ({', '.join(sorted(names))}), but the "
                f"chat template has no tool support: {problem}, so the model would never see "
                "them. Set rollout.chat_template to a template that renders `tools` (e.g. "
                "Qwen2.5's or Qwen3's).",
                "tools",
            )
        name = next(iter(sorted(names)))
        self.chat.tool_reply_text([ToolResult(name, "ROLL_TOOL_PROBE")])  # a ModelError: 400

    # ---- the reply -------------------------------------------------------------------------------
    def _reply(
        self, completion: Completion, pending: _Call, options: CallOptions, params: SamplingParams
    ) -> tuple[Reply, bool]:
        """The reply to a completion, and whether its tool calls (if any) were readable calls
        of the declared tools that the call allowed."""
        tok = self.chat.tokenizer
        text = pending.forced + str(tok.decode(completion.response_ids, skip_special_tokens=True))
        stop_hit = None
        if completion.finish_reason == "stop" and options.stop:
            text, stop_hit = _cut_at_stop(text, options.stop, len(pending.forced))
        parsed = parse_hermes(text)
        unknown = [c.name for c in parsed.calls if c.name not in pending.tool_names]
        allowed = options.tool_choice.mode != "none"
        if options.tool_choice.mode == "function":
            allowed = all(c.name == options.tool_choice.name for c in parsed.calls)
        valid = not parsed.errors and not unknown and (allowed or not parsed.calls)
        if valid and pending.strict:  # strict tools: arguments that break the schema
            from roll_core.envs.tools import argument_problem

            schemas = dict(pending.strict)
            valid = not any(
                c.name in schemas and argument_problem(schemas[c.name], c.arguments)
                for c in parsed.calls
            )
        reasoning = _reasoning(text)
        turn = len(self.traj.turns)
        if parsed.calls and valid:
            calls = tuple(
                ToolCall(c.name, c.arguments, f"call_{turn}_{k}")
                for k, c in enumerate(parsed.calls)
            )
            content, finish = parsed.content, "tool_calls"
        else:
            calls = ()
            content = strip_reasoning(text).strip() if parsed.has_calls else parsed.content
            content = content or ("" if reasoning else text.strip())
            finish = "length" if completion.finish_reason == "length" else "stop"
        logprobs = self._logprobs(completion) if options.logprobs else None
        reply = Reply(
            content=content,
            reasoning=reasoning,
            tool_calls=calls,
            finish=finish,  # type: ignore[arg-type]
            stop_sequence=stop_hit,
            completion=completion,
            prompt_tokens=len(pending.prompt),
            max_tokens=params.max_new_tokens,
            capped_from=None,
            overridden=(),
            call_index=self.calls + 1,
            session=self.token,
            logprobs=logprobs,
        )
        return reply, valid

    def _logprobs(self, completion: Completion) -> tuple[TokenLogprob, ...]:
        decode = self.chat.tokenizer.decode
        tops = completion.top_logprobs or [[] for _ in completion.response_ids]
        return tuple(
            TokenLogprob(
                str(decode([tid])),
                float(lp),
                tuple((str(decode([t])), float(v)) for t, v in top),
            )
            for tid, lp, top in zip(
                completion.response_ids, completion.log_probs, tops, strict=True
            )
        )

    def _record(
        self,
        pending: _Call,
        completion: Completion,
        reply: Reply,
        valid: bool,
        gen_s: float,
        env_s: float,
    ) -> None:
        """Apply a served call to the session: its prompt's new ids, then the generated ids."""
        if pending.new_segment:
            self.traj.new_segment()
        self.traj.trace.add_context(pending.context)
        self.tools_key, self.tool_names = pending.tools_key, pending.tool_names
        self.messages = list(pending.keys)
        ids = list(completion.response_ids)
        self.traj.trace.add_routes(completion.routed_experts, pending.prompt)
        self.traj.trace.add_generated(ids, list(completion.log_probs))
        self.after_eos = bool(ids) and ids[-1] == self.chat.eos_id
        message: dict[str, Any] = {"role": "assistant", "content": reply.content}
        if reply.tool_calls:
            message["tool_calls"] = [openai_call(c) for c in reply.tool_calls]
        self.messages.append(_key(normalise(message, len(self.messages))))
        self.calls += 1
        self.traj.turns.append(
            Turn(
                prompt_ids=pending.prompt,
                response_ids=ids,
                log_probs=list(completion.log_probs),
                finish_reason=completion.finish_reason,
                policy_version=completion.policy_version,
                action=reply.content,
                reward=0.0,
                state_key=prompt_key(pending.prompt),
                segment=len(self.traj.segments),
                action_is_valid=valid,
                gen_s=gen_s,
                env_s=env_s,
            )
        )


def prompt_key(prompt: list[int]) -> str:
    """A turn's state for step-level credit (GiGPO's anchor): its prompt ids, hashed, so calls
    of one group that saw exactly the same prompt are the same state."""
    return hashlib.blake2b(array("q", prompt).tobytes(), digest_size=12).hexdigest()


def _cut_at_stop(text: str, stops: tuple[str, ...], start: int) -> tuple[str, str | None]:
    """``text`` up to the first of ``stops`` found after ``start``, and that stop string."""
    found = [(text.find(s, start), s) for s in stops if s and text.find(s, start) >= 0]
    if not found:
        return text, None
    at, stop = min(found)
    return text[:at], stop


def _reasoning(text: str) -> str | None:
    """The text of the reply's reasoning block (``<think>...</think>``, or before a lone
    ``</think>`` when the template opened it in the prompt); None: none."""
    if "</think>" not in text:
        return None
    head = text.split("</think>", 1)[0]
    return head.split("<think>", 1)[-1].strip()


def openai_call(call: ToolCall) -> dict[str, Any]:
    """A tool call in an OpenAI assistant message (arguments as a JSON string)."""
    return {
        "id": call.call_id,
        "type": "function",
        "function": {"name": call.name, "arguments": json.dumps(call.arguments)},
    }


# ---- messages ------------------------------------------------------------------------------------
_ROLES = ("system", "user", "assistant", "tool", "developer")


def _text(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text":
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise bad(
                    f"{where}.content[{j}] is a {kind!r} part: roll's endpoint serves a text "
                    "model and takes only text parts ({'type': 'text', 'text': ...}).",
                    "messages",
                )
            if not isinstance(part.get("text"), str):
                raise bad(f"{where}.content[{j}].text must be a string.", "messages")
            parts.append(part["text"])
        return "".join(parts)
    raise bad(f"{where}.content must be a string or a list of text parts.", "messages")


def normalise(msg: Any, k: int) -> dict[str, Any]:
    """A Chat Completions message as ``{role, content, calls, render}`` (``render``: the message
    the chat template gets: tool-call arguments as objects, as templates expect). Any field of
    the wrong type is a 400 naming it."""
    where = f"messages[{k}]"
    if not isinstance(msg, dict) or msg.get("role") not in _ROLES:
        raise bad(
            f"{where} is not a chat message with a role (system, developer, user, assistant or "
            "tool).",
            "messages",
        )
    role = "system" if msg["role"] == "developer" else str(msg["role"])
    unknown = sorted(set(msg) - _MESSAGE_FIELDS[role])
    if unknown:
        raise bad(f"{where}: unsupported field(s) {unknown} for a {role} message.", "messages")
    content = _text(msg.get("content"), where)
    calls = _calls(msg.get("tool_calls"), where) if role == "assistant" else []
    render: dict[str, Any] = {"role": role, "content": content}
    if calls:
        render["tool_calls"] = [ToolCall(c.name, c.arguments).openai() for c in calls]
    name = msg.get("name")
    if name is not None and not isinstance(name, str):
        raise bad(f"{where}.name must be a string.", "messages")
    if role == "tool":
        render["name"] = name or ""
        call_id = msg.get("tool_call_id")
        if call_id is not None and not isinstance(call_id, str):
            raise bad(f"{where}.tool_call_id must be a string.", "messages")
    out = {"role": role, "content": content, "calls": calls, "render": render}
    if role == "tool" and msg.get("tool_call_id"):
        out["call_id"] = str(msg["tool_call_id"])
    return out


_MESSAGE_FIELDS = {
    "system": {"role", "content", "name"},
    "user": {"role", "content", "name"},
    "assistant": {"role", "content", "name", "tool_calls", "refusal", "reasoning_content"},
    "tool": {"role", "content", "tool_call_id", "name"},
}


def _calls(raw: Any, where: str) -> list[ToolCall]:
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise bad(f"{where}.tool_calls must be a list of tool calls.", "messages")
    calls = []
    for j, call in enumerate(raw):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise bad(
                f"{where}.tool_calls[{j}] must be {{'id', 'type': 'function', 'function': "
                "{'name': str, 'arguments': str}}.",
                "messages",
            )
        args = fn.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError:
                raise bad(f"{where}.tool_calls[{j}].function.arguments is not JSON.") from None
        if not isinstance(args, dict):
            raise bad(
                f"{where}.tool_calls[{j}].function.arguments must be a JSON object (as a "
                f"string), got a {type(args).__name__}.",
                "messages",
            )
        calls.append(ToolCall(fn["name"], args, call.get("id")))
    return calls


def _key(m: dict[str, Any]) -> tuple[Any, ...]:
    calls = tuple((c.name, json.dumps(c.arguments, sort_keys=True)) for c in m["calls"])
    content = m["content"]
    if m["role"] == "assistant":  # reasoning the client keeps or drops: the same message
        content = strip_reasoning(content)
    return (m["role"], content.strip(), calls)


def _rewrite_message(k: int, keys: list[tuple[Any, ...]], before: list[tuple[Any, ...]]) -> str:
    if k >= len(keys):
        return (
            f"the call sends {len(keys)} messages, fewer than the {len(before)} this episode "
            "already has: an episode is one conversation, continued call by call."
        )
    return (
        f"messages[{k}] differs from what this episode's conversation has there "
        f"(sent {_cut(keys[k])}, expected {_cut(before[k])}). Send the conversation back as "
        "it was, with the assistant message the endpoint returned appended unchanged "
        "(messages.append(response.choices[0].message)); the trained tokens are exactly "
        "what the model saw, so history cannot be rewritten."
    )


def _cut(key: tuple[Any, ...]) -> str:
    text = repr(key)
    return text if len(text) < 120 else text[:117] + "..."
