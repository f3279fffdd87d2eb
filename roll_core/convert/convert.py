"""``roll convert``: Megatron-core <-> Hugging Face, tensor by tensor.

:func:`mcore_to_hf` reads a Megatron checkpoint (legacy or torch_dist, any TP/PP size), merges
each parameter over tensor-parallel ranks, maps it to its Hugging Face tensors and writes
safetensors shards, a ``config.json`` and (optionally) the tokenizer. :func:`hf_to_mcore` goes
the other way for a given TP/PP size and layout. Both write into a temporary directory next to
DST and rename it when complete, so an interrupted conversion leaves no half-written model.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from roll_core.convert.archs import (
    EXTRA_STATES,
    GLOBAL_KEYS,
    HF_LAYER_PREFIX,
    LAYER_KEYS,
    SHAPE_FIELDS,
    TRANSFORMER_IMPLS,
    ArchSpec,
    ExtraState,
    KeyMap,
    ModelDims,
    args_from_dims,
    check_dims,
    detect_arch,
    dims_from_args,
    dims_from_hf_config,
    get_arch,
    hf_config_from_dims,
    key_applies,
    mcore_shape,
)
from roll_core.convert.hf import HFReader, HFWriter, copy_tokenizer
from roll_core.convert.megatron import (
    ParamSpec,
    open_checkpoint,
    write_latest,
    write_legacy,
    write_torch_dist,
)
from roll_core.convert.roll_megatron import (
    VOCAB_DIVISIBLE_BY,
    RollReader,
    rank_files_dir,
    refuse_options,
)
from roll_core.convert.safe_load import load_torch_file
from roll_core.convert.staging import check_dst, io_errors, publish, staging
from roll_core.convert.tensors import (
    gate_up_from_mcore,
    gate_up_to_mcore,
    pad_vocab,
    padded_vocab_size,
    qkv_from_mcore,
    qkv_to_mcore,
    rotary_halves_from_interleaved,
    unpad_vocab,
)
from roll_core.errors import CheckpointError, UsageError

DTYPES = ("auto", "float32", "bfloat16", "float16")
FORMATS = ("torch_dist", "legacy")
#: ``progress(done, total, label)`` after each tensor.
ProgressFn = Callable[[int, int, str], None]


@dataclass
class ConvertResult:
    """What a conversion wrote."""

    dst: Path
    arch: str
    layout: str
    tp: int
    pp: int
    num_layers: int
    num_tensors: int
    num_params: int
    dtype: str
    files: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    ep: int = 1
    """Expert-parallel size (1 for dense models)."""


# -- per-key transforms (the ``kind`` of a KeyMap) -------------------------------------------


def to_hf(key: KeyMap, t: torch.Tensor, dims: ModelDims) -> list[torch.Tensor]:
    """The HF tensors (in ``key.hf`` order) of global Megatron tensor ``t``."""
    if key.kind == "qkv":
        q, k, v = qkv_from_mcore(
            t, num_heads=dims.num_heads, num_kv_heads=dims.num_kv_heads, head_dim=dims.head_dim
        )
        if dims.rotary_interleaved:
            q, k = (rotary_halves_from_interleaved(x, head_dim=dims.head_dim) for x in (q, k))
        return [q, k, v]
    if key.kind == "head" and dims.rotary_interleaved:
        return [rotary_halves_from_interleaved(t, head_dim=dims.head_dim)]
    if key.kind == "gate_up":
        return list(gate_up_from_mcore(t))
    if key.kind == "vocab":
        return [unpad_vocab(t, dims.vocab_size)]
    return [t]


def to_mcore(key: KeyMap, hf: list[torch.Tensor], dims: ModelDims) -> torch.Tensor:
    """The global Megatron tensor made of HF tensors ``hf`` (inverse of :func:`to_hf`)."""
    if key.kind == "qkv":
        q, k, v = hf
        return qkv_to_mcore(
            q,
            k,
            v,
            num_heads=dims.num_heads,
            num_kv_heads=dims.num_kv_heads,
            head_dim=dims.head_dim,
        )
    if key.kind == "gate_up":
        return gate_up_to_mcore(*hf)
    if key.kind == "vocab":
        return pad_vocab(hf[0], dims.padded_vocab_size)
    return hf[0]


#: One step of a conversion: a parameter, its layer and its expert (None where not per-...).
Step = tuple[KeyMap, "int | None", "int | None"]


def plan(dims: ModelDims) -> list[Step]:
    """Every (parameter, layer, expert) of a model of shape ``dims``, in Megatron's order."""
    globals_ = [k for k in GLOBAL_KEYS if key_applies(k, dims)]
    layer_keys = [k for k in LAYER_KEYS if key_applies(k, dims)]
    out: list[Step] = [(k, None, None) for k in globals_ if k.mcore.startswith("embedding.")]
    for i in range(dims.num_layers):
        for k in layer_keys:
            out += [(k, i, e) for e in range(dims.num_experts)] if k.per_expert else [(k, i, None)]
    out += [(k, None, None) for k in globals_ if not k.mcore.startswith("embedding.")]
    return out


