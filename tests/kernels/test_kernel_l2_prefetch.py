"""kernels/l2_prefetch on the GPU: a prefetch compiles and runs (eagerly and from a side stream inside a CUDA
graph), changes nothing, skips dropped ids, and a read that follows it finds its bytes in L2 (it runs faster than
the same read from HBM)."""

from __future__ import annotations

import statistics

import pytest
import torch

from mstar.kernels import l2_prefetch
from mstar.kernels.l2_prefetch import Segment

pytestmark = pytest.mark.skipif(not (torch.cuda.is_available() and l2_prefetch.supported("cuda")),
                                reason="needs a CUDA GPU of compute capability 9.0+")


def test_a_prefetch_changes_nothing_in_a_graph_on_a_side_stream():
    stacked = torch.randint(0, 256, (8, 96, 160), dtype=torch.uint8, device="cuda")
    weight = torch.randn(333, 77, device="cuda")  # 102,564 bytes: not a whole number of 16-byte pieces
    before = (stacked.clone(), weight.clone())
    ids = torch.tensor([[3, -1, 7, 0]], device="cuda")  # -1: a dropped pair, skipped
    segments = [Segment.of(stacked, per_expert=True), Segment.of(weight)]
    side = torch.cuda.Stream()
    l2_prefetch.prefetch(segments, ids)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            l2_prefetch.prefetch(segments, ids)
        out = weight * 2
        torch.cuda.current_stream().wait_stream(side)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(stacked, before[0]) and torch.equal(weight, before[1])
    assert torch.equal(out, before[1] * 2)


def _read_us(t: torch.Tensor, flush: torch.Tensor, fetch: bool) -> float:
    flush.add_(1)  # 256 MB through L2: t's bytes are gone from it
    if fetch:
        l2_prefetch.prefetch([Segment.of(t)])
        torch.cuda._sleep(2_000_000)  # ~1 ms: the prefetches land (they are not waited for)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    t.sum(dtype=torch.float32)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3


def test_a_prefetched_read_finds_its_bytes_in_l2():
    t = torch.randn(12 * 2**20, device="cuda", dtype=torch.bfloat16)  # 24 MB: half the 50 MB L2
    flush = torch.zeros(64 * 2**20, device="cuda")
    for fetch in (False, True):  # warm up both
        _read_us(t, flush, fetch)
    cold = statistics.median(_read_us(t, flush, False) for _ in range(7))
    warm = statistics.median(_read_us(t, flush, True) for _ in range(7))
    assert warm < 0.8 * cold, f"a prefetched 24 MB read took {warm:.1f} us against {cold:.1f} us from HBM"
