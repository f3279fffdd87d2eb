"""Token ids of a multi-turn conversation with an env, built without re-tokenising generations.

Token-in/token-out: the ids of a trajectory are the first prompt (system + first observation,
rendered by the model's chat template), then for every turn the ids the model *generated*
(exactly, eos included) and the ids of the env's reply. The env's reply is the chat template's
text between an earlier assistant message's text and the next generation prompt (ChatML:
``<|im_end|>\\n<|im_start|>user\\n{observation}<|im_end|>\\n<|im_start|>assistant\\n``), found once
by rendering a probe conversation ``[user, assistant: SENTINEL, user: PROBE]`` with the generation
prompt and taking the text after the sentinel. When the generation already ended with the eos
token that closes the assistant turn, that token is not repeated.

Templates that rewrite history (Qwen3 writes an empty ``<think></think>`` into the last assistant
turn and drops the reasoning of earlier ones) are not prefix-stable: re-rendering the conversation
would change the ids of earlier turns. The trace never re-renders: it keeps the generated ids and
appends only the template's ids for the new messages, so what is trained is exactly what the model
was given and generated (token-in/token-out); :attr:`ChatFormat.prefix_stable` tells which case
a template is. A template that does not write an earlier assistant message's text as given (so
no reply can be appended after it) leaves :attr:`ChatFormat.append_error` set: such a template can
only be used where turns are never concatenated (step mode); the pipeline checks this before a
run starts.

Only generated ids carry a loss-mask 1 and a behaviour log-prob; everything the env or the
template wrote is masked.

Image observations (an env's :class:`~roll_core.envs.base.Observation` with pictures, for a
vision-language model): the observation's user message has one image part per picture before
its text; its template text is found the same way (a probe message with that many image parts),
each picture goes through the model's image processor once, when the observation arrives, and
its placeholder becomes one ``<|image_pad|>`` per merged patch. The trace keeps every message's
:class:`~roll_core.data.vision.VisionInputs` in order, so the images a turn was generated with
are exactly the images the trained sequence carries.

Tool calling (an env with :attr:`~roll_core.envs.base.TextEnv.tools`): the first prompt renders
the tool schemas (``tools=``) into the system turn; an observation carrying tool results
(:func:`~roll_core.envs.base.observation_tool_results`) is one ``tool`` message per result, and its
ids are the template's text after an earlier assistant message up to the next generation prompt
for exactly those messages (``[user, assistant: SENTINEL, tool, tool, ...]`` rendered with the real
contents; Qwen: ``<|im_end|>\n<|im_start|>user\n<tool_response>\n...\n</tool_response><|im_end|>
\n<|im_start|>assistant\n``). The model's calls stay in the trace as the ids it generated.

:meth:`ChatFormat.check_shapes` renders the conversation shapes an env produces (user turns,
assistant turns with and without reasoning, assistant tool calls, tool results) both ways, as the
trace builds them and as the template renders the whole conversation, and says for each shape
whether they are the same ids. Where they differ the template rewrites history; the trace is
still exact (it never re-renders), and the run's log names the shapes (see
``roll_core.pipelines.checks.agentic.template_policy`` and docs/agentic.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from roll_core.data.chat import encode_chat_images, image_message, render_chat
from roll_core.data.vision import VisionInputs, concat_vision
from roll_core.envs.base import ToolResult, observation_images, observation_tool_results
from roll_core.errors import ModelError
from roll_core.models.routing import extend_routes

Tools = Sequence[dict[str, Any]] | None

_SENTINEL = "ROLL_SENTINEL_7f3a"
_PROBE = "ROLL_OBSERVATION_PROBE"


def _after_sentinel(text: str, probe: str) -> tuple[str, str] | None:
    """The template's text between the sentinel assistant message and the probe user message,
    and after the probe (None: the sentinel or the probe is not written once, in order)."""
    if text.count(_SENTINEL) != 1 or text.count(probe) != 1:
        return None
    after = text.split(_SENTINEL, 1)[1]
    if probe not in after:
        return None
    before, _, suffix = after.partition(probe)
    return before, suffix


class ChatFormat:
    """The chat-template pieces of one tokenizer, as token ids.

    ``processor``: a vision-language model's :class:`~roll_core.models.vision.VisionProcessor`,
    for envs whose observations carry images (None: a text model; an image then is an error).
    """

    def __init__(self, tokenizer: Any, processor: Any | None = None) -> None:
        self.tokenizer = tokenizer
        self.processor = processor
        self._image_replies: dict[int, tuple[str, str]] = {}
        self.eos_id: int | None = tokenizer.eos_token_id
        self._base = [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": _SENTINEL},
        ]
        self.prefix_stable = False
        self.renders_history = True  # renders [user, assistant, user] at all
        self.append_error: str | None = None
        self.shape_checks: list[ShapeCheck] = []  # filled by check_shapes()
        self._env_prefix = self._env_suffix = ""
        try:
            text_base = self._text(self._base, generation_prompt=False)
            text_full = self._text([*self._base, {"role": "user", "content": _PROBE}], True)
        except Exception as err:  # noqa: BLE001 - the template's own error, reported as such
            self.append_error = f"it fails on a [user, assistant, user] conversation: {err}"
            self.renders_history = False
            return
        self.prefix_stable = _SENTINEL in text_base and text_full.startswith(text_base)
        pieces = _after_sentinel(text_full, _PROBE)
        if pieces is None:
            self.append_error = (
                "it does not write an earlier assistant message's text as given (rendering "
                f"[user, assistant {_SENTINEL!r}, user {_PROBE!r}] gave {text_full!r})"
            )
            return
        self._env_prefix, self._env_suffix = pieces  # e.g. "<|im_end|>\\n<|im_start|>user\\n"

    @property
    def can_append(self) -> bool:
        """Whether env replies can be appended to generated ids (trajectory mode)."""
        return self.append_error is None

    def _text(
        self, messages: list[dict[str, Any]], generation_prompt: bool, tools: Tools = None
    ) -> str:
        return render_chat(
            self.tokenizer,
            messages,
            add_generation_prompt=generation_prompt,
            fold_system=True,
            tools=tools,
        )

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def prompt(self, messages: list[dict[str, Any]], tools: Tools = None) -> list[int]:
        """Ids of ``messages`` rendered with the generation prompt (and ``tools``)."""
        return self.encode(self._text(messages, True, tools))

    def env_message(self, observation: str, *, after_eos: bool) -> list[int]:
        """Ids of the env's reply after an assistant turn (closing that turn if needed)."""
        self._check_append()
        ids = self.encode(self._env_prefix + observation + self._env_suffix)
        if after_eos and ids and ids[0] == self.eos_id:
            ids = ids[1:]
        return ids

    # ---- tool results ----------------------------------------------------------------------------
    def tool_reply_text(self, results: Sequence[ToolResult], user: str | None = None) -> str:
        """The template's text after an assistant turn for ``results`` as ``tool`` messages
        (then ``user``, a user message after them, if given), up to the next generation prompt
        (a ModelError when the template cannot write it there)."""
        self._check_append()
        messages = [*self._base, *(r.message() for r in results)]
        if user is not None:
            messages.append({"role": "user", "content": user})
        try:
            text = self._text(messages, True)
        except Exception as err:  # noqa: BLE001 - the template's own error, reported as such
            raise ModelError(
                f"the chat template fails on tool messages after an assistant turn: {err}.",
                hint="Use a chat template with tool support (rollout.chat_template), e.g. "
                "Qwen2.5's or Qwen3's.",
            ) from None
        after = text.split(_SENTINEL, 1)[1] if text.count(_SENTINEL) == 1 else None
        pos = 0
        contents = [r.content for r in results] + ([user] if user is not None else [])
        for content in contents if after is not None else ():
            found = after.find(content, pos)  # type: ignore[union-attr]
            if found < 0:
                after = None
                break
            pos = found + len(content)
        if after is None:
            raise ModelError(
                "the chat template does not write tool results after an earlier assistant "
                f"message's text as given (rendering [user, assistant {_SENTINEL!r}, tool ...] "
                f"gave {text!r}), so they cannot be appended to the generated ids.",
                hint="Use rollout.mode: step, or a chat template with tool support that writes "
                "earlier assistant turns verbatim (rollout.chat_template).",
            )
        return after

    def tool_message(
        self, results: Sequence[ToolResult], *, after_eos: bool, user: str | None = None
    ) -> list[int]:
        """Ids of the ``tool`` messages of ``results`` (then a ``user`` message, if given)
        after an assistant turn."""
        ids = self.encode(self.tool_reply_text(results, user))
        if after_eos and ids and ids[0] == self.eos_id:
            ids = ids[1:]
        return ids

    def observation_messages(self, observation: str) -> list[dict[str, Any]]:
        """The chat messages of an observation: one ``tool`` message per tool result, else the
        user message (images first, then the text)."""
        results = observation_tool_results(observation)
        if results:
            return [r.message() for r in results]
        return [self.user_message(observation)]

    # ---- does the template rewrite history? ------------------------------------------------------
    def check_shapes(self, tools: Tools = None) -> list[ShapeCheck]:
        """For each conversation shape an env produces (:func:`conversation_shapes`: user turns,
        reasoning, tool calls, tool results), whether the template renders the whole
        conversation as exactly the ids the trace builds turn by turn (first prompt, generated
        ids, the template's ids for the other messages). Kept in :attr:`shape_checks`."""
        reasoning = "</think>" in str(getattr(self.tokenizer, "chat_template", "") or "")
        checks = []
        for shape, items in conversation_shapes(tools, reasoning=reasoning):
            try:
                checks.append(self._check_shape(shape, items, tools))
            except Exception as err:  # noqa: BLE001 - the template's own error, reported as such
                checks.append(ShapeCheck(shape, False, f"cannot be rendered: {err}"))
        self.shape_checks = checks
        return checks

    def _check_shape(
        self, shape: str, items: list[dict[str, Any] | _Gen], tools: Tools
    ) -> ShapeCheck:
        first = next(i for i, m in enumerate(items) if isinstance(m, _Gen))
        ids = self.prompt([m for m in items[:first] if isinstance(m, dict)], tools)
        k = first
        while k < len(items):
            item = items[k]
            if isinstance(item, _Gen):
                ids += self.encode(item.text) + ([self.eos_id] if self.eos_id is not None else [])
                k += 1
                continue
            run = []
            while k < len(items) and not isinstance(items[k], _Gen):
                run.append(items[k])
                k += 1
            if run[0]["role"] == "tool":  # type: ignore[index]
                results = [ToolResult(m["name"], m["content"]) for m in run]  # type: ignore[index]
                ids += self.tool_message(results, after_eos=True)
            else:
                ids += self.env_message(run[0]["content"], after_eos=True)  # type: ignore[index]
        messages = [m.message if isinstance(m, _Gen) else m for m in items]
        full = self.prompt(messages, tools)
        if full == ids:
            return ShapeCheck(shape, True)
        return ShapeCheck(shape, False, _first_difference(self.tokenizer, ids, full))

    # ---- observations with images --------------------------------------------------------------
    def user_message(self, observation: str) -> dict[str, Any]:
        """The user message of an observation: its images (as image parts), then its text."""
        return image_message(str(observation), len(observation_images(observation)))

    def prompt_with_images(
        self, messages: list[dict[str, Any]], images: Sequence[Any], tools: Tools = None
    ) -> tuple[list[int], VisionInputs | None]:
        """Ids (placeholders expanded) and vision inputs of ``messages`` with the generation
        prompt; ``images`` fill the messages' image parts in order."""
        if not images:
            return self.prompt(messages, tools), None
        ids, vision = encode_chat_images(
            self._vision(), messages, images, add_generation_prompt=True, fold_system=True
        )
        return ids, vision

    def first_prompt(
        self, system: str, observation: str, tools: Tools = None
    ) -> tuple[list[int], VisionInputs | None]:
        """Ids and vision inputs of the episode's first prompt (system + first observation;
        ``tools``: the env's tool schemas, rendered by the template)."""
        messages = first_messages(system, "")[:-1] + [self.user_message(observation)]
        return self.prompt_with_images(messages, observation_images(observation), tools)

    def observe(
        self, observation: str, *, after_eos: bool
    ) -> tuple[list[int], VisionInputs | None]:
        """:meth:`env_message` for an observation that may carry images or tool results: its
        ids (image placeholders expanded) and the vision inputs of its images (None: none)."""
        results = observation_tool_results(observation)
        if results:
            return self.tool_message(results, after_eos=after_eos), None
        images = observation_images(observation)
        if not images:
            return self.env_message(observation, after_eos=after_eos), None
        processor = self._vision()
        prefix, suffix = self._image_reply(len(images))
        text = prefix + str(observation) + suffix
        pieces = text.split(processor.image_token)
        if len(pieces) - 1 != len(images):
            raise ModelError(
                f"the chat template wrote {len(pieces) - 1} image placeholder(s) for an "
                f"observation with {len(images)} image(s)."
            )
        vision = processor.process_images(images)
        counts = vision.num_image_tokens(processor.merge_size)  # as encode_chat_images does
        expanded = pieces[0] + "".join(
            processor.image_token * n + rest for n, rest in zip(counts, pieces[1:], strict=True)
        )
        ids = self.encode(expanded)
        if after_eos and ids and ids[0] == self.eos_id:
            ids = ids[1:]
        return ids, vision

    def _image_reply(self, num_images: int) -> tuple[str, str]:
        """Template text before and after an observation's text in a reply with images."""
        self._check_append()
        if num_images not in self._image_replies:
            full = self._text([*self._base, image_message(_PROBE, num_images)], True)
            pieces = _after_sentinel(full, _PROBE)
            if pieces is None:
                raise ModelError(
                    "the chat template does not write an earlier assistant message's text as "
                    "given before an observation with images, so the env's reply cannot be "
                    "appended to the generated ids.",
                    hint="Use rollout.mode: step, or a chat template (rollout.chat_template) "
                    "that writes earlier assistant turns verbatim.",
                )
            self._image_replies[num_images] = pieces
        return self._image_replies[num_images]

    def _check_append(self) -> None:
        if self.append_error is not None:
            raise ModelError(
                f"the chat template cannot continue a conversation turn by turn: "
                f"{self.append_error}.",
                hint="Use rollout.mode: step (each turn its own sample), or a chat template "
                "(rollout.chat_template) that writes earlier assistant turns verbatim.",
            )

    def _vision(self) -> Any:
        if self.processor is None:
            raise ModelError(
                "the env's observations carry images, but the model is a text-only model.",
                hint="Use a vision-language model (e.g. builtin:tiny-qwen2.5-vl, "
                "Qwen/Qwen2.5-VL-3B-Instruct), or the env option obs_mode: text.",
            )
        return self.processor


