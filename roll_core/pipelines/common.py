"""What every pipeline's driver loop shares: the step counter that resumes, the eval and
checkpoint schedule, tracking, run status, and a clean stop on Ctrl-C.

A pipeline registers each stateful part once (``loop.register("prompts", loader)``: the
prompt stream, the RL state, the reward stage, the rollout source, the roles), calls
``start = loop.begin()``, iterates ``loop.steps(start, max_steps)``, calls
``loop.end_step(step, metrics)`` once per step and ``loop.finish(export=...)`` at the end.
A checkpoint holds every part by name: a part with ``state_dict()`` / ``load_state_dict()``
under its name in trainer_state.json, a part with ``save_checkpoint(dir)`` /
``load_checkpoint(dir)`` (model weights, optimizer state) as files in the checkpoint
directory. Step numbers are 1-based: step N is the state after N optimizer updates, and
checkpoint step-N resumes at step N + 1.
"""

from __future__ import annotations

import contextlib
import json
import signal
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console

from roll_core.config.recipes import Recipe
from roll_core.engine.plan import Plan
from roll_core.errors import CheckpointError, Interrupted, RollError, UsageError
from roll_core.runs import CheckpointManager, Run, atomic_write_text
from roll_core.runs.export import FINAL, export_atomic
from roll_core.tracking import build_tracking
from roll_core.tracking.console import summary_metrics
from roll_core.tracking.jsonl import truncate_after
from roll_core.tracking.progress import Phase, phase
from roll_core.tracking.terminal import make_console

TRAINER_STATE = "trainer_state.json"


class RunInterrupted(Interrupted):
    """The user stopped the run (Ctrl-C / SIGTERM); it can be resumed."""


@dataclass
class RolePlan:
    """One row of the resource plan `--dry-run` prints."""

    role: str
    worker: str
    backend: str
    world_size: int
    device: str
    executor: str
    detail: str = ""


def check_same_data(
    ckpt: Path, state: dict[str, Any], *, size: int, unit: str = "examples"
) -> None:
    """Refuse to resume against training data of another size than the checkpoint's."""
    saved = state.get("train_size", size)
    if saved != size:
        raise CheckpointError(
            f"the training data changed since {ckpt.name}: it had {saved} {unit}, now {size}.",
            hint="Resume with the data the run started with, or start a new run.",
        )


