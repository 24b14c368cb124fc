"""Programmatic dependent launch (PDL) for the step's small Triton kernels.

A decode step is ~3,400 kernels, most of them a few microseconds long, and each pays its launch (grid
setup, the wait for the previous kernel to drain) before its first load: ~1 us a kernel inside a CUDA graph
on the H200. With PDL (Hopper and newer) a kernel launched with `launch_pdl=True` may start while the kernel
before it still runs; it then waits in `gdc_wait` until that kernel has finished and its writes are visible.
So the launch overlaps the previous kernel's tail, and correctness holds as long as a kernel reads and writes
global memory only after its wait: `wait_for_inputs` is therefore the first statement of every kernel that
takes it. Right after the wait it lets its own dependents launch (so at most two kernels overlap: a program
never runs ahead of an unfinished producer).

A kernel launched without the attribute (cuBLAS, fla, torch's) waits for the previous one as usual, and a
PDL kernel after it simply finds nothing to wait for; `gdc_wait` in a kernel launched without PDL returns at
once. Off Hopper and in Triton's interpreter the flag is off and the kernels compile without the calls.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl


@functools.cache
def _hopper_or_newer(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def options(kernel, device: torch.device) -> dict:
    """Launch keywords for `kernel` (a `@triton.jit` function taking a `PDL: tl.constexpr`) on `device`:
    PDL on CUDA devices of compute capability 9.0+ unless the kernel runs in the interpreter."""
    device = torch.device(device)
    on = (device.type == "cuda" and type(kernel).__name__ != "InterpretedFunction"
          and _hopper_or_newer(device.index if device.index is not None else torch.cuda.current_device()))
    return {"PDL": True, "launch_pdl": True} if on else {"PDL": False}


@triton.jit
def wait_for_inputs(PDL: tl.constexpr):
    """Wait for the previous kernel's writes, then let the next kernel launch (module doc)."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