@dataclass(frozen=True)
class ShapeCheck:
    """One conversation shape: whether the template's rendering of the whole conversation is
    the trace's ids (``stable``), and where it differs (``detail``)."""

    shape: str
    stable: bool
    detail: str = ""


@dataclass(frozen=True)
class _Gen:
    """An assistant turn in a probe shape: the text the model generated, and the message a
    chat history would store for it (tool calls structured, as OpenAI-style clients keep them)."""

    text: str
    message: dict[str, Any]


_REASONING = "<think>\nThe user wants a number.\n</think>\n\n"


def conversation_shapes(
    tools: Tools, *, reasoning: bool
) -> list[tuple[str, list[dict[str, Any] | _Gen]]]:
    """The probe conversations of :meth:`ChatFormat.check_shapes` (each ends with the message
    the next generation follows)."""
    from roll_core.envs.tools import tool_call_text  # envs: a lower layer, loaded when used

    system = {"role": "system", "content": "Play the game."}
    user = {"role": "user", "content": "What is 6 times 7?"}
    later = {"role": "user", "content": "And 8 times 9?"}
    answer = _Gen("42", {"role": "assistant", "content": "42"})
    shapes: list[tuple[str, list[dict[str, Any] | _Gen]]] = [
        ("user and assistant turns", [system, user, answer, later])
    ]
    if reasoning:
        thought = _Gen(_REASONING + "42", {"role": "assistant", "content": _REASONING + "42"})
        shapes.append(
            ("assistant with reasoning, then a user turn", [system, user, thought, later])
        )
    if not tools:
        return shapes
    fn = tools[0].get("function", {})
    name = str(fn.get("name", "tool"))
    arg = next(iter(fn.get("parameters", {}).get("properties", {})), "input")

    def calls(n: int, prefix: str = "") -> _Gen:
        args = [{arg: f"6 * {7 + k}"} for k in range(n)]
        text = prefix + "\n".join(tool_call_text(name, a) for a in args)
        structured = [
            {"type": "function", "function": {"name": name, "arguments": a}} for a in args
        ]
        return _Gen(text, {"role": "assistant", "content": prefix, "tool_calls": structured})

    results = [ToolResult(name, "42").message(), ToolResult(name, "48").message()]
    shapes += [
        ("assistant tool call, then its tool result", [system, user, calls(1), results[0]]),
        ("two tool calls, then two tool results", [system, user, calls(2), *results]),
        (
            "tool result, an answer, then a user turn",
            [system, user, calls(1), results[0], answer, later],
        ),
    ]
    if reasoning:
        shapes.append(
            (
                "assistant with reasoning and a tool call, then its tool result",
                [system, user, calls(1, _REASONING), results[0]],
            )
        )
    return shapes


