"""Gets into page-locked memory (``get(..., pin_memory=True)``), for a rank that moves its batch to a GPU.

The result tensors are views of one buffer from torch's pinned-memory allocator, made by torch
itself (not numpy), so torch knows their storage as its own pinned block - it keeps such a block
from reuse while a ``non_blocking`` copy out of it runs, as for ``Tensor.pin_memory()``. The bytes
are checked on a GPU where there is one; everywhere, the views' storage and the refusals.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import assert_same, unique_keys, wide_batch, wide_pad
from tq import JaggedTensor, TQClient
from tq.client import _results
from tq.columns import field_layout, tensor_at, tensor_in
from tq.errors import InvalidRequestError
from tq.schema import FieldSchema

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (page-locked memory is for copies to a GPU)")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16", "int64", "int32", "int8", "uint8", "bool", "float64"])
def test_views_of_a_torch_buffer_read_as_numpy_views_do_and_share_its_storage(dtype):
    schema = FieldSchema(kind="tensor", dtype=dtype, shape=(3,))
    lay = field_layout(schema)
    base = torch.from_numpy(np.random.default_rng(0).integers(0, 2, size=4096, dtype=np.uint8))
    shape = (5, 3)
    start = 128
    want = tensor_at(base.numpy(), start, lay, shape)
    got = tensor_in(base, start, 5 * 3 * lay.bits.itemsize, lay, shape)
    assert got.dtype == want.dtype and got.shape == want.shape
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    assert got.untyped_storage().data_ptr() == base.untyped_storage().data_ptr()  # torch's own storage, not numpy's
    empty = tensor_in(base, 4096, 0, lay, (0, 3))
    assert empty.shape == (0, 3)


def test_results_made_from_a_torch_buffer_are_its_views():
    schema = FieldSchema(kind="jagged", dtype="int64", shape=())
    lay = field_layout(schema)
    base = torch.arange(64, dtype=torch.int64).view(torch.uint8)

    class Fetched:  # what _results reads of a fetched field: its rows' byte sizes
        sizes = np.array([16, 24, 8], dtype=np.int64)
        row_offsets = None

    out = _results(base.numpy(), [(Fetched, lay, 64, 48, (6,))], ["x"], "jagged", base)
    jt = out["x"]
    assert isinstance(jt, JaggedTensor) and jt.values.tolist() == [8, 9, 10, 11, 12, 13]
    assert jt.offsets.tolist() == [0, 2, 5, 6]
    assert jt.values.untyped_storage().data_ptr() == base.untyped_storage().data_ptr()


def test_pin_memory_with_copy_false_is_refused_naming_both(client, partition):
    meta = client.put(partition, unique_keys(2), {"x": torch.arange(2)})
    with pytest.raises(InvalidRequestError, match="pin_memory=True copies into page-locked memory; copy=False"):
        client.get(meta, ["x"], copy=False, pin_memory=True)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where there is no CUDA")
def test_pin_memory_without_cuda_is_refused_at_once(client, partition):
    meta = client.put(partition, unique_keys(2), {"x": torch.arange(2)})
    with pytest.raises(InvalidRequestError, match=r"pin_memory=True needs CUDA"):
        client.get(meta, ["x"], pin_memory=True)


@cuda
@pytest.mark.parametrize("transport", ["auto", "tcp"])
def test_a_pinned_get_gives_pinned_tensors_of_the_same_bytes_that_copy_to_the_gpu(tq_server, transport):
    n = 40
    cols = wide_batch(n, 12, 517, seed=11)
    jagged = [f for f, v in cols.items() if isinstance(v, JaggedTensor)]
    pads = {f: wide_pad(cols[f].dtype) for f in jagged}
    with TQClient(tq_server.address, timeout=15.0, transport=transport) as c:
        pid = f"pinned-{transport}"
        c.register_partition(pid, reuse=True)
        try:
            meta = c.put(pid, unique_keys(n), cols)
            for layout in ("padded", "jagged"):
                want = c.get(meta, layout=layout, pad_value=pads)
                got = c.get(meta, layout=layout, pad_value=pads, pin_memory=True)
                for f in jagged:
                    g, w = (got[f], want[f]) if layout == "padded" else (got[f].values, want[f].values)
                    assert g.is_pinned() and not w.is_pinned()
                    on_gpu = g.to("cuda", non_blocking=True)
                    del g, got[f]  # the source may go at once: torch holds its block until the copy ran
                    torch.cuda.synchronize()
                    assert_same(on_gpu.cpu(), w)
                assert_same(got["reward"], cols["reward"])
                assert got["reward"].is_pinned()
                assert got["tag"] == cols["tag"]
        finally:
            c.drop_partition(pid)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where there is no CUDA")
def test_the_gpu_fetch_benchmark_says_it_needs_cuda(capsys):
    from benchmarks.gpu_fetch import main

    with pytest.raises(SystemExit) as exc:
        main(["--run-dir", "unused"])
    assert exc.value.code == 2 and "needs a CUDA device" in capsys.readouterr().err
