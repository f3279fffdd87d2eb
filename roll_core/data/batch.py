"""The Batch: the one type that crosses process boundaries.

A :class:`Batch` holds per-sample tensors that share their first dimension (``input_ids``
``[B, T]``, ``advantages`` ``[B]``, ...), per-sample Python values of the same length (ids,
domain names, decoded text) and a free-form ``meta`` dict shared by the whole batch (policy
version, step, ...). Clusters split a Batch over their ranks and concatenate the results, so
split / concat / select / to(device) live here. A Batch is a plain dataclass and pickles as one
(Ray sends it between processes).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

Indices = Sequence[int] | torch.Tensor


@dataclass(eq=False)
class Batch:
    """Per-sample tensors and values of one length, plus batch-level ``meta``.

    Construction checks that every tensor has the same first dimension and every non-tensor
    list the same length, and raises ``ValueError`` naming the offending key otherwise.
    Methods never modify a Batch in place, except ``batch[key] = value``. Results of ``split``
    and ``chunk`` hold views of the tensors (like torch slicing); every result gets a shallow
    copy of ``meta``.
    """

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    non_tensors: dict[str, list] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.tensors = dict(self.tensors)
        self.non_tensors = dict(self.non_tensors)
        self.meta = dict(self.meta)
        self._check()

    # -- validation -------------------------------------------------------------------------

    def _check(self) -> None:
        both = sorted(set(self.tensors) & set(self.non_tensors))
        if both:
            raise ValueError(f"Batch key(s) {both} are both tensor and non-tensor fields.")
        expected: tuple[str, int] | None = None
        for key, value in self.tensors.items():
            if not isinstance(value, torch.Tensor):
                raise ValueError(f"Batch tensor {key!r} is a {type(value).__name__}, not a tensor.")
            if value.dim() == 0:
                raise ValueError(f"Batch tensor {key!r} is a scalar; it needs a batch dimension.")
            expected = _check_length(key, value.shape[0], expected)
        for key, values in self.non_tensors.items():
            if not isinstance(values, list):
                raise ValueError(
                    f"Batch non-tensor {key!r} is a {type(values).__name__}; it must be a list."
                )
            expected = _check_length(key, len(values), expected)

    # -- mapping-like access ----------------------------------------------------------------

    def __len__(self) -> int:
        for value in self.tensors.values():
            return int(value.shape[0])
        for values in self.non_tensors.values():
            return len(values)
        return 0

    def __contains__(self, key: object) -> bool:
        return key in self.tensors or key in self.non_tensors

    def __getitem__(self, key: str) -> torch.Tensor | list:
        if key in self.tensors:
            return self.tensors[key]
        if key in self.non_tensors:
            return self.non_tensors[key]
        raise KeyError(f"Batch has no field {key!r}; it has {self.keys()}.")

    def __setitem__(self, key: str, value: torch.Tensor | list) -> None:
        """Add or replace one field; its length is checked against the other fields."""
        old_tensor = self.tensors.pop(key, None)
        old_list = self.non_tensors.pop(key, None)
        if isinstance(value, torch.Tensor):
            self.tensors[key] = value
        else:
            self.non_tensors[key] = value
        try:
            self._check()
        except ValueError:
            self.tensors.pop(key, None)
            self.non_tensors.pop(key, None)
            if old_tensor is not None:
                self.tensors[key] = old_tensor
            if old_list is not None:
                self.non_tensors[key] = old_list
            raise

    def keys(self) -> list[str]:
        """Tensor keys then non-tensor keys, in insertion order."""
        return [*self.tensors, *self.non_tensors]

    # -- slicing ----------------------------------------------------------------------------

    def select(self, indices: Indices) -> Batch:
        """The samples at ``indices`` (ints or a bool mask), in that order."""
        index = torch.as_tensor(indices) if not isinstance(indices, torch.Tensor) else indices
        if index.dtype == torch.bool:
            if index.shape != (len(self),):
                raise ValueError(
                    f"Boolean mask of shape {tuple(index.shape)} for a batch of {len(self)}."
                )
            index = index.nonzero().flatten()
        index = index.long().flatten().cpu()
        if index.numel() and (index.min() < -len(self) or index.max() >= len(self)):
            raise IndexError(f"Index out of range for a batch of {len(self)} samples.")
        positions = index.tolist()
        return Batch(
            tensors={k: v[index.to(v.device)] for k, v in self.tensors.items()},
            non_tensors={k: [v[i] for i in positions] for k, v in self.non_tensors.items()},
            meta=self.meta,
        )

    def _slice(self, start: int, stop: int) -> Batch:
        return Batch(
            tensors={k: v[start:stop] for k, v in self.tensors.items()},
            non_tensors={k: v[start:stop] for k, v in self.non_tensors.items()},
            meta=self.meta,
        )

    def split(self, n_chunks: int) -> list[Batch]:
        """``n_chunks`` contiguous parts whose sizes differ by at most one (larger ones first)."""
        if n_chunks < 1 or n_chunks > len(self):
            raise ValueError(f"Cannot split a batch of {len(self)} samples into {n_chunks} chunks.")
        base, extra = divmod(len(self), n_chunks)
        chunks, start = [], 0
        for i in range(n_chunks):
            stop = start + base + (1 if i < extra else 0)
            chunks.append(self._slice(start, stop))
            start = stop
        return chunks

    def chunk(self, size: int) -> list[Batch]:
        """Contiguous micro-batches of ``size`` samples; the last one may be smaller."""
        if size < 1:
            raise ValueError(f"Chunk size must be at least 1, got {size}.")
        return [self._slice(start, start + size) for start in range(0, len(self), size)]

    # -- combining and moving ---------------------------------------------------------------

    @staticmethod
    def concat(batches: Sequence[Batch]) -> Batch:
        """Join batches with the same keys along the first dimension; meta from the first."""
        if not batches:
            raise ValueError("Batch.concat needs at least one batch.")
        first = batches[0]
        for i, other in enumerate(batches[1:], start=1):
            if set(other.tensors) != set(first.tensors) or set(other.non_tensors) != set(
                first.non_tensors
            ):
                raise ValueError(
                    f"Batch.concat: batch {i} has keys {sorted(other.keys())}, "
                    f"batch 0 has {sorted(first.keys())}."
                )
        tensors = {}
        for key in first.tensors:
            try:
                tensors[key] = torch.cat([b.tensors[key] for b in batches], dim=0)
            except RuntimeError as err:
                shapes = [tuple(b.tensors[key].shape) for b in batches]
                raise ValueError(
                    f"Batch.concat: tensor {key!r} shapes {shapes} do not match."
                ) from err
        non_tensors = {k: [x for b in batches for x in b.non_tensors[k]] for k in first.non_tensors}
        return Batch(tensors=tensors, non_tensors=non_tensors, meta=first.meta)

    def to(self, device: torch.device | str) -> Batch:
        """A Batch whose tensors are on ``device`` (the non-tensor lists are not copied)."""
        return Batch(
            tensors={k: v.to(device) for k, v in self.tensors.items()},
            non_tensors=self.non_tensors,
            meta=self.meta,
        )

    def __repr__(self) -> str:
        parts = [
            f"{k}: {tuple(v.shape)} {str(v.dtype).removeprefix('torch.')}"
            for k, v in self.tensors.items()
        ]
        parts += [f"{k}: list" for k in self.non_tensors]
        return f"Batch(len={len(self)}, {', '.join(parts)}, meta={sorted(self.meta)})"


def _check_length(key: str, length: int, expected: tuple[str, int] | None) -> tuple[str, int]:
    if expected is not None and length != expected[1]:
        raise ValueError(
            f"Batch field {key!r} has {length} samples, but {expected[0]!r} has {expected[1]}; "
            "every field needs one entry per sample."
        )
    return expected or (key, length)
