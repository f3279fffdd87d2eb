"""Megatron-core checkpoints on disk: find the layout, read global tensors, write both layouts.

Layouts (under the checkpoint root, next to ``latest_checkpointed_iteration.txt``, in
``iter_XXXXXXX/`` or ``release/``):

* ``legacy``: one ``mp_rank_TT[_PPP]/model_optim_rng.pt`` per tensor-parallel rank ``TT`` and
  pipeline stage ``PPP``; each holds the stage's part of the model (``decoder.layers.<local
  index>.<name>``) and the training ``args``. Files are memory-mapped, so reading one tensor does
  not load the optimizer state stored next to it.
* ``torch_dist``: ``torch.distributed.checkpoint`` files (``*.distcp`` + ``.metadata``), plus
  ``common.pt`` (``args``) and ``metadata.json``. Tensors are stored globally (tensor-parallel
  shards are chunks of one tensor) and the layers stacked (``decoder.layers.<name>`` with a
  leading layer dimension). Read with ``torch.distributed.checkpoint`` one layer at a time, in a
  single process, so neither a GPU nor Megatron is needed.

Readers return *global* tensors under canonical names (see :mod:`roll_core.convert.archs`):
tensor-parallel shards merged, pipeline stages renumbered to global layer ids.
"""

from __future__ import annotations

