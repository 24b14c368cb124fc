"""Copies between the host and the device that never make the host wait for the GPU's queue.

A plain `torch.tensor(values, device="cuda")` (or `.to("cuda")` of a CPU tensor) copies from pageable
memory and then synchronizes the stream: the host stops until every kernel queued before it has
run. Between two engine steps that is harmless; while the host plans step N+1 with step N still on
the GPU (async scheduling, core.py) it would serialize the two. So host values go up through pinned
memory with `non_blocking=True`, which only queues the copy (torch's pinned-memory allocator keeps
the buffer alive until the copy has run), and a step's results come down the same way into pinned
memory, with an event that the host waits on once, when it needs them.

A step uploads a dozen small lists; `to_device_lists` sends several in one copy. (A pinned ring written in
place was tried instead of a pinned tensor per upload: it cost the host more per upload, measured in
benchmarks/mini_pair/h100_graphs_e5fde61/README.md.)

On a CPU device both are plain tensors: there is no queue to wait for.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch

_ALIGN = 16  # bytes: each of to_device_lists' views starts aligned, as Triton's pointer specialization assumes


def to_device(values: list, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """`torch.tensor(values, dtype=dtype, device=device)`, queued without a stream synchronization."""
    if torch.device(device).type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


def to_device_lists(lists: Sequence[Sequence], dtype: torch.dtype, device: torch.device | str
                    ) -> tuple[torch.Tensor, ...]:
    """`tuple(to_device(v, dtype, device) for v in lists)` for flat lists, in one upload: each copy costs the
    host a launch, and a step's planning uploads a dozen small lists. Each list is a view into the one device
    tensor, starting 16-byte aligned (Triton specializes its kernels on that), so in-place writes to one
    never touch another."""
    per = _ALIGN // dtype.itemsize
    starts = list(itertools.accumulate((-(-len(v) // per) * per for v in lists), initial=0))
    flat = [0] * starts[-1]
    for start, values in zip(starts[:-1], lists, strict=True):
        flat[start : start + len(values)] = values
    uploaded = to_device(flat, dtype, device)
    return tuple(uploaded[start : start + len(values)] for start, values in zip(starts[:-1], lists, strict=True))


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
