"""kernels/gpu_delay on the GPU: inside a CUDA graph a replay waits at least the modeled time and the
device tally counts exactly the delays the graph holds (CUDA only; the host path is covered by
tests/distributed/test_modeled_comm.py)."""

from __future__ import annotations

import pytest
import torch

from mstar.kernels.gpu_delay import delay

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_graph_replay_waits_and_counts():
    tally = torch.zeros(3, dtype=torch.int64, device="cuda")
    waits = [(20_000, 1 << 20), (5_000, 4096), (40_000, 123)]  # ns, bytes
    for ns, nbytes in waits:  # compile outside the capture
        delay(ns, nbytes, tally)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for ns, nbytes in waits:
            delay(ns, nbytes, tally)
    tally.zero_()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    replays = 5
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    assert tally.tolist() == [replays * len(waits), replays * sum(b for _, b in waits),
                              replays * sum(ns for ns, _ in waits)]
    seconds = start.elapsed_time(end) * 1e-3
    modeled = replays * sum(ns for ns, _ in waits) * 1e-9
    assert modeled <= seconds < modeled + replays * len(waits) * 5e-6  # a few us of launch and timer slack each
