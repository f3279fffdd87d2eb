"""`roll eval MODEL_OR_RUN --env NAME`: a model's episodes in an env, e.g. a checkpoint on the
held-out SWE tasks.

The model plays ``episodes`` episodes (seeds ``seed``, ``seed + 1``, ...) of the env through
:class:`roll_core.envs.model_policy.ModelPolicy` (its own chat template and tool format, greedy
by default), one after another, each to its end (:func:`roll_core.envs.play.play_episode`).
For a run, the env's options default to the run's own: the ``envs`` entry of that env in its
``config.yaml``, with its ``eval_options`` merged in (so an agentic run on ``swe`` with
``eval_options: {split: test}`` is evaluated on the held-out tasks), and the seeds start at the
run's ``eval.seed_start``; ``options`` given here override both. Written: every episode as a
``roll debug-env --record`` JSONL line (so ``roll debug-env ENV --replay FILE`` plays it back),
and a summary JSON: the episodes, success rate, mean return, length, invalid actions and the
mean of every number the env reports in its last step's ``episode_metrics`` (``swe``:
``solved``, ``diff_lines``, ``tool_errors``, ``timeouts``, ``sandbox_faults``, ``grade_s``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from roll_core.errors import UsageError
from roll_core.evaluation.models import ResolvedModel, resolve_model_or_run

__all__ = ["EnvEvalResult", "evaluate_env"]


@dataclass(frozen=True)
class EnvEvalResult:
    """What :func:`evaluate_env` played and wrote."""

    model: ResolvedModel
    env: str
    options: dict[str, Any]
    metrics: dict[str, float]
    out: Path
    summary: Path


def run_env_options(model: ResolvedModel, env: str) -> dict[str, Any]:
    """The run's options of ``env`` with its ``eval_options`` (empty when not from a run or
    the run has no such env)."""
    for entry in model.setting("envs") or []:
        if isinstance(entry, dict) and entry.get("env") == env:
            return {**(entry.get("options") or {}), **(entry.get("eval_options") or {})}
    return {}


def evaluate_env(
    model_or_run: str,
    env: str,
    options: dict[str, Any] | None = None,
    *,
    episodes: int = 32,
    seed: int | None = None,
    max_new_tokens: int | None = None,
    temperature: float = 0.0,
    step_timeout: float = 600.0,
    out: str | None = None,
    runs_dir: str | Path = "runs",
    progress: Callable[[int, int], None] | None = None,
) -> EnvEvalResult:
    """Play and record ``episodes`` episodes of ``env`` by the model (module docstring)."""
    from roll_core.envs.model_policy import ModelPolicy
    from roll_core.envs.play import play_episode, summarize, write_episode
    from roll_core.envs.registry import make_env

    if episodes < 1:
        raise UsageError(f"--episodes {episodes}: play at least one episode.")
    model = resolve_model_or_run(model_or_run, runs_dir=runs_dir)
    chosen = {**run_env_options(model, env), **(options or {})}
    instance = make_env(env, **chosen)  # a bad name or option: the ConfigError, before a model
    start = seed if seed is not None else int(model.setting("eval", "seed_start") or 0)
    budget = max_new_tokens or int(model.setting("rollout", "max_new_tokens") or 64)
    policy = ModelPolicy(model.path, max_new_tokens=budget, temperature=temperature)
    path = Path(out) if out else _default_out(model, env)
    path.parent.mkdir(parents=True, exist_ok=True)
    played = []
    with path.open("w") as stream:
        for i in range(episodes):
            episode = play_episode(
                instance, policy, start + i, model=model.label, step_timeout=step_timeout
            )
            write_episode(stream, episode)
            stream.flush()
            played.append(episode)
            if progress is not None:
                progress(i + 1, episodes)
    metrics = {k: float(v) for k, v in summarize(played).items()}
    metrics |= _episode_metrics([e.turns[-1].info for e in played if e.turns])
    summary = path.with_name(path.name.removesuffix(".jsonl") + ".summary.json")
    record = {"model": model.label, "env": env, "options": chosen, "seed_start": start}
    summary.write_text(json.dumps({**record, "metrics": metrics}, indent=2, default=str) + "\n")
    return EnvEvalResult(model, env, chosen, metrics, path, summary)


def _episode_metrics(infos: list[dict[str, Any]]) -> dict[str, float]:
    """The mean of each number in the episodes' final ``episode_metrics``."""
    sums: dict[str, list[float]] = {}
    for info in infos:
        for key, value in (info.get("episode_metrics") or {}).items():
            if isinstance(value, (int, float)):
                sums.setdefault(key, []).append(float(value))
    return {f"env/{k}": sum(v) / len(v) for k, v in sorted(sums.items())}


def _default_out(model: ResolvedModel, env: str) -> Path:
    """``<run>/eval/env-<env>.jsonl`` for a run, else ``eval-<model>-env-<env>.jsonl`` here."""
    stem = "env-" + re.sub(r"[^\w.-]+", "_", env)
    if model.run is not None:
        return model.run.dir / "eval" / f"{stem}.jsonl"
    name = re.sub(r"[^\w.-]+", "_", Path(model.label).name or model.label).strip("_")
    return Path(f"eval-{name}-{stem}.jsonl")
