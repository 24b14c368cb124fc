"""Weights into L2 while the step waits on something else: `prefetch`, one launch for a side stream.

At small batches a decode step spends much of its time with HBM idle: its collectives (four a MoE layer, a few
microseconds each, moving kilobytes) and its latency-bound small kernels. The projection that follows a
collective does not read the collective's output through its weights, so those bytes can be on their way into
L2 (50 MB on an H100/H200) while the collective runs, and the projection then streams them from L2. The caller
(`models/kimi_k3/gpu_ops.L2Prefetcher`) launches this on a side stream forked where the wait begins, so that it
runs beside the collective (a real one or the emulation's modeled wait), not before it.

One launch covers up to `MAX_SEGMENTS` byte ranges, each either one range (a weight) or one range per id (an
expert's slice of a stacked tensor, `ids` read on the device: the router's picks, known before the all-gather
that precedes the expert GEMMs). Programs issue `cp.async.bulk.prefetch.L2` (sm_90) for CHUNK bytes each, a
lane a chunk: nothing is written and nothing waits for the data, so a prefetch changes no result, only where
the next reads find their bytes. Off sm_90 (and in Triton's interpreter, which has no PTX) `supported` is
false and the caller issues nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

MAX_SEGMENTS = 4  # byte ranges (or per-id ranges) one launch covers
CHUNK = 16384  # bytes one prefetch instruction asks for
ALIGN = 16  # cp.async.bulk: address and size multiples of 16 bytes
LANES = 128  # prefetches a program issues at once (one warp-group of 4 warps, one a lane)
PROGRAMS = 16  # programs per (segment, id): a few SMs' worth of issue, the rest of the GPU is the main stream's


@dataclass(frozen=True)
class Segment:
    """`nbytes` from `address`, or with `stride` (and `prefetch`'s ids) from address + id * stride for each id."""

    address: int
    nbytes: int
    stride: int = 0

    @classmethod
    def of(cls, t: torch.Tensor, *, per_expert: bool = False) -> Segment:
        """The whole of contiguous `t`, or (per_expert) one row of dim 0 per id: t[id] must be contiguous."""
        if per_expert:
            row = t[0]
            if not row.is_contiguous():
                raise ValueError(f"a per-expert segment needs contiguous rows t[e], got strides {t.stride()}")
            return cls(t.data_ptr(), row.numel() * t.element_size(), t.stride(0) * t.element_size())
        if not t.is_contiguous():
            raise ValueError(f"a segment must be one contiguous range of bytes, got strides {t.stride()}")
        return cls(t.data_ptr(), t.numel() * t.element_size())

    def aligned(self) -> Segment:
        """The 16-byte-aligned range inside this one (a prefetch must not reach past what it was given)."""
        start = -(-self.address // ALIGN) * ALIGN
        end = (self.address + self.nbytes) // ALIGN * ALIGN
        if self.stride % ALIGN:
            raise ValueError(f"a per-id segment's stride must be a multiple of {ALIGN} bytes, got {self.stride}")
        return Segment(start, max(0, end - start), self.stride)


def supported(device: torch.device | str) -> bool:
    """Whether `prefetch` issues anything on `device` (CUDA, compute capability 9.0+)."""
    device = torch.device(device)
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def prefetch(segments: list[Segment], ids: torch.Tensor | None = None) -> None:
    """Ask L2 for the bytes of `segments` on the current stream (one launch). With `ids` (int tensor, any shape;
    values must index the stacked tensors), every segment with a stride is prefetched at each id; segments
    without one once."""
    if not 1 <= len(segments) <= MAX_SEGMENTS:
        raise ValueError(f"prefetch takes 1 to {MAX_SEGMENTS} segments, got {len(segments)}")
    parts = [s.aligned() for s in segments]
    if ids is None:
        if any(s.stride for s in parts):
            raise ValueError("a segment with a stride is prefetched per id: pass ids")
        ids = torch.empty(1, dtype=torch.int32, device=torch.cuda.current_device())  # never read (no stride)
    flat = ids.reshape(-1)
    args = [v for s in parts for v in (s.address, s.nbytes, s.stride)]
    args += [0, 0, 0] * (MAX_SEGMENTS - len(parts))
    _prefetch_kernel[(PROGRAMS, MAX_SEGMENTS, flat.numel())](flat, *args, CHUNK=CHUNK, LANES=LANES, num_warps=4)


@triton.jit
def _pick(s, a0, a1, a2, a3):
    return tl.where(s == 0, a0, tl.where(s == 1, a1, tl.where(s == 2, a2, a3)))


@triton.jit
def _prefetch_kernel(ids_ptr, addr0, bytes0, stride0, addr1, bytes1, stride1, addr2, bytes2, stride2, addr3, bytes3,
                     stride3, CHUNK: tl.constexpr, LANES: tl.constexpr):
    """Program (p, s, i): chunks p, p + P, ... of segment s at id i (the whole segment once when its stride is 0:
    only i = 0 issues it)."""
    s = tl.program_id(1)
    item = tl.program_id(2)
    nbytes = _pick(s, bytes0, bytes1, bytes2, bytes3).to(tl.int64)
    stride = _pick(s, stride0, stride1, stride2, stride3).to(tl.int64)
    if nbytes == 0 or (stride == 0 and item > 0):
        return
    base = _pick(s, addr0, addr1, addr2, addr3).to(tl.int64)
    if stride != 0:
        expert = tl.load(ids_ptr + item).to(tl.int64)
        if expert < 0:  # a dropped pair (an expert another rank holds)
            return
        base += expert * stride
    chunks = tl.cdiv(nbytes, CHUNK)
    step = tl.num_programs(0) * LANES
    for first in range(tl.program_id(0) * LANES, chunks, step):
        c = first + tl.arange(0, LANES).to(tl.int64)
        size = tl.minimum(nbytes - c * CHUNK, CHUNK).to(tl.int32)
        live = (c < chunks).to(tl.int32)
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.b32 p, $3, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
            "=r,l,r,r", [base + c * CHUNK, size, live], dtype=tl.int32, is_pure=False, pack=1)