import argparse
import io
import json
import re
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.distributed import checkpoint as dcp
from torch.distributed.checkpoint import (
    DefaultLoadPlanner,
    FileSystemReader,
    FileSystemWriter,
    LoadPlan,
    SavePlan,
    SavePlanner,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from roll_core.convert.archs import (
    EXTRA_STATE_MODULES,
    GLOBAL_KEYS,
    LAYER_KEYS,
    LOCAL_NAMES,
    MCORE_LAYER_PREFIX,
)
from roll_core.convert.safe_load import load_pickle, load_torch_file, namespace_to_dict
from roll_core.convert.tensors import merge_tp, split_tp
from roll_core.errors import CheckpointError, UsageError

LATEST_FILE = "latest_checkpointed_iteration.txt"
LEGACY_FILE = "model_optim_rng.pt"
RANK_DIR = re.compile(r"^mp_rank_(\d{2})(?:_(\d{3}))?(?:_(\d{3}))?$")
TP_RULE: Mapping[str, str] = {k.mcore: k.tp for k in (*GLOBAL_KEYS, *LAYER_KEYS)}
CHECKPOINT_VERSION = 3.0


def tp_rule(name: str) -> str:
    """The tensor-parallel rule of canonical parameter ``name``."""
    return TP_RULE.get(name, "replicated")


# -- finding the checkpoint ------------------------------------------------------------------


def find_iteration_dir(src: Path) -> Path:
    """The directory that holds one iteration's files (SRC itself or the one ``latest`` names)."""
    if not src.exists():
        raise UsageError(f"{src} does not exist.", hint="Pass a Megatron checkpoint directory.")
    if not src.is_dir():
        raise UsageError(
            f"{src} is a file; a Megatron checkpoint is a directory.",
            hint="Pass the checkpoint root (with latest_checkpointed_iteration.txt) or one "
            "iter_XXXXXXX directory.",
        )
    if _layout_of(src) is not None:
        return src
    latest = src / LATEST_FILE
    if latest.is_file():
        text = latest.read_text().strip()
        name = "release" if text == "release" else f"iter_{int(text):07d}" if text.isdigit() else ""
        if not name or not (src / name).is_dir():
            raise CheckpointError(
                f"{latest} names iteration {text!r}, but {src / (name or text)} does not exist.",
                hint="Pass the iter_XXXXXXX directory you want directly.",
            )
        return src / name
    iters = sorted(
        p for p in src.iterdir() if p.is_dir() and re.match(r"^(iter_\d{7}|release)$", p.name)
    )
    if len(iters) == 1:
        return iters[0]
    found = sorted(p.name + ("/" if p.is_dir() else "") for p in src.iterdir())[:12]
    raise UsageError(
        f"{src} is neither a legacy Megatron checkpoint (mp_rank_*/{LEGACY_FILE}) nor a "
        f"torch_dist one (metadata.json, .metadata, *.distcp, common.pt); it contains: "
        f"{', '.join(found) or 'nothing'}"
        + (f" (iterations: {', '.join(p.name for p in iters)})" if iters else "")
        + ".",
        hint="Pass the checkpoint root (with latest_checkpointed_iteration.txt) or one "
        "iter_XXXXXXX directory.",
    )


def _layout_of(d: Path) -> str | None:
    if (d / "metadata.json").is_file() or (d / ".metadata").is_file():
        return "torch_dist"
    if any(RANK_DIR.match(p.name) for p in d.iterdir() if p.is_dir()):
        return "legacy"
    return None


def open_checkpoint(src: Path) -> LegacyReader | DistReader:
    """A reader for the Megatron checkpoint at ``src`` (either layout)."""
    it_dir = find_iteration_dir(src)
    return DistReader(it_dir) if _layout_of(it_dir) == "torch_dist" else LegacyReader(it_dir)


# -- legacy layout ---------------------------------------------------------------------------


class LegacyReader:
    """Reads ``mp_rank_TT[_PPP]/model_optim_rng.pt`` files (memory-mapped)."""

    layout = "legacy"

    def __init__(self, it_dir: Path) -> None:
        self.dir = it_dir
        ranks: dict[tuple[int, int], Path] = {}
        for p in sorted(it_dir.iterdir()):
            m = RANK_DIR.match(p.name)
            if not (p.is_dir() and m):
                continue
            if m.group(3) is not None:
                raise CheckpointError(
                    f"{p.name} is an expert-parallel shard; Mixture-of-Experts checkpoints are not "
                    "supported yet.",
                    hint="docs/convert.md lists the supported architectures.",
                )
            ranks[(int(m.group(1)), int(m.group(2) or 0))] = p / LEGACY_FILE
        first = next((f for f in ranks.values() if f.is_file()), None)
        if first is None:
            raise CheckpointError(
                f"no {LEGACY_FILE} in any mp_rank_* directory of {it_dir}.",
                hint="The checkpoint is incomplete; copy it again.",
            )
        self.args = namespace_to_dict(load_torch_file(first).get("args"))
        self.tp = int(self.args.get("tensor_model_parallel_size") or 1)
        self.pp = int(self.args.get("pipeline_model_parallel_size") or 1)
        self._check_grid(ranks)
        self.files = ranks
        self.states: dict[tuple[int, int], Mapping[str, Any]] = {}
        for rank, f in sorted(ranks.items()):
            sd = load_torch_file(f)
            args = namespace_to_dict(sd.get("args"))
            sizes = (
                args.get("tensor_model_parallel_size"),
                args.get("pipeline_model_parallel_size"),
            )
            if args and sizes != (self.tp, self.pp):
                raise CheckpointError(
                    f"{f} says tensor/pipeline parallel sizes {sizes}, {first} says "
                    f"{(self.tp, self.pp)}.",
                    hint="The mp_rank_* directories come from different runs; use one run's files.",
                )
            if "model" not in sd:
                keys = ", ".join(sorted(k for k in sd if isinstance(k, str))[:8])
                raise CheckpointError(
                    f"{f} has no 'model' entry (keys: {keys}).",
                    hint="Virtual-pipeline checkpoints (model0, model1, ...) are not supported.",
                )
            self.states[rank] = sd["model"]
        self._index_layers()

    def _check_grid(self, ranks: dict[tuple[int, int], Path]) -> None:
        expected = {(t, p) for t in range(self.tp) for p in range(self.pp)}
        extra = sorted(set(ranks) - expected)
        if extra:
            raise CheckpointError(
                f"{self.dir} has shards for ranks (tp, pp) {extra}, outside the "
                f"tensor/pipeline parallel sizes {self.tp}x{self.pp} its args give.",
                hint="The directory mixes checkpoints of different parallel sizes.",
            )
        missing = [
            str(self.dir / _rank_dir(t, p, self.pp) / LEGACY_FILE)
            for t, p in sorted(expected)
            if not ranks.get((t, p), Path("/nonexistent")).is_file()
        ]
        if missing:
            raise CheckpointError(
                f"{len(missing)} shard file(s) missing for tp={self.tp} pp={self.pp}: "
                + ", ".join(missing),
                hint="Copy the complete checkpoint (every mp_rank_* directory).",
            )

    def _index_layers(self) -> None:
        """Global layer id -> (stage, local id), from the layer keys each stage holds."""
        pat = re.compile(r"^decoder\.layers\.(\d+)\.")
        self.layer_of: list[tuple[int, int]] = []
        for stage in range(self.pp):
            ids = {int(m.group(1)) for k in self.states[(0, stage)] if (m := pat.match(k))}
            if ids and ids != set(range(len(ids))):
                raise CheckpointError(
                    f"pipeline stage {stage} has layers {sorted(ids)}, not 0..{len(ids) - 1}.",
                    hint="The checkpoint is damaged or uses virtual pipeline stages.",
                )
            self.layer_of += [(stage, i) for i in range(len(ids))]
        self.num_layers = len(self.layer_of)
        want = self.args.get("num_layers")
        if want is not None and int(want) != self.num_layers:
            raise CheckpointError(
                f"the pipeline stages hold {self.num_layers} layers; args.num_layers is {want}.",
                hint="Some stages are missing or come from a different run.",
            )
        keys = self.states[(0, 0)]
        self.transformer_impl = (
            "local"
            if any(k.endswith(".input_layernorm.weight") for k in keys)
            else "transformer_engine"
        )

    def has(self, name: str, layer: int | None = None) -> bool:
        """Whether canonical parameter ``name`` (of ``layer``) is stored."""
        return self._key(name, layer)[1] is not None

    def _key(self, name: str, layer: int | None) -> tuple[int, str | None]:
        if layer is None:
            stage = 0 if name.startswith("embedding.") else self.pp - 1
            return stage, name if name in self.states[(0, stage)] else None
        stage, local = self.layer_of[layer]
        sd = self.states[(0, stage)]
        for candidate in (name, LOCAL_NAMES.get(name)):
            key = f"{MCORE_LAYER_PREFIX}{local}.{candidate}"
            if candidate and key in sd:
                return stage, key
        return stage, None

    def read(self, name: str, layer: int | None = None) -> torch.Tensor:
        """The global tensor of canonical parameter ``name`` (merged over TP ranks)."""
        stage, key = self._key(name, layer)
        if key is None:
            where = f"layer {layer}" if layer is not None else f"stage {stage}"
            raise CheckpointError(
                f"parameter {name} ({where}) is not in {self.files[(0, stage)]}.",
                hint="The checkpoint's args do not match its weights (an architecture flag such "
                "as qk_layernorm or add_qkv_bias differs); check the training arguments.",
            )
        shards = [self.states[(t, stage)][key] for t in range(self.tp)]
        return merge_tp(shards, tp_rule(name), name=key)


def _rank_dir(tp_rank: int, pp_rank: int, pp: int) -> str:
    return f"mp_rank_{tp_rank:02d}" + (f"_{pp_rank:03d}" if pp > 1 else "")


# -- torch_dist layout -----------------------------------------------------------------------


class _SafeFileSystemReader(FileSystemReader):
    """FileSystemReader whose metadata is read with the safe unpickler."""

    def __init__(self, path: Path, metadata: Metadata) -> None:
        super().__init__(path)
        self._metadata = metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        return self._metadata


class _ChunkLoadPlanner(DefaultLoadPlanner):
    """Loads a chunk (one layer) of each requested tensor: ``{fqn: (offsets, tensor)}``."""

    def __init__(self, chunks: Mapping[str, tuple[tuple[int, ...], torch.Tensor]]) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.chunks = chunks

    def create_local_plan(self) -> LoadPlan:
        items = []
        for fqn, (offsets, tensor) in self.chunks.items():
            md = self.metadata.state_dict_metadata[fqn]  # type: ignore[union-attr]
            chunk = ChunkStorageMetadata(torch.Size(offsets), tensor.shape)
            items += create_read_items_for_chunk_list(fqn, md, [chunk])  # type: ignore[arg-type]
        return LoadPlan(items)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        return self.chunks[index.fqn][1]


class DistReader:
    """Reads a ``torch_dist`` checkpoint directory with ``torch.distributed.checkpoint``."""

    layout = "torch_dist"

    def __init__(self, it_dir: Path) -> None:
        self.dir = it_dir
        meta_json = it_dir / "metadata.json"
        missing = [
            str(p)
            for p in (meta_json, it_dir / ".metadata", it_dir / "common.pt")
            if not p.is_file()
        ]
        if missing:
            raise CheckpointError(
                "the torch_dist checkpoint is incomplete; missing: " + ", ".join(missing) + ".",
                hint="Copy the complete iteration directory.",
            )
        backend = json.loads(meta_json.read_text()).get("sharded_backend")
        if backend != "torch_dist":
            raise CheckpointError(
                f"{meta_json} names sharded backend {backend!r}; only 'torch_dist' is supported.",
                hint="Re-save the checkpoint with --ckpt-format torch_dist.",
            )
        self.metadata: Metadata = load_pickle(it_dir / ".metadata")
        files = sorted({info.relative_path for info in (self.metadata.storage_data or {}).values()})
        absent = [str(it_dir / f) for f in files if not (it_dir / f).is_file()]
        if absent:
            raise CheckpointError(
                f"{len(absent)} shard file(s) missing: " + ", ".join(absent) + ".",
                hint="Copy the complete iteration directory (every *.distcp file).",
            )
        common = load_torch_file(it_dir / "common.pt")
        self.args = namespace_to_dict(common.get("args") if isinstance(common, dict) else None)
        self.tp = int(self.args.get("tensor_model_parallel_size") or 1)
        self.pp = int(self.args.get("pipeline_model_parallel_size") or 1)
        self.tensors: dict[str, TensorStorageMetadata] = {
            k: v
            for k, v in self.metadata.state_dict_metadata.items()
            if isinstance(v, TensorStorageMetadata)
        }
        layer_sizes = {
            v.size[0] for k, v in self.tensors.items() if k.startswith(MCORE_LAYER_PREFIX)
        }
        if len(layer_sizes) > 1:
            raise CheckpointError(
                f"the stacked layer tensors have different layer counts {sorted(layer_sizes)}.",
                hint="The checkpoint is damaged.",
            )
        self.num_layers = layer_sizes.pop() if layer_sizes else 0
        self.transformer_impl = "transformer_engine"
        self._reader = _SafeFileSystemReader(it_dir, self.metadata)

    def _fqn(self, name: str, layer: int | None) -> str:
        return name if layer is None else MCORE_LAYER_PREFIX + name

    def has(self, name: str, layer: int | None = None) -> bool:
        """Whether canonical parameter ``name`` is stored."""
        return self._fqn(name, layer) in self.tensors

    def read(self, name: str, layer: int | None = None) -> torch.Tensor:
        """The global tensor of ``name`` (one layer of a stacked tensor when ``layer`` is set)."""
        fqn = self._fqn(name, layer)
        md = self.tensors.get(fqn)
        if md is None:
            raise CheckpointError(
                f"parameter {fqn} is not in {self.dir}/.metadata.",
                hint="The checkpoint's args do not match its weights (an architecture flag such "
                "as qk_layernorm or add_qkv_bias differs); check the training arguments.",
            )
        shape = tuple(md.size) if layer is None else (1, *md.size[1:])
        offsets = (0,) * len(shape) if layer is None else (layer,) + (0,) * (len(shape) - 1)
        out = torch.empty(shape, dtype=md.properties.dtype)
        planner = _ChunkLoadPlanner({fqn: (offsets, out)})
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process"
            warnings.simplefilter("ignore", UserWarning)
            dcp.load({fqn: out}, storage_reader=self._reader, planner=planner, no_dist=True)
        return out if layer is None else out[0]


# -- writing ---------------------------------------------------------------------------------

#: ``produce(name, layer)`` -> the global tensor of a canonical parameter.
Producer = Callable[[str, "int | None"], torch.Tensor]


@dataclass(frozen=True)
class ParamSpec:
    """One parameter to write: canonical name, layer (None outside layers), global shape."""

    name: str
    layer: int | None
    shape: tuple[int, ...]


def write_latest(root: Path, text: str = "release") -> None:
    """``latest_checkpointed_iteration.txt`` (``release``: Megatron starts at iteration 0)."""
    (root / LATEST_FILE).write_text(text)


def _common(args: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "args": argparse.Namespace(**args),
        "checkpoint_version": CHECKPOINT_VERSION,
        "iteration": 0,
    }


def write_legacy(
    it_dir: Path,
    params: list[ParamSpec],
    produce: Producer,
    *,
    args: Mapping[str, Any],
    tp: int,
    pp: int,
    transformer_impl: str,
    tied: bool,
    on_tensor: Callable[[str], None] | None = None,
) -> list[Path]:
    """Write one ``mp_rank_TT[_PPP]/model_optim_rng.pt`` per (TP rank, stage).

    Memory holds one rank file at a time: each global tensor is produced again for every TP rank
    and split, so no stage is ever held whole.
    """
    num_layers = int(args["num_layers"])
    per_stage = num_layers // pp
    written = []
    for stage in range(pp):
        first, last = stage == 0, stage == pp - 1
        layers = range(stage * per_stage, (stage + 1) * per_stage)
        for rank in range(tp):
            state: dict[str, Any] = {}
            for p in params:
                if p.layer is None:
                    if p.name.startswith("embedding."):
                        if not first:
                            continue
                    elif not last:
                        continue
                    key = p.name
                elif p.layer in layers:
                    local = p.layer - stage * per_stage
                    name = (
                        LOCAL_NAMES.get(p.name, p.name) if transformer_impl == "local" else p.name
                    )
                    key = f"{MCORE_LAYER_PREFIX}{local}.{name}"
                else:
                    continue
                state[key] = split_tp(produce(p.name, p.layer), tp_rule(p.name), tp, name=key)[rank]
                if rank == tp - 1 and on_tensor is not None:
                    on_tensor(key)
            if last and tied and pp > 1:
                # Megatron keeps a copy of the tied embedding on the last stage.
                emb = produce("embedding.word_embeddings.weight", None)
                state["output_layer.weight"] = split_tp(emb, "vocab", tp)[rank]
            for layer in layers:
                for module in EXTRA_STATE_MODULES[transformer_impl]:
                    state[
                        f"{MCORE_LAYER_PREFIX}{layer - stage * per_stage}.{module}._extra_state"
                    ] = None
            if last and "output_layer.weight" in state:
                state["output_layer._extra_state"] = None
            path = it_dir / _rank_dir(rank, stage, pp) / LEGACY_FILE
            path.parent.mkdir(parents=True, exist_ok=True)
            torch.save({**_common(args), "model": _ordered(state)}, path)
            written.append(path)
    return written


def _ordered(state: dict[str, Any]) -> dict[str, Any]:
    """Keys in Megatron's module order: embedding, layers by id, final norm, output layer."""

    def order(key: str) -> tuple[int, int, str]:
        if key.startswith("embedding."):
            return (0, 0, key)
        m = re.match(r"^decoder\.layers\.(\d+)\.", key)
        if m:
            return (1, int(m.group(1)), "")
        return (2, 0, key)

    return dict(sorted(state.items(), key=lambda kv: order(kv[0])))


class _LazySavePlanner(SavePlanner):
    """Writes chunks produced on demand, so only one tensor is in memory at a time."""

    def __init__(self, items: list[WriteItem], resolve: Callable[[WriteItem], Any]) -> None:
        self.items = items
        self.resolve = resolve

    def set_up_planner(
        self, state_dict: Any, storage_meta: Any = None, is_coordinator: bool = True
    ) -> None:
        pass

    def create_local_plan(self) -> SavePlan:
        return SavePlan(self.items)

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        from torch.distributed.checkpoint.default_planner import create_default_global_save_plan

        return create_default_global_save_plan(all_plans)

    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        return new_plan

    def resolve_data(self, write_item: WriteItem) -> Any:
        return self.resolve(write_item)


def _tensor_item(
    fqn: str,
    offsets: tuple[int, ...],
    sizes: tuple[int, ...],
    size: tuple[int, ...],
    dtype: torch.dtype,
) -> WriteItem:
    return WriteItem(
        index=MetadataIndex(fqn, torch.Size(offsets)),
        type=WriteItemType.SHARD,
        tensor_data=TensorWriteData(
            chunk=ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes)),
            properties=TensorProperties(dtype=dtype),
            size=torch.Size(size),
        ),
    )


