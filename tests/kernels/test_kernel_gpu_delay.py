"""kernels/gpu_delay on the GPU: inside a CUDA graph a replay waits the modeled time (to within the timer's
slack; exactly once calibrated) and the device tally counts exactly the delays the graph holds (CUDA only;
the host path is covered by tests/distributed/test_modeled_comm.py)."""

from __future__ import annotations

import pytest
import torch

from mstar.kernels.gpu_delay import calibrate, delay

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
    # uncalibrated each kernel costs a few us beyond its wait; calibrated (if an earlier test did it), ~0
    assert modeled - replays * len(waits) * 1e-6 <= seconds < modeled + replays * len(waits) * 5e-6


def replay_seconds(ns: int, kernels: int) -> float:
    """One replay of a graph of `kernels` delays of `ns` each, timed with CUDA events."""
    tally = torch.zeros(3, dtype=torch.int64, device="cuda")
    delay(ns, 0, tally)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(kernels):
            delay(ns, 0, tally)
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e-3


def test_a_calibrated_collective_of_6_us_takes_6_us_of_the_timeline():
    overhead = calibrate("cuda")
    assert 0 <= overhead < 5_000
    for ns in (4_000, 6_000, 20_000):
        per_kernel = replay_seconds(ns, 100) / 100
        assert abs(per_kernel - ns * 1e-9) < 0.1 * ns * 1e-9, (ns, per_kernel, overhead)
