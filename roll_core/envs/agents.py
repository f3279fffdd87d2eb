"""Agent programs: a user's own agent, written as plain OpenAI-client code, as an env of a run.

An agent module (``envs[].agent`` in a recipe: ``package.module:run``, or a file
``path/to/agent.py:run``; ``:run`` may be left out) defines::

    async def run(client, task) -> float:      # or a plain `def run(client, task)`
        ...                                    # client: openai.AsyncOpenAI (openai.OpenAI)
        return reward

and optionally ``make_task(seed, **options) -> task`` (the task of an episode from its seed
and the recipe's ``envs[].options``; without it the task is ``{"seed": seed, **options}``) and
``expert(task, messages) -> reply`` (what a good model would answer to a call: a string, or
``{"content": ..., "tool_calls": [{"name": ..., "arguments": {...}}]}``), which the warm start
(``warm_start.policy: expert``) clones before RL. The
module never imports roll: during rollout roll serves an OpenAI-compatible endpoint and hands
``run`` a client whose base URL is the episode's own session on it
(:mod:`roll_core.rollout.agentic.endpoint`). This module only loads and checks the program.
"""

from __future__ import annotations

import difflib
import importlib.util
import inspect
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from roll_core.envs.registry import _import_module
from roll_core.errors import ConfigError

_HINT = (
    "An agent module defines `async def run(client, task) -> float` (or a plain `def run`), "
    "where client is an openai.AsyncOpenAI (openai.OpenAI) client; name it as "
    "package.module:run or path/to/agent.py:run (docs/agentic.md, 'Bring your own agent')."
)


@dataclass(frozen=True)
class AgentProgram:
    """A loaded agent: its ``run`` (async or not) and how its tasks are made."""

    path: str
    run: Callable[..., Any]
    is_async: bool
    make_task: Callable[..., Any] | None = None
    expert: Callable[..., Any] | None = None
    options: dict[str, Any] = field(default_factory=dict)

    @staticmethod
    def source_file(fn: Callable[..., Any]) -> str | None:
        """The file ``fn`` is defined in (where its errors are located), if known."""
        try:
            return inspect.getsourcefile(fn)
        except TypeError:
            return None

    def task(self, seed: int) -> Any:
        """The task of the episode with ``seed`` (``make_task(seed, **options)``, else a dict)."""
        if self.make_task is None:
            return {"seed": seed, **self.options}
        return self.make_task(seed, **self.options)


def load_agent(path: str, options: dict[str, Any] | None = None) -> AgentProgram:
    """Import the agent ``path`` and check its ``run``: a ConfigError naming the module and
    what to do when it does not import, has no ``run``, or ``run`` does not take
    ``(client, task)``."""
    target, _, attr = path.rpartition(":") if ":" in path else (path, "", "run")
    attr = attr or "run"
    module = _load_module(target, path)
    run = getattr(module, attr, None)
    if run is None or not callable(run):
        found = [n for n, v in vars(module).items() if inspect.isfunction(v)]
        raise ConfigError(
            f"agent module '{target}' has no function '{attr}' (agent '{path}').",
            hint=f"Functions in {target}: {', '.join(sorted(found)) or 'none'}. {_HINT}",
        )
    try:
        inspect.signature(run).bind(None, None)
    except (TypeError, ValueError):
        raise ConfigError(
            f"agent '{path}': {attr}{inspect.signature(run)} cannot be called as "
            f"{attr}(client, task).",
            hint=_HINT,
        ) from None
    make_task = getattr(module, "make_task", None)
    if make_task is not None and not callable(make_task):
        raise ConfigError(f"agent '{path}': make_task is not a function.", hint=_HINT)
    if make_task is not None:
        _check_options(path, make_task, dict(options or {}))
    expert = getattr(module, "expert", None)
    return AgentProgram(
        path=path,
        expert=expert if callable(expert) else None,
        run=run,
        is_async=inspect.iscoroutinefunction(run),
        make_task=make_task,
        options=dict(options or {}),
    )


