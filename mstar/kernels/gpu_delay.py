"""A GPU-side wait of a given length that also tallies what it stands for: the modeled collectives.

`delay(ns, nbytes, tally)` queues one tiny kernel that spins on the GPU's global timer for `ns`
nanoseconds and adds (1, nbytes, ns) to the int64 counters `tally` [3]. On the stream it serialises
like the collective it stands in for (later kernels wait for it), and inside a CUDA graph it is
recorded and replayed like any kernel, so a replayed step both waits and counts exactly the
collectives its graph holds, whatever the model's layout. One program of one warp: it occupies one SM
for the wait, as a one-shot all-reduce occupies a few.

The kernel itself costs something beyond its spin (its launch in the graph, the timer reads, the
atomics): about 2 us on an H200, a third of a modeled 6 us collective. `calibrate(device)` measures that
once per device, in a captured chain of these kernels, and `delay` spins that much less, so that a
collective modeled at 6 us takes 6 us of the step's timeline, as the published figures it stands for do.

Off CUDA (tests) nothing waits; the counters are added on the host, so the tally is the same.
"""

from __future__ import annotations

import torch

try:  # a base CPU install has no triton: there the host path below is the only one
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised by the base-install test
    triton = None


_overhead_ns: dict[int, int] = {}  # per CUDA device index: what one delay kernel costs beyond its spin


def calibrate(device: torch.device | str, *, kernels: int = 64, spin_ns: int = 5000) -> int:
    """Measure, on CUDA `device`, how many ns one delay kernel in a replayed graph takes beyond its spin
    (graph replay of `kernels` of them, CUDA events); later `delay` calls there subtract it. Call it
    outside any capture; returns the overhead (0 off CUDA)."""
    device = torch.device(device)
    if device.type != "cuda":
        return 0
    if torch.cuda.is_current_stream_capturing():
        raise RuntimeError("gpu_delay.calibrate: call it before capturing a graph, not inside one")
    index = device.index if device.index is not None else torch.cuda.current_device()
    tally = torch.zeros(3, dtype=torch.int64, device=device)
    with torch.cuda.device(index):
        _delay_kernel[(1,)](tally, spin_ns, 0, 0, num_warps=1)  # compile outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(kernels):
                _delay_kernel[(1,)](tally, spin_ns, 0, 0, num_warps=1)
        graph.replay()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
    per_kernel_ns = start.elapsed_time(end) * 1e6 / kernels
    _overhead_ns[index] = max(0, round(per_kernel_ns - spin_ns))
    return _overhead_ns[index]


def delay(ns: int, nbytes: int, tally: torch.Tensor) -> None:
    """Wait `ns` ns on `tally`'s device (CUDA: the kernel spins `ns` less what `calibrate` measured it to
    cost beyond its spin) and add (1 call, nbytes, ns) to `tally` [3] int64."""
    if tally.dtype != torch.int64 or tally.shape != (3,):
        raise ValueError(f"tally must be an int64 tensor of 3 counters (calls, bytes, ns), got {tally.dtype} "
                         f"{tuple(tally.shape)}")
    if ns < 0 or nbytes < 0:
        raise ValueError(f"delay: ns={ns} and nbytes={nbytes} must be >= 0")
    if tally.device.type != "cuda":
        tally += torch.tensor([1, nbytes, ns], dtype=torch.int64)
        return
    spin = max(0, ns - _overhead_ns.get(tally.device.index, 0))
    _delay_kernel[(1,)](tally, spin, nbytes, ns, num_warps=1)


if triton is not None:

    @triton.jit
    def _delay_kernel(tally_ptr, spin_ns, nbytes, modeled_ns):
        start = tl.extra.cuda.globaltimer()
        while tl.extra.cuda.globaltimer() - start < spin_ns:
            pass
        tl.atomic_add(tally_ptr, 1)
        tl.atomic_add(tally_ptr + 1, nbytes)
        tl.atomic_add(tally_ptr + 2, modeled_ns)
