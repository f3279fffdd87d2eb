"""Reward functions by name: the built-ins, user functions by dotted path, weighted sums.

``REWARDS`` maps a built-in name to its class; the class's dataclass fields are the options a
recipe may set for it (``math``: ``answer_pattern``, ``answer_key``; ``format``: ``pattern``).
Any other reward is a user function named ``pkg.module:function``, imported here (a bad path
is a :class:`~roll_core.errors.ConfigError` at start-up, not a failure per sample) and called
as ``fn(sample, **args)``.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import importlib
import inspect
import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from roll_core.config.reward import DOTTED_PATH, DomainRewardConfig, RewardFnConfig
from roll_core.errors import ConfigError
from roll_core.rewards.base import RewardFn, RewardResult, RewardSample, as_result
from roll_core.rewards.code import CodeReward
from roll_core.rewards.exact_match import ExactMatchReward
from roll_core.rewards.format_reward import FormatReward
from roll_core.rewards.judge import JudgeReward
from roll_core.rewards.math_reward import MathReward
from roll_core.rewards.rules import ChoiceReward, InstructionsReward, RepetitionPenalty

__all__ = [
    "REWARDS",
    "UserReward",
    "WeightedSum",
    "build_domain_reward",
    "build_reward",
    "builtin_options",
    "load_user_function",
]

REWARDS: dict[str, type] = {
    "math": MathReward,
    "format": FormatReward,
    "code": CodeReward,
    "judge": JudgeReward,
    "instructions": InstructionsReward,
    "choice": ChoiceReward,
    "repetition": RepetitionPenalty,
    "exact_match": ExactMatchReward,
}
"""Built-in reward name -> dataclass; its init fields are the options it accepts."""

_PATH_HINT = (
    "A user reward is named 'pkg.module:function'; the module must be importable from the "
    "directory you run roll in (or be on PYTHONPATH, or installed)."
)


def builtin_options(name: str) -> set[str]:
    """The options (recipe keys besides ``name`` and ``weight``) of built-in reward ``name``."""
    return {f.name for f in dataclasses.fields(REWARDS[name]) if f.init}


def _unknown_name(name: str) -> ConfigError:
    close = difflib.get_close_matches(name, list(REWARDS), n=1)
    guess = f" Did you mean {close[0]!r}?" if close else ""
    return ConfigError(
        f"unknown reward {name!r}.{guess} Valid names: {', '.join(REWARDS)}, or a user "
        "function as a dotted path 'pkg.module:function'.",
        hint=_PATH_HINT,
    )


def load_user_function(path: str) -> Callable[..., Any]:
    """Import ``pkg.module:function`` (the part after ``:`` may be ``Class.attr``).

    Like ``uvicorn app:main``, the current directory is importable: it is appended to
    ``sys.path`` when missing (the ``roll`` script does not put it there).

    Raises:
        ConfigError: malformed path, module not importable (or raising on import),
            attribute missing (the module's public callables are listed) or not callable.
    """
    if not DOTTED_PATH.match(path):
        raise ConfigError(
            f"reward {path!r} is not a dotted path of the form 'pkg.module:function'.",
            hint=_PATH_HINT,
        )
    module_name, _, attr_path = path.partition(":")
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.append(cwd)
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        if err.name is not None and module_name.startswith(err.name):
            raise ConfigError(
                f"reward {path!r}: cannot import module {module_name!r} "
                f"(no module named {err.name!r}).",
                hint=_PATH_HINT,
            ) from None
        raise ConfigError(
            f"reward {path!r}: importing {module_name!r} failed: {err}.",
            hint="The module itself imports something that is not installed.",
        ) from None
    except Exception as err:
        raise ConfigError(
            f"reward {path!r}: importing {module_name!r} raised {type(err).__name__}: {err}.",
            hint="Fix the module (run `python -c 'import " + module_name + "'` to see the "
            "traceback).",
        ) from None
    obj: Any = module
    for part in attr_path.split("."):
        if not hasattr(obj, part):
            names = sorted(
                n
                for n, v in vars(module).items()
                if callable(v)
                and not n.startswith("_")
                and getattr(v, "__module__", None) == module.__name__
            )
            shown = ", ".join(names[:12]) + (" ..." if len(names) > 12 else "") or "none"
            raise ConfigError(
                f"reward {path!r}: module {module_name!r} has no attribute {attr_path!r}. "
                f"Its public callables: {shown}.",
                hint="Check the name after ':'.",
            )
        obj = getattr(obj, part)
    if not callable(obj):
        raise ConfigError(
            f"reward {path!r} is an object of type {type(obj).__name__}, not a function.",
            hint="Point the path at a function fn(sample) returning a float or RewardResult.",
        )
    return obj


@functools.lru_cache(maxsize=256)
def _resolve(path: str) -> Callable[..., Any]:
    return load_user_function(path)


@dataclass(frozen=True)
class UserReward:
    """A user function given by dotted path, called as ``fn(sample, **args)``.

    It pickles as its path, so worker processes import the function themselves.
    """

    path: str
    args: Mapping[str, Any] = field(default_factory=dict)

    def check(self) -> None:
        """Import the function now and check it can be called as ``fn(sample, **args)``."""
        fn = _resolve(self.path)
        try:
            inspect.signature(fn).bind(None, **self.args)
        except TypeError as err:
            raise ConfigError(
                f"reward {self.path!r} cannot be called as fn(sample"
                f"{''.join(f', {k}=...' for k in self.args)}): {err}.",
                hint="A reward function takes the sample as its one positional argument; "
                "`args` in the recipe become keyword arguments.",
            ) from None
        except ValueError:  # no signature (some builtins): nothing to check
            pass

    def warmup(self) -> None:
        """Import the function (in a worker process: at start-up, not on the first sample)."""
        _resolve(self.path)

    def __call__(self, sample: RewardSample) -> RewardResult:
        value = _resolve(self.path)(sample, **self.args)
        return as_result(value, source=f"reward function {self.path}")


@dataclass(frozen=True)
class WeightedSum:
    """``sum_i weight_i * score_i`` over named reward functions.

    ``info`` holds ``<label>/score`` for every part plus the parts' own info keys (the first
    part that reports a key wins, so with ``[math, format]`` ``format_ok`` is math's).
    """

    parts: tuple[tuple[str, float, RewardFn], ...]

    def warmup(self) -> None:
        """Call ``warmup()`` of every part that has one (math imports math-verify)."""
        for _, _, fn in self.parts:
            warm = getattr(fn, "warmup", None)
            if callable(warm):
                warm()

    def check_row(self, row: Mapping[str, Any], where: str = "row") -> None:
        """Let every part that validates rows (``code``, ``instructions``) check ``row``."""
        for _, _, fn in self.parts:
            check = getattr(fn, "check_row", None)
            if callable(check):
                check(row, where)

    def metrics(self, *, reset: bool = True) -> dict[str, float]:
        """The parts' own metrics (``code/...``, ``judge/...``), for thread isolation."""
        out: dict[str, float] = {}
        for _, _, fn in self.parts:
            part = getattr(fn, "metrics", None)
            if callable(part):
                out.update(part(reset=reset))
        return out

    def close(self) -> None:
        """Close the parts that hold resources (a judge's HTTP session)."""
        for _, _, fn in self.parts:
            close = getattr(fn, "close", None)
            if callable(close):
                close()

    def __call__(self, sample: RewardSample) -> RewardResult:
        total = 0.0
        info: dict[str, Any] = {}
        for label, weight, fn in self.parts:
            result = as_result(fn(sample), source=f"reward {label}")
            total += weight * result.score
            info[f"{label}/score"] = result.score
            for key, value in result.info.items():
                info.setdefault(key, value)
        return RewardResult(total, info)


def build_reward(name: str, *, args: Mapping[str, Any] | None = None, **options: Any) -> RewardFn:
    """One reward function: a built-in by name (``options`` are its fields) or a dotted path.

    Raises:
        ConfigError: unknown name (the valid ones are listed), an option the reward does not
            take, a bad pattern, or a user function that cannot be imported or called.
    """
    if name in REWARDS:
        extra = set(options) - builtin_options(name)
        if extra or args:
            bad = sorted(extra) or ["args"]
            raise ConfigError(
                f"reward {name!r} takes no option {', '.join(map(repr, bad))}; its options: "
                f"{', '.join(sorted(builtin_options(name))) or 'none'}."
            )
        return REWARDS[name](**options)
    if ":" not in name:
        raise _unknown_name(name)
    if options:
        raise ConfigError(
            f"reward {name!r} is a user function; {', '.join(map(repr, sorted(options)))} "
            "apply to built-in rewards only.",
            hint="Pass settings to your function with `args: {key: value}`.",
        )
    user = UserReward(name, dict(args or {}))
    user.check()
    return user


def _label(name: str) -> str:
    return name.rpartition(":")[2].rpartition(".")[2] if ":" in name else name


def build_domain_reward(spec: DomainRewardConfig | RewardFnConfig | str) -> WeightedSum:
    """The weighted sum for one domain from its recipe section (or a bare name)."""
    if isinstance(spec, str):
        spec = DomainRewardConfig.model_validate(spec)
    elif isinstance(spec, RewardFnConfig):
        spec = DomainRewardConfig(rewards=[spec])
    parts: list[tuple[str, float, RewardFn]] = []
    seen: dict[str, int] = {}
    for item in spec.rewards:
        options = (
            {k: getattr(item, k) for k in builtin_options(item.name)}
            if (item.name in REWARDS)
            else {}
        )
        fn = build_reward(item.name, args=item.args or None, **options)
        label = _label(item.name)
        seen[label] = seen.get(label, 0) + 1
        if seen[label] > 1:
            label = f"{label}_{seen[label]}"
        parts.append((label, item.weight, fn))
    return WeightedSum(tuple(parts))