def _check_options(path: str, make_task: Callable[..., Any], options: dict[str, Any]) -> None:
    """A ConfigError when ``make_task(seed, **options)`` cannot take the recipe's options (an
    option it has no parameter for, with did-you-mean; a parameter it requires)."""
    try:
        sig = inspect.signature(make_task)
    except (TypeError, ValueError):  # a builtin or C callable: it is called as it is
        return
    try:
        sig.bind(0, **options)
        return
    except TypeError as err:
        problem = str(err)
    takes = [
        name
        for name, p in list(sig.parameters.items())[1:]
        if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
    ]
    unknown = [k for k in options if k not in takes]
    if unknown and not any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values()):
        close = {k: difflib.get_close_matches(k, takes, n=1) for k in unknown}
        problem = "unknown option " + ", ".join(
            f"'{k}'" + (f" (did you mean '{close[k][0]}'?)" if close[k] else "") for k in unknown
        )
    shown = ", ".join(str(p.replace(annotation=p.empty)) for p in sig.parameters.values())
    raise ConfigError(
        f"agent '{path}': envs[].options do not fit make_task({shown}): {problem}.",
        hint="envs[].options are the keyword arguments of the agent module's "
        f"make_task(seed, **options) (it takes: {', '.join(takes) or 'none'}). Fix the option "
        "names in the recipe, or the parameters of make_task.",
    )


def check_task(program: AgentProgram, seed: int, timeout: float) -> Any:
    """``program.task(seed)``, made before any episode needs it (a run's checks, ``roll
    debug-env``): an EnvFault naming the agent module and make_task's own error (the line that
    raised) when it raises or hangs, so the user's bug is told as theirs. A roll error
    (ConfigError, SandboxError: a built-in agent's own check) is raised as it is."""
    from roll_core.envs.faults import EnvFault, call_with_timeout, describe_fault
    from roll_core.errors import RollError

    fn = program.make_task or program.task
    try:
        return call_with_timeout(program.task, seed, timeout=timeout)
    except RollError:
        raise  # already says what to change
    except Exception as err:  # noqa: BLE001 - the user's make_task raised or hung
        options = "".join(f", {k}={v!r}" for k, v in program.options.items())
        module = program.path.rpartition(":")[0] if ":" in program.path else program.path
        raise EnvFault(
            f"agent '{program.path}': make_task({seed}{options}) (seed {seed} and the recipe's "
            f"envs[].options) failed: {describe_fault(err, program.source_file(fn))}.",
            hint=f"Fix make_task in {module} or the options the recipe gives it "
            "(envs[].options); rerun with --debug for the traceback.",
        ) from err


def expert_text(reply: Any) -> str:
    """The response text of an expert reply (a string, or an assistant message with
    ``tool_calls``, written in the hermes format the endpoint reads back)."""
    from roll_core.envs.tools import tool_call_text

    if isinstance(reply, str):
        return reply
    if not isinstance(reply, dict):
        raise TypeError(
            f"expert() returned {type(reply).__name__}; it returns the reply text or "
            '{"content": ..., "tool_calls": [{"name": ..., "arguments": {...}}]}'
        )
    calls = []
    for call in reply.get("tool_calls") or []:
        fn = call.get("function", call)
        calls.append(tool_call_text(str(fn["name"]), dict(fn.get("arguments") or {})))
    return "\n".join([str(reply.get("content") or ""), *calls]).strip()


def _load_module(target: str, path: str) -> Any:
    if not (target.endswith(".py") or "/" in target):
        return _import_module(target, path, "agent")
    file = Path(target)
    if not file.is_file():
        raise ConfigError(
            f"agent file '{target}' does not exist (agent '{path}').",
            hint="Give the path of the agent's .py file (relative to the directory you run "
            "roll from), or its module as package.module:run.",
        )
    name = f"roll_agent_{abs(hash(str(file.resolve())))}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, file)
    if spec is None or spec.loader is None:
        raise ConfigError(f"agent file '{target}' cannot be imported as Python.", hint=_HINT)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as err:  # a user module that fails while importing: the user's to fix
        raise ConfigError(
            f"importing agent file '{target}' raised {type(err).__name__}: {err}.",
            hint="Fix the module (rerun with --debug for the traceback).",
        ) from err
    sys.modules[name] = module
    return module
