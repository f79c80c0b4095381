"""BatchedDataDict: per-sample column operations keep tensors and lists aligned."""

from __future__ import annotations

import pytest
import torch

from common.batched_data_dict import BatchedDataDict


def _bdd(n: int = 5, width: int = 3) -> BatchedDataDict:
    return BatchedDataDict(
        ids=torch.arange(n * width).reshape(n, width),
        score=torch.arange(n, dtype=torch.float32),
        text=[f"s{i}" for i in range(n)],
    )


def test_size_and_mismatch():
    assert _bdd().size == 5
    assert BatchedDataDict().size == 0
    bad = BatchedDataDict(a=torch.zeros(3), b=[1, 2])
    with pytest.raises(ValueError, match="different batch sizes"):
        bad.size


def test_select_slice_shard_chunk():
    b = _bdd()
    s = b.select_indices([4, 0, 4])
    assert s["text"] == ["s4", "s0", "s4"]
    assert s["score"].tolist() == [4.0, 0.0, 4.0]
    assert torch.equal(s["ids"][1], b["ids"][0])
    assert b.slice(1, 3)["text"] == ["s1", "s2"] and b.slice(1, 3)["ids"].shape == (2, 3)
    shards = b.shard_by_indices([[0, 2, 4], [1, 3]])
    assert [x["text"] for x in shards] == [["s0", "s2", "s4"], ["s1", "s3"]]
    assert [c.size for c in b.chunk(2)] == [3, 2]
    assert b.chunk(2)[1]["text"] == ["s3", "s4"]
    with pytest.raises(IndexError):
        b.select_indices([5])


def test_from_batches_pads_token_dim():
    a = BatchedDataDict(ids=torch.ones(2, 3, dtype=torch.long), m=torch.ones(2, 3, dtype=torch.bool), t=["a", "b"])
    b = BatchedDataDict(ids=torch.full((1, 5), 7), m=torch.ones(1, 5, dtype=torch.bool), t=["c"])
    out = BatchedDataDict.from_batches([a, b], pad_value_dict={"ids": -1})
    assert out["ids"].shape == (3, 5) and out["ids"][0].tolist() == [1, 1, 1, -1, -1]
    assert out["m"][1].tolist() == [True, True, True, False, False]  # default pad 0 / False
    assert out["t"] == ["a", "b", "c"]
    with pytest.raises(ValueError, match="keys"):
        BatchedDataDict.from_batches([a, BatchedDataDict(ids=torch.ones(1, 3))])


def test_repeat_interleave_and_to():
    b = _bdd(2).repeat_interleave(3)
    assert b["text"] == ["s0"] * 3 + ["s1"] * 3
    assert b["score"].tolist() == [0.0] * 3 + [1.0] * 3
    moved = b.to("cpu")
    assert isinstance(moved, BatchedDataDict) and moved["text"] is b["text"]
    with pytest.raises(KeyError, match="missing"):
        b.select_columns(["nope"])
