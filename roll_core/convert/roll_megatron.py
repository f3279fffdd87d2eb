"""roll's own Megatron checkpoints: the `megatron` train backend's per-rank files.

A checkpoint of a run with `actor_train.backend: megatron` is one directory
(`checkpoints/step-N/actor_train/`) holding `megatron-rankNNNNN.pt` per rank: its model
chunks' state dicts (megatron-core's local layer names), its optimizer shard, RNG, the run's
`layout` (world size, tp, pp, ep, vpp, sp), the rank's :class:`RankPlace` (which TP / expert
/ data-parallel coordinates and which layers it holds) and the model's `config.json`.

The rules that say which rank's tensor is which Hugging Face tensor live here once and serve
both readers of such shards: the live backend (its `final/` export and weight sync gather the
owners' shards over the process group) and :class:`RollReader` (`roll convert mcore2hf` on a
checkpoint directory: the same owners' shards, read from the files). Both merge over tensor
parallelism with :func:`roll_core.convert.tensors.merge_tp` and map to HF tensors with
:func:`roll_core.convert.convert.to_hf`.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from roll_core.convert.archs import LEGACY_EXPERT_NAMES, LOCAL_NAMES, KeyMap, args_from_dims
from roll_core.convert.tensors import merge_tp
from roll_core.errors import CheckpointError, UsageError

RANK_FILE = "megatron-rank{rank:05d}.pt"
_RANK_RE = re.compile(r"^megatron-rank(\d{5})\.pt$")
VOCAB_DIVISIBLE_BY = 128
"""Megatron-LM's default `make_vocab_size_divisible_by` (times tp): the padded vocabulary."""


@dataclass(frozen=True)
class RankPlace:
    """Where one rank sits in the layout: what it owns of each tensor."""

    tp_rank: int
    etp_rank: int
    """Expert-tensor-parallel rank (the TP rank of the expert weights)."""
    dp_rank: int
    edp_rank: int
    """Expert-data-parallel rank: expert weights are sent by its rank 0."""
    ep_rank: int
    layers: dict[int, tuple[int, int]]
    """Global layer -> (model chunk, index of the layer in that chunk)."""
    n_local_experts: int
    tied_embeddings: bool

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RankPlace:
        fields = dict(data)
        fields["layers"] = {int(k): (int(v[0]), int(v[1])) for k, v in data["layers"].items()}
        return cls(**fields)

    def tp_rank_of(self, key: KeyMap) -> int:
        """This rank's position among the tensor-parallel shards of ``key``."""
        return self.etp_rank if key.per_expert else self.tp_rank

    def owns(self, key: KeyMap) -> bool:
        """Whether this rank's shard of ``key`` is the one to export: one copy per TP rank,
        from data-parallel rank 0 (expert-data-parallel rank 0 for expert weights)."""
        return (self.edp_rank if key.per_expert else self.dp_rank) == 0

    def locate(
        self,
        key: KeyMap,
        layer: int | None,
        expert: int | None,
        names: list[Any],
        *,
        copies: bool = True,
    ) -> list[tuple[int, str]]:
        """(chunk, parameter name) of this rank's tensors of ``key`` at ``layer`` / ``expert``;
        ``names[c]`` holds the parameter names of chunk ``c``. ``copies``: with a tied
        embedding and PP, the last stage's copy (`output_layer.weight`) too."""
        if layer is None:
            found = [(c, key.mcore) for c, n in enumerate(names) if key.mcore in n]
            tied = key.mcore == "embedding.word_embeddings.weight" and self.tied_embeddings
            if tied and copies:
                found += [(c, "output_layer.weight") for c, n in enumerate(names)
                          if "output_layer.weight" in n]  # fmt: skip
            return found
        if layer not in self.layers:
            return []
        chunk, local = self.layers[layer]
        if not key.per_expert:
            return [(chunk, f"decoder.layers.{local}.{LOCAL_NAMES.get(key.mcore, key.mcore)}")]
        if expert is None or expert // self.n_local_experts != self.ep_rank:
            return []
        name = LEGACY_EXPERT_NAMES[key.mcore][0].format(e=expert % self.n_local_experts)
        return [(chunk, f"decoder.layers.{local}.{name}")]


# -- reading a checkpoint directory ------------------------------------------------------------


def rank_files_dir(src: Path) -> Path | None:
    """The directory of `megatron-rank*.pt` files SRC names: SRC itself, its `actor_train/`
    (a step directory), or through a `latest` pointer (a run's `checkpoints/`, or the run
    directory). None: SRC is not a roll checkpoint."""
    candidates = [src, src / "actor_train"]
    for root in (src, src / "checkpoints"):
        pointer = root / "latest"
        if pointer.is_file() and pointer.read_text().strip():
            step = root / pointer.read_text().strip()
            candidates += [step, step / "actor_train"]
    for cand in candidates:
        if cand.is_dir() and any(_RANK_RE.match(p.name) for p in cand.iterdir()):
            return cand
    return None


