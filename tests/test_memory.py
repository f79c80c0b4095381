"""The service gives back memory it only caches: a storage unit's ``trim`` releases the idle buffers of
past fetches and its free heap pages, not only the free pages of its arena.

Real controller and storage-unit processes; memory measured from outside with psutil.
"""

from __future__ import annotations

import psutil
import torch

from conftest import wait_until
from tq import TQClient, TQServer

MiB = 1 << 20


def _anon(pid: int) -> int:
    """Private memory of a process: RSS less its shared pages (the arena is shared memory)."""
    m = psutil.Process(pid).memory_info()
    return m.rss - m.shared


def test_trim_gives_back_a_units_idle_fetch_buffers():
    """A TCP get of 32 MiB leaves the unit holding the buffer it gathered the rows in (its pool keeps
    up to 256 MiB of them for the next fetch). Before, ``trim`` released only free arena pages and the
    unit stayed 32 MiB larger for good - one source of the chaos benchmark's RSS growth, which trims
    before it measures; now the buffer goes back to the OS."""
    with TQServer(storage_units=1, capacity=128 * MiB) as server, TQClient(server.address, transport="tcp") as c:
        c.register_partition("p")
        value = torch.arange(8 * MiB, dtype=torch.int32).reshape(1, -1)  # 32 MiB in one row
        meta = c.put("p", ["big"], {"x": value})
        assert torch.equal(c.get(meta, ["x"])["x"], value)
        pid = c.stats()["units"][0]["pid"]
        before = _anon(pid)
        c.trim()
        assert wait_until(lambda: before - _anon(pid) > 24 * MiB, timeout=5), (
            f"unit private memory {before / MiB:.0f} MiB before trim, {_anon(pid) / MiB:.0f} MiB after"
        )
        assert torch.equal(c.get(meta, ["x"])["x"], value)  # and it still serves


def test_trim_gives_back_a_units_idle_receive_buffers():
    """A TCP put of 32 MiB reaches its unit as one message, received into a pooled buffer that the
    unit keeps for the next (up to stream_transport.RECEIVE_POOL_BYTES): ``trim`` gives it back."""
    with TQServer(storage_units=1, capacity=128 * MiB) as server, TQClient(server.address, transport="tcp") as c:
        c.register_partition("p")
        value = torch.arange(8 * MiB, dtype=torch.int32).reshape(1, -1)  # 32 MiB in one row
        meta = c.put("p", ["big"], {"x": value})
        stats = c.stats()
        pid, unit = stats["units"][0]["pid"], stats["unit_stats"][0]
        before = _anon(pid)
        free = unit["arena_size"] - unit["bytes_used"]  # what trim releases of the arena
        assert c.trim() - free >= 24 * MiB  # the receive buffer is counted among the released bytes
        assert wait_until(lambda: before - _anon(pid) > 24 * MiB, timeout=5), (
            f"unit private memory {before / MiB:.0f} MiB before trim, {_anon(pid) / MiB:.0f} MiB after"
        )
        assert torch.equal(c.get(meta, ["x"])["x"], value)  # and it still serves
