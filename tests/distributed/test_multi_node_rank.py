"""One rank of node 1 dies (tests/support/two_nodes.py: SIGKILL of one follower mid-request, as an OOM kill
or a GPU fault would): node 1's launcher kills its other rank and exits 3, node 0 names the rank that died
(reported through the store), exits 3 within 10 s, and nothing is left running on either node."""

from __future__ import annotations

import os
import signal
import time

from live_server import wait_until
from processes import is_spawned_rank
from test_distributed_lifecycle import Stream

from mstar.distributed.worker import EXIT_RANK_FAILED


def test_a_dead_rank_on_node1_ends_both_nodes_and_node0_names_it(two_nodes):
    stream = Stream(two_nodes.url, list(range(3, 20)), max_tokens=400)
    stream.start()
    assert stream.first.wait(60)
    victim = next(pid for pid in two_nodes.node1.tree if is_spawned_rank(pid))
    start = time.monotonic()
    os.kill(victim, signal.SIGKILL)
    assert two_nodes.node1.proc.wait(timeout=30) == EXIT_RANK_FAILED, two_nodes.logs()
    assert two_nodes.node0.proc.wait(timeout=30) == EXIT_RANK_FAILED, two_nodes.logs()
    elapsed = time.monotonic() - start
    assert elapsed < 10, f"the nodes took {elapsed:.1f} s to stop"
    assert wait_until(lambda: two_nodes.node0.all_gone() and two_nodes.node1.all_gone(), 5), "a rank outlived its node"
    assert f"(pid {victim}) exited with status -9" in two_nodes.node1.log()
    assert "node 1 failed: rank " in two_nodes.node0.log() and f"(pid {victim}) exited with status -9" in \
        two_nodes.node0.log(), two_nodes.logs()
    stream.join(10)
    assert not stream.is_alive() and stream.finish_reason != "length" and stream.error, "the client was not told"
