"""The text-environment protocol every roll env implements.

An env talks text: :meth:`TextEnv.reset` returns the first observation, :meth:`TextEnv.step`
takes the model's whole response and returns ``(observation, reward, terminated, truncated,
info)``, the five values of gymnasium's ``step``. The env parses its own action format; an
action it cannot parse is not an exception but an *invalid action*: the step costs the
configurable ``format_penalty``, ``info["action_is_valid"]`` is ``False`` with the reason in
``info["invalid_reason"]``, and the episode continues (or ends, with
``end_on_invalid_action=true``).

Episodes are single-use and fully determined by ``(options, seed, actions)``: ``reset(seed)``
starts a fresh episode from nothing but the seed, so reusing an env object and building a new
one give the same episode (the shape of tinker-cookbook's single-use ``Env``).

A subclass writes four small pieces and inherits the bookkeeping (step counting, max steps,
invalid actions, return, the ``info`` keys every caller may rely on)::

    class Coin(TextEnv):
        name = "coin"
        Options = CoinOptions                    # a pydantic model: the env's keyword options
        instructions = "Guess the coin: answer <answer>heads</answer> or <answer>tails</answer>."

        def on_reset(self, rng):                 # rng: numpy Generator seeded by reset(seed)
            self.coin = rng.choice(["heads", "tails"])
            return "I flipped a coin.", {}

        def parse_action(self, text):            # raise InvalidAction for text it cannot read
            return parse_choice(text, {"heads": "heads", "tails": "tails"})

        def on_step(self, action):               # -> Transition
            won = action == self.coin
            return Transition(f"It was {self.coin}.", float(won), True, {"success": won})

        def render(self):
            return "coin: hidden"

An env may also *show* its state: when :meth:`TextEnv.render_image` returns a picture (the grid
games with ``obs_mode=image``), every observation is an :class:`Observation`, a ``str`` (the
text part: feedback, the legal actions) that also carries ``.images``. Text-only code keeps
working on it as a string; image-aware code (the agentic rollout, ``roll debug-env``) reads
:func:`observation_images`.

Tool calling: an env that declares :attr:`TextEnv.tools` (JSON schemas in the OpenAI function
format) has them rendered into the system turn by the model's chat template (``tools=``); the
results of the model's calls come back as an :class:`Observation` carrying ``.tool_results``
(:class:`ToolResult`), which the chat template renders as ``tool`` messages instead of a user
turn. :class:`~roll_core.envs.tools.ToolCallingEnv` does the parsing and checking.

See docs/envs.md for the authoring guide.
"""

from __future__ import annotations

import difflib
import hashlib
import re
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from roll_core.errors import ConfigError

if TYPE_CHECKING:
    from PIL.Image import Image

#: ``info`` keys every step result carries (see :meth:`TextEnv.step`).
INFO_KEYS: tuple[str, ...] = ("action_is_valid", "step", "success", "episode_return")


