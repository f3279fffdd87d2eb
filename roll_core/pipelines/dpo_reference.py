"""DPO's reference log-probs: computed lazily for the pairs the run uses, cached, checksummed.

The reference policy never changes, so its summed response log-probs are computed once per
pair and cached in `runs/<id>/reference_logps.safetensors`. Only the pairs the run will use
are scored: the train loader is deterministic (seed, epoch order), so the pairs of steps
1..max_steps are known before step 1 (a 20-step run of 32 pairs per step scores 640 pairs, not
the whole 5,000-pair file). Every eval pair is scored (each evaluation uses them all).

Determinism (a killed and resumed run, or one resumed with a larger `trainer.max_steps`, must
end bitwise like a run never stopped): a pair's value may depend on the batch it is computed
in (padding, vectorised reductions), so batches are a function of the data only: the pairs a
step uses for the first time, in the step's order, in `eval.batch_size` chunks. Extending
max_steps adds the new steps' pairs and never regroups old ones.

The cache stores the train values densely (`[2 * pairs]`, NaN where not computed yet; rows
chosen_i, rejected_i) plus the eval values, with a fingerprint of the tokenised pairs and a
sha256 over the tensors' bytes. A cache whose checksum does not match is damaged: it is said
and recomputed, never trusted (like a checkpoint).
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from roll_core.data import Batch, StatefulLoader
from roll_core.data.preference import Pair, collate_pairs

REFERENCE_CACHE = "reference_logps.safetensors"
_FORMAT = "lazy-v1"


def fingerprint(pairs: list[Pair]) -> str:
    """Identity of the tokenised pairs (a cache of other data is never used)."""
    h = hashlib.sha256()
    for pair in pairs:
        for side in ("chosen", "rejected"):
            h.update(repr((pair[side]["input_ids"], pair[side]["loss_mask"])).encode())
    return h.hexdigest()


def tensors_sha256(tensors: dict[str, torch.Tensor]) -> str:
    """sha256 over every tensor's name, dtype, shape and bytes, in name order."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def first_uses(
    n_pairs: int, per_step: int, *, seed: int, shuffle: bool, max_steps: int
) -> Iterator[list[int]]:
    """For each step 1..max_steps, the pair indices it uses for the first time, in order."""
    loader = StatefulLoader(n_pairs, per_step, seed=seed, shuffle=shuffle)
    seen: set[int] = set()
    for _ in range(max_steps):
        new = [i for i in next(loader) if i not in seen]
        seen.update(new)
        yield new


def read_cache(path: Path, expected_fingerprint: str) -> tuple[dict[str, torch.Tensor] | None, str]:
    """(the cached tensors, "") or (None, why they are not used)."""
    if not path.is_file():
        return None, ""
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
        tensors = load_file(str(path))
    except Exception as err:  # noqa: BLE001 - any damage means: recompute
        return None, f"{path.name} is unreadable ({type(err).__name__}); recomputing"
    if meta.get("format") != _FORMAT or meta.get("fingerprint") != expected_fingerprint:
        return None, f"{path.name} is for other pairs or an older format; recomputing"
    if meta.get("sha256") != tensors_sha256(tensors):
        return None, f"{path.name} is damaged (checksum mismatch); recomputing"
    return tensors, ""


def write_cache(path: Path, tensors: dict[str, torch.Tensor], fp: str) -> None:
    """Atomically (temporary file, fsync, rename), with the checksum in its metadata."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    meta = {"format": _FORMAT, "fingerprint": fp, "sha256": tensors_sha256(tensors)}
    save_file(tensors, str(tmp), metadata=meta)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _score(
    pairs: list[Pair], compute: Callable[[Batch], torch.Tensor], pad_id: int
) -> torch.Tensor:
    """Summed response log-probs of `pairs` in one batch: [2 * len(pairs)]."""
    batch = collate_pairs(pairs, pad_id=pad_id)
    per_token = compute(batch)
    return (per_token * batch.tensors["loss_mask"][:, 1:]).sum(-1)


def fill_reference(
    cached: dict[str, torch.Tensor] | None,
    *,
    train: list[Pair],
    eval_pairs: list[Pair],
    steps: list[list[int]],
    batch_size: int,
    pad_id: int,
    compute: Callable[[Batch], torch.Tensor] | None,
) -> tuple[dict[str, torch.Tensor], int]:
    """The cache completed for `steps` (first uses per step) and every eval pair; returns it
    and how many pairs were scored now. `compute` is None when nothing needs scoring."""
    out = {
        "train": torch.full((2 * len(train),), float("nan")),
        "eval": torch.zeros(0),
    }
    if cached is not None and cached["train"].shape == out["train"].shape:
        out = {"train": cached["train"].clone(), "eval": cached["eval"].clone()}
    scored = 0
    have_eval = out["eval"].numel() == 2 * len(eval_pairs)
    if not have_eval:
        assert compute is not None
        parts = [torch.zeros(0)]
        for i in range(0, len(eval_pairs), batch_size):
            parts.append(_score(eval_pairs[i : i + batch_size], compute, pad_id))
        out["eval"] = torch.cat(parts).contiguous()
        scored += len(eval_pairs)
    for new in steps:
        todo = [i for i in new if torch.isnan(out["train"][2 * i])]
        for k in range(0, len(todo), batch_size):
            chunk = todo[k : k + batch_size]
            assert compute is not None
            values = _score([train[i] for i in chunk], compute, pad_id)
            rows = torch.tensor([r for i in chunk for r in (2 * i, 2 * i + 1)], dtype=torch.long)
            out["train"][rows] = values.to(out["train"].dtype)
            scored += len(chunk)
    return out, scored


def missing(cached: dict[str, torch.Tensor] | None, steps: list[list[int]], n_eval: int) -> int:
    """How many pairs `fill_reference` would score."""
    if cached is None:
        return len({i for new in steps for i in new}) + n_eval
    train = cached["train"]
    need = sum(1 for new in steps for i in new if torch.isnan(train[2 * i]))
    return need + (0 if cached["eval"].numel() == 2 * n_eval else n_eval)


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    start = time.perf_counter()
    return fn(), time.perf_counter() - start