def extra_states(dims: ModelDims, transformer_impl: str) -> list[ExtraState]:
    """The modules with ``_extra_state`` in a model of shape ``dims`` and this implementation."""
    return [x for x in EXTRA_STATES if transformer_impl in x.impls and key_applies(x, dims)]


def hf_names(key: KeyMap, layer: int | None, expert: int | None = None) -> list[str]:
    """The HF tensor names of ``key`` (of ``layer``, ``expert``)."""
    prefix = "" if layer is None else HF_LAYER_PREFIX.format(i=layer)
    return [prefix + (n.format(e=expert) if expert is not None else n) for n in key.hf]


def _label(key: KeyMap, layer: int | None, expert: int | None) -> str:
    where = "" if layer is None else f"layer {layer} "
    return where + key.mcore + ("" if expert is None else f" expert {expert}")


# -- dtypes ----------------------------------------------------------------------------------


def _resolve_dtype(dtype: str) -> torch.dtype | None:
    """The output dtype (None for ``auto``: every tensor keeps its own)."""
    if dtype not in DTYPES:
        raise UsageError(
            f"--dtype {dtype!r} is not one of {', '.join(DTYPES)}.", hint="Pick one of those."
        )
    return None if dtype == "auto" else getattr(torch, dtype)


def _cast(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    return t if dtype is None else t.to(dtype)


def _dtypes_written(main: torch.dtype, seen: set[torch.dtype]) -> str:
    """``bfloat16``, or ``bfloat16 (also float32)`` for a mixed-precision model."""
    others = sorted(_dtype_name(d) for d in seen - {main})
    return _dtype_name(main) + (f" (also {', '.join(others)})" if others else "")


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# -- Megatron -> HF --------------------------------------------------------------------------


def mcore_to_hf(
    src: Path,
    dst: Path,
    *,
    arch: str | None = None,
    hf_config: Path | None = None,
    tokenizer: Path | None = None,
    dtype: str = "auto",
    vocab_size: int | None = None,
    max_shard_bytes: int = 5 * 2**30,
    overwrite: bool = False,
    progress: ProgressFn | None = None,
) -> ConvertResult:
    """Convert the Megatron checkpoint ``src`` (either layout) into a HF model directory ``dst``.

    ``arch`` overrides the architecture detected from the checkpoint's args; ``hf_config`` is a
    ``config.json`` to use instead of the one derived from the args (its shape must match);
    the real vocabulary size comes from ``vocab_size``, else ``hf_config``, else the args
    (``vocab_size``), else the padded size is kept (and a note says so).
    """
    out_dtype = _resolve_dtype(dtype)
    if vocab_size is not None and vocab_size < 1:
        raise UsageError(
            f"--vocab-size {vocab_size} is not a vocabulary size.",
            hint="Pass the tokenizer's vocabulary size (a positive number), or leave it out to "
            "use the one in the checkpoint's args.",
        )
    check_dst(src, dst, overwrite)
    with io_errors(f"reading {src}"):
        reader = _open_reader(src, arch)
    user_config = _read_json(hf_config) if hf_config is not None else None
    if user_config is None:  # roll's checkpoints record the model's config.json
        user_config = getattr(reader, "hf_config", None)
    if vocab_size is None and user_config is not None:
        vocab_size = user_config.get("vocab_size")
    dims, spec = _checkpoint_dims(reader, vocab_size, arch, user_config, hf_config)
    notes = []
    if dims.vocab_size == dims.padded_vocab_size and not (
        vocab_size or reader.args.get("vocab_size")
    ):
        notes.append(
            f"the real vocabulary size is unknown, so the padded size {dims.padded_vocab_size} was "
            "kept; pass --vocab-size or --hf-config to drop the padding."
        )
    if isinstance(reader, RollReader) and tokenizer is None:
        notes.append(
            "roll's checkpoints hold no tokenizer: pass --tokenizer (the run's model or final/ "
            "directory) to copy it."
        )
    steps = plan(dims)
    with staging(dst) as tmp, io_errors(f"converting {src} into {dst}"):
        main_dtype = out_dtype or reader.read("embedding.word_embeddings.weight").dtype
        writer = HFWriter(tmp, max_shard_bytes)
        n_params, seen = 0, set()
        for done, (key, layer, expert) in enumerate(steps, 1):
            t = reader.read(key.mcore, layer, expert)
            _check_shape(key, layer, expert, t, dims)
            for hf_name, ht in zip(hf_names(key, layer, expert), to_hf(key, t, dims), strict=True):
                writer.add(hf_name, _cast(ht, out_dtype))
                n_params += ht.numel()
            seen.add(_cast(t, out_dtype).dtype)
            if progress is not None:
                progress(done, len(steps), _label(key, layer, expert))
        files = writer.close()
        config = (
            dict(user_config)
            if user_config is not None
            else hf_config_from_dims(spec, dims, _dtype_name(main_dtype), _token_ids(tokenizer))
        )
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        files.append("config.json")
        if tokenizer is not None:
            files += copy_tokenizer(tokenizer, tmp)
        publish(tmp, dst)
    return ConvertResult(
        dst, spec.name, reader.layout, reader.tp, reader.pp, dims.num_layers,
        sum(len(k.hf) for k, _, _ in steps), n_params, _dtypes_written(main_dtype, seen), files,
        notes, reader.ep,
    )  # fmt: skip


def _open_reader(src: Path, arch: str | None) -> Any:
    """A Megatron-LM checkpoint reader, or :class:`RollReader` where SRC is (or leads to) the
    per-rank files of roll's `megatron` train backend."""
    roll_dir = rank_files_dir(src) if src.is_dir() else None
    if roll_dir is None:
        return open_checkpoint(src)
    refuse_options(arch)
    return RollReader(roll_dir, load_torch_file, _roll_dims)


def _roll_dims(config: dict[str, Any], tp: int) -> ModelDims:
    """The shape of the model a roll megatron run trained (its config.json, padded as the
    backend pads the vocabulary for ``tp``)."""
    spec = get_arch(str(config.get("model_type", "<missing model_type>")))
    vocab = int(config.get("vocab_size") or 0)
    dims = dims_from_hf_config(spec, config, padded_vocab_size(vocab, VOCAB_DIVISIBLE_BY, tp))
    check_dims(spec, dims)
    return dims


def _checkpoint_dims(
    reader: Any,
    vocab_size: int | None,
    arch: str | None,
    user_config: dict[str, Any] | None,
    hf_config: Path | None,
) -> tuple[ModelDims, ArchSpec]:
    """The checkpoint's shape and architecture, checked against its weights and --hf-config."""
    dims = dims_from_args(reader.args, vocab_size=vocab_size)
    if not 0 < dims.vocab_size <= dims.padded_vocab_size:
        raise UsageError(
            f"vocabulary size {dims.vocab_size} does not fit the checkpoint's "
            f"{dims.padded_vocab_size} embedding rows.",
            hint="Pass the real vocabulary size with --vocab-size (at most the padded size).",
        )
    name = arch or (user_config or {}).get("model_type")
    spec = get_arch(name) if name else detect_arch(dims)
    check_dims(spec, dims)
    if user_config is not None:
        _check_same_shape(
            dims, dims_from_hf_config(spec, user_config, dims.padded_vocab_size), hf_config
        )
    if reader.num_layers != dims.num_layers:
        raise CheckpointError(
            f"the checkpoint holds {reader.num_layers} layers; its args say {dims.num_layers}.",
            hint="The checkpoint is incomplete or its args belong to another run.",
        )
    return dims, spec


def _token_ids(tokenizer: Path | None) -> dict[str, int | None]:
    """bos/eos/pad token ids of the tokenizer in directory ``tokenizer`` (empty without one)."""
    if tokenizer is None or not tokenizer.is_dir():
        return {}
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(tokenizer))
    except (OSError, ValueError) as e:
        raise UsageError(
            f"--tokenizer {tokenizer} cannot be loaded: {e}",
            hint="Pass a directory written by tokenizer.save_pretrained.",
        ) from e
    return {
        "bos_token_id": tok.bos_token_id,
        "eos_token_id": tok.eos_token_id,
        "pad_token_id": tok.pad_token_id,
    }


