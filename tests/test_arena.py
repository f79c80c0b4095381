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


@pytest.mark.skipif(_MADV_POPULATE_WRITE is None, reason="MADV_POPULATE_WRITE is Linux-only")
def test_prefault_skips_pieces_it_mapped_before_until_told_they_were_given_back() -> None:
    """A writer's mapping remembers the whole 2 MiB pieces it populated: populating them again walks
    every page for nothing. Proven by the owner giving the pages back behind its back (what a trim
    does): the stale memory skips them, and after forget_populated they are mapped again."""
    path = f"/dev/shm/tq-test-arena-{uuid.uuid4().hex}"
    owner = Arena(path, 16 << 20, create=True, own=True)
    writer = Arena(path, 16 << 20, create=False)
    try:
        owner.allocate_pages(0, 16 << 20)
        writer.prefault(0, 8 << 20)
        assert _resident_bytes(path) >= 8 << 20
        owner.release_pages(0, 16 << 20)  # the pages go back to the OS: unmapped in every process
        assert _resident_bytes(path) == 0
        writer.prefault(0, 8 << 20)  # remembered as mapped: no call
        assert _resident_bytes(path) == 0
        writer.prefault(3 * 4096 + (8 << 20), 4 << 20)  # new pieces are still mapped
        assert 4 << 20 <= _resident_bytes(path) <= (4 << 20) + 2 * 4096
        writer.forget_populated()
        writer.prefault(0, 8 << 20)
        assert _resident_bytes(path) >= 12 << 20
        # an unaligned range marks only the pieces it covered whole: the partial ones are mapped again
        owner.release_pages(0, 16 << 20)
        writer.forget_populated()
        writer.prefault(4096, (4 << 20) - 8192)  # piece 0 from its second page, piece 1 but its last page
        owner.release_pages(0, 16 << 20)
        writer.prefault(0, 4 << 20)
        assert _resident_bytes(path) == 4 << 20  # neither piece was whole: both mapped again
    finally:
        writer.close()
        owner.close(unlink=True)


def test_a_shared_memory_file_past_the_file_size_limit_fails_as_capacity_and_leaves_nothing(tmp_path):
    """A process under a file size limit (``ulimit -f``; RLIMIT_FSIZE, which the tests' full-disk
    fault sets on a whole process) cannot make a location table's file past it: that is the
    CapacityError naming the limit - what the controller turns into a clean refusal before any state
    changes - not a bare OSError its serving loop reports as an internal error. Found by the
    model-based crash test (a commit needing a new table column while the journal could not grow)."""
    import resource
    import signal

    from tq.arena import map_new_shm_file
    from tq.errors import CapacityError

    path = str(tmp_path / "table")
    old = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 16, old[1]))
    try:
        with pytest.raises(CapacityError, match="file size limit"):
            map_new_shm_file(path, 1 << 20)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old)
        signal.signal(signal.SIGXFSZ, handler)
    assert os.listdir(tmp_path) == []
    fd, mm = map_new_shm_file(path, 1 << 20)  # the limit lifted: made whole
    assert os.fstat(fd).st_size == 1 << 20
    mm.close()
    os.close(fd)
