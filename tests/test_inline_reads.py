"""Inline reads: a reader of another host (a ``transport="tcp"`` client acts as one) gets few rows that
lie in arenas of the controller's host back in the locate reply - one round trip, no fetch from the
unit - and everything else as before. Real controller and storage-unit processes."""

from __future__ import annotations

import os
import signal

import numpy as np
import pytest
import torch

from conftest import unique_keys, wait_until
from tq import TQClient, TQServer
from tq.controller import INLINE_ROWS_BYTES
from tq.errors import StorageUnitError, TQConnectionError

MiB = 1 << 20


def _served(client: TQClient) -> list[int]:
    """Bytes each unit sent in fetch replies."""
    return [u["bytes_served_total"] for u in client.stats()["unit_stats"]]


def test_a_remote_readers_small_get_comes_back_with_the_locate_not_from_the_unit():
    """Fixed-shape, jagged and object fields of a few keys, read in another key order than written:
    right values in the asked layouts, and no byte served by the unit - the controller sent them."""
    with TQServer(storage_units=1, capacity=16 * MiB) as srv, TQClient(srv.address, transport="tcp") as remote:
        remote.register_partition("ir")
        keys = unique_keys(5)
        x = torch.arange(20, dtype=torch.float32).reshape(5, 4)
        tokens = [torch.arange(n, dtype=torch.int64) + 10 * n for n in (3, 1, 4, 1, 5)]
        meta = remote.put("ir", keys, {"x": x, "tokens": tokens, "text": ["a", "bb", "", "dddd", "e"]})
        served, inline = _served(remote), remote.stats()["bytes_read_inline_total"]
        order = [3, 0, 4, 1, 2]
        sub = remote.get_meta("ir", [keys[i] for i in order])
        got = remote.get(sub, ["x", "tokens", "text"], layout="list")
        assert torch.equal(got["x"], x[order])
        assert [t.tolist() for t in got["tokens"]] == [tokens[i].tolist() for i in order]
        assert got["text"] == [["a", "bb", "", "dddd", "e"][i] for i in order]
        padded = remote.get(meta, ["tokens"], pad_value=-1)["tokens"]
        assert padded.shape == (5, 5) and padded[1].tolist() == [10, -1, -1, -1, -1]
        assert _served(remote) == served  # the unit sent nothing
        x_bytes, token_bytes = x.numel() * 4, sum(t.numel() for t in tokens) * 8  # and the text's, in the first get
        assert remote.stats()["bytes_read_inline_total"] > inline + x_bytes + 2 * token_bytes


def test_rows_up_to_the_inline_limit_come_inline_past_it_from_the_unit_and_same_host_readers_read_the_arena():
    """Exactly INLINE_ROWS_BYTES come inline; one row more than that comes from the unit; a same-host
    reader reads the arena itself (nothing inline, nothing served)."""
    with (
        TQServer(storage_units=1, capacity=16 * MiB) as srv,
        TQClient(srv.address, transport="tcp") as remote,
        TQClient(srv.address) as here,
    ):
        remote.register_partition("ir-big")
        fits = torch.arange(INLINE_ROWS_BYTES // 4, dtype=torch.float32).reshape(2, -1)
        big = torch.arange(INLINE_ROWS_BYTES // 4 + 1024, dtype=torch.float32).reshape(1, -1)
        at_limit, over = remote.put("ir-big", unique_keys(2), {"x": fits}), remote.put("ir-big", unique_keys(1), {"y": big})
        served, inline = _served(remote), remote.stats()["bytes_read_inline_total"]
        assert torch.equal(remote.get(at_limit, ["x"])["x"], fits)
        assert _served(remote) == served and remote.stats()["bytes_read_inline_total"] == inline + INLINE_ROWS_BYTES
        assert torch.equal(remote.get(over, ["y"])["y"], big)
        assert _served(remote)[0] >= served[0] + big.numel() * 4
        assert torch.equal(here.get(over, ["y"])["y"], big)
        assert remote.stats()["bytes_read_inline_total"] == inline + INLINE_ROWS_BYTES


def test_rows_on_several_units_come_back_inline_in_key_order():
    """Keys written to two units, read interleaved: each row is taken from its own unit's arena."""
    with TQServer(storage_units=2, capacity=32 * MiB) as srv, TQClient(srv.address, transport="tcp") as remote:
        remote.register_partition("ir-two")
        metas = []
        for unit in (0, 1):
            remote._pick_unit = lambda nbytes=0, unit=unit: unit  # pin this put to one unit
            metas.append(
                remote.put("ir-two", unique_keys(3, f"u{unit}"), {"x": torch.full((3, 2), float(unit)) + torch.arange(3.0)[:, None]})
            )
        served = _served(remote)
        keys = [k for pair in zip(metas[0].keys, metas[1].keys) for k in pair]
        got = remote.get(remote.get_meta("ir-two", keys), ["x"])["x"]
        want = torch.tensor([[u + i, u + i] for i in range(3) for u in (0.0, 1.0)])
        assert torch.equal(got, want)
        assert _served(remote) == served


def test_a_unit_restarted_on_its_arena_is_read_inline_again_and_a_down_one_is_named():
    """While the unit is down its rows are refused naming it (as the fetch would be); once restarted on
    its arena the controller maps it anew and the rows come back inline, the same."""
    with TQServer(storage_units=1, capacity=16 * MiB) as srv, TQClient(srv.address, transport="tcp", timeout=20.0) as remote:
        remote.register_partition("ir-restart")
        meta = remote.put("ir-restart", unique_keys(4), {"x": torch.arange(8.0).reshape(4, 2)})
        assert torch.equal(remote.get(meta, ["x"])["x"], torch.arange(8.0).reshape(4, 2))
        st = remote.stats()
        pid, version = st["unit_stats"][0]["pid"], st["units_version"]
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(StorageUnitError, match="storage unit 0"):
            for _ in range(100):  # until the controller has seen it go
                remote.get(meta, ["x"])

        def rejoined() -> bool:
            try:
                return remote.stats()["units_version"] > version
            except TQConnectionError:
                return False

        assert wait_until(rejoined, timeout=30.0, interval=0.2)
        served, inline = _served(remote), remote.stats()["bytes_read_inline_total"]
        assert torch.equal(remote.get(meta, ["x"])["x"], torch.arange(8.0).reshape(4, 2))
        assert _served(remote) == served
        assert remote.stats()["bytes_read_inline_total"] == inline + 32


def test_a_row_freed_and_its_space_reused_is_never_read_inline_for_another_key():
    """A discarded key's space taken by a new key: the old meta's get is refused, the new one reads
    its own bytes (the controller reads only rows it still locates)."""
    with TQServer(storage_units=1, capacity=16 * MiB) as srv, TQClient(srv.address, transport="tcp") as remote:
        remote.register_partition("ir-reuse")
        old = remote.put("ir-reuse", unique_keys(2, "old"), {"x": torch.zeros(2, 64)})
        remote.discard(old)
        new = remote.put("ir-reuse", unique_keys(2, "new"), {"x": torch.ones(2, 64)})
        inline = remote.stats()["bytes_read_inline_total"]
        assert torch.equal(remote.get(new, ["x"])["x"], torch.ones(2, 64))
        assert remote.stats()["bytes_read_inline_total"] == inline + 2 * 64 * 4  # it was read inline
        with pytest.raises(Exception, match="old"):
            remote.get(old, ["x"])
        assert np.all(remote.get(new, ["x"])["x"].numpy() == 1.0)