def _read_json(path: Path) -> dict[str, Any]:
    f = path / "config.json" if path.is_dir() else path
    try:
        data = json.loads(f.read_text())
    except FileNotFoundError as e:
        raise UsageError(
            f"--hf-config {f} does not exist.", hint="Pass a config.json file or its directory."
        ) from e
    except json.JSONDecodeError as e:
        raise UsageError(f"--hf-config {f} is not valid JSON: {e}.", hint="Fix the file.") from e
    if not isinstance(data, dict):
        raise UsageError(f"--hf-config {f} is not a JSON object.", hint="Pass a config.json.")
    return data


def _check_same_shape(from_args: ModelDims, from_config: ModelDims, path: Path | None) -> None:
    diff = [
        f"{f}: checkpoint {getattr(from_args, f)} vs config {getattr(from_config, f)}"
        for f in SHAPE_FIELDS
        if getattr(from_args, f) != getattr(from_config, f)
    ]
    if diff:
        raise UsageError(
            f"--hf-config {path} does not describe this checkpoint: " + "; ".join(diff) + ".",
            hint="Pass the config of the model the checkpoint was trained from, or leave "
            "--hf-config out to derive one from the checkpoint.",
        )


def _check_shape(
    key: KeyMap, layer: int | None, expert: int | None, t: torch.Tensor, dims: ModelDims
) -> None:
    want = mcore_shape(key.mcore, dims)
    if tuple(t.shape) != want:
        raise CheckpointError(
            f"{_label(key, layer, expert)} has shape {tuple(t.shape)}; the checkpoint's args "
            f"describe {want}.",
            hint="The args stored in the checkpoint do not match its weights; pass --hf-config "
            "with the model's real config.",
        )


