"""JaggedTensor's conversions from and to padded tensors, against the plain masked-select definition."""

from __future__ import annotations

import pytest
import torch

from tq import JaggedTensor


def _reference(padded: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    mask = torch.arange(padded.shape[1]).unsqueeze(0) < lengths.unsqueeze(1)
    return padded[mask]


@pytest.mark.parametrize("dtype", [torch.int64, torch.float32, torch.bfloat16, torch.bool, torch.uint8])
@pytest.mark.parametrize("trailing", [(), (3,), (2, 5)])
def test_from_padded_takes_each_rows_first_entries_back_to_back(dtype, trailing):
    g = torch.Generator().manual_seed(len(trailing) * 7 + 1)
    n, L = 37, 53
    padded = (torch.randn((n, L, *trailing), generator=g) * 100).to(dtype)
    lengths = torch.randint(0, L + 1, (n,), generator=g)
    lengths[3], lengths[4] = 0, L  # an empty row and a full one
    jt = JaggedTensor.from_padded(padded, lengths)
    want = _reference(padded, lengths)
    assert jt.values.dtype == dtype and jt.values.shape == want.shape
    assert torch.equal(
        jt.values.view(torch.uint8) if dtype == torch.bfloat16 else jt.values, want.view(torch.uint8) if dtype == torch.bfloat16 else want
    )
    assert jt.lengths.tolist() == lengths.tolist()
    assert torch.equal(jt.to_padded(L, 0)[_mask(lengths, L)], want)  # and back


def _mask(lengths: torch.Tensor, L: int) -> torch.Tensor:
    return torch.arange(L).unsqueeze(0) < lengths.unsqueeze(1)


def test_from_padded_reads_a_non_contiguous_tensor_and_edge_shapes():
    base = torch.arange(6 * 9, dtype=torch.float32).reshape(9, 6)
    padded = base.t()  # [6, 9], not contiguous
    lengths = torch.tensor([9, 0, 4, 1, 9, 2])
    assert torch.equal(JaggedTensor.from_padded(padded, lengths).values, _reference(padded, lengths))
    assert JaggedTensor.from_padded(torch.zeros(0, 5), []).values.shape == (0,)
    assert JaggedTensor.from_padded(torch.zeros(3, 5, 2), [0, 0, 0]).values.shape == (0, 2)


@pytest.mark.parametrize(
    "padded, lengths",
    [(torch.zeros(3, 4), [1, 2]), (torch.zeros(3, 4), [1, 5, 2]), (torch.zeros(3, 4), [1, -1, 2]), (torch.zeros(4), [1, 1, 1, 1])],
)
def test_from_padded_refuses_lengths_that_do_not_fit(padded, lengths):
    with pytest.raises(ValueError, match="do not fit"):
        JaggedTensor.from_padded(padded, lengths)


@pytest.mark.parametrize(
    "dtype, pad", [(torch.int64, -3), (torch.float32, 1.5), (torch.bfloat16, -2.0), (torch.bool, True), (torch.uint8, 9)]
)
@pytest.mark.parametrize("trailing", [(), (3,)])
def test_to_padded_writes_rows_then_the_pad_value(dtype, pad, trailing):
    g = torch.Generator().manual_seed(3)
    lengths = torch.tensor([5, 0, 11, 1, 7])
    offsets = torch.zeros(6, dtype=torch.int64)
    torch.cumsum(lengths, 0, out=offsets[1:])
    values = (torch.randn((int(offsets[-1]), *trailing), generator=g) * 50).to(dtype)
    jt = JaggedTensor(values, offsets)
    want = torch.full((5, 13, *trailing), pad, dtype=dtype)
    want[_mask(lengths, 13)] = values
    got = jt.to_padded(13, pad)
    assert got.dtype == dtype and got.shape == want.shape
    assert torch.equal(
        got.view(torch.uint8) if dtype == torch.bfloat16 else got, want.view(torch.uint8) if dtype == torch.bfloat16 else want
    )
    assert jt.to_padded().shape[1] == 11  # the longest row by default
    with pytest.raises(ValueError, match="shorter than the longest row"):
        jt.to_padded(10)


@pytest.mark.parametrize(
    "values, offsets, message",
    [
        (
            torch.tensor(1),
            torch.tensor([0, 1]),
            r"values must be a tensor of at least 1 dim \[total, \*trailing\], got a tensor of shape \(\)",
        ),
        ([1, 2], torch.tensor([0, 2]), "values must be a tensor of at least 1 dim .*, got list"),
        (torch.arange(2), [0, 2], "offsets must be a 1-d int64 tensor, got list"),
        (torch.arange(5), torch.tensor([0, 3, 2, 5]), "offsets must be non-decreasing"),
    ],
    ids=["0d-values", "list-values", "list-offsets", "decreasing"],
)
def test_a_jagged_tensor_of_the_wrong_parts_is_refused_naming_them(values, offsets, message):
    """A 0-d values tensor was an IndexError from its shape, a list an AttributeError."""
    with pytest.raises(ValueError, match=message):
        JaggedTensor(values, offsets)