def write_torch_dist(
    it_dir: Path,
    params: list[ParamSpec],
    produce: Producer,
    *,
    args: Mapping[str, Any],
    dtype: torch.dtype,
    transformer_impl: str,
    on_tensor: Callable[[str], None] | None = None,
) -> None:
    """Write a ``torch_dist`` checkpoint Megatron-core loads at any TP/PP size.

    Each layer of a stacked tensor is one chunk, produced when the writer reaches it.
    """
    num_layers = int(args["num_layers"])
    items: list[WriteItem] = []
    sources: dict[tuple[str, int | None], ParamSpec] = {}
    for p in params:
        if p.layer is None:
            fqn, offsets, size = p.name, (0,) * len(p.shape), p.shape
        else:
            fqn = MCORE_LAYER_PREFIX + p.name
            offsets, size = (p.layer,) + (0,) * len(p.shape), (num_layers, *p.shape)
        items.append(
            _tensor_item(
                fqn, offsets, (1, *p.shape) if p.layer is not None else p.shape, size, dtype
            )
        )
        sources[(fqn, p.layer)] = p
    for layer in range(num_layers):
        for module in EXTRA_STATE_MODULES[transformer_impl]:
            fqn = f"{MCORE_LAYER_PREFIX}{module}._extra_state/shard_{layer}_{num_layers}"
            items.append(WriteItem(index=MetadataIndex(fqn), type=WriteItemType.BYTE_IO))

    def resolve(item: WriteItem) -> Any:
        fqn = item.index.fqn
        if item.type == WriteItemType.BYTE_IO:
            buf = io.BytesIO()
            torch.save([None], buf)
            buf.seek(0)
            return buf
        layer = None if not fqn.startswith(MCORE_LAYER_PREFIX) else int(item.index.offset[0])  # type: ignore[index]
        p = sources[(fqn, layer)]
        t = produce(p.name, p.layer).to(dtype)
        if on_tensor is not None:
            on_tensor(fqn if layer is None else f"{fqn}[{layer}]")
        return t if layer is None else t.unsqueeze(0)

    it_dir.mkdir(parents=True, exist_ok=True)
    writer = FileSystemWriter(it_dir, single_file_per_rank=True, thread_count=1, sync_files=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(
            {"_": torch.empty(0)},
            storage_writer=writer,
            planner=_LazySavePlanner(items, resolve),
            no_dist=True,
        )
    torch.save(_common(args), it_dir / "common.pt")
    meta = {
        "sharded_backend": "torch_dist",
        "sharded_backend_version": 1,
        "common_backend": "torch",
        "common_backend_version": 1,
    }
    (it_dir / "metadata.json").write_text(json.dumps(meta))


def iter_params(
    num_layers: int, names: list[str], global_names: list[str]
) -> Iterator[tuple[str, int | None]]:
    """(name, layer) in Megatron's order: embedding, layers, final norm, output layer."""
    for name in global_names:
        if name.startswith("embedding."):
            yield name, None
    for layer in range(num_layers):
        for name in names:
            yield name, layer
    for name in global_names:
        if not name.startswith("embedding."):
            yield name, None
