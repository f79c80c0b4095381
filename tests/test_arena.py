"""tq.arena.Arena: pre-faulting a range maps its pages in this process before a big copy."""

import os
import uuid

import psutil
import pytest

from tq.arena import _MADV_POPULATE_WRITE, Arena


def _resident_bytes(path: str) -> int:
    return sum(m.rss for m in psutil.Process().memory_maps(grouped=True) if m.path == path)


@pytest.mark.skipif(_MADV_POPULATE_WRITE is None, reason="MADV_POPULATE_WRITE is Linux-only")
def test_prefault_maps_the_range_and_only_it() -> None:
    path = f"/dev/shm/tq-test-arena-{uuid.uuid4().hex}"
    arena = Arena(path, 16 << 20, create=True)
    try:
        assert _resident_bytes(path) == 0  # a sparse file: nothing mapped yet
        arena.prefault(3 * 4096 + 17, 4 << 20)  # an unaligned start: its page is included
        assert 4 << 20 <= _resident_bytes(path) <= (4 << 20) + 2 * 4096
        arena.view[3 * 4096 + 17 : (3 * 4096 + 17) + (4 << 20)] = 7  # and the range is writable as usual
        assert int(arena.view[(3 * 4096 + 17) + (4 << 20) - 1]) == 7
        arena.prefault(0, 0)  # nothing to do
    finally:
        arena.close(unlink=True)
    assert not os.path.exists(path)
