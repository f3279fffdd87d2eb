"""GEM environments (the ``gem-llm`` package, https://github.com/axon-rl/gem) as roll text envs.

``gem:ID`` names GEM's env ``ID`` (``gem:game:GuessTheNumber-v0-easy``,
``gem:game:Mastermind-v0-easy``, ``gem:rg:simple_equations``, ...); ``roll debug-env`` and
recipes take it like any env name. ``options.kwargs`` go to ``gem.make(ID, **kwargs)``;
``options.tool_wrappers`` wrap the env in GEM's own tool wrappers (``python_tool``: GEM's
sandboxed Python, called with ``<python>...</python>`` in GEM's format), whose results come back
as ``tool`` messages. Only envs that run offline work on an offline machine: the games and the
ReasoningGym (``rg:``) tasks generate their problems; ``math:``/``code:``/``qa:`` download data
sets; ``game:Wordle``/``Hangman``/``WordSearch`` need NLTK's word list.

How GEM's protocol maps onto :class:`~roll_core.envs.base.TextEnv`:

* observation: GEM's text, then ``info["suffix"]`` (the board and "Enter your guess", which
  GEM keeps out of the observation) on a new line, as GEM's own ``concat`` wrappers show it;
* actions: GEM reads its own (``\\boxed{...}`` in the games) and prices a format error in its
  reward (``format_error_reward``), so every response is passed on and counts as a valid action;
* success: the episode terminated on a step whose reward is at least
  ``options.success_reward`` (1.0: GEM's ``success_reward``; ReasoningGym's score of a correct
  answer);
* seeding: GEM draws from the global ``random`` / ``numpy.random`` generators, which its
  ``reset(seed)`` seeds. Episodes run on several threads, so every call into a GEM env holds
  one lock and swaps in that env's own generator state: an episode is determined by its seed
  whatever else runs at the same time.
"""

from __future__ import annotations

import difflib
import hashlib
import logging
import random
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, ClassVar

import numpy as np
from pydantic import Field

from roll_core.envs.base import EnvOptions, Observation, TextEnv, ToolResult, Transition
from roll_core.errors import ConfigError

SCHEME = "gem:"
_LOCK = threading.RLock()  # GEM's envs share the process's global random generators
_CLASSES: dict[str, type[GemTextEnv]] = {}


class GemOptions(EnvOptions):
    """Options of a GEM env."""

    max_steps: int = Field(20, ge=1, description="Steps before the episode is truncated.")
    kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="Keyword arguments of gem.make(ID, **kwargs), e.g. {max_turns: 5}.",
    )
    tool_wrappers: list[str] = Field(
        default_factory=list,
        description="GEM tool wrappers applied in order (e.g. python_tool); their results are "
        "tool messages.",
    )
    success_reward: float = Field(
        1.0, description="A terminating step with at least this reward is a success."
    )
    instructions: bool = Field(
        True,
        description="Show GEM's reset text (the game's instructions); false: only its suffix "
        "(e.g. 'Enter your next guess.'), for tiny models whose context cannot hold the "
        "instructions (give a short version as the recipe's system_prompt).",
    )


class GemTextEnv(TextEnv):
    """A GEM env behind the text protocol; :func:`gem_env_class` makes one class per GEM id."""

    gem_id: ClassVar[str] = ""
    scheme_named = True
    Options = GemOptions
    options: GemOptions

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self._gem: Any = None
        self._rng_state: tuple[Any, Any] | None = None
        self._last = ""

    @contextmanager
    def _own_random(self) -> Iterator[None]:
        """Hold the lock and run with this env's global-generator state, then put back the
        state the process had."""
        with _LOCK:
            saved = (random.getstate(), np.random.get_state())
            if self._rng_state is not None:
                random.setstate(self._rng_state[0])
                np.random.set_state(self._rng_state[1])
            try:
                yield
            finally:
                self._rng_state = (random.getstate(), np.random.get_state())
                random.setstate(saved[0])
                np.random.set_state(saved[1])

    def _call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        with self._own_random():
            return fn(*args, **kwargs)

    def on_reset(self, rng: np.random.Generator) -> tuple[str, dict[str, Any]]:
        seed = int(rng.integers(2**31))
        if self._gem is None:
            self._gem = self._call(_make, self.gem_id, self.options)
        obs, info = self._call(self._gem.reset, seed=seed)
        self._last = _text(obs if self.options.instructions else "", info)
        return self._last, {"gem_id": self.gem_id}

    def parse_action(self, text: str) -> str:
        return text  # GEM reads (and prices) its own action format

    def on_step(self, action: str) -> Transition:
        obs, reward, terminated, truncated, info = self._call(self._gem.step, action)
        text = _text(obs, info)
        self._last = text
        reward = float(reward)
        success = bool(terminated) and reward >= self.options.success_reward
        out_info: dict[str, Any] = {"success": success, "gem_reward": reward}
        if "tool_type" in info:  # a GEM tool wrapper ran a tool: its output is a tool message
            name = str(info["tool_type"])
            out_info["tool"] = name
            observation: str = Observation(text, tool_results=[ToolResult(name, str(obs))])
        else:
            observation = text
        return Transition(observation, reward, bool(terminated), out_info, bool(truncated))

    def render(self) -> str:
        return self._last

    def state_key(self) -> str:
        return hashlib.sha1(self._last.encode()).hexdigest()[:16]

    def random_action(self, rng: np.random.Generator) -> str:
        with self._own_random():
            random.seed(int(rng.integers(2**31)))  # the policy's draw, from the policy's rng
            try:
                return str(self._gem.sample_random_action())
            except NotImplementedError:
                raise NotImplementedError(
                    f"the GEM env {self.gem_id} has no sample_random_action()"
                ) from None