# -- HF -> Megatron --------------------------------------------------------------------------


def hf_to_mcore(
    src: Path,
    dst: Path,
    *,
    tp: int = 1,
    pp: int = 1,
    ep: int = 1,
    fmt: str = "torch_dist",
    transformer_impl: str = "transformer_engine",
    dtype: str = "auto",
    make_vocab_size_divisible_by: int = 128,
    overwrite: bool = False,
    progress: ProgressFn | None = None,
) -> ConvertResult:
    """Convert the HF model directory ``src`` into a Megatron checkpoint ``dst``.

    ``ep`` (expert-parallel size, MoE models only) splits the experts over ``ep`` legacy files
    per (TP rank, stage); ``torch_dist`` only records it. ``fmt`` is ``torch_dist`` or ``legacy``; ``transformer_impl`` (``transformer_engine`` or
    ``local``) picks the legacy layer-norm names and the ``_extra_state`` entries Megatron's
    strict loader expects. The checkpoint is a ``release`` checkpoint (weights and args only):
    load it in Megatron-LM with ``--finetune`` or ``--no-load-optim --no-load-rng``.
    """
    _check_options(fmt, transformer_impl, (tp, pp, ep, make_vocab_size_divisible_by))
    out_dtype = _resolve_dtype(dtype)
    resolved = _hf_source(src)
    check_dst(resolved, dst, overwrite)
    with io_errors(f"reading {src}"):
        reader = HFReader(resolved)
    spec = get_arch(str(reader.config.get("model_type", "<missing model_type>")))
    vocab = int(reader.config.get("vocab_size") or 0)
    dims = dims_from_hf_config(
        spec, reader.config, padded_vocab_size(vocab, make_vocab_size_divisible_by, tp)
    )
    check_dims(spec, dims)
    _check_parallel(dims, tp, pp, ep)
    steps = plan(dims)
    main_dtype, params = _param_specs(src, reader, dims, steps, out_dtype)
    args = args_from_dims(
        dims, tp=tp, pp=pp, transformer_impl=transformer_impl, dtype=_dtype_name(main_dtype),
        divisible_by=make_vocab_size_divisible_by, ep=ep,
    )  # fmt: skip
    produce = _producer(reader, dims, {k.mcore: k for k, _, _ in steps})
    on_tensor = _tensor_counter(len(params), progress)
    with staging(dst) as tmp, io_errors(f"converting {src} into {dst}"):
        it_dir = tmp / "release"
        extras = extra_states(dims, transformer_impl)
        if fmt == "legacy":
            write_legacy(
                it_dir, params, produce, args=args, tp=tp, pp=pp, ep=ep,
                transformer_impl=transformer_impl, tied=dims.tied_embeddings,
                extra_states=extras, on_tensor=on_tensor,
            )  # fmt: skip
        else:
            write_torch_dist(
                it_dir, params, produce, args=args, dtype=main_dtype,
                transformer_impl=transformer_impl, extra_states=extras, on_tensor=on_tensor,
            )  # fmt: skip
        write_latest(tmp)
        files = sorted(str(p.relative_to(tmp)) for p in tmp.rglob("*") if p.is_file())
        publish(tmp, dst)
    notes = _padding_notes(dims)
    return ConvertResult(
        dst, spec.name, fmt, tp, pp, dims.num_layers, len(params),
        sum(int(torch.Size(p.shape).numel()) for p in params),
        _dtypes_written(main_dtype, {p.dtype for p in params if p.dtype}), files, notes, ep,
    )  # fmt: skip


