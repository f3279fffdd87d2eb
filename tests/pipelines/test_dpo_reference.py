"""DPO reference log-probs: which pairs a run scores, how they are grouped, the checksum."""

from __future__ import annotations

from pathlib import Path

import torch

from roll_core.data import Batch
from roll_core.pipelines.dpo_reference import (
    fill_reference,
    first_uses,
    missing,
    read_cache,
    write_cache,
)


def test_first_uses_are_the_new_pairs_of_each_step() -> None:
    # 6 pairs, 4 per step, no shuffle: step 1 = [0,1,2,3]; the incomplete tail [4,5] is
    # dropped, so steps 2 and 3 are [0,1,2,3] again (epochs 2, 3): nothing new to score.
    assert list(first_uses(6, 4, seed=0, shuffle=False, max_steps=3)) == [[0, 1, 2, 3], [], []]
    # 20 steps x 32 of 5,100 pairs score 640 pairs, not 5,100 (issue 18's example)
    steps = list(first_uses(5100, 32, seed=0, shuffle=True, max_steps=20))
    assert sum(len(s) for s in steps) == 640
    assert missing(None, steps, n_eval=10) == 650


def _pair(n: int) -> dict:
    side = {"input_ids": [1] * n, "loss_mask": [0] + [1] * (n - 1)}
    return {"chosen": side, "rejected": side}


def test_fill_groups_by_step_and_extends_without_regrouping() -> None:
    calls: list[int] = []

    def compute(batch: Batch) -> torch.Tensor:
        calls.append(len(batch))  # rows = 2 x pairs
        return torch.ones(len(batch), batch.tensors["input_ids"].shape[1] - 1)

    train = [_pair(3 + i % 2) for i in range(6)]
    steps = list(first_uses(6, 2, seed=0, shuffle=False, max_steps=2))  # [[0,1],[2,3]]
    out, scored = fill_reference(
        None, train=train, eval_pairs=[], steps=steps, batch_size=16, pad_id=0, compute=compute
    )
    assert scored == 4 and calls == [4, 4]  # one batch per step, not one of 4 pairs
    # pair 0 has 3 tokens: 2 response tokens of log-prob 1 -> 2.0; pairs 4, 5 not computed
    assert out["train"][:8].tolist() == [2.0, 2.0, 3.0, 3.0, 2.0, 2.0, 3.0, 3.0]
    assert torch.isnan(out["train"][8:]).all()
    steps3 = list(first_uses(6, 2, seed=0, shuffle=False, max_steps=3))
    assert missing(out, steps3, 0) == 2
    calls.clear()
    out3, scored = fill_reference(
        out, train=train, eval_pairs=[], steps=steps3, batch_size=16, pad_id=0, compute=compute
    )
    assert scored == 2 and calls == [4] and torch.equal(out3["train"][:8], out["train"][:8])


def test_cache_checksum_catches_a_flipped_bit(tmp_path: Path) -> None:
    path = tmp_path / "ref.safetensors"
    tensors = {"train": torch.tensor([1.0, float("nan")]), "eval": torch.tensor([0.5, 0.25])}
    write_cache(path, tensors, "fp")
    back, why = read_cache(path, "fp")
    assert why == "" and back is not None and torch.equal(back["eval"], tensors["eval"])
    assert read_cache(path, "other")[1].endswith("older format; recomputing")
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0x01
    path.write_bytes(bytes(raw))
    back, why = read_cache(path, "fp")
    assert back is None and "damaged (checksum mismatch)" in why
    path.write_bytes(b"garbage")
    assert "unreadable" in read_cache(path, "fp")[1]
