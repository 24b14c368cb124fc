"""A node that goes silent (tests/support/two_nodes.py; SIGSTOP of its whole process tree: alive, its
connections open, nothing answers, as a node whose network is cut). Node 0 notices through the beats in
the store, mid-request, while its ranks wait in a collective: it exits 3 within 10 s and its ranks with
it, and the client is told. Node 1, woken up again, finds node 0 gone and ends too."""

from __future__ import annotations

import os
import signal
import time

from live_server import wait_until
from test_distributed_lifecycle import Stream

from mstar.distributed.worker import EXIT_RANK_FAILED


def _signal_tree(node, sig: int) -> None:
    for pid in [node.proc.pid, *node.tree]:
        os.kill(pid, sig)


def test_a_silent_node1_ends_node0_and_node1_then_ends_itself(two_nodes):
    stream = Stream(two_nodes.url, list(range(3, 20)), max_tokens=400)
    stream.start()
    assert stream.first.wait(60)
    start = time.monotonic()
    _signal_tree(two_nodes.node1, signal.SIGSTOP)
    try:
        status = two_nodes.node0.proc.wait(timeout=30)
        elapsed = time.monotonic() - start
    finally:
        _signal_tree(two_nodes.node1, signal.SIGCONT)
    assert status == EXIT_RANK_FAILED, two_nodes.logs()
    assert elapsed < 10, f"node 0 took {elapsed:.1f} s to stop"
    assert "node 1 sent no heartbeat" in two_nodes.node0.log()
    assert wait_until(two_nodes.node0.all_gone, 5), "a rank of node 0 outlived it"
    stream.join(10)
    assert not stream.is_alive() and stream.finish_reason != "length" and stream.error, "the client was not told"

    assert two_nodes.node1.proc.wait(timeout=10) == EXIT_RANK_FAILED, two_nodes.logs()
    assert wait_until(two_nodes.node1.all_gone, 5), "a rank of node 1 outlived it"
