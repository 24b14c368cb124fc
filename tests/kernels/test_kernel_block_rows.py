"""The KDA block path's row movement (mstar/kernels/kda_blocks.py: gather_block_rows, copy_rows) against
torch indexing: fresh random layouts, outputs poisoned first. Without CUDA through Triton's interpreter."""

from __future__ import annotations

import os
import random

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from mstar.kernels import kda_blocks  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32] + ([torch.bfloat16] if DEVICE == "cuda" else [])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("trial", range(3))
def test_gather_block_rows_places_x_prefix_and_zero_rows(dtype, trial):
    rng = random.Random()
    N, P, D = rng.randint(1, 9), rng.randint(1, 12), rng.choice([48, 1100])
    M = N + P + rng.randint(0, 5)
    x = torch.randn(N, D, device=DEVICE).to(dtype)
    prefix = torch.randn(P, D, device=DEVICE, dtype=torch.float32).to(dtype)
    dest = rng.sample(range(M), N + rng.randint(0, P))  # x rows, then some prefix rows; the rest zeros
    sources = [kda_blocks.ZERO_ROW] * M
    for i, d in enumerate(dest[:N]):
        sources[d] = i
    for d in dest[N:]:
        sources[d] = kda_blocks.PREFIX_ROW - rng.randrange(P)
    got = kda_blocks.gather_block_rows(x, prefix, torch.tensor(sources, device=DEVICE))
    want = torch.zeros(M, D, dtype=dtype, device=DEVICE)
    for r, c in enumerate(sources):
        if c >= 0:
            want[r] = x[c]
        elif c <= kda_blocks.PREFIX_ROW:
            want[r] = prefix[kda_blocks.PREFIX_ROW - c]
    assert torch.equal(got, want)


@pytest.mark.parametrize("trial", range(3))
def test_copy_rows_writes_only_the_listed_rows(trial):
    rng = random.Random()
    S, T, D = rng.randint(1, 8), rng.randint(8, 16), rng.choice([32, 1030])
    src = torch.randn(S, D, device=DEVICE)
    dst = torch.full((T, D), -777.0, device=DEVICE)  # poisoned: rows not listed must keep it
    n = rng.randint(0, min(S, T))
    src_rows, dst_rows = [rng.randrange(S) for _ in range(n)], rng.sample(range(T), n)
    want = dst.clone()
    for s, d in zip(src_rows, dst_rows, strict=True):
        want[d] = src[s]
    kda_blocks.copy_rows(src, torch.tensor(src_rows, dtype=torch.long, device=DEVICE), dst,
                         torch.tensor(dst_rows, dtype=torch.long, device=DEVICE))
    assert torch.equal(dst, want)