class EnvOptions(BaseModel):
    """Options every env takes. An env's own options model subclasses this one."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    max_steps: int = Field(20, ge=1, description="Steps before the episode is truncated.")
    format_penalty: float = Field(
        -0.1, description="Reward of a step whose action cannot be parsed (usually <= 0)."
    )
    end_on_invalid_action: bool = Field(
        False, description="End the episode (terminated) at the first invalid action."
    )


@dataclass(frozen=True)
class ToolResult:
    """The result of one tool call: the tool's ``name``, its output as text (``content``) and
    the id of the call it answers (``call_id``, when the model's format gives one)."""

    name: str
    content: str
    call_id: str | None = None

    def message(self) -> dict[str, Any]:
        """The ``tool`` chat message of this result (OpenAI's shape; templates read
        ``content``, some also ``name`` / ``tool_call_id``)."""
        msg: dict[str, Any] = {"role": "tool", "name": self.name, "content": self.content}
        if self.call_id is not None:
            msg["tool_call_id"] = self.call_id
        return msg


class Observation(str):
    """An observation with more than text: its text (this string) plus ``images`` (PIL RGB
    images) or ``tool_results`` (:class:`ToolResult`: the answers to the model's tool calls,
    rendered as ``tool`` messages rather than one user message).

    It *is* the text, so code written for text envs (printing, string checks, recordings)
    works unchanged and sees the text part only; string operations (``obs + "..."``) give a
    plain ``str`` without the images. In a chat message the images come first, then the text.
    Equality is the text's: compare :func:`observation_images` as well where pixels matter.
    """

    images: tuple[Image, ...]
    tool_results: tuple[ToolResult, ...]

    def __new__(
        cls, text: str, images: Sequence[Image] = (), tool_results: Sequence[ToolResult] = ()
    ) -> Observation:
        obj = super().__new__(cls, text)
        obj.images = tuple(images)
        obj.tool_results = tuple(tool_results)
        return obj

    @property
    def text(self) -> str:
        """The text part as a plain ``str``."""
        return str.__str__(self)

    def __reduce__(self) -> tuple[Any, ...]:  # pickles (Ray, threads) with its images
        return (Observation, (self.text, self.images, self.tool_results))

    def __repr__(self) -> str:
        extra = f", tool_results={len(self.tool_results)}" if self.tool_results else ""
        return f"Observation({self.text!r}, images={len(self.images)}{extra})"


def observation_images(observation: str) -> tuple[Image, ...]:
    """The images of an observation (``()`` for a plain text observation)."""
    return tuple(getattr(observation, "images", ()))


def observation_tool_results(observation: str) -> tuple[ToolResult, ...]:
    """The tool results an observation carries (``()``: it is a user turn)."""
    return tuple(getattr(observation, "tool_results", ()))


class StepResult(NamedTuple):
    """What :meth:`TextEnv.step` returns; unpacks like gymnasium's 5-tuple."""

    observation: str
    reward: float
    terminated: bool
    truncated: bool
    info: dict[str, Any]


@dataclass
class Transition:
    """What a subclass's :meth:`TextEnv.on_step` returns for a valid action."""

    observation: str
    reward: float
    terminated: bool = False
    info: dict[str, Any] = field(default_factory=dict)
    truncated: bool = False  # the env's own time limit (``max_steps`` is applied by TextEnv)


class InvalidAction(Exception):
    """Raised by :meth:`TextEnv.parse_action` for a response it cannot read.

    Not an error of the caller: :meth:`TextEnv.step` turns it into an invalid-action step.
    ``str(err)`` is the reason shown to the model.
    """


class EnvStateError(RuntimeError):
    """``step`` before ``reset`` or after the episode ended: a bug in the calling loop."""


class TextEnv(ABC):
    """Base class of text environments. See the module docstring for the contract."""

    #: Registry name (``roll debug-env NAME``); set by subclasses.
    name: ClassVar[str] = ""
    #: The pydantic model of the env's keyword options (extra keys are rejected).
    Options: ClassVar[type[EnvOptions]] = EnvOptions
    #: Arrow keys -> action text, for grid games a human plays with the arrow keys.
    key_actions: ClassVar[Mapping[str, str]] = {}
    #: Instructions for the model (see :attr:`system_prompt`).
    instructions: ClassVar[str] = ""
    #: True for classes made from a name scheme (``gem:ID``): they are named by ``name``.
    scheme_named: ClassVar[bool] = False

    def __init__(self, **options: Any) -> None:
        self.options: EnvOptions = validate_options(type(self), options)
        self._rng: np.random.Generator | None = None
        self._steps = 0
        self._return = 0.0
        self._done = True
        self._started = False
        self._success = False

    # ---- the protocol ------------------------------------------------------------------------
    @property
    def system_prompt(self) -> str:
        """The system message of every episode: how to play and the action format.

        Defaults to :attr:`instructions`; override the property when it depends on options.
        """
        return self.instructions

    @property
    def tools(self) -> list[dict[str, Any]]:
        """The tools the model may call, as JSON schemas in the OpenAI function format
        (``{"type": "function", "function": {"name", "description", "parameters"}}``); the
        chat template renders them (``tools=``). ``[]``: no native tools (the default)."""
        return []

    def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        """Start a new episode determined by ``seed``; returns ``(observation, info)``."""
        self._rng = np.random.default_rng(seed)
        self._steps, self._return = 0, 0.0
        self._done, self._started, self._success = False, True, False
        observation, info = self.on_reset(self._rng)
        info = {**info, "step": 0, "success": False, "episode_return": 0.0, "seed": seed}
        return self._with_image(observation), info

    def step(self, action: str) -> StepResult:
        """Apply the model's response ``action``; returns ``StepResult`` (a 5-tuple).

        ``info`` always holds ``action_is_valid`` (bool), ``step`` (steps taken, invalid ones
        included), ``success`` (the task is solved), ``episode_return`` (rewards so far) and,
        for an invalid action, ``invalid_reason``. ``truncated`` is true when ``max_steps``
        steps have been taken without the episode terminating.
        """
        if not self._started:
            raise EnvStateError(f"{self.name or type(self).__name__}: step() before reset().")
        if self._done:
            raise EnvStateError(
                f"{self.name or type(self).__name__}: step() after the episode ended; "
                "call reset() for a new episode."
            )
        self._steps += 1
        try:
            parsed = self.parse_action(action)
        except InvalidAction as err:
            reason = str(err)
            t = Transition(
                observation=self.invalid_observation(reason),
                reward=self.options.format_penalty,
                terminated=self.options.end_on_invalid_action,
                info={"action_is_valid": False, "invalid_reason": reason},
            )
        else:
            t = self.on_step(parsed)
            t.info.setdefault("action_is_valid", True)
        self._success = bool(t.info.get("success", self._success))
        truncated = not t.terminated and (t.truncated or self._steps >= self.options.max_steps)
        self._done = t.terminated or truncated
        self._return += t.reward
        info = {
            **t.info,
            "step": self._steps,
            "success": self._success,
            "episode_return": self._return,
        }
        observation = self._with_image(t.observation)
        return StepResult(observation, float(t.reward), bool(t.terminated), truncated, info)

    def _with_image(self, text: str) -> str:
        """``text`` as an :class:`Observation` with the current picture, when there is one."""
        if isinstance(text, Observation):
            return text
        picture = self.render_image()
        return text if picture is None else Observation(text, (picture,))

    @abstractmethod
    def render(self) -> str:
        """The current state as text for a human (usually the same grid the model sees)."""

    def render_image(self) -> Image | None:
        """The current state as a picture (a PIL RGB image), or None for a text-only env.

        When it returns an image, :meth:`reset` and :meth:`step` hand out every observation
        as an :class:`Observation` carrying that picture (the grid games' ``obs_mode=image``).
        It must be deterministic: the same state, the same pixels.
        """
        return None

    # ---- what subclasses implement -----------------------------------------------------------
    @abstractmethod
    def on_reset(self, rng: np.random.Generator) -> tuple[str, dict[str, Any]]:
        """Build a new episode from ``rng`` alone; return the first observation and info."""

    @abstractmethod
    def parse_action(self, text: str) -> Any:
        """Read an action from the model's response; raise :class:`InvalidAction` if none."""

    @abstractmethod
    def on_step(self, action: Any) -> Transition:
        """Apply a parsed action. Put ``success=True`` in ``info`` when the task is solved."""

    # ---- optional hooks ----------------------------------------------------------------------
    def invalid_observation(self, reason: str) -> str:
        """The observation after an invalid action: the reason, the format, the state."""
        return f"Invalid action: {reason}. {self.action_hint()}\n{self.render()}"

    def action_hint(self) -> str:
        """One sentence on the action format (used in invalid-action observations)."""
        actions = self.valid_actions()
        if actions:
            return (
                "Answer with one of "
                + ", ".join(actions)
                + ", e.g. <answer>"
                + actions[0]
                + "</answer>."
            )
        return "See the instructions for the action format."

    def valid_actions(self) -> list[str]:
        """The finite action set as text, or ``[]`` when actions are free text."""
        return []

    def random_action(self, rng: np.random.Generator) -> str:
        """A response a random policy would give (default: a valid action, uniformly)."""
        actions = self.valid_actions()
        if not actions:
            raise NotImplementedError(f"{type(self).__name__} has no random_action()")
        return str(actions[int(rng.integers(len(actions)))])

    def expert_action(self) -> str | None:
        """A good action from the current state (the env's own solver), as the answer text a
        policy would give, or None when the env has no solver or no action helps (a lost
        state). Used by ``warm_start.policy: expert``; envs without a solver keep this default.
        """
        return None

    @classmethod
    def has_expert(cls) -> bool:
        """Whether the env overrides :meth:`expert_action`."""
        return cls.expert_action is not TextEnv.expert_action

    def state_key(self) -> str:
        """A short hash of the current state (equal states, equal keys): groups steps by state."""
        return hashlib.sha1(self.render().encode()).hexdigest()[:16]

    # ---- read-only state ---------------------------------------------------------------------
    @property
    def done(self) -> bool:
        """True when the episode has ended (or never started)."""
        return self._done

    @property
    def steps(self) -> int:
        """Steps taken in this episode."""
        return self._steps

    @property
    def rng(self) -> np.random.Generator:
        """The episode's random generator (seeded by ``reset``)."""
        if self._rng is None:
            raise EnvStateError(f"{self.name or type(self).__name__}: reset() first.")
        return self._rng


# ---- parsing helpers shared by the built-in envs ---------------------------------------------
_ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.IGNORECASE | re.DOTALL)


