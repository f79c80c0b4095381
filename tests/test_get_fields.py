"""Gets of many fields at once (the get sweep's case): one buffer and one copy call for all of them.

Every field of a get is copied into one pooled buffer with one ``copy_fields`` call, on the streaming
path when the get as a whole is large, whatever each field's size. These tests check the bytes of
such gets (every dtype, trailing shapes, row spans that straddle the store vectors, per-field pads,
fixed-shape and object fields among them, all three layouts, both transports) and that the fields
share one pooled buffer.
"""

from __future__ import annotations

import os

import pytest
import torch

from conftest import assert_same, bits, unique_keys, wide_batch, wide_pad
from tq import JaggedTensor, TQClient, rowcopy
from tq.bufferpool import HostBufferPool


@pytest.mark.parametrize("transport", ["auto", "tcp"])
def test_a_wide_get_gives_every_field_bit_exact_in_every_layout(tq_server, transport):
    n, fields = 48, 24
    cols = wide_batch(n, fields, 701, seed=5)
    jagged = [f for f, v in cols.items() if isinstance(v, JaggedTensor)]
    padded_bytes = sum(n * 701 * v.values[0:1].numel() * v.values.element_size() for f, v in cols.items() if f in jagged)
    assert padded_bytes >= rowcopy.STREAM_BYTES > 0 and padded_bytes // fields < rowcopy.STREAM_BYTES  # one field alone would not stream
    with TQClient(tq_server.address, timeout=15.0, transport=transport) as c:
        pid = f"wide-{transport}"
        c.register_partition(pid, reuse=True)
        try:
            meta = c.put(pid, unique_keys(n), cols)
            pads = {f: wide_pad(cols[f].dtype, float("-inf") if cols[f].dtype.is_floating_point else 0) for f in jagged[::2]}
            for _ in range(2):  # the second get reuses the first one's pooled buffer
                got = c.get(meta, pad_value=pads)
                assert list(got) == list(cols)
                for f in jagged:
                    want = cols[f].to_padded(701, pads.get(f, 0))
                    assert_same(got[f], want)
                assert_same(got["reward"], cols["reward"])
                assert got["tag"] == cols["tag"]
            got = c.get(meta, jagged[:5], layout="jagged", pad_to=800)  # pad_to is for the padded layout only
            for f in jagged[:5]:
                assert torch.equal(got[f].offsets, cols[f].offsets)
                assert_same(got[f].values, cols[f].values)
            if transport == "auto":  # views of the arena, offsets made by the location read (24-byte rows among them)
                with c.get(meta, jagged[:5], layout="jagged", copy=False) as got:
                    assert got.viewed == frozenset(jagged[:5])
                    for f in jagged[:5]:
                        assert torch.equal(got[f].offsets, cols[f].offsets)
                        assert_same(got[f].values, cols[f].values)
            rows = c.get(meta, [jagged[1]], layout="list")[jagged[1]]
            for r, w in zip(rows, cols[jagged[1]].unbind()):
                assert_same(r, w)
            got = c.get(meta.with_extra_info(pad_to_multiple=64), jagged[:3])
            for f in jagged[:3]:
                assert got[f].shape[1] == 704
                assert torch.equal(bits(got[f]), bits(cols[f].to_padded(704)))
        finally:
            c.drop_partition(pid)


def test_the_fields_of_a_get_share_one_pooled_buffer(tq_server):
    """32 fields of 0.2 MB each: one pooled buffer for the get (before, each was below the pool's
    1 MiB minimum and fresh memory on every get), back in the pool once the last field dies."""
    n, fields = 64, 32
    offsets = torch.arange(n + 1, dtype=torch.int64) * 800
    cols = {f"f{f:02d}": JaggedTensor(torch.full((n * 800,), float(f)), offsets) for f in range(fields)}
    pool = HostBufferPool(max_cached_bytes=64 << 20)
    assert n * 800 * 4 < pool.min_pooled_bytes <= fields * n * 800 * 4
    with TQClient(tq_server.address, timeout=15.0, buffer_pool=pool) as c:
        c.register_partition("shared-buffer", reuse=True)
        try:
            meta = c.put("shared-buffer", unique_keys(n), cols)
            got = c.get(meta)
            assert all(bool((got[f] == float(i)).all()) and got[f].shape == (n, 800) for i, f in enumerate(cols))
            keep = got.pop("f07")
            del got
            assert pool.cached_bytes == 0  # one field still alive holds the get's buffer
            del keep
            assert pool.cached_bytes >= fields * n * 800 * 4
        finally:
            c.drop_partition("shared-buffer")


@pytest.mark.parametrize("transport", ["auto", "tcp"])
def test_large_gets_copy_on_torchs_intra_op_threads_and_puts_on_a_few_at_least(tq_server, transport, monkeypatch):
    """A get of several SHARE_BYTES copies on as many threads as torch's intra-op setting allows (what
    a Ray actor's ``num_cpus`` sets through ``OMP_NUM_THREADS``), one thread when it is 1; a same-host
    put on at least PUT_MIN_THREADS (or the cores there are), as Ray's object store copies a big object
    whatever the worker's setting. The bytes are the same either way. The thread counts are what the
    row copier reports it ran on."""
    if not rowcopy.HAVE_FASTCOPY:
        pytest.skip("the C helper was not built")
    import tq.client as client_mod

    ran: list[tuple[str, int]] = []
    real_fields, real_chunks = client_mod.copy_fields, client_mod.write_chunks
    monkeypatch.setattr(client_mod, "copy_fields", lambda *a: ran.append(("get", real_fields(*a))) or ran[-1][1])
    monkeypatch.setattr(client_mod, "write_chunks", lambda *a: ran.append(("put", real_chunks(*a))) or ran[-1][1])
    n, width = 64, (5 * rowcopy.SHARE_BYTES) // (64 * 4)  # one 20 MiB float32 column: 5 shares
    cores = len(os.sched_getaffinity(0))
    cols = {"x": torch.arange(n * width, dtype=torch.float32).reshape(n, width)}
    was = torch.get_num_threads()
    with TQClient(tq_server.address, timeout=30.0, transport=transport) as c:
        c.register_partition("copy-threads", reuse=True)
        try:
            for threads in (1, 2):
                torch.set_num_threads(threads)
                ran.clear()
                meta = c.put("copy-threads", unique_keys(n), cols)
                got = c.get(meta)
                assert torch.equal(got["x"], cols["x"])
                assert ("get", threads) in ran
                if transport == "auto":  # a same-host put writes the arena itself; over TCP the unit does
                    assert ("put", max(threads, min(client_mod.PUT_MIN_THREADS, cores))) in ran
                c.discard(meta)
        finally:
            torch.set_num_threads(was)
            c.drop_partition("copy-threads")
