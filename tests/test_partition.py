"""A network partition between two emulated hosts (network namespaces), and its healing: a writer on
the cut-off node and a reader of its rows on the head fail fast while the link is down, succeed again
within seconds of it coming back (not after TCP's retransmission back-off), and every acknowledged
write reads back bit-exact (``benchmarks/tq_partition.py``). Skipped where namespaces cannot be made."""

from __future__ import annotations

import pytest

from benchmarks import tq_partition
from conftest import cannot_make_netns

WHY = cannot_make_netns()


@pytest.mark.skipif(WHY is not None, reason=WHY or "")
@pytest.mark.timeout(240)
@pytest.mark.long
def test_a_partitioned_node_is_served_again_within_seconds_of_the_link_coming_back(tmp_path):
    # 15 s down: the old connections' next retransmission would come ~10 s after the heal
    r = tq_partition.run(cut_s=15.0, after_s=6.0, timeout=5.0, run_dir=tmp_path)
    failed = [(name, got, want) for name, got, want, met in tq_partition.targets(r) if not met]
    assert not failed, (failed, r["roles"])