def extract_answer(text: str) -> str:
    """The content of the last ``<answer>...</answer>`` in ``text``, else ``text`` itself.

    An opening ``<answer>`` with no closing tag (a response cut at max tokens) yields what
    follows it.
    """
    found = _ANSWER_RE.findall(text)
    if found:
        return str(found[-1]).strip()
    lower = text.lower()
    if "<answer>" in lower:
        return text[lower.rindex("<answer>") + len("<answer>") :].strip()
    return text.strip()


def parse_choice(
    text: str,
    choices: Mapping[str, str],
    *,
    aliases: Mapping[str, str] | None = None,
    what: str = "action",
) -> str:
    """Leniently read one of ``choices`` (lower-case name -> canonical action) from ``text``.

    Looks inside ``<answer>`` tags when present. The answer must name exactly one distinct
    action (``"Up"``, ``"up."``, ``"I push up"`` read as Up; ``"up or left"`` and ``"jump"``
    are invalid). A name is any non-empty text (``"pick up"``, ``"move_left"``, ``"slot 2"``),
    matched case-insensitively as a whole (not inside a longer word or number, any run of
    whitespace matching a space); where names overlap the longest match wins (``"Pick up"``
    reads as ``pick up``, not ``up``). ``aliases`` (e.g. ``"u" -> "Up"``) match only a whole
    answer, so a stray letter inside a sentence is never read as an action.
    """
    answer = extract_answer(text)
    bare = answer.strip().strip(".!").strip().lower()
    if aliases and bare in aliases:
        return aliases[bare]
    hits = _named_choices(answer, choices)
    valid = ", ".join(dict.fromkeys(choices.values()))
    if not answer:
        raise InvalidAction(f"empty {what}; expected one of {valid}")
    if len(hits) > 1:
        raise InvalidAction(f"{_quote(answer)} names several {what}s ({', '.join(sorted(hits))})")
    if not hits:
        raise InvalidAction(f"{_quote(answer)} is not one of {valid}")
    return hits.pop()


