"""A node that goes silent (tests/support/two_nodes.py; SIGSTOP of its whole process tree: alive, its
connections open, nothing answers, as a node whose network is cut), either way round:
- node 1 silent: node 0 notices through the beats in the store, mid-request, while its ranks wait in a
  collective: it exits 3 within 10 s and its ranks with it, and the client is told. Node 1, woken up
  again, finds node 0 gone and ends too.
- node 0 silent (the HTTP node, which hosts the store): node 1's launcher finds the store silent while its
  ranks wait in a collective, kills them and exits 3 within 10 s. Node 0, woken up again, finds node 1 gone:
  it exits 3 with nothing left running, and the client is told."""

from __future__ import annotations

import contextlib
import os
import signal
import time

from live_server import wait_until
from test_distributed_lifecycle import Stream

from mstar.distributed.worker import EXIT_RANK_FAILED


def _signal_tree(node, sig: int) -> None:
    for pid in [node.proc.pid, *node.tree]:
        # a process of the tree may be gone already (killed while stopped, as the other node ended): nothing to do
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def _stop_until_the_other_exits(silent, other) -> tuple[int, float]:
    """SIGSTOP `silent`'s tree until `other` exits (30 s at most): its exit status and how long it took."""
    start = time.monotonic()
    _signal_tree(silent, signal.SIGSTOP)
    try:
        status = other.proc.wait(timeout=30)
        return status, time.monotonic() - start
    finally:
        _signal_tree(silent, signal.SIGCONT)


def _streaming(two_nodes) -> Stream:
    stream = Stream(two_nodes.url, list(range(3, 20)), max_tokens=400)
    stream.start()
    assert stream.first.wait(60)
    return stream


def test_a_silent_node1_ends_node0_and_node1_then_ends_itself(two_nodes):
    stream = _streaming(two_nodes)
    status, elapsed = _stop_until_the_other_exits(two_nodes.node1, two_nodes.node0)
    assert status == EXIT_RANK_FAILED, two_nodes.logs()
    assert elapsed < 10, f"node 0 took {elapsed:.1f} s to stop"
    assert "node 1 sent no heartbeat" in two_nodes.node0.log()
    assert wait_until(two_nodes.node0.all_gone, 5), "a rank of node 0 outlived it"
    stream.join(10)
    assert not stream.is_alive() and stream.finish_reason != "length" and stream.error, "the client was not told"

    assert two_nodes.node1.proc.wait(timeout=10) == EXIT_RANK_FAILED, two_nodes.logs()
    assert wait_until(two_nodes.node1.all_gone, 5), "a rank of node 1 outlived it"


def test_a_silent_node0_ends_node1_then_node0_ends_itself(two_nodes):
    stream = _streaming(two_nodes)
    status, elapsed = _stop_until_the_other_exits(two_nodes.node0, two_nodes.node1)
    assert status == EXIT_RANK_FAILED, two_nodes.logs()
    assert elapsed < 10, f"node 1 took {elapsed:.1f} s to stop"
    assert "node 1: node 0 is gone: the rendezvous store (on node 0)" in two_nodes.node1.log(), two_nodes.logs()
    assert wait_until(two_nodes.node1.all_gone, 5), "a rank of node 1 outlived it"

    assert two_nodes.node0.proc.wait(timeout=10) == EXIT_RANK_FAILED, two_nodes.logs()
    assert wait_until(two_nodes.node0.all_gone, 5), "a rank of node 0 outlived it"
    stream.join(10)
    assert not stream.is_alive() and stream.finish_reason != "length" and stream.error, "the client was not told"
