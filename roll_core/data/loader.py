"""An endless, resumable sampler of example indices.

``StatefulLoader`` hands out lists of indices into a dataset, epoch after epoch. Epoch ``e``
visits the examples in the order ``torch.randperm(n, generator=manual_seed(seed + e))`` (or
``0..n-1`` without shuffling), so the order depends only on the seed and the epoch number, and
a three-number state (epoch, position in the epoch, samples seen) restores it exactly: after
``load_state_dict(state)`` the next batches are the ones an uninterrupted loader would give.
A batch never spans two epochs; with ``drop_last`` the incomplete tail of each epoch is skipped.
"""

from __future__ import annotations

from typing import Any

import torch

from roll_core.errors import DataError


class StatefulLoader:
    """Infinite iterator over batches of example indices (``list[int]``), resumable exactly."""

    def __init__(
        self,
        num_examples: int,
        batch_size: int,
        *,
        seed: int,
        shuffle: bool = True,
        drop_last: bool = True,
    ) -> None:
        if batch_size < 1:
            raise DataError(f"The batch size must be at least 1, got {batch_size}.")
        if num_examples < 1:
            raise DataError("The dataset has no examples; there is nothing to iterate over.")
        if drop_last and batch_size > num_examples:
            raise DataError(
                f"The dataset has {num_examples} examples, fewer than one batch of {batch_size}.",
                hint="Lower the batch size or use a larger dataset.",
            )
        self.num_examples = num_examples
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle = shuffle
        self.drop_last = drop_last
        self._epoch = 0
        self._position = 0
        self._samples_seen = 0
        self._order: torch.Tensor | None = None  # the epoch's order (8 bytes an index)

    @property
    def epoch(self) -> int:
        """The epoch the next batch comes from (0-based)."""
        return self._epoch

    @property
    def samples_seen(self) -> int:
        """Indices handed out so far, over all epochs."""
        return self._samples_seen

    @property
    def batches_per_epoch(self) -> int:
        full, rest = divmod(self.num_examples, self.batch_size)
        return full + (1 if rest and not self.drop_last else 0)

    def __iter__(self) -> StatefulLoader:
        return self

    def __next__(self) -> list[int]:
        order = self._epoch_order()
        batch = order[self._position : self._position + self.batch_size].tolist()
        self._position += len(batch)
        self._samples_seen += len(batch)
        if self._position >= self._epoch_end():
            self._epoch += 1
            self._position = 0
            self._order = None
        return batch

    def state_dict(self) -> dict[str, int]:
        """``{"epoch", "position", "samples_seen"}``: enough to resume exactly."""
        return {
            "epoch": self._epoch,
            "position": self._position,
            "samples_seen": self._samples_seen,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state``, as returned by :meth:`state_dict` of a same-shaped loader."""
        missing = [k for k in ("epoch", "position", "samples_seen") if k not in state]
        if missing:
            raise DataError(f"Data-loader state is missing {missing}; the checkpoint is damaged.")
        epoch, position = int(state["epoch"]), int(state["position"])
        if epoch < 0 or not 0 <= position < self._epoch_end():
            raise DataError(
                f"Data-loader state (epoch {epoch}, position {position}) does not fit a dataset "
                f"of {self.num_examples} examples in batches of {self.batch_size}.",
                hint="The dataset or batch size changed since the checkpoint was written; "
                "resume with the same data and batch size.",
            )
        self._epoch, self._position = epoch, position
        self._samples_seen = int(state["samples_seen"])
        self._order = None

    def _epoch_end(self) -> int:
        """Where the current epoch stops (the start of the dropped tail with drop_last)."""
        if self.drop_last:
            return self.num_examples - self.num_examples % self.batch_size
        return self.num_examples

    def _epoch_order(self) -> torch.Tensor:
        if self._order is None:
            if self.shuffle:
                generator = torch.Generator().manual_seed(self.seed + self._epoch)
                self._order = torch.randperm(self.num_examples, generator=generator)
            else:
                self._order = torch.arange(self.num_examples)
        return self._order