def _named_choices(answer: str, choices: Mapping[str, str]) -> set[str]:
    """The actions whose names occur in ``answer``, longest name first, no overlaps."""
    text = " ".join(answer.lower().split())
    taken = [False] * len(text)
    hits: set[str] = set()
    for key in sorted(choices, key=lambda k: len(" ".join(k.split())), reverse=True):
        name = " ".join(key.lower().split())
        if not name:
            continue
        # a name that starts/ends with a letter or digit must not continue a longer word
        head = r"(?<![^\W_])" if name[0].isalnum() else ""
        tail = r"(?![^\W_])" if name[-1].isalnum() else ""
        for found in re.finditer(head + re.escape(name) + tail, text):
            span = range(found.start(), found.end())
            if not any(taken[i] for i in span):
                for i in span:
                    taken[i] = True
                hits.add(choices[key])
    return hits


def _quote(text: str, limit: int = 40) -> str:
    flat = " ".join(text.split())
    return repr(flat if len(flat) <= limit else flat[: limit - 3] + "...")


#: Registered envs by name (filled by :func:`roll_core.envs.registry.register_env`). It lives
#: here so that an env can name itself (:func:`env_id`) in its own option errors without
#: this module importing the registry.
_REGISTRY: dict[str, type[TextEnv]] = {}


def env_id(cls: type[TextEnv]) -> str:
    """How ``cls`` is named on the command line and in recordings."""
    if cls.name and (_REGISTRY.get(cls.name) is cls or cls.scheme_named):
        return cls.name
    return f"{cls.__module__}:{cls.__qualname__}"


def validate_options(cls: type[TextEnv], options: dict[str, Any]) -> EnvOptions:
    """``options`` validated by ``cls.Options``; a bad one is a ConfigError naming it."""
    try:
        return cls.Options(**options)
    except ValidationError as err:
        raise _option_error(cls, err) from None


def describe_options(cls: type[TextEnv]) -> list[tuple[str, str, Any, str]]:
    """``(name, type, default, description)`` of every option of ``cls``."""
    rows = []
    for name, f in cls.Options.model_fields.items():
        ann = f.annotation
        type_name = ann.__name__ if isinstance(ann, type) else str(ann).replace("typing.", "")
        rows.append(
            (name, type_name, f.get_default(call_default_factory=True), f.description or "")
        )
    return rows


def options_summary(cls: type[TextEnv]) -> str:
    """``width=6, height=6, ...``: every option with its default, on one line."""
    return ", ".join(f"{name}={default!r}" for name, _, default, _ in describe_options(cls))


def _option_error(cls: type[TextEnv], err: ValidationError) -> ConfigError:
    who = env_id(cls)
    valid = list(cls.Options.model_fields)
    problems = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"])
        if e["type"] == "extra_forbidden":
            close = difflib.get_close_matches(loc, valid, n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            problems.append(f"unknown option '{loc}'{hint}")
        elif loc:
            problems.append(f"option {loc}={e.get('input')!r}: {e['msg']}")
        else:
            problems.append(str(e["msg"]).removeprefix("Value error, "))
    return ConfigError(
        f"env {who}: " + "; ".join(problems) + ".",
        hint=f"Options of {who} (name=default): {options_summary(cls)}.",
    )
