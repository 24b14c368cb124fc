"""kernels/gpu_delay: inside a CUDA graph a replay waits the modeled time (to within the timer's slack; exactly
once calibrated), the device tally counts exactly the delays the graph holds, and a gathering wait fills its
copies (CUDA; the copy loop alone also through Triton's interpreter; the host path is covered by
tests/distributed/test_modeled_comm.py)."""

from __future__ import annotations

import os
import random

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from mstar.kernels import gpu_delay  # noqa: E402
from mstar.kernels.gpu_delay import calibrate, delay  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@triton.jit
def _copy_probe(src_ptr, dst_ptr, rows, cols, stride_src, stride_dst, piece_stride, pieces, programs,
                BLOCK: tl.constexpr):
    gpu_delay._copy_pieces(src_ptr, dst_ptr, rows, cols, stride_src, stride_dst, piece_stride, pieces,
                           tl.program_id(0), programs, BLOCK)


def gather_case(rng: random.Random, dtype: torch.dtype, along_rows: bool):
    """(source, output, its pieces) of a modeled all-gather at random sizes; the output poisoned."""
    rows, cols, pieces = rng.randint(1, 9), rng.choice([5, 64, 300, 1500]), rng.randint(1, 8)
    wide = torch.randn(rows, cols + rng.randint(0, 7), device=DEVICE).to(dtype)
    source = wide[:, :cols]  # a row stride of its own, as the MoE input GEMM's column slice has
    if along_rows:
        out = torch.full((pieces * rows, cols), float("nan"), device=DEVICE).to(dtype)
        views = out.view(pieces, rows, cols).unbind(0)
        want = torch.cat([source] * pieces)
    else:
        out = torch.full((rows, pieces * cols), float("nan"), device=DEVICE).to(dtype)
        views = out.view(rows, pieces, cols).unbind(1)
        want = torch.cat([source] * pieces, dim=-1)
    return source, out, list(views), want


@pytest.mark.parametrize("along_rows", [False, True])
@pytest.mark.parametrize("trial", range(3))
def test_copy_loop_fills_every_piece(along_rows, trial):
    rng = random.Random()
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    source, out, views, want = gather_case(rng, dtype, along_rows)
    step = views[1].storage_offset() - views[0].storage_offset() if len(views) > 1 else 0
    programs = rng.randint(1, 5)
    block = rng.choice([16, 128])
    _copy_probe[(programs,)](source, views[0], source.shape[0], source.shape[1], source.stride(0), views[0].stride(0),
                             step, len(views), programs, BLOCK=block)
    assert torch.equal(out, want)


def test_copies_are_checked():
    tally = torch.zeros(3, dtype=torch.int64)
    x = torch.randn(3, 4)
    out = torch.empty(3, 8)
    with pytest.raises(ValueError, match="go together"):
        delay(10, 10, tally, source=x)
    with pytest.raises(ValueError, match="views of one tensor"):
        delay(10, 10, tally, source=x, copies=[out[:, :4], torch.empty(3, 4)])
    with pytest.raises(ValueError, match="unit column stride"):
        delay(10, 10, tally, source=x.t(), copies=[out[:, :3]])
    with pytest.raises(ValueError, match="evenly spaced"):
        wide = torch.empty(3, 16)
        delay(10, 10, tally, source=x, copies=[wide[:, :4], wide[:, 4:8], wide[:, 12:]])
    delay(10, 10, tally, source=x, copies=[out[:, :4], out[:, 4:]])
    assert torch.equal(out, torch.cat([x, x], dim=-1)) and tally.tolist() == [1, 10, 10]


@needs_cuda
@pytest.mark.parametrize("along_rows", [False, True])
def test_a_gathering_wait_fills_its_copies_in_a_graph_and_still_waits(along_rows):
    rng = random.Random()
    tally = torch.zeros(3, dtype=torch.int64, device="cuda")
    source, out, views, want = gather_case(rng, torch.bfloat16, along_rows)
    delay(1_000, 1, tally, source=source, copies=views)  # compile outside the capture
    torch.cuda.synchronize()
    out.fill_(float("nan"))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        delay(30_000, 123, tally, source=source, copies=views)
    tally.zero_()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    torch.cuda.synchronize()
    assert torch.equal(out, want)
    assert tally.tolist() == [1, 123, 30_000]
    assert start.elapsed_time(end) * 1e-3 >= 30e-6 - 5e-6


@needs_cuda
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


@needs_cuda
def test_a_calibrated_collective_of_6_us_takes_6_us_of_the_timeline():
    overhead = calibrate("cuda")
    assert 0 <= overhead < 5_000
    for ns in (4_000, 6_000, 20_000):
        per_kernel = replay_seconds(ns, 100) / 100
        assert abs(per_kernel - ns * 1e-9) < 0.1 * ns * 1e-9, (ns, per_kernel, overhead)
