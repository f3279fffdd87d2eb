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
from collections.abc import Callable, Mapping
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
    DIST_LOCAL_NAMES,
    GLOBAL_KEYS,
    LAYER_KEYS,
    LEGACY_EXPERT_NAMES,
    LOCAL_NAMES,
    MCORE_LAYER_PREFIX,
    ExtraState,
)
from roll_core.convert.safe_load import (
    check_zip_crcs,
    load_pickle,
    load_torch_file,
    namespace_to_dict,
)
from roll_core.convert.staging import checkpoint_errors
from roll_core.convert.tensors import merge_tp, split_tp
from roll_core.errors import CheckpointError, UsageError

LATEST_FILE = "latest_checkpointed_iteration.txt"
LEGACY_FILE = "model_optim_rng.pt"
RANK_DIR = re.compile(r"^mp_rank_(\d{2})(?:_(\d{3}))?(?:_(\d{3}))?$")
TP_RULE: Mapping[str, str] = {k.mcore: k.tp for k in (*GLOBAL_KEYS, *LAYER_KEYS)}
#: Args that give the tensor, pipeline and expert parallel sizes.
_SIZE_ARGS = (
    "tensor_model_parallel_size",
    "pipeline_model_parallel_size",
    "expert_model_parallel_size",
)
#: (tensor-parallel rank, pipeline stage, expert-parallel rank) of a legacy file.
Rank = tuple[int, int, int]
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
    """Reads ``mp_rank_TT[_PPP][_EEE]/model_optim_rng.pt`` files (memory-mapped).

    ``EEE`` (the expert-parallel rank) is there when the expert-parallel size is above 1, as
    Megatron-LM names them; with one pipeline stage that gives ``mp_rank_TT_EEE``, so the
    directory names are read with the sizes the checkpoint's ``args`` give.
    """

    layout = "legacy"

    def __init__(self, it_dir: Path) -> None:
        self.dir = it_dir
        found: dict[str, Path] = {
            p.name: p / LEGACY_FILE
            for p in sorted(it_dir.iterdir())
            if p.is_dir() and RANK_DIR.match(p.name)
        }
        first = next((f for f in found.values() if f.is_file()), None)
        if first is None:
            raise CheckpointError(
                f"no {LEGACY_FILE} in any mp_rank_* directory of {it_dir}.",
                hint="The checkpoint is incomplete; copy it again.",
            )
        self.args = namespace_to_dict(load_torch_file(first).get("args"))
        self.tp = int(self.args.get("tensor_model_parallel_size") or 1)
        self.pp = int(self.args.get("pipeline_model_parallel_size") or 1)
        self.ep = int(self.args.get("expert_model_parallel_size") or 1)
        self.num_experts = int(self.args.get("num_experts") or 0)
        self._check_expert_sizes()
        ranks = {self._rank_of(name): f for name, f in found.items()}
        self._check_grid(ranks)
        self.files = ranks
        self.states: dict[Rank, Mapping[str, Any]] = {}
        for rank, f in sorted(ranks.items()):
            sd = load_torch_file(f)
            args = namespace_to_dict(sd.get("args"))
            sizes = tuple(args.get(k) or 1 for k in _SIZE_ARGS)
            if args and sizes != (self.tp, self.pp, self.ep):
                raise CheckpointError(
                    f"{f} says tensor/pipeline/expert parallel sizes {sizes}, {first} says "
                    f"{(self.tp, self.pp, self.ep)}.",
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

    def _check_expert_sizes(self) -> None:
        if self.ep > 1 and not self.num_experts:
            raise CheckpointError(
                f"args give expert_model_parallel_size {self.ep} but no num_experts.",
                hint="The checkpoint's args are damaged; check the training arguments.",
            )
        if self.num_experts % self.ep:
            raise CheckpointError(
                f"{self.num_experts} experts do not split over expert-parallel size {self.ep}.",
                hint="The checkpoint's args are damaged; check the training arguments.",
            )
        etp = self.args.get("expert_tensor_parallel_size")
        if self.num_experts and etp not in (None, self.tp):
            raise CheckpointError(
                f"the experts are split over expert-tensor-parallel size {etp}, the other layers "
                f"over tensor-parallel size {self.tp}; the legacy layout of such a run is not "
                "supported.",
                hint="Save the checkpoint with --ckpt-format torch_dist (any split converts) or "
                "with expert_tensor_parallel_size equal to tensor_model_parallel_size.",
            )
        self.num_local_experts = self.num_experts // self.ep

    def _rank_of(self, name: str) -> Rank:
        """(tp, pp, ep) rank of directory ``name`` (``mp_rank_TT[_PPP][_EEE]``)."""
        m = RANK_DIR.match(name)
        assert m is not None
        parts = [int(g) for g in m.groups()[1:] if g is not None]
        if len(parts) != (self.pp > 1) + (self.ep > 1):
            raise CheckpointError(
                f"{self.dir / name} does not fit tensor/pipeline/expert parallel sizes "
                f"{self.tp}x{self.pp}x{self.ep} (expected names like "
                f"{_rank_dir(0, 0, 0, self.pp, self.ep)}).",
                hint="The directory mixes checkpoints of different parallel sizes.",
            )
        return (
            int(m.group(1)),
            parts[0] if self.pp > 1 else 0,
            parts[-1] if self.ep > 1 else 0,
        )

    def _check_grid(self, ranks: dict[Rank, Path]) -> None:
        expected = {
            (t, p, e) for t in range(self.tp) for p in range(self.pp) for e in range(self.ep)
        }
        extra = sorted(set(ranks) - expected)
        if extra:
            raise CheckpointError(
                f"{self.dir} has shards for ranks (tp, pp, ep) {extra}, outside the "
                f"tensor/pipeline/expert parallel sizes {self.tp}x{self.pp}x{self.ep} its args "
                "give.",
                hint="The directory mixes checkpoints of different parallel sizes.",
            )
        missing = [
            str(self.dir / _rank_dir(t, p, e, self.pp, self.ep) / LEGACY_FILE)
            for t, p, e in sorted(expected)
            if not ranks.get((t, p, e), Path("/nonexistent")).is_file()
        ]
        if missing:
            raise CheckpointError(
                f"{len(missing)} shard file(s) missing for tp={self.tp} pp={self.pp} "
                f"ep={self.ep}: " + ", ".join(missing),
                hint="Copy the complete checkpoint (every mp_rank_* directory).",
            )

    def _index_layers(self) -> None:
        """Global layer id -> (stage, local id), from the layer keys each stage holds."""
        pat = re.compile(r"^decoder\.layers\.(\d+)\.")
        self.layer_of: list[tuple[int, int]] = []
        for stage in range(self.pp):
            ids = {int(m.group(1)) for k in self.states[(0, stage, 0)] if (m := pat.match(k))}
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
        keys = self.states[(0, 0, 0)]
        self.transformer_impl = (
            "local"
            if any(k.endswith(".input_layernorm.weight") for k in keys)
            else "transformer_engine"
        )

    def has(self, name: str, layer: int | None = None, expert: int | None = None) -> bool:
        """Whether canonical parameter ``name`` (of ``layer``, ``expert``) is stored."""
        return self._key(name, layer, expert)[1] is not None

    def _key(self, name: str, layer: int | None, expert: int | None) -> tuple[Rank, str | None]:
        if layer is None:
            rank = (0, 0 if name.startswith("embedding.") else self.pp - 1, 0)
            return rank, name if name in self.states[rank] else None
        stage, local = self.layer_of[layer]
        e_rank, candidates = 0, [name, LOCAL_NAMES.get(name)]
        if expert is not None:
            if not 0 <= expert < self.num_experts:
                return (0, stage, 0), None
            e_rank, local_expert = divmod(expert, self.num_local_experts)
            candidates = [n.format(e=local_expert) for n in LEGACY_EXPERT_NAMES[name]]
        sd = self.states[(0, stage, e_rank)]
        for candidate in candidates:
            key = f"{MCORE_LAYER_PREFIX}{local}.{candidate}"
            if candidate and key in sd:
                return (0, stage, e_rank), key
        return (0, stage, e_rank), None

    def read(self, name: str, layer: int | None = None, expert: int | None = None) -> torch.Tensor:
        """The global tensor of canonical parameter ``name`` (merged over TP ranks)."""
        (_, stage, e_rank), key = self._key(name, layer, expert)
        if key is None:
            where = f"layer {layer}" if layer is not None else f"stage {stage}"
            where += f", expert {expert}" if expert is not None else ""
            raise CheckpointError(
                f"parameter {name} ({where}) is not in {self.files[(0, stage, e_rank)]}.",
                hint="The checkpoint's args do not match its weights (an architecture flag such "
                "as qk_layernorm, add_qkv_bias or num_experts differs, or the experts use "
                "Megatron's legacy GroupedMLP); check the training arguments.",
            )
        shards = [self.states[(t, stage, e_rank)][key] for t in range(self.tp)]
        return merge_tp(shards, tp_rule(name), name=key)


def _rank_dir(tp_rank: int, pp_rank: int, ep_rank: int, pp: int, ep: int) -> str:
    """Megatron-LM's name of a rank's directory: ``mp_rank_TT[_PPP][_EEE]``."""
    return (
        f"mp_rank_{tp_rank:02d}"
        + (f"_{pp_rank:03d}" if pp > 1 else "")
        + (f"_{ep_rank:03d}" if ep > 1 else "")
    )


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


def _read_metadata_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(
            f"{path} is not valid JSON: {e}.",
            hint="The checkpoint is damaged; copy the iteration directory again (it should read "
            '{"sharded_backend": "torch_dist", ...}).',
        ) from e
    if not isinstance(data, dict):
        raise CheckpointError(
            f"{path} holds a JSON {type(data).__name__}, not an object.",
            hint='The checkpoint is damaged; it should read {"sharded_backend": "torch_dist", ...}.',
        )
    return data


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
        backend = _read_metadata_json(meta_json).get("sharded_backend")
        if backend != "torch_dist":
            raise CheckpointError(
                f"{meta_json} names sharded backend {backend!r}; only 'torch_dist' is supported.",
                hint="Re-save the checkpoint with --ckpt-format torch_dist.",
            )
        self.metadata: Metadata = load_pickle(it_dir / ".metadata")
        if not isinstance(self.metadata, Metadata):
            raise CheckpointError(
                f"{it_dir / '.metadata'} holds a {type(self.metadata).__name__}, not "
                "torch.distributed.checkpoint metadata.",
                hint="The checkpoint is damaged; copy the iteration directory again.",
            )
        self.files_of: dict[str, set[str]] = {}
        self._items_of: dict[str, set[tuple[str, int, int]]] = {}
        for index, info in (self.metadata.storage_data or {}).items():
            self.files_of.setdefault(index.fqn, set()).add(info.relative_path)
            item = (info.relative_path, info.offset, info.length)
            self._items_of.setdefault(index.fqn, set()).add(item)
        self._checked: set[tuple[str, int, int]] = set()
        files = sorted(set().union(*self.files_of.values()))
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
        self.ep = int(self.args.get("expert_model_parallel_size") or 1)
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
        if layer is None:
            return name
        local = DIST_LOCAL_NAMES.get(name)  # a local MoE layer's pre-MLP norm
        if local is not None and MCORE_LAYER_PREFIX + name not in self.tensors:
            return MCORE_LAYER_PREFIX + local
        return MCORE_LAYER_PREFIX + name

    def has(self, name: str, layer: int | None = None, expert: int | None = None) -> bool:
        """Whether canonical parameter ``name`` is stored."""
        return self._fqn(name, layer) in self.tensors

    def read(self, name: str, layer: int | None = None, expert: int | None = None) -> torch.Tensor:
        """The global tensor of ``name``: one layer of a stacked tensor when ``layer`` is set,
        one expert of that layer when ``expert`` is (``[layer, expert, ...]`` tensors)."""
        fqn = self._fqn(name, layer)
        md = self.tensors.get(fqn)
        index = tuple(i for i in (layer, expert) if i is not None)
        if md is None or len(md.size) <= len(index):
            raise CheckpointError(
                f"parameter {fqn} is not in {self.dir}/.metadata"
                + (f" (as a tensor of shape {tuple(md.size)})." if md is not None else "."),
                hint="The checkpoint's args do not match its weights (an architecture flag such "
                "as qk_layernorm, add_qkv_bias or num_experts differs); check the training "
                "arguments.",
            )
        if any(not 0 <= i < n for i, n in zip(index, md.size, strict=False)):
            raise CheckpointError(
                f"{fqn} has shape {tuple(md.size)}; index {index} is outside it.",
                hint="The checkpoint's args (num_layers, num_experts) do not match its weights.",
            )
        shape = (1,) * len(index) + tuple(md.size[len(index) :])
        offsets = index + (0,) * (len(shape) - len(index))
        self._check_items(fqn)
        out = torch.empty(shape, dtype=md.properties.dtype)
        planner = _ChunkLoadPlanner({fqn: (offsets, out)})
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process"
            warnings.simplefilter("ignore", UserWarning)
            where = ", ".join(sorted(self.files_of.get(fqn, ()))) or "no file"
            with checkpoint_errors(f"reading {fqn} from {self.dir} ({where})"):
                dcp.load({fqn: out}, storage_reader=self._reader, planner=planner, no_dist=True)
        return out.reshape(md.size[len(index) :])

    def _check_items(self, fqn: str) -> None:
        """Check the CRC-32s of every stored item of ``fqn`` once: each is a ``torch.save`` zip
        whose CRCs ``torch.distributed.checkpoint`` never checks (garbage loads as weights)."""
        for item in sorted(self._items_of.get(fqn, set()) - self._checked):
            relative, offset, length = item
            path = self.dir / relative
            with checkpoint_errors(f"reading {fqn} from {path}"), open(path, "rb") as f:
                f.seek(offset)
                data = f.read(length)
            if len(data) == length:  # a short file: dcp.load reports it as truncated
                check_zip_crcs(io.BytesIO(data), f"{path} at byte {offset} ({fqn})")
            self._checked.add(item)


# -- writing ---------------------------------------------------------------------------------

#: ``produce(name, layer, expert)`` -> the global tensor of a canonical parameter.
Producer = Callable[[str, "int | None", "int | None"], torch.Tensor]


@dataclass(frozen=True)
class ParamSpec:
    """One parameter to write: canonical name, layer (None outside layers), expert (None
    outside experts), global shape (of one layer's, one expert's tensor)."""

    name: str
    layer: int | None
    shape: tuple[int, ...]
    expert: int | None = None
    dtype: torch.dtype | None = None
    """The dtype to store it in (None: the writer's ``dtype``)."""


def write_latest(root: Path, text: str = "release") -> None:
    """``latest_checkpointed_iteration.txt`` (``release``: Megatron starts at iteration 0)."""
    (root / LATEST_FILE).write_text(text)


def _common(args: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "args": argparse.Namespace(**args),
        "checkpoint_version": CHECKPOINT_VERSION,
        "iteration": 0,
    }


def _legacy_name(name: str, transformer_impl: str, local_expert: int | None) -> str:
    """The legacy (per-stage, per-rank) name of canonical parameter or module ``name``."""
    if local_expert is not None:
        return LEGACY_EXPERT_NAMES[name][0].format(e=local_expert)
    return LOCAL_NAMES.get(name, name) if transformer_impl == "local" else name


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
    extra_states: list[ExtraState],
    ep: int = 1,
    on_tensor: Callable[[str], None] | None = None,
) -> list[Path]:
    """Write one ``mp_rank_TT[_PPP][_EEE]/model_optim_rng.pt`` per (TP rank, stage, EP rank).

    Every expert-parallel rank's file holds the stage's non-expert parameters and its own
    ``num_experts / ep`` experts (local ids from 0). Memory holds one rank file at a time: each
    global tensor is produced again for every TP rank and split, so no stage is ever held whole.
    """
    num_layers = int(args["num_layers"])
    per_stage = num_layers // pp
    n_local = int(args.get("num_experts") or 0) // ep
    written = []
    for stage in range(pp):
        first, last = stage == 0, stage == pp - 1
        layers = range(stage * per_stage, (stage + 1) * per_stage)
        for e_rank in range(ep):
            experts = range(e_rank * n_local, (e_rank + 1) * n_local)
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
                    elif p.layer in layers and (p.expert is None or p.expert in experts):
                        local = p.layer - stage * per_stage
                        local_expert = None if p.expert is None else p.expert - experts.start
                        name = _legacy_name(p.name, transformer_impl, local_expert)
                        key = f"{MCORE_LAYER_PREFIX}{local}.{name}"
                    else:
                        continue
                    t = produce(p.name, p.layer, p.expert)
                    t = t if p.dtype is None else t.to(p.dtype)
                    state[key] = split_tp(t, tp_rule(p.name), tp, name=key)[rank]
                    once = rank == tp - 1 and (p.expert is not None or e_rank == 0)
                    if once and on_tensor is not None:
                        on_tensor(key if p.expert is None else f"{key} (expert {p.expert})")
                if last and tied and pp > 1:
                    # Megatron keeps a copy of the tied embedding on the last stage.
                    emb = produce("embedding.word_embeddings.weight", None, None)
                    emb = emb.to(next(p.dtype or emb.dtype for p in params if p.layer is None))
                    state["output_layer.weight"] = split_tp(emb, "vocab", tp)[rank]
                for layer in layers:
                    local = layer - stage * per_stage
                    for x in extra_states:
                        for e in range(n_local) if x.per_expert else [None]:
                            module = _legacy_name(x.module, transformer_impl, e)
                            state[f"{MCORE_LAYER_PREFIX}{local}.{module}._extra_state"] = None
                if last and "output_layer.weight" in state:
                    state["output_layer._extra_state"] = None
                path = it_dir / _rank_dir(rank, stage, e_rank, pp, ep) / LEGACY_FILE
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
    extra_states: list[ExtraState],
    on_tensor: Callable[[str], None] | None = None,
) -> None:
    """Write a ``torch_dist`` checkpoint Megatron-core loads at any TP/PP/EP size.

    Layer tensors are stacked ``[layer, ...]``, expert tensors ``[layer, expert, ...]``; each
    layer's (and expert's) part is one chunk, produced when the writer reaches it.
    """
    num_layers = int(args["num_layers"])
    num_experts = int(args.get("num_experts") or 0)
    items: list[WriteItem] = []
    sources: dict[tuple[str, tuple[int, ...]], ParamSpec] = {}  # (fqn, offsets) -> param
    for p in params:
        index = tuple(i for i in (p.layer, p.expert) if i is not None)
        if p.layer is None:
            fqn = p.name
        else:
            name = DIST_LOCAL_NAMES.get(p.name, p.name) if transformer_impl == "local" else p.name
            fqn = MCORE_LAYER_PREFIX + name
        stacked = (num_layers, num_experts)[: len(index)]
        offsets = index + (0,) * len(p.shape)
        chunk = (1,) * len(index) + p.shape
        items.append(_tensor_item(fqn, offsets, chunk, (*stacked, *p.shape), p.dtype or dtype))
        sources[(fqn, offsets)] = p
    for layer in range(num_layers):
        for x in extra_states:
            for e in range(num_experts) if x.per_expert else [None]:
                where = (
                    f"{layer}_{num_layers}"
                    if e is None
                    else f"{layer}.{e}_{num_layers}.{num_experts}"
                )
                fqn = f"{MCORE_LAYER_PREFIX}{x.module}._extra_state/shard_{where}"
                items.append(WriteItem(index=MetadataIndex(fqn), type=WriteItemType.BYTE_IO))

    def resolve(item: WriteItem) -> Any:
        fqn = item.index.fqn
        if item.type == WriteItemType.BYTE_IO:
            buf = io.BytesIO()
            torch.save([None], buf)
            buf.seek(0)
            return buf
        p = sources[(fqn, tuple(item.index.offset or ()))]
        index = [i for i in (p.layer, p.expert) if i is not None]
        t = produce(p.name, p.layer, p.expert).to(p.dtype or dtype)
        if on_tensor is not None:
            on_tensor(fqn + "".join(f"[{i}]" for i in index))
        return t.reshape((1,) * len(index) + tuple(t.shape))

    it_dir.mkdir(parents=True, exist_ok=True)
    writer = FileSystemWriter(it_dir, single_file_per_rank=True, thread_count=1, sync_files=False)
    with warnings.catch_warnings(), checkpoint_errors(f"writing {it_dir}"):
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