def first_messages(system: str, observation: str) -> list[dict[str, str]]:
    messages = [{"role": "system", "content": system}] if system else []
    return [*messages, {"role": "user", "content": observation}]


def _first_difference(tokenizer: Any, trace: list[int], full: list[int]) -> str:
    """Where the template's rendering of the whole conversation leaves the trace, as text."""
    a, b = tokenizer.decode(trace), tokenizer.decode(full)
    n = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
    if a == b:
        return "the same text, tokenised differently at a message boundary"
    return (
        f"the template writes {b[max(0, n - 30) : n + 30]!r} where the trace has "
        f"{a[max(0, n - 30) : n + 30]!r}"
    )


@dataclass
class TokenTrace:
    """The ids of a whole trajectory, its loss mask and behaviour log-probs (same length), and
    the vision inputs of its images in the order they appear in the ids."""

    ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    images: list[VisionInputs] = field(default_factory=list)
    routes: Any = None
    """Router replay: ``[N, L, K]`` routed experts of the trace's first N tokens (None: none
    recorded; roll_core/models/routing.py)."""

    def add_routes(self, routes: Any, prompt: list[int]) -> None:
        """A call's recorded routes (`Completion.routed_experts`), before its response is
        added: they cover `prompt` then the response. Kept only when the call continued this
        trace (`prompt` is the trace so far); the first record of each token wins."""
        if routes is not None and prompt == self.ids:
            self.routes = extend_routes(self.routes, routes)

    def add_context(self, ids: list[int], vision: VisionInputs | None = None) -> None:
        self.ids += ids
        self.mask += [0] * len(ids)
        self.log_probs += [0.0] * len(ids)
        if vision is not None:
            self.images.append(vision)

    def vision(self) -> VisionInputs | None:
        """Every image of the trace so far as one sample's vision inputs (None: no image)."""
        if not self.images:
            return None
        return VisionInputs(**concat_vision(self.images))

    def add_generated(self, ids: list[int], log_probs: list[float]) -> None:
        if len(ids) != len(log_probs):
            raise ValueError(f"{len(ids)} generated ids but {len(log_probs)} log-probs")
        self.ids += ids
        self.mask += [1] * len(ids)
        self.log_probs += list(log_probs)
