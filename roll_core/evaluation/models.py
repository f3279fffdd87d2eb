"""Which model `roll eval` / `roll generate` load: a run id, a run or checkpoint directory, a
model directory, a built-in model or a hub id, all named by one argument (MODEL_OR_RUN).

Resolution order, first match wins:

1. ``builtin:NAME``: the built-in tiny model.
2. An existing directory: a Hugging Face model directory (``config.json``) as it is; a
   checkpoint ``checkpoints/step-N`` (its ``actor_train/model``); a run directory
   (``meta.json``: as a run id, below).
3. A run id in ``runs_dir``: the run's ``final/`` model, else its newest intact checkpoint.
4. Anything else with a ``/`` is a hub id (``org/name``); a bare word is a run id that does
   not exist, and the error lists the recent runs.

A run also gives its resolved ``config.yaml``, from which `roll eval` takes its defaults
(prompt/answer columns, system prompt, generation budget, reward) so it scores the way the
run's own evaluation did.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from roll_core.errors import ModelError, UsageError
from roll_core.models.builtin import BUILTIN_PREFIX
from roll_core.runs import CheckpointManager, Run, list_runs

_SHARDED = {"dcp": "FSDP2", "deepspeed": "DeepSpeed", "adapter": "LoRA adapter"}


@dataclass(frozen=True)
class ResolvedModel:
    """A model to load and, when it came from a run, that run and its config."""

    path: str
    """What `load_causal_lm` / the infer backends get (a directory, builtin:NAME or hub id)."""
    label: str
    """How to name it to the user (``run X (final)``, a path, ...)."""
    run: Run | None = None
    config: dict[str, Any] = field(default_factory=dict)
    """The run's resolved config.yaml (empty when not from a run)."""

    def setting(self, *keys: str) -> Any:
        """``config[k0][k1]...``, or None when the run has no such key."""
        node: Any = self.config
        for key in keys:
            if not isinstance(node, dict) or key not in node:
                return None
            node = node[key]
        return node


def resolve_model_or_run(spec: str, *, runs_dir: str | Path = "runs") -> ResolvedModel:
    """Resolve MODEL_OR_RUN (see the module docstring).

    Raises:
        ModelError: a directory or run that holds no loadable Hugging Face model.
        UsageError: a bare name that is neither a run nor a built-in model.
    """
    if spec.startswith(BUILTIN_PREFIX):
        return ResolvedModel(path=spec, label=spec)
    path = Path(spec).expanduser()
    if path.is_dir():
        return _from_directory(path, runs_dir)
    run_dir = Path(runs_dir) / spec
    if spec and "/" not in spec and (run_dir / "meta.json").is_file():
        return _from_run(Run(run_dir))
    if _is_hub_id(spec):
        return ResolvedModel(path=spec, label=spec)  # loading says if it is unknown / offline
    if "/" in spec or spec.startswith((".", "~")):
        raise ModelError(
            f"model path not found: {spec} (resolved to {path.absolute()}).",
            hint="Give a run id (`roll runs` lists them), a run, checkpoint or model "
            "directory, a built-in model (`roll models`) or a hub id (org/name).",
        )
    recent = [r.id for r in list_runs(runs_dir)[:5]]
    listing = f" Recent runs: {', '.join(recent)}." if recent else ""
    raise UsageError(
        f"{spec!r} is not a run in {Path(runs_dir).resolve()} nor a model directory.{listing}",
        hint="Give a run id (`roll runs`; `--runs-dir` if runs live elsewhere), a model "
        "directory, builtin:NAME (`roll models`) or a hub id (org/name).",
    )


def _is_hub_id(spec: str) -> bool:
    """``org/name`` whose ``org`` is not a directory here (``runs/typo`` is a path)."""
    if spec.startswith((".", "/", "~")) or spec.count("/") != 1:
        return False
    return not Path(spec.split("/", 1)[0]).exists()


def _from_directory(path: Path, runs_dir: str | Path) -> ResolvedModel:
    if (path / "config.json").is_file():
        return ResolvedModel(path=str(path.resolve()), label=str(path))
    if (path / "meta.json").is_file():
        return _from_run(Run(path))
    for model_dir in (path / "actor_train" / "model", path / "model"):
        if (model_dir / "config.json").is_file():
            run = _run_of_checkpoint(path)
            config = _read_config(run) if run else {}
            return ResolvedModel(str(model_dir.resolve()), label=str(path), run=run, config=config)
    raise ModelError(_no_model_message(path), hint=_NO_MODEL_HINT)


def _from_run(run: Run) -> ResolvedModel:
    config = _read_config(run)
    final = run.dir / "final"
    if (final / "config.json").is_file():
        return ResolvedModel(str(final.resolve()), f"run {run.id} (final)", run, config)
    found = CheckpointManager(run.checkpoints_dir).find_resumable()
    if found is not None:
        model_dir = found.path / "actor_train" / "model"
        if (model_dir / "config.json").is_file():
            label = f"run {run.id} ({found.path.name})"
            return ResolvedModel(str(model_dir.resolve()), label, run, config)
        raise ModelError(_no_model_message(found.path), hint=_NO_MODEL_HINT)
    raise ModelError(
        f"run {run.id} has no final model and no checkpoint yet (status: "
        f"{run.meta().get('status', '?')}).",
        hint="Wait for its first checkpoint, or `roll resume` it; a finished run writes "
        "final/ unless checkpoint.export_final is false.",
    )


def _run_of_checkpoint(ckpt: Path) -> Run | None:
    run_dir = ckpt.resolve().parent.parent  # runs/<id>/checkpoints/step-N
    return Run(run_dir) if (run_dir / "meta.json").is_file() else None


def _read_config(run: Run) -> dict[str, Any]:
    try:
        data = yaml.safe_load(run.config_path.read_text())
    except (OSError, yaml.YAMLError):
        return {}
    return data if isinstance(data, dict) else {}


def _no_model_message(path: Path) -> str:
    where = path / "actor_train" if (path / "actor_train").is_dir() else path
    kinds = [name for sub, name in _SHARDED.items() if (where / sub).exists()]
    if kinds:
        return (
            f"{path} holds {kinds[0]} weights, not a Hugging Face model directory, so it "
            "cannot be loaded for generation."
        )
    return f"{path} is not a model, checkpoint or run directory (no config.json, meta.json or actor_train/model)."


_NO_MODEL_HINT = (
    "Use the run's final/ model (the run id does this), or a checkpoint of a run trained "
    "with the torch backend without LoRA; sharded and adapter checkpoints are exported to "
    "final/ when the run finishes."
)
