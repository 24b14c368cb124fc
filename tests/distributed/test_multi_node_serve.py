"""Two "nodes" on loopback (tests/support/two_nodes.py: two `mstar-serve --nnodes 2 --node-rank N` process
trees of two ranks each, TP4 x EP2): greedy output over HTTP equals the TP1 reference, and SIGTERM to node
0 drains it, then both nodes exit 0 with nothing left running."""

from __future__ import annotations

import signal

from greedy_ties import assert_greedy_matches, random_jobs
from live_server import wait_until
from two_nodes import complete_all


def test_two_nodes_serve_greedy_identical_then_sigterm_drains_both(two_nodes, tiny_model):
    jobs = random_jobs(tiny_model, (5, 23, 40), max_tokens=(6, 12))
    assert_greedy_matches(tiny_model, jobs, complete_all(two_nodes.url, jobs))
    assert "ep_size=2" in two_nodes.node0.log()

    two_nodes.node0.proc.send_signal(signal.SIGTERM)
    assert two_nodes.node0.proc.wait(timeout=30) == 0, two_nodes.logs()
    assert two_nodes.node1.proc.wait(timeout=15) == 0, two_nodes.logs()
    assert wait_until(lambda: two_nodes.node0.all_gone() and two_nodes.node1.all_gone(), 10), "a rank outlived its node"
    assert "node 1: its ranks stopped" in two_nodes.node1.log()
