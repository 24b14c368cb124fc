"""Copies between the host and the device that never make the host wait for the GPU's queue.

A plain `torch.tensor(values, device="cuda")` (or `.to("cuda")` of a CPU tensor) copies from pageable
memory and then synchronizes the stream: the host stops until every kernel queued before it has
run. Between two engine steps that is harmless; while the host plans step N+1 with step N still on
the GPU (async scheduling, core.py) it would serialize the two. So host values go up through pinned
memory with `non_blocking=True`, which only queues the copy, and a step's results come down the same
way into pinned memory, with an event that the host waits on once, when it needs them.

A step uploads a few dozen small lists. Each through a pinned tensor of its own would cost a pinned
allocation, a CPU tensor built from the list and an event for the allocator to know when the block
is free again; they pass instead through one pinned ring (`_UploadRing`), written in place, which
the host waits on only when it comes round to bytes whose copy may not have run yet.

On a CPU device both are plain tensors: there is no queue to wait for.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Sequence

import numpy as np
import torch

_NUMPY = {torch.long: np.int64, torch.int32: np.int32, torch.float32: np.float32, torch.float64: np.float64,
          torch.bool: np.bool_}
_ALIGN = 16  # bytes: each upload starts aligned, as Triton's pointer specialization assumes of its tensors


class _UploadRing:
    """A pinned host buffer that uploads are written into one after another, in two halves: before writing
    into a half again the host waits for the copies queued from it a lap before (an event recorded when it
    was left), so no byte is overwritten before its copy has run. A lap is thousands of steps: the wait is
    a formality, not a synchronization with the step in flight."""

    def __init__(self, nbytes: int = 1 << 21):
        self.buffer = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        self.bytes = self.buffer.numpy()
        self.half = nbytes // 2
        self.current = 0  # the half being written
        self.offset = 0
        self.left: list[torch.cuda.Event | None] = [None, None]  # when each half was last left

    def upload(self, values: np.ndarray, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        start = self._claim(values.nbytes)
        self.bytes[start : start + values.nbytes] = values.reshape(-1).view(np.uint8)
        host = self.buffer[start : start + values.nbytes].view(dtype).view(values.shape)
        return torch.empty(values.shape, dtype=dtype, device=device).copy_(host, non_blocking=True)

    def _claim(self, nbytes: int) -> int:
        start = self.offset
        if start + nbytes > (self.current + 1) * self.half:
            start = self._enter(1 - self.current)
        self.offset = start + -(-nbytes // _ALIGN) * _ALIGN
        return start

    def _enter(self, half: int) -> int:
        """Move on to `half`: mark the one left, wait for the copies out of `half` a lap ago (a process
        drives one device: its current stream is the one every copy was queued on)."""
        self.left[self.current] = torch.cuda.Event()
        self.left[self.current].record()
        if self.left[half] is not None:
            self.left[half].synchronize()
        self.current = half
        return half * self.half


_rings = threading.local()  # a ring per thread: writers never share one


def to_device(values: list, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """`torch.tensor(values, dtype=dtype, device=device)`, queued without a stream synchronization."""
    device = torch.device(device)
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    array = np.asarray(values, dtype=_NUMPY[dtype])
    ring = getattr(_rings, "ring", None)
    if ring is None:
        ring = _rings.ring = _UploadRing()
    # A copy captured into a graph would read its bytes at every replay: those get a pinned block of their own.
    if array.nbytes == 0 or array.nbytes > ring.half or torch.cuda.is_current_stream_capturing():
        return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)
    return ring.upload(array, dtype, device)


def to_device_lists(lists: Sequence[Sequence], dtype: torch.dtype, device: torch.device | str
                    ) -> tuple[torch.Tensor, ...]:
    """`tuple(to_device(v, dtype, device) for v in lists)` for flat lists, in one upload: each copy costs the
    host a launch, and a step's planning uploads a dozen small lists. Each list is a view into the one device
    tensor, starting 16-byte aligned (Triton specializes its kernels on that), so in-place writes to one
    never touch another."""
    per = _ALIGN // torch.empty((), dtype=dtype).element_size()
    starts = list(itertools.accumulate((-(-len(v) // per) * per for v in lists), initial=0))
    flat = [0] * starts[-1]
    for start, values in zip(starts, lists, strict=False):
        flat[start : start + len(values)] = values
    uploaded = to_device(flat, dtype, device)
    return tuple(uploaded[start : start + len(values)] for start, values in zip(starts, lists, strict=False))


class HostCopy:
    """A device tensor on its way to the host: one copy into pinned memory, queued behind the work
    that computes it, and an event; `wait()` blocks until it has arrived."""

    def __init__(self, tensor: torch.Tensor):
        if tensor.device.type != "cuda":
            self._host, self._event = tensor, None
            return
        self._host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        self._host.copy_(tensor, non_blocking=True)
        self._event = torch.cuda.Event()
        self._event.record()

    def wait(self) -> torch.Tensor:
        if self._event is not None:
            self._event.synchronize()
        return self._host
