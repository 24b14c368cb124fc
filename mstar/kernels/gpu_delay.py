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

A gathering collective also has an output to fill (the emulated rank repeats its own piece in every rank's place):
`delay(..., source=, copies=)` writes it from programs of its own beside the waiting one, inside the wait, as a
real all-gather writes its output inside its own time. A copy kernel of its own (the cat it replaces) would add a
launch and its copy time to a step on top of the modeled cost.

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


def delay(ns: int, nbytes: int, tally: torch.Tensor, *, source: torch.Tensor | None = None,
          copies: list[torch.Tensor] | None = None) -> None:
    """Wait `ns` ns on `tally`'s device (CUDA: the kernel spins `ns` less what `calibrate` measured it to
    cost beyond its spin) and add (1 call, nbytes, ns) to `tally` [3] int64. With `source` [R, C] (unit column
    stride), copy it into each of `copies`: views of one tensor, each [R, C] with the same strides, evenly spaced
    (an all-gather's output pieces), by the same launch."""
    if tally.dtype != torch.int64 or tally.shape != (3,):
        raise ValueError(f"tally must be an int64 tensor of 3 counters (calls, bytes, ns), got {tally.dtype} "
                         f"{tuple(tally.shape)}")
    if ns < 0 or nbytes < 0:
        raise ValueError(f"delay: ns={ns} and nbytes={nbytes} must be >= 0")
    if (source is None) != (copies is None):
        raise ValueError("delay: source and copies go together (the pieces to fill and what fills them)")
    piece_stride = _check_copies(source, copies) if source is not None else 0
    if tally.device.type != "cuda":
        tally += torch.tensor([1, nbytes, ns], dtype=torch.int64)
        for copy in copies or ():
            copy.copy_(source)
        return
    spin = max(0, ns - _overhead_ns.get(tally.device.index, 0))
    if source is None or source.numel() == 0:
        _delay_kernel[(1,)](tally, spin, nbytes, ns, num_warps=1)
        return
    rows, cols = source.shape
    tiles = rows * triton.cdiv(cols, COPY_BLOCK)
    programs = min(tiles, COPY_PROGRAMS_PER_SM * torch.cuda.get_device_properties(tally.device).multi_processor_count)
    _delay_copy_kernel[(1 + programs,)](tally, spin, nbytes, ns, source, copies[0], rows, cols, source.stride(0),
                                        copies[0].stride(0), piece_stride, len(copies), BLOCK=COPY_BLOCK,
                                        num_warps=4)


COPY_BLOCK = 1024  # columns of one row a copy program moves at a time
COPY_PROGRAMS_PER_SM = 2


def _check_copies(source: torch.Tensor, copies: list[torch.Tensor]) -> int:
    """The distance in elements between consecutive copies (0 for one); raises where `delay` cannot fill them."""
    if source.dim() != 2 or source.stride(1) != 1:
        raise ValueError(f"delay: source must be [rows, columns] with unit column stride, got shape "
                         f"{tuple(source.shape)} strides {source.stride()}")
    if not copies:
        raise ValueError("delay: copies must hold at least one view to fill")
    first = copies[0]
    storage = first.untyped_storage().data_ptr()
    for copy in copies:
        if (copy.shape != source.shape or copy.stride() != first.stride() or copy.dtype != source.dtype
                or copy.device != source.device or copy.untyped_storage().data_ptr() != storage):
            raise ValueError("delay: copies must be views of one tensor, each shaped, strided and typed as source")
    step = copies[1].storage_offset() - first.storage_offset() if len(copies) > 1 else 0
    if any(c.storage_offset() - first.storage_offset() != i * step for i, c in enumerate(copies)):
        raise ValueError("delay: copies must be evenly spaced in their tensor")
    return step


if triton is not None:

    @triton.jit
    def _spin_and_tally(tally_ptr, spin_ns, nbytes, modeled_ns):
        start = tl.extra.cuda.globaltimer()
        while tl.extra.cuda.globaltimer() - start < spin_ns:
            pass
        tl.atomic_add(tally_ptr, 1)
        tl.atomic_add(tally_ptr + 1, nbytes)
        tl.atomic_add(tally_ptr + 2, modeled_ns)

    @triton.jit
    def _delay_kernel(tally_ptr, spin_ns, nbytes, modeled_ns):
        _spin_and_tally(tally_ptr, spin_ns, nbytes, modeled_ns)

    @triton.jit
    def _delay_copy_kernel(tally_ptr, spin_ns, nbytes, modeled_ns, src_ptr, dst_ptr, rows, cols, stride_src,
                           stride_dst, piece_stride, pieces, BLOCK: tl.constexpr):
        """Program 0 waits and tallies; the others fill the copies (`_copy_pieces`) meanwhile."""
        if tl.program_id(0) == 0:
            _spin_and_tally(tally_ptr, spin_ns, nbytes, modeled_ns)
        else:
            _copy_pieces(src_ptr, dst_ptr, rows, cols, stride_src, stride_dst, piece_stride, pieces,
                         tl.program_id(0) - 1, tl.num_programs(0) - 1, BLOCK)

    @triton.jit
    def _copy_pieces(src_ptr, dst_ptr, rows, cols, stride_src, stride_dst, piece_stride, pieces, index, programs,
                     BLOCK: tl.constexpr):
        """Program `index` of `programs`: tiles index, index + programs, ... of src [rows, cols] (BLOCK columns of
        a row each), each stored into every one of the `pieces` copies (dst + k piece_stride)."""
        col_tiles = tl.cdiv(cols, BLOCK)
        for tile in range(index, rows * col_tiles, programs):
            row = (tile // col_tiles).to(tl.int64)
            offs = (tile % col_tiles) * BLOCK + tl.arange(0, BLOCK)
            ok = offs < cols
            values = tl.load(src_ptr + row * stride_src + offs, mask=ok)
            for k in range(pieces):
                tl.store(dst_ptr + k * piece_stride + row * stride_dst + offs, values, mask=ok)
