"""Two "nodes" on loopback with DSpark (tests/support/two_nodes.py, TP4 x EP2, rank 0 drafts): greedy output
over HTTP equals the TP1 reference; then killing node 1's whole process tree mid-request ends node 0
within 10 s: /health answers 503 while it ends, the client is told, it exits 3, and no rank survives."""

from __future__ import annotations

import contextlib
import threading
import time

import httpx
import pytest
from greedy_ties import assert_greedy_matches, random_jobs
from live_server import wait_until
from test_distributed_lifecycle import Stream
from two_nodes import TwoNodes, complete_all, overrides

from mstar.distributed.worker import EXIT_RANK_FAILED


@pytest.fixture
def two_nodes(tiny_dirs, tmp_path):
    nodes = TwoNodes(tmp_path, overrides(tiny_dirs, dspark=True))
    try:
        yield nodes.wait_ready()
    finally:
        nodes.close()


def test_dspark_on_two_nodes_then_killing_node1_ends_node0(two_nodes, tiny_model):
    jobs = random_jobs(tiny_model, (9, 31), max_tokens=(10, 16))
    assert_greedy_matches(tiny_model, jobs, complete_all(two_nodes.url, jobs))
    metrics = httpx.get(two_nodes.url + "/metrics", timeout=10).text
    name = "mstar_spec_decode_num_draft_tokens_total{"
    drafted = next(line for line in metrics.splitlines() if line.startswith(name))
    assert float(drafted.split()[1]) > 0, "the server did not speculate"

    stream = Stream(two_nodes.url, list(range(3, 20)), max_tokens=400)
    stream.start()
    assert stream.first.wait(60)
    health: list[int] = []

    def poll_health() -> None:
        while two_nodes.node0.proc.poll() is None:
            with contextlib.suppress(httpx.HTTPError):
                health.append(httpx.get(two_nodes.url + "/health", timeout=1).status_code)
            time.sleep(0.05)

    start = time.monotonic()
    two_nodes.node1.kill_tree()
    poller = threading.Thread(target=poll_health, daemon=True)
    poller.start()
    status = two_nodes.node0.proc.wait(timeout=30)
    elapsed = time.monotonic() - start
    assert status == EXIT_RANK_FAILED, two_nodes.logs()
    assert elapsed < 10, f"node 0 took {elapsed:.1f} s to stop"
    assert wait_until(two_nodes.node0.all_gone, 5), "a rank of node 0 outlived it"
    poller.join(5)
    assert 503 in health, f"/health answered {sorted(set(health))} while node 0 was ending"
    stream.join(10)
    assert not stream.is_alive() and stream.finish_reason != "length" and stream.error, "the client was not told"