def _param_specs(
    src: Path, reader: HFReader, dims: ModelDims, steps: list[Step], out_dtype: torch.dtype | None
) -> tuple[torch.dtype, list[ParamSpec]]:
    """The checkpoint's main dtype and one :class:`ParamSpec` per tensor to write (Megatron
    name, layer, shape, expert, dtype), in the order of ``steps``."""
    with io_errors(f"reading {src}"):
        main_dtype = out_dtype or reader.dtype_of("model.embed_tokens.weight")
        params = [
            ParamSpec(
                k.mcore,
                layer,
                mcore_shape(k.mcore, dims),
                e,
                out_dtype or reader.dtype_of(hf_names(k, layer, e)[0]),
            )  # fmt: skip
            for k, layer, e in steps
        ]
    return main_dtype, params


def _tensor_counter(total: int, progress: ProgressFn | None) -> Callable[[str], None]:
    """A callback counting the tensors written, reporting each to ``progress``."""
    done = 0

    def on_tensor(label: str) -> None:
        nonlocal done
        done += 1
        if progress is not None:
            progress(done, total, label)

    return on_tensor


def _padding_notes(dims: ModelDims) -> list[str]:
    """What the user should know about the vocabulary padding (nothing when unpadded)."""
    notes = []
    if dims.padded_vocab_size != dims.vocab_size:
        notes.append(
            f"vocabulary padded from {dims.vocab_size} to {dims.padded_vocab_size} rows (zeros); "
            "mcore2hf removes the padding again."
        )
    return notes


