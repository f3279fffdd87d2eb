"""`roll eval` and `roll generate`: evaluate a model on a dataset, or talk to it."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from roll_cli.common import Debug, RunsDir, handle_errors

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


@handle_errors
def eval_command(
    model_or_run: ModelOrRun,
    data: Annotated[
        str, typer.Option("--data", help="Dataset file or directory (jsonl/json/csv/parquet).")
    ],
    reward: Annotated[
        str | None,
        typer.Option(
            "--reward",
            help="Reward name (math, format, code, choice, ...) or pkg.module:function "
            "(default: an RLVR run's own rewards, else math).",
        ),
    ] = None,
    n: Annotated[int, typer.Option("--n", help="Samples per prompt (pass@k up to k = n).")] = 1,
    temperature: Annotated[
        float | None,
        typer.Option("--temperature", help="0: greedy (default for --n 1; else 1.0)."),
    ] = None,
    top_p: TopP = 1.0,
    max_new_tokens: MaxNewTokens = None,
    prompt_key: Annotated[
        str | None, typer.Option("--prompt-key", help="Prompt column (default: prompt).")
    ] = None,
    answer_key: Annotated[
        str | None, typer.Option("--answer-key", help="Reference answer column (default: answer).")
    ] = None,
    system: System = None,
    max_rows: Annotated[
        int | None, typer.Option("--max-rows", help="Evaluate the first N rows only.")
    ] = None,
    backend: Backend = "hf",
    seed: Seed = 0,
    batch_size: Annotated[
        int, typer.Option("--batch-size", help="Requests per generate call.")
    ] = 64,
    out_path: Annotated[
        Path | None,
        typer.Option(
            "--out",
            help="Per-row JSONL (default: RUN/eval/DATA.jsonl, or ./eval-MODEL-DATA.jsonl).",
        ),
    ] = None,
    runs_dir: RunsDir = Path("runs"),
    debug: Debug = False,
) -> None:
    """Evaluate a model on a dataset: accuracy, pass@k, mean length; per-row JSONL."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    from roll_core.evaluation import EvalSettings, evaluate

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
