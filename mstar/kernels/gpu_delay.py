"""A GPU-side wait of a given length that also tallies what it stands for: the modeled collectives.

`delay(ns, nbytes, tally)` queues one tiny kernel that spins on the GPU's global timer for `ns`
nanoseconds and adds (1, nbytes, ns) to the int64 counters `tally` [3]. On the stream it serialises
like the collective it stands in for (later kernels wait for it), and inside a CUDA graph it is
recorded and replayed like any kernel, so a replayed step both waits and counts exactly the
collectives its graph holds, whatever the model's layout. One program of one warp: it occupies one SM
for the wait, as a one-shot all-reduce occupies a few.

Off CUDA (tests) nothing waits; the counters are added on the host, so the tally is the same.
"""

from __future__ import annotations

import torch

try:  # a base CPU install has no triton: there the host path below is the only one
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised by the base-install test
    triton = None


def delay(ns: int, nbytes: int, tally: torch.Tensor) -> None:
    """Wait `ns` ns on `tally`'s device (CUDA) and add (1 call, nbytes, ns) to `tally` [3] int64."""
    if tally.dtype != torch.int64 or tally.shape != (3,):
        raise ValueError(f"tally must be an int64 tensor of 3 counters (calls, bytes, ns), got {tally.dtype} "
                         f"{tuple(tally.shape)}")
    if ns < 0 or nbytes < 0:
        raise ValueError(f"delay: ns={ns} and nbytes={nbytes} must be >= 0")
    if tally.device.type != "cuda":
        tally += torch.tensor([1, nbytes, ns], dtype=torch.int64)
        return
    _delay_kernel[(1,)](tally, ns, nbytes, num_warps=1)


if triton is not None:

    @triton.jit
    def _delay_kernel(tally_ptr, ns, nbytes):
        start = tl.extra.cuda.globaltimer()
        while tl.extra.cuda.globaltimer() - start < ns:
            pass
        tl.atomic_add(tally_ptr, 1)
        tl.atomic_add(tally_ptr + 1, nbytes)
        tl.atomic_add(tally_ptr + 2, ns)