def _check_options(fmt: str, transformer_impl: str, sizes: tuple[int, ...]) -> None:
    if fmt not in FORMATS:
        raise UsageError(
            f"--format {fmt!r} is not one of {', '.join(FORMATS)}.", hint="Pick one of those."
        )
    if transformer_impl not in TRANSFORMER_IMPLS:
        raise UsageError(
            f"--transformer-impl {transformer_impl!r} is not one of {', '.join(TRANSFORMER_IMPLS)}.",
            hint="Pick the one the Megatron run uses (Megatron-LM's default is transformer_engine).",
        )
    if min(sizes) < 1:
        raise UsageError(
            "--tp, --pp, --ep and --make-vocab-size-divisible-by must be at least 1.",
            hint="Pass positive sizes.",
        )


def _hf_source(src: Path) -> Path:
    """The local directory of HF model ``src`` (``builtin:NAME`` materialised)."""
    from roll_core.models import resolve_model_path

    resolved = Path(resolve_model_path(str(src)))
    if not resolved.is_dir():
        raise UsageError(
            f"{src} is not a directory.",
            hint="Pass a local Hugging Face model directory (convert does not download hub ids) "
            "or builtin:NAME.",
        )
    return resolved


def _producer(reader: HFReader, dims: ModelDims, keys: dict[str, KeyMap]) -> Any:
    """``produce(name, layer, expert)``: the global Megatron tensor made of HF tensors."""

    def produce(name: str, layer: int | None, expert: int | None) -> torch.Tensor:
        key = keys[name]
        names = hf_names(key, layer, expert)
        hf = [reader.get(n) for n in names]
        if key.kind == "vocab" and hf[0].shape[0] != dims.vocab_size:
            raise CheckpointError(
                f"{names[0]} has {hf[0].shape[0]} rows; config.json says "
                f"vocab_size {dims.vocab_size}.",
                hint="The weights do not match config.json.",
            )
        t = to_mcore(key, hf, dims)
        _check_hf_shape(key, names, t, dims)
        return t

    return produce


def _check_parallel(dims: ModelDims, tp: int, pp: int, ep: int) -> None:
    if ep > 1 and not dims.moe:
        raise UsageError(
            f"--ep {ep}: expert parallelism needs a mixture-of-experts model; this one is dense.",
            hint="Leave out --ep (or pass --ep 1).",
        )
    sizes = [
        ("num_hidden_layers", dims.num_layers, "--pp", pp),
        ("num_attention_heads", dims.num_heads, "--tp", tp),
        ("num_key_value_heads", dims.num_kv_heads, "--tp", tp),
        ("intermediate_size", dims.ffn_hidden_size, "--tp", tp),
    ]
    if dims.moe:
        sizes += [
            ("num_experts", dims.num_experts, "--ep", ep),
            ("moe_intermediate_size", dims.moe_ffn_hidden_size, "--tp", tp),
        ]
    if dims.shared_experts:
        sizes.append(
            ("shared_expert_intermediate_size", dims.moe_shared_ffn_hidden_size, "--tp", tp)
        )
    problems = [
        f"{what} {n} is not divisible by {flag} {size}" for what, n, flag, size in sizes if n % size
    ]
    if problems:
        raise UsageError(
            "cannot split the model: " + "; ".join(problems) + ".",
            hint="Choose --tp, --pp and --ep that divide those sizes.",
        )


def _check_hf_shape(key: KeyMap, names: list[str], t: torch.Tensor, dims: ModelDims) -> None:
    want = mcore_shape(key.mcore, dims)
    if tuple(t.shape) != want:
        raise CheckpointError(
            f"{', '.join(names)} make a tensor of shape {tuple(t.shape)}; config.json "
            f"describes {want}.",
            hint="The weights do not match config.json.",
        )


def describe(result: ConvertResult) -> dict[str, Any]:
    """The result as a plain dict (for printing)."""
    return dataclasses.asdict(result)


__all__ = ["ArchSpec", "ConvertResult", "describe", "hf_to_mcore", "mcore_to_hf", "plan"]
