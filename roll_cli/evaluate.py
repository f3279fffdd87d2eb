"""`roll eval` and `roll generate`: evaluate a model on a dataset, or talk to it."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console

from roll_cli.common import Debug, RunsDir, handle_errors

if TYPE_CHECKING:
    from roll_core.evaluation import EvalResult

out = Console(soft_wrap=True, highlight=False)
err = Console(stderr=True, soft_wrap=True, highlight=False)

ModelOrRun = Annotated[
    str,
    typer.Argument(
        help="A run id, a run / checkpoint / model directory, builtin:NAME or a hub id.",
        show_default=False,
    ),
]
Backend = Annotated[str, typer.Option("--backend", help="Infer backend: hf or vllm.")]
MaxNewTokens = Annotated[
    int | None,
    typer.Option(
        "--max-new-tokens", help="Longest answer in tokens (default: the run's, else 64)."
    ),
]
Seed = Annotated[int, typer.Option("--seed", help="Sampling seed.")]
TopP = Annotated[float, typer.Option("--top-p", help="Nucleus sampling mass.")]
System = Annotated[
    str | None,
    typer.Option("--system", help="System prompt (default: the run's data.system_prompt)."),
]


DataArg = Annotated[
    str | None,
    typer.Option("--data", help="Dataset file or directory (jsonl/json/csv/parquet)."),
]

RewardArg = Annotated[
    str | None,
    typer.Option(
        "--reward",
        help="Reward name (math, format, code, choice, ...) or pkg.module:function "
        "(default: an RLVR run's own rewards, else math).",
    ),
]

NArg = Annotated[int, typer.Option("--n", help="Samples per prompt (pass@k up to k = n).")]

TemperatureArg = Annotated[
    float | None,
    typer.Option("--temperature", help="0: greedy (default for --n 1; else 1.0)."),
]

PromptKeyArg = Annotated[
    str | None, typer.Option("--prompt-key", help="Prompt column (default: prompt).")
]

AnswerKeyArg = Annotated[
    str | None, typer.Option("--answer-key", help="Reference answer column (default: answer).")
]

MaxRowsArg = Annotated[
    int | None, typer.Option("--max-rows", help="Evaluate the first N rows only.")
]

BatchSizeArg = Annotated[int, typer.Option("--batch-size", help="Requests per generate call.")]

OutPathArg = Annotated[
    Path | None,
    typer.Option(
        "--out",
        help="Per-row JSONL (default: RUN/eval/DATA.jsonl, or ./eval-MODEL-DATA.jsonl).",
    ),
]

EnvArg = Annotated[
    str | None,
    typer.Option(
        "--env",
        help="Evaluate in an env instead of on a dataset: its episodes played by the model "
        "(e.g. swe; a run's own options of that env and its eval_options by default).",
    ),
]

EnvOptionArg = Annotated[
    list[str] | None,
    typer.Option("--env-option", help="With --env: an env option name=value (repeatable)."),
]

EpisodesArg = Annotated[int, typer.Option("--episodes", help="With --env: episodes to play.")]


@handle_errors
def eval_command(
    model_or_run: ModelOrRun,
    data: DataArg = None,
    reward: RewardArg = None,
    n: NArg = 1,
    temperature: TemperatureArg = None,
    top_p: TopP = 1.0,
    max_new_tokens: MaxNewTokens = None,
    prompt_key: PromptKeyArg = None,
    answer_key: AnswerKeyArg = None,
    system: System = None,
    max_rows: MaxRowsArg = None,
    backend: Backend = "hf",
    seed: Seed = 0,
    batch_size: BatchSizeArg = 64,
    out_path: OutPathArg = None,
    env: EnvArg = None,
    env_option: EnvOptionArg = None,
    episodes: EpisodesArg = 32,
    runs_dir: RunsDir = Path("runs"),
    debug: Debug = False,
) -> None:
    """Evaluate a model on a dataset (accuracy, pass@k, mean length; per-row JSONL) or in an
    env (--env: success rate, return, the env's episode metrics; per-episode JSONL)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    from roll_core.errors import UsageError
    from roll_core.evaluation import EvalSettings, evaluate

    if (data is None) == (env is None):
        raise UsageError(
            "roll eval takes --data DATASET (a dataset with a reward) or --env NAME (episodes "
            "of an env), one of them.",
            hint="e.g. `roll eval RUN --data data/tiny-arith/test.jsonl` or "
            "`roll eval RUN --env swe --env-option split=test`.",
        )
    if env is not None:
        _eval_env(model_or_run, env, env_option or [], episodes, seed, max_new_tokens,
                  temperature, out_path, runs_dir)  # fmt: skip
        return
    assert data is not None

    settings = EvalSettings(
        data=data,
        reward=reward,
        n=n,
        temperature=temperature,
        top_p=top_p,
        max_new_tokens=max_new_tokens,
        prompt_key=prompt_key,
        answer_key=answer_key,
        system_prompt=system,
        max_rows=max_rows,
        backend=backend,
        seed=seed,
        batch_size=batch_size,
        out=str(out_path) if out_path else None,
    )
    columns = ("samples", BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=err, transient=True, disable=not err.is_terminal) as bar:
        task = bar.add_task("samples", total=None)
        result = evaluate(
            model_or_run,
            settings,
            runs_dir=runs_dir,
            progress=lambda done, total: bar.update(task, completed=done, total=total),
        )
    _print_eval_result(result)


def _print_eval_result(result: EvalResult) -> None:
    """The metrics line, reward warnings and where the per-row results were written."""
    s, m = result.settings, result.metrics
    sampling = "greedy" if s.temperature == 0 else f"n={s.n}, temperature={s.temperature:g}"
    out.print(f"model: {result.model.label}  data: {s.data} ({int(m['prompts'])} rows, {sampling})")
    shown = [k for k in ("accuracy", *sorted(k for k in m if k.startswith("pass@")))]
    shown = [k for k in shown if k in m] + ["reward_mean", "response_length_mean"]
    out.print("  ".join(f"{k} {m[k]:.4g}" for k in shown))
    if m.get("reward_errors"):
        err.print(
            f"[yellow]warning:[/yellow] the reward failed on {int(m['reward_errors'])} samples "
            "(scored 0); see reward_errors in the JSONL."
        )
    out.print(f"per-row results: {result.out}")
    out.print(f"summary: {result.summary}")


def _eval_env(
    model_or_run: str,
    env: str,
    options: list[str],
    episodes: int,
    seed: int,
    max_new_tokens: int | None,
    temperature: float | None,
    out_path: Path | None,
    runs_dir: Path,
) -> None:
    from roll_core.envs.registry import parse_option_args
    from roll_core.evaluation.envs import evaluate_env

    result = evaluate_env(
        model_or_run,
        env,
        parse_option_args(options),
        episodes=episodes,
        seed=seed or None,
        max_new_tokens=max_new_tokens,
        temperature=temperature or 0.0,
        out=str(out_path) if out_path else None,
        runs_dir=runs_dir,
        progress=lambda done, total: err.print(f"episode {done}/{total}", style="dim"),
    )
    m = result.metrics
    out.print(f"model: {result.model.label}  env: {env} {result.options}")
    shown = ["episodes", "success_rate", "mean_return", "mean_length", "invalid_action_rate"]
    shown += [k for k in m if k.startswith("env/")]
    out.print("  ".join(f"{k} {m[k]:.4g}" for k in shown if k in m))
    out.print(f"per-episode results: {result.out} (roll debug-env {env} --replay FILE)")
    out.print(f"summary: {result.summary}")


@handle_errors
def generate_command(
    model_or_run: ModelOrRun,
    prompt: Annotated[
        str | None,
        typer.Argument(
            help="One prompt; without it, chat (one turn per line).", show_default=False
        ),
    ] = None,
    max_new_tokens: MaxNewTokens = None,
    temperature: Annotated[
        float, typer.Option("--temperature", help="0: greedy (the default).")
    ] = 0.0,
    top_p: TopP = 1.0,
    seed: Seed = 0,
    system: System = None,
    backend: Backend = "hf",
    runs_dir: RunsDir = Path("runs"),
    debug: Debug = False,
) -> None:
    """Answer one prompt, or chat (history kept, rendered with the chat template)."""
    from roll_core.evaluation import GenerateSettings, Generator

    settings = GenerateSettings(
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_p=top_p,
        seed=seed,
        backend=backend,
        system_prompt=system,
    )
    generator = Generator.load(model_or_run, settings, runs_dir=runs_dir)
    try:
        if prompt is not None:
            sys.stdout.write(generator.complete(prompt) + "\n")
        else:
            _chat(generator)
    finally:
        generator.close()


def _chat(generator: object) -> None:
    from roll_core.evaluation import Generator

    assert isinstance(generator, Generator)
    chat = generator.chat()
    tty = sys.stdin.isatty()
    if tty:
        err.print(
            f"chat with {generator.model.label} (greedy unless --temperature): "
            "/reset forgets the conversation, /exit or Ctrl-D ends."
        )
    while True:
        try:
            line = input("you> ") if tty else sys.stdin.readline()
        except (EOFError, KeyboardInterrupt):
            break
        if not tty and not line:
            break  # end of piped input
        text = line.strip()
        if not text:
            continue
        if text in ("/exit", "/quit"):
            break
        if text == "/reset":
            chat.reset()
            err.print("[dim](conversation cleared)[/dim]")
            continue
        reply = chat.say(text)
        sys.stdout.write((f"model> {reply}" if tty else reply) + "\n")
        sys.stdout.flush()
    if tty:
        err.print()