def _text(obs: Any, info: dict[str, Any]) -> str:
    text = str(obs)
    suffix = info.get("suffix")
    if suffix:
        text = (text + "\n" if text and not text.endswith("\n") else text) + str(suffix)
    prefix = info.get("prefix")
    return str(prefix) + text if prefix else text


def _gem() -> Any:
    root = logging.getLogger()
    before = (root.level, list(root.handlers))
    try:
        import gem  # its __init__ calls logging.basicConfig(level=INFO): undone below
    except ImportError as err:
        raise ConfigError(
            f"GEM envs need the gem-llm package, which does not import ({err}).",
            hint="Install it with `pip install 'roll[gem]'` (or `pip install gem-llm`).",
        ) from None
    finally:
        root.setLevel(before[0])
        for handler in [h for h in root.handlers if h not in before[1]]:
            root.removeHandler(handler)
    return gem


def _make(gem_id: str, options: GemOptions) -> Any:
    gem = _gem()
    try:
        env = gem.make(gem_id, **options.kwargs)
    except TypeError as err:
        raise ConfigError(
            f"gem.make({gem_id!r}) rejects options.kwargs {options.kwargs}: {err}.",
            hint="Pass only the keyword arguments of that GEM env's class.",
        ) from None
    if options.tool_wrappers:
        from gem.wrappers.wrapper_factory import WRAPPER_FACTORY

        for name in options.tool_wrappers:
            factory = WRAPPER_FACTORY.get(name)
            if factory is None or "tool" not in name:
                valid = ", ".join(k for k in WRAPPER_FACTORY if "tool" in k)
                raise ConfigError(
                    f"unknown GEM tool wrapper {name!r} for gem:{gem_id}.",
                    hint=f"GEM's tool wrappers: {valid}. (Observation wrappers are not used: "
                    "roll renders the conversation with the model's chat template.)",
                )
            env = factory(env)
    return env


def gem_env_class(name: str) -> type[GemTextEnv]:
    """The :class:`GemTextEnv` subclass of ``gem:ID`` (one per id, made on first use)."""
    gem_id = name[len(SCHEME) :].strip()
    if gem_id in _CLASSES:
        return _CLASSES[gem_id]
    _gem()  # a clear error when gem-llm is not installed
    from gem.envs.registration import ENV_REGISTRY

    if gem_id not in ENV_REGISTRY:
        close = difflib.get_close_matches(gem_id, list(ENV_REGISTRY), n=3)
        games = sorted({k.rsplit("-", 1)[0] for k in ENV_REGISTRY if k.startswith("game:")})
        raise ConfigError(
            f"GEM has no env {gem_id!r}."
            + (f" Did you mean {', '.join(repr(c) for c in close)}?" if close else ""),
            hint=f"Name a GEM env as gem:ID, e.g. gem:game:GuessTheNumber-v0-easy (games: "
            f"{', '.join(games)}; ReasoningGym tasks: gem:rg:NAME).",
        )
    cls = type(
        f"Gem[{gem_id}]",
        (GemTextEnv,),
        {"name": SCHEME + gem_id, "gem_id": gem_id, "__module__": __name__},
    )
    _CLASSES[gem_id] = cls
    return cls
