"""models/kimi_k3/weight_prefetch: which byte ranges a prefetch asks for, when a step asks at all, and (on a
Hopper GPU) that prefetches forked inside a captured graph join it and change no result."""

from __future__ import annotations

import pytest
import torch

from mstar.kernels import l2_prefetch, moe_mxfp4
from mstar.kernels.l2_prefetch import Segment
from mstar.models.kimi_k3.weight_prefetch import MAX_ROWS, WeightPrefetch, weight_segments


def test_weights_are_cut_at_the_budget_in_order():
    a, b, c = torch.zeros(100, dtype=torch.uint8), torch.zeros(50, dtype=torch.uint8), torch.zeros(8)
    assert weight_segments([a, b], 1000) == [Segment(a.data_ptr(), 100), Segment(b.data_ptr(), 50)]
    assert weight_segments([a, b, c], 120) == [Segment(a.data_ptr(), 100), Segment(b.data_ptr(), 20)]
    assert weight_segments([a, b], 100) == [Segment(a.data_ptr(), 100)]
    assert weight_segments([a] * 6, 10**6) == [Segment(a.data_ptr(), 100)] * l2_prefetch.MAX_SEGMENTS


def test_only_small_steps_over_several_ranks_on_hopper_prefetch():
    prefetch = WeightPrefetch()
    assert not prefetch.wanted(1, 8, torch.device("cpu"))  # no bulk prefetch off CUDA
    if torch.cuda.is_available() and l2_prefetch.supported("cuda"):
        cuda = torch.device("cuda", torch.cuda.current_device())
        assert prefetch.wanted(1, 8, cuda) and prefetch.wanted(MAX_ROWS, 2, cuda)
        assert not prefetch.wanted(MAX_ROWS + 1, 8, cuda)  # a GEMM that reuses its weights
        assert not prefetch.wanted(1, 1, cuda)  # no collective to hide behind


@pytest.mark.skipif(not (torch.cuda.is_available() and l2_prefetch.supported("cuda")), reason="needs a Hopper GPU")
def test_prefetches_forked_in_a_captured_step_join_it_and_change_nothing():
    g = torch.Generator(device="cuda").manual_seed(0)
    experts = moe_mxfp4.StackedExperts(*(torch.randint(0, 256, shape, dtype=torch.uint8, device="cuda", generator=g)
                                         for shape in ((12, 64, 64), (12, 64, 4), (12, 128, 32), (12, 128, 2))))
    weight = torch.randn(256, 128, device="cuda")
    x = torch.randn(3, 128, device="cuda")
    ids = torch.tensor([[5, 0], [11, 3], [2, 2]], device="cuda")
    local_ids = torch.tensor([-1, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10], device="cuda")  # expert 0 held elsewhere
    snapshot = [t.clone() for t in (*experts, weight)]
    prefetch = WeightPrefetch()

    def step():
        prefetch.experts(experts, ids, local_ids)
        y = x @ weight.T
        prefetch.weights([weight])
        out = y * 2
        prefetch.join()
        return out

    expect = step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = step()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(got, expect)
    assert all(torch.equal(t, s) for t, s in zip((*experts, weight), snapshot, strict=True))
