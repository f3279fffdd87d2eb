"""Tests for roll_core/data/batch.py, with hand-written expected values."""

from __future__ import annotations

import pickle

import pytest
import torch

from roll_core.data import Batch


def make_batch() -> Batch:
    # x[i] = [2i, 2i+1]; y[i] = i; ids[i] = "abcde"[i]
    return Batch(
        tensors={"x": torch.arange(10).reshape(5, 2), "y": torch.arange(5, dtype=torch.float32)},
        non_tensors={"ids": list("abcde")},
        meta={"step": 3},
    )


def test_access() -> None:
    b = make_batch()
    assert len(b) == 5
    assert b.keys() == ["x", "y", "ids"]
    assert "x" in b and "ids" in b and "z" not in b
    assert b["ids"] == ["a", "b", "c", "d", "e"]
    assert b["x"][4].tolist() == [8, 9]
    with pytest.raises(KeyError, match="'z'"):
        b["z"]
    assert len(Batch()) == 0


def test_validation_names_the_key() -> None:
    with pytest.raises(ValueError, match="'y' has 4 samples, but 'x' has 5"):
        Batch(tensors={"x": torch.zeros(5), "y": torch.zeros(4, 2)})
    with pytest.raises(ValueError, match="'ids' has 2 samples"):
        Batch(tensors={"x": torch.zeros(5)}, non_tensors={"ids": ["a", "b"]})
    with pytest.raises(ValueError, match="'s' is a scalar"):
        Batch(tensors={"s": torch.tensor(1.0)})
    with pytest.raises(ValueError, match="'ids' is a tuple"):
        Batch(non_tensors={"ids": ("a",)})
    with pytest.raises(ValueError, match=r"\['k'\] are both"):
        Batch(tensors={"k": torch.zeros(1)}, non_tensors={"k": [1]})


def test_setitem_checks_length_and_keeps_old_value() -> None:
    b = make_batch()
    b["adv"] = torch.ones(5)
    b["text"] = ["t"] * 5
    assert b.keys() == ["x", "y", "adv", "ids", "text"]
    with pytest.raises(ValueError, match="'y'"):
        b["y"] = torch.zeros(3)
    assert b["y"].tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]
    b["y"] = ["now", "a", "list", "of", "five"]  # moves from tensors to non_tensors
    assert "y" not in b.tensors and b["y"][0] == "now"


def test_select() -> None:
    b = make_batch()
    s = b.select([4, 0])
    assert s["x"].tolist() == [[8, 9], [0, 1]]
    assert s["y"].tolist() == [4.0, 0.0]
    assert s["ids"] == ["e", "a"]
    assert s.meta == {"step": 3}
    m = b.select(torch.tensor([True, False, True, False, False]))
    assert m["ids"] == ["a", "c"] and m["x"][:, 0].tolist() == [0, 4]
    assert len(b.select([])) == 0
    with pytest.raises(IndexError):
        b.select([5])


def test_split_sizes_and_order() -> None:
    b = make_batch()
    parts = b.split(3)
    assert [len(p) for p in parts] == [2, 2, 1]
    assert [p["ids"] for p in parts] == [["a", "b"], ["c", "d"], ["e"]]
    assert parts[2]["x"].tolist() == [[8, 9]]
    assert [len(p) for p in b.split(2)] == [3, 2]
    assert [len(p) for p in b.split(5)] == [1] * 5
    with pytest.raises(ValueError, match="5 samples into 6 chunks"):
        b.split(6)
    with pytest.raises(ValueError):
        b.split(0)


def test_chunk() -> None:
    parts = make_batch().chunk(2)
    assert [p["ids"] for p in parts] == [["a", "b"], ["c", "d"], ["e"]]
    assert [len(p) for p in make_batch().chunk(10)] == [5]
    with pytest.raises(ValueError):
        make_batch().chunk(0)


def test_concat_inverts_split() -> None:
    b = make_batch()
    parts = b.split(2)
    parts[1].meta["step"] = 99  # meta comes from the first batch
    joined = Batch.concat(parts)
    assert torch.equal(joined["x"], b["x"]) and torch.equal(joined["y"], b["y"])
    assert joined["ids"] == b["ids"] and joined.meta == {"step": 3}


def test_concat_rejects_different_keys() -> None:
    b = make_batch()
    other = Batch(tensors={"x": torch.zeros(1, 2, dtype=torch.long)})
    with pytest.raises(ValueError, match="batch 1 has keys"):
        Batch.concat([b, other])
    with pytest.raises(ValueError):
        Batch.concat([])


def test_to_device() -> None:
    moved = make_batch().to("meta")
    assert moved["x"].device.type == "meta" and moved["x"].shape == (5, 2)
    assert moved["ids"] == list("abcde") and moved.meta == {"step": 3}


def test_pickle_round_trip() -> None:
    b = make_batch()
    back = pickle.loads(pickle.dumps(b))
    assert back.keys() == b.keys() and torch.equal(back["x"], b["x"])
    assert back["ids"] == b["ids"] and back.meta == b.meta