class DriverLoop:
    """Step counter, schedules, tracking and status for one run of one pipeline."""

    def __init__(
        self,
        cfg: Recipe,
        run: Run,
        *,
        plan: Plan,
        resume: bool,
        new_config: str | None = None,
        console: Console | None = None,
    ):
        self.cfg = cfg
        self.plan = plan
        """The run's plan, made once at launch (engine/plan.py): role building reads it."""
        self.new_config = new_config
        self.started = False
        self.run = run
        self.resume = resume
        self.console = console or make_console(stderr=True)
        self.ckpts = CheckpointManager(run.checkpoints_dir, keep_last=cfg.checkpoint.keep_last)
        self.tracking: Any = None
        self._parts: dict[str, tuple[Any, bool]] = {}
        self._data: tuple[int, str] | None = None
        self._stop_requested = False
        self._last_saved = -1
        self._last_evaluated = -1
        self.last_metrics: dict[str, float] = {}
        self._summary: dict[str, float] = dict(run.meta().get("metrics") or {}) if resume else {}
        self._old_handlers: dict[int, Any] = {}

    def console_note(self, message: str) -> None:
        self.console.print(message, style="dim", markup=False, highlight=False, soft_wrap=True)

    def phase(
        self, label: str, total: int | None = None, *, brief: bool = False
    ) -> contextlib.AbstractContextManager[Phase]:
        """``with loop.phase("loading models"):`` shows a phase that is not a training step
        (``brief``: a recurring one, summarised only when it took a second or more)."""
        live = self.tracking.live_progress() if self.tracking is not None else None
        return phase(self.console, label, total=total, progress=live, brief=brief)

    def log_eval(self, step: int, evaluate: Callable[[], dict[str, float]]) -> None:
        """Run an evaluation outside a training step (e.g. before step 1) and log it."""
        with self.phase("evaluating"):
            metrics = evaluate()
        self.log_extra(step, metrics)

    # ---- checkpointed parts --------------------------------------------------------------------
    def register(self, name: str, part: Any, *, required: bool = True) -> None:
        """Save `part` in every checkpoint and restore it on resume, by `name` (module doc).
        `required=False`: a checkpoint without it (written before the part existed) loads."""
        if self.started:
            raise RuntimeError(f"DriverLoop.register({name!r}) after begin()")
        if name in self._parts:
            raise ValueError(f"a checkpoint part named {name!r} is registered already")
        self._parts[name] = (part, required)

    def expect_data(self, size: int, unit: str = "examples") -> None:
        """Record the training data's size in every checkpoint (``train_size``); resuming
        against data of another size is a CheckpointError (the loader's position would
        point elsewhere)."""
        self._data = (size, unit)

    def _save_parts(self, ckpt: Path) -> dict[str, Any]:
        state: dict[str, Any] = {} if self._data is None else {"train_size": self._data[0]}
        for name, (part, _) in self._parts.items():
            if hasattr(part, "save_checkpoint"):
                part.save_checkpoint(ckpt)
            else:
                state[name] = part.state_dict()
        return state

    def _load_parts(self, ckpt: Path, state: dict[str, Any]) -> None:
        if self._data is not None:
            check_same_data(ckpt, state, size=self._data[0], unit=self._data[1])
        for name, (part, required) in self._parts.items():
            if hasattr(part, "load_checkpoint"):
                part.load_checkpoint(ckpt)
            elif name in state:
                part.load_state_dict(state[name])
            elif required:
                raise CheckpointError(
                    f"{ckpt.name} has no saved {name!r} state ({TRAINER_STATE} holds "
                    f"{sorted(state)}): it was written by another pipeline or an older roll.",
                    hint="Resume with the roll version and recipe that wrote it, or start a "
                    "new run.",
                )

    # ---- start / resume ----------------------------------------------------------------------
    def begin(self) -> int:
        """Restore the newest intact checkpoint when resuming (every registered part);
        return the last completed step."""
        start = 0
        if self.resume:
            found = self.ckpts.find_resumable()
            if found is not None:
                for name, reason in found.skipped:
                    self.console.print(
                        f"[yellow]checkpoint {name} is damaged ({reason}); "
                        f"falling back to {found.path.name}.[/yellow]"
                    )
                if found.note:
                    self.console.print(f"[yellow]{found.note}[/yellow]")
                state = json.loads((found.path / TRAINER_STATE).read_text())
                self._load_parts(found.path, state)
                start = found.step
                self._last_saved = start
                if start >= self.cfg.trainer.max_steps:
                    self._check_unfinished(found.path.name, start)
                else:
                    self.console_note(f"resumed from {found.path.name}")
                self.ckpts.prune(keep=found.path)  # a kill may have come before the last prune
            else:
                self.console_note("no checkpoint was saved yet: starting again from step 0")
            if self.new_config is not None:
                atomic_write_text(self.run.config_path, self.new_config)
            self.run.record_resume(
                command=sys.argv, from_step=start, checkpoint=found.path.name if found else None
            )
        truncate_after(self.run.metrics_path, start)
        self._install_signal_handlers()  # before trackers: SwanLab chains to the handler it finds
        self.tracking = build_tracking(
            backends=self.cfg.tracking.backends,
            run_dir=self.run.dir,
            run_name=self.run.id,
            project=self.cfg.tracking.project,
            config=self.cfg.model_dump(mode="json"),
            total_steps=self.cfg.trainer.max_steps,
            start_step=start,
            time_split_every=self.cfg.tracking.time_split_every,
            console=self.console,
        )
        self.started = True
        return start

    def _check_unfinished(self, ckpt: str, start: int) -> None:
        """At max_steps: go on to the final export if the run never finished, else refuse."""
        meta = self.run.meta()
        final = self.run.dir / FINAL
        if meta.get("status") == "finished" and (
            final.is_dir() or not self.cfg.checkpoint.export_final
        ):
            raise UsageError(
                f"run {self.run.id} already reached trainer.max_steps="
                f"{self.cfg.trainer.max_steps} ({ckpt}); nothing to resume.",
                hint=f"To train further: roll resume {self.run.id} "
                f"trainer.max_steps=N (N > {start}).",
            )
        self.last_metrics = dict(meta.get("metrics") or {})
        self.console.print(
            f"[yellow]{ckpt} is the last step (trainer.max_steps={self.cfg.trainer.max_steps}) "
            f"but the run stopped before it finished (status {meta.get('status')!r}, "
            f"final/ {'present' if final.is_dir() else 'missing'}): finishing it from "
            f"{ckpt}.[/yellow]"
        )

    def _install_signal_handlers(self) -> None:
        def request_stop(signum: int, frame: Any) -> None:
            if self._stop_requested:
                raise KeyboardInterrupt
            self._stop_requested = True
            self.console.print(
                "[yellow]stopping after this step and saving a checkpoint "
                "(press Ctrl-C again to stop now)[/yellow]"
            )

        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(ValueError):  # not the main thread: no handlers
                self._old_handlers[sig] = signal.signal(sig, request_stop)

    def _restore_signal_handlers(self) -> None:
        for sig, handler in self._old_handlers.items():
            signal.signal(sig, handler)
        self._old_handlers.clear()

    # ---- the loop ----------------------------------------------------------------------------
    def steps(self, start: int, max_steps: int) -> Iterator[int]:
        for step in range(start + 1, max_steps + 1):
            yield step
            if self._stop_requested and step < max_steps:
                if self._last_saved != step:
                    self.save(step)
                self.close("interrupted")
                raise RunInterrupted(
                    f"run {self.run.id} stopped at step {step} (checkpoint saved).",
                    hint=f"Continue it with: {self.resume_command()}",
                )

    def resume_command(self) -> str:
        """The command that continues this run, as a user would type it."""
        parent = self.run.dir.parent
        flag = "" if parent == Path("runs").absolute() else f" --runs-dir {parent}"
        return f"roll resume {self.run.id}{flag}"

    def _due(self, step: int, every: int | None) -> bool:
        return step == self.cfg.trainer.max_steps or (every is not None and step % every == 0)

    def end_step(
        self,
        step: int,
        metrics: dict[str, float],
        *,
        evaluate: Callable[[int], dict[str, float]] | None = None,
    ) -> None:
        """Evaluate, log and checkpoint as the schedule says for a finished step."""
        if evaluate is not None and self._due(step, self.cfg.eval.every_steps):
            with self.phase("evaluating", brief=True):
                metrics = {**metrics, **evaluate(step)}
            self._last_evaluated = step
        self.last_metrics = metrics
        if (
            step % self.cfg.trainer.log_every_steps == 0
            or step == self.cfg.trainer.max_steps
            or any(k.startswith("eval/") for k in metrics)
        ):
            self.tracking.log(step, metrics)
        else:
            self.tracking.tick(step)
        self._summary.update(summary_metrics(metrics))  # `roll runs` shows the best of them
        self.run.update_meta(step=step, metrics=self._summary)
        if self._due(step, self.cfg.checkpoint.every_steps):
            self.save(step)

    def log_extra(self, step: int, metrics: dict[str, float]) -> None:
        """Log metrics outside a training step (e.g. validation before the first step)."""
        self.tracking.log(step, metrics)

    def save(self, step: int) -> Path:
        def write(tmp: Path) -> None:
            state = self._save_parts(tmp)
            state["step"] = step
            atomic_write_text(tmp / TRAINER_STATE, json.dumps(state, indent=1))

        path = self.ckpts.save(step, write)
        self._last_saved = step
        return path

    def finish(self, *, export: Callable[[Path], Any] | None) -> dict[str, float]:
        if export is not None and self.cfg.checkpoint.export_final:
            final = export_atomic(self.run.dir / FINAL, export)
            self.console_note(f"final model (Hugging Face format): {final}")
        self.close("finished")
        return dict(self.last_metrics)

    def last_checkpoint(self) -> str | None:
        """The newest intact checkpoint's directory name, for failure messages."""
        try:
            found = self.ckpts.find_resumable()
        except (RollError, OSError):
            return None
        return found.path.name if found else None

    def close(self, status: str | None) -> None:
        """Stop trackers and handlers; record `status` (None: leave the run's status alone)."""
        self._restore_signal_handlers()
        if self.tracking is not None:
            tracking, self.tracking = self.tracking, None
            tracking.close()
        if status is not None:
            self.run.update_meta(status=status)

    def close_failed(self, err: BaseException) -> list[str]:
        """Mark the run failed after `err` without raising again (the disk may be full or
        read-only); return what could not be done, for the error message."""
        problems = []
        self._restore_signal_handlers()
        if self.tracking is not None:
            tracking, self.tracking = self.tracking, None
            try:
                tracking.close()
            except Exception as close_err:  # noqa: BLE001 - reported in the message
                problems.append(f"closing the trackers failed too ({close_err})")
        try:
            self.run.update_meta(status="failed", error=f"{type(err).__name__}: {err}"[:2000])
        except Exception as meta_err:  # noqa: BLE001 - reported in the message
            problems.append(f"meta.json could not be marked failed ({meta_err})")
        return problems
