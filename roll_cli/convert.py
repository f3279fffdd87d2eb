"""`roll convert`: Megatron-core <-> Hugging Face checkpoints (calls roll_core.convert)."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console

from roll_cli.common import handle_errors

convert_app = typer.Typer(
    help="Convert checkpoints between Megatron-core (legacy or torch_dist, any TP/PP/EP) and "
    "Hugging Face safetensors. No GPU or Megatron install needed.",
    no_args_is_help=True,
)

out = Console()
err = Console(stderr=True)

Debug = Annotated[bool, typer.Option("--debug", help="Show tracebacks for errors.")]
Overwrite = Annotated[
    bool, typer.Option("--overwrite", help="Replace DST if it is not empty (written atomically).")
]
Dtype = Annotated[
    str,
    typer.Option(
        "--dtype",
        help="Output dtype: auto (each tensor keeps its own), float32, bfloat16, float16.",
    ),
]


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}


def parse_size(text: str) -> int:
    """``5GB`` -> 5_000_000_000, ``512MiB`` -> 536_870_912, ``1000`` -> 1000 (bytes)."""
    from roll_core.errors import UsageError

    m = _SIZE.match(text)
    if not m:
        raise UsageError(
            f"--max-shard-size {text!r} is not a size.", hint="Write it like 5GB, 500MB or 2GiB."
        )
    unit = (m.group(2) or "").lower().removesuffix("b")
    base = 1024 ** ("kmgt".index(unit[0]) + 1) if unit.endswith("i") else _UNITS[unit]
    size = int(float(m.group(1)) * base)
    if size <= 0:
        raise UsageError("--max-shard-size must be positive.", hint="Write it like 5GB.")
    return size


@contextmanager
def _progress(label: str) -> Iterator[Callable[[int, int, str], None]]:
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
    )

    if not err.is_terminal:  # a log file gets the summary only
        yield lambda done, total, item: None
        return
    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("[dim]{task.fields[item]}"),
        console=err,
        transient=True,
    ) as bar:
        task = bar.add_task(label, total=None, item="")

        def update(done: int, total: int, item: str) -> None:
            bar.update(task, completed=done, total=total, item=item)

        yield update


def _sizes(result: Any) -> str:
    """``tp=2, pp=2`` (and ``, ep=2`` for expert-parallel checkpoints)."""
    return f"tp={result.tp}, pp={result.pp}" + (f", ep={result.ep}" if result.ep > 1 else "")


def _report(result: Any, what: str) -> None:
    out.print(
        f"[green]converted[/green] {what}: {result.arch}, {result.num_layers} layers, "
        f"{result.num_tensors} tensors, {result.num_params:,} parameters, {result.dtype}"
    )
    shown = result.files if len(result.files) <= 8 else [*result.files[:7], "..."]
    out.print(f"wrote {result.dst}: " + ", ".join(shown), highlight=False)
    for note in result.notes:
        out.print(f"[yellow]note:[/yellow] {note}", highlight=False)


@convert_app.command("mcore2hf")
@handle_errors
def mcore2hf(
    src: Annotated[
        Path,
        typer.Argument(
            help="Megatron checkpoint: the root (with latest_checkpointed_iteration.txt) or one "
            "iter_XXXXXXX directory; legacy or torch_dist layout. Or a roll run's megatron "
            "checkpoint (checkpoints/step-N, its actor_train/, checkpoints/ or the run "
            "directory: megatron-rank*.pt files).",
            show_default=False,
        ),
    ],
    dst: Annotated[Path, typer.Argument(help="New Hugging Face model directory.")],
    arch: Annotated[
        str | None,
        typer.Option(
            "--arch",
            help="Architecture (llama, qwen2, qwen3, qwen3_moe, qwen2_moe); default: detected.",
        ),
    ] = None,
    hf_config: Annotated[
        Path | None,
        typer.Option("--hf-config", help="config.json (or its directory) to use as is."),
    ] = None,
    tokenizer: Annotated[
        Path | None, typer.Option("--tokenizer", help="Directory whose tokenizer files to copy.")
    ] = None,
    dtype: Dtype = "auto",
    vocab_size: Annotated[
        int | None,
        typer.Option(
            "--vocab-size",
            help="Real vocabulary size, positive (the padding rows above it are dropped).",
        ),
    ] = None,
    max_shard_size: Annotated[
        str, typer.Option("--max-shard-size", help="Largest safetensors file (bounds memory).")
    ] = "5GB",
    overwrite: Overwrite = False,
    debug: Debug = False,
) -> None:
    """Megatron-core checkpoint -> Hugging Face safetensors + config.json."""
    from roll_core.convert import mcore_to_hf

    shard_bytes = parse_size(max_shard_size)
    with _progress("mcore2hf") as progress:
        result = mcore_to_hf(
            src,
            dst,
            arch=arch,
            hf_config=hf_config,
            tokenizer=tokenizer,
            dtype=dtype,
            vocab_size=vocab_size,
            max_shard_bytes=shard_bytes,
            overwrite=overwrite,
            progress=progress,
        )
    _report(result, f"{result.layout} checkpoint ({_sizes(result)}) to Hugging Face")


@convert_app.command("hf2mcore")
@handle_errors
def hf2mcore(
    src: Annotated[
        Path,
        typer.Argument(
            help="Hugging Face model directory (safetensors), or builtin:NAME.", show_default=False
        ),
    ],
    dst: Annotated[Path, typer.Argument(help="New Megatron checkpoint directory.")],
    tp: Annotated[int, typer.Option("--tp", help="Tensor-parallel size.")] = 1,
    pp: Annotated[int, typer.Option("--pp", help="Pipeline-parallel size.")] = 1,
    ep: Annotated[
        int, typer.Option("--ep", help="Expert-parallel size (mixture-of-experts models).")
    ] = 1,
    fmt: Annotated[
        str, typer.Option("--format", help="Checkpoint layout: torch_dist or legacy.")
    ] = "torch_dist",
    transformer_impl: Annotated[
        str,
        typer.Option(
            "--transformer-impl",
            help="Layers of the Megatron run: transformer_engine or local (names, extra state).",
        ),
    ] = "transformer_engine",
    dtype: Dtype = "auto",
    make_vocab_size_divisible_by: Annotated[
        int,
        typer.Option(
            "--make-vocab-size-divisible-by", help="Megatron's vocabulary padding multiple (x tp)."
        ),
    ] = 128,
    overwrite: Overwrite = False,
    debug: Debug = False,
) -> None:
    """Hugging Face model -> Megatron-core checkpoint split for --tp x --pp (x --ep)."""
    from roll_core.convert import hf_to_mcore

    with _progress("hf2mcore") as progress:
        result = hf_to_mcore(
            Path(str(src)),
            dst,
            tp=tp,
            pp=pp,
            ep=ep,
            fmt=fmt,
            transformer_impl=transformer_impl,
            dtype=dtype,
            make_vocab_size_divisible_by=make_vocab_size_divisible_by,
            overwrite=overwrite,
            progress=progress,
        )
    _report(result, f"Hugging Face model to {result.layout} ({_sizes(result)})")