class RollReader:
    """Reads roll's per-rank megatron checkpoint like the Megatron-LM readers of
    :mod:`roll_core.convert.megatron` (`read(name, layer, expert)` gives the global tensor),
    so `mcore_to_hf` converts it with the same plan, checks, HF mapping and writer."""

    layout = "roll megatron"

    def __init__(
        self, directory: Path, load: Callable[[Path], Any], dims_of: Callable[..., Any]
    ) -> None:
        """``load``: reads one file (the converter's safe, memory-mapped loader);
        ``dims_of(config, tp)``: the model's ModelDims from its config.json."""
        self.dir = directory
        first = directory / RANK_FILE.format(rank=0)
        if not first.is_file():
            raise CheckpointError(
                f"{first} is missing: the checkpoint {directory} is partial (rank 0's file "
                "holds the layout and the model config).",
                hint="Copy the whole checkpoint directory again, or convert an earlier complete "
                "checkpoint (checkpoints/step-*/actor_train).",
            )
        head = load(first)
        if "place" not in head or "hf_config" not in head:
            raise CheckpointError(
                f"{first} was written by a roll version that did not record each rank's place "
                "in the layout, so its shards cannot be assembled offline.",
                hint="Resume the run with this roll version and let it save a checkpoint, then "
                "convert that one (or use the run's final/ directly).",
            )
        self.saved_layout: dict[str, Any] = dict(head["layout"])
        self.hf_config: dict[str, Any] = dict(head["hf_config"])
        self.tp, self.pp = int(self.saved_layout["tp"]), int(self.saved_layout["pp"])
        self.ep = int(self.saved_layout["ep"])
        world = int(self.saved_layout["world_size"])
        self._check_files(world)
        self.ranks = [(RankPlace.from_dict(head["place"]), head["model"])]
        for rank in range(1, world):
            path = directory / RANK_FILE.format(rank=rank)
            state = load(path)
            if state.get("layout") != self.saved_layout or "place" not in state:
                raise CheckpointError(
                    f"{path} was saved with layout {state.get('layout')}, rank 0's file with "
                    f"{self.saved_layout}: the directory mixes checkpoints of different runs.",
                    hint="Copy every megatron-rank*.pt of one checkpoint into one directory.",
                )
            self.ranks.append((RankPlace.from_dict(state["place"]), state["model"]))
        self.dims = dims_of(self.hf_config, self.tp)
        self.num_layers = self.dims.num_layers
        from roll_core.convert.convert import plan  # convert.py imports this module

        self._keys = {k.mcore: k for k, _, _ in plan(self.dims)}
        self._names = [[set(m) for m in model] for _, model in self.ranks]

    def _check_files(self, world: int) -> None:
        found = {int(m.group(1)) for p in self.dir.iterdir() if (m := _RANK_RE.match(p.name))}
        missing = sorted(set(range(world)) - found)
        extra = sorted(found - set(range(world)))
        if missing:
            names = ", ".join(RANK_FILE.format(rank=r) for r in missing[:4])
            raise CheckpointError(
                f"{self.dir} is missing {names}"
                + (f" and {len(missing) - 4} more" if len(missing) > 4 else "")
                + f": the run had {world} ranks (world_size in {RANK_FILE.format(rank=0)}) and "
                "each writes its own file.",
                hint="The checkpoint is partial: copy the missing files from where the run "
                "saved them, or convert an earlier complete checkpoint.",
            )
        if extra:
            raise CheckpointError(
                f"{self.dir} holds {RANK_FILE.format(rank=extra[0])}, but rank 0's file says the "
                f"run had {world} ranks: files of another run are mixed in.",
                hint="Keep only the megatron-rank*.pt files of one checkpoint in the directory.",
            )

    @property
    def args(self) -> dict[str, Any]:
        """Megatron-LM-style args describing the model (what `mcore_to_hf` reads the shape
        from)."""
        dtype = str(self.read("embedding.word_embeddings.weight").dtype).removeprefix("torch.")
        return args_from_dims(self.dims, tp=self.tp, pp=self.pp, ep=self.ep, dtype=dtype,
                              transformer_impl="local", divisible_by=VOCAB_DIVISIBLE_BY)  # fmt: skip

    def read(self, name: str, layer: int | None = None, expert: int | None = None) -> torch.Tensor:
        """The global Megatron tensor ``name`` (of ``layer``, ``expert``), merged over TP."""
        key = self._keys[name]
        parts: dict[int, torch.Tensor] = {}
        for (place, model), names in zip(self.ranks, self._names, strict=True):
            if not place.owns(key):
                continue
            for chunk, local in place.locate(key, layer, expert, names, copies=False):
                parts.setdefault(place.tp_rank_of(key), model[chunk][local])
        size = self.tp if key.tp != "replicated" else 1
        if not parts or (key.tp != "replicated" and sorted(parts) != list(range(size))):
            where = "" if layer is None else f" of layer {layer}"
            raise CheckpointError(
                f"{self.dir}: the rank files hold tensor-parallel shards {sorted(parts)} of "
                f"{name}{where}{'' if expert is None else f' expert {expert}'}, not 0..{size - 1}.",
                hint="The rank files do not match the layout they record; copy the checkpoint "
                "again from where the run saved it.",
            )
        return merge_tp([parts[r] for r in sorted(parts)], key.tp, name=name)


def refuse_options(arch: str | None) -> None:
    """`--arch` does not apply to roll's checkpoints: they record the model's config.json."""
    if arch is not None:
        raise UsageError(
            f"--arch {arch} does not apply to a roll megatron checkpoint: it records the "
            "model's config.json (model_type included).",
            hint="Leave out --arch (use --hf-config to write another config.json).",
        )
