"""The client's pool of host buffers for get results: reuse, safety while a tensor still views a
buffer, best fit, most-recently-released first, and the idle-bytes budget."""

from __future__ import annotations

import gc
import os
import re
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch

from tq.bufferpool import POOL_GRANULE, HostBufferPool

MiB = 1 << 20


def _addr(a: np.ndarray) -> int:
    return a.__array_interface__["data"][0]


def test_a_released_buffer_is_reused_and_a_live_one_never_is():
    pool = HostBufferPool(max_cached_bytes=64 * MiB)
    a = pool.empty(3 * MiB)
    t = torch.from_numpy(a)  # a tensor viewing the buffer keeps it alive after the array is dropped
    first = _addr(a)
    del a
    gc.collect()
    b = pool.empty(3 * MiB)
    assert _addr(b) != first and pool.cached_bytes == 0  # still viewed by t: not handed out again
    b[:] = 7
    assert not (t.numpy() == 7).any()
    del t
    gc.collect()
    assert pool.cached_bytes == 4 * MiB  # rounded up to the 2 MiB granule
    c = pool.empty(3 * MiB)
    assert _addr(c) == first and pool.cached_bytes == 0


def test_most_recently_released_buffer_of_a_size_comes_back_first():
    pool = HostBufferPool(max_cached_bytes=64 * MiB)
    b0, b1, b2 = (pool.empty(2 * MiB) for _ in range(3))
    addrs = [_addr(b) for b in (b0, b1, b2)]
    del b0  # released in order 0, 1, 2
    gc.collect()
    del b1
    gc.collect()
    del b2
    gc.collect()
    x, y = pool.empty(2 * MiB), pool.empty(2 * MiB)
    assert (_addr(x), _addr(y)) == (addrs[2], addrs[1])


def test_best_fit_never_hands_out_a_buffer_over_twice_the_request():
    pool = HostBufferPool(max_cached_bytes=64 * MiB)
    big = pool.empty(16 * MiB)
    big_addr = _addr(big)
    del big
    gc.collect()
    small = pool.empty(2 * MiB)  # 16 MiB idle, but more than 2x: a new mapping
    assert _addr(small) != big_addr and pool.cached_bytes == 16 * MiB
    fits = pool.empty(9 * MiB)  # rounded to 10 MiB; 16 <= 20: reused
    assert _addr(fits) == big_addr and fits.size == 9 * MiB


def test_a_request_over_every_idle_buffer_grows_the_largest_in_place():
    """Batches that grow step by step (a GRPO run's responses lengthen) reuse the pages they had: the
    largest idle buffer is grown, keeping its bytes; a fresh mapping would be zeroed."""
    pool = HostBufferPool(max_cached_bytes=64 * MiB)
    small, large = pool.empty(2 * MiB), pool.empty(4 * MiB)
    large[: 4 * MiB] = 7
    del small, large
    gc.collect()
    grown = pool.empty(7 * MiB)  # rounded to 8 MiB; neither idle buffer holds it
    assert grown.size == 7 * MiB and (grown[: 4 * MiB] == 7).all()
    assert pool.cached_bytes == 2 * MiB  # the smaller one stays idle
    grown[:] = 1  # every byte of the grown buffer is writable
    del grown
    gc.collect()
    assert pool.cached_bytes == 10 * MiB  # it comes back at its new size
    again = pool.empty(8 * MiB)
    assert (again[: 4 * MiB] == 1).all() and pool.cached_bytes == 2 * MiB


def test_idle_bytes_stay_within_the_budget_and_small_requests_are_not_pooled():
    pool = HostBufferPool(max_cached_bytes=4 * MiB)
    bufs = [pool.empty(POOL_GRANULE) for _ in range(4)]
    del bufs
    gc.collect()
    assert pool.cached_bytes == 4 * MiB  # two of the four kept, the rest unmapped
    tiny = pool.empty(1000)
    assert tiny.size == 1000 and pool.cached_bytes == 4 * MiB
    pool.clear()
    assert pool.cached_bytes == 0


def test_buffers_are_private_anonymous_memory():
    """Not shared anonymous memory (shmem), which gets no transparent huge pages where shmem THP is off:
    each buffer's mapping in /proc/self/smaps is private ("rw-p")."""
    if not os.path.exists("/proc/self/smaps"):
        pytest.skip("needs /proc/self/smaps (Linux)")
    pool = HostBufferPool(max_cached_bytes=64 * MiB)
    a = pool.empty(4 * MiB)
    addr = _addr(a)
    with open("/proc/self/smaps") as f:
        for line in f:
            m = re.match(r"([0-9a-f]+)-([0-9a-f]+) (\S+)", line)
            if m and int(m.group(1), 16) <= addr < int(m.group(2), 16):
                assert m.group(3) == "rw-p", line
                return
    raise AssertionError("the buffer's mapping is not in /proc/self/smaps")


def _thread_faults() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt


@pytest.mark.skipif(not hasattr(__import__("resource"), "RUSAGE_THREAD"), reason="per-thread fault counts are Linux-only")
def test_a_fresh_buffer_is_populated_before_the_get_writes_it():
    from tq.bufferpool import huge_page_mapping

    try:  # MADV_POPULATE_WRITE needs Linux >= 5.14
        huge_page_mapping(POOL_GRANULE, populate=False).madvise(23)
    except (OSError, ValueError):
        pytest.skip("this kernel cannot populate a mapping in one call")
    pool = HostBufferPool(max_cached_bytes=256 * MiB)
    a = pool.empty(64 * MiB)
    before = _thread_faults()
    a[:] = 1  # what the get's copy does: every page written
    populated = _thread_faults() - before
    del a
    gc.collect()
    grown = pool.empty(128 * MiB)  # the idle 64 MiB grown: its new half is populated too
    before = _thread_faults()
    grown[64 * MiB :] = 1
    populated_grown = _thread_faults() - before
    plain = np.frombuffer(huge_page_mapping(64 * MiB), dtype=np.uint8)
    before = _thread_faults()
    plain[:] = 1
    faulted = _thread_faults() - before
    # 32 huge pages or 16k small ones, against (nearly) none: a loaded machine's kernel may fault a few
    # populated pages again (5 of 32 seen in a full-suite run), never most of them
    assert faulted >= 16 and populated * 4 <= faulted and populated_grown * 4 <= faulted, (populated, populated_grown, faulted)


_COLLECTED_INSIDE_THE_POOL = """
import gc
from tq.bufferpool import HostBufferPool
pool = HostBufferPool(max_cached_bytes=64 << 20)
arr = pool.empty(4 << 20)
cycle = [arr]
cycle.append(cycle)  # freed only by the cyclic collector, which runs at any allocation of any thread
del arr, cycle
gc.disable()
with pool._lock:  # the collector running while this thread is inside the pool (a get taking a buffer)
    gc.collect()
gc.enable()
assert pool.cached_bytes == 4 << 20, pool.cached_bytes  # the buffer still came back
again = pool.empty(4 << 20)
assert pool.cached_bytes == 0
print("collected", flush=True)
"""


def test_a_buffer_collected_while_its_thread_is_inside_the_pool_does_not_deadlock():
    """A pooled buffer returns when its last array is collected - by a finalizer, which runs wherever
    the collector happens to run: also inside the pool's own critical section, on the thread that
    holds its lock. The finalizer took that lock too, so the thread waited on itself forever. It now
    only queues the buffer; the next use of the pool takes it back."""
    out = subprocess.run([sys.executable, "-c", _COLLECTED_INSIDE_THE_POOL], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0 and out.stdout.strip() == "collected", out.stderr[-2000:]


def test_a_child_forked_while_another_thread_is_inside_a_pool_can_use_it():
    """The receive pool is shared by a process's threads (a big TCP get's lanes): a child forked while
    one of them held the pool's lock used to wait for it forever at its first big allocation."""
    pool = HostBufferPool()
    inside, leave = threading.Event(), threading.Event()

    def hold() -> None:
        with pool._lock:  # as a thread inside empty() at the moment of the fork
            inside.set()
            leave.wait(10)

    t = threading.Thread(target=hold)
    t.start()
    inside.wait(5)
    pid = os.fork()
    if pid == 0:  # the child: one allocation through the pool, then out
        try:
            ok = pool.empty(POOL_GRANULE).size == POOL_GRANULE
        finally:
            os._exit(0 if ok else 1)
    leave.set()
    t.join()
    for _ in range(100):  # at most 10 s
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        time.sleep(0.1)
    else:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        pytest.fail("the forked child waited on its pool's lock")
    assert os.waitstatus_to_exitcode(status) == 0


def test_a_buffer_queued_back_while_its_dying_array_still_exports_it_is_neither_grown_nor_closed_under_it():
    """A buffer's weak-reference callback runs while its array is being freed, before the array lets
    go of the mapping; another thread can take the buffer back in that window. Growing it (mremap)
    or closing it there raises BufferError: the pool leaves such a buffer alone instead of failing
    the get or the trim."""
    pool = HostBufferPool(max_cached_bytes=64 * MiB)
    a = pool.empty(2 * MiB)
    (ref,) = [r for r, _, _ in pool._watched.values() if r() is a]
    pool._released.put(ref)  # the callback's call, ``a`` not yet freed
    bigger = pool.empty(4 * MiB)  # the only idle buffer is smaller: grown - but it is still exported
    bigger[:] = 1
    assert bigger.size == 4 * MiB
    mm = a.base.obj if isinstance(a.base, memoryview) else a.base  # the mapping, still exported by ``a``
    pool._watched[id(ref)] = (ref, mm, 2 * MiB)  # back in the pool again, still exported
    pool._released.put(ref)
    pool.clear()  # closing it would raise too
    assert pool.cached_bytes == 0
    a[:] = 3  # the array still writes its own pages
