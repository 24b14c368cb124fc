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


@pytest.mark.parametrize("trial", range(3))
def test_copy_rows_gathers_and_scatters_by_position_and_skips_dead_rows(trial):
    """A row list left None is the row's position: a gather of slots into rows 0..n-1, and back, with `live`
    leaving the rows marked 0 unwritten (the KDA prefill's empty sequences)."""
    rng = random.Random()
    S, D = rng.randint(4, 10), rng.choice([32, 1030])
    n = rng.randint(1, S)
    pool = torch.randn(S, D, device=DEVICE)
    slots = rng.sample(range(S), n)
    index = torch.tensor(slots, dtype=torch.long, device=DEVICE)
    gathered = torch.full((n, D), float("nan"), device=DEVICE)
    kda_blocks.copy_rows(pool, index, gathered, None)
    assert torch.equal(gathered, pool[index])
    final = torch.randn(n, D, device=DEVICE)
    live = [rng.randint(0, 3) for _ in range(n)]  # a sequence's length: 0 is empty
    want = pool.clone()
    for i, slot in enumerate(slots):
        if live[i]:
            want[slot] = final[i]
    kda_blocks.copy_rows(final, None, pool, index, live=torch.tensor(live, device=DEVICE))
    assert torch.equal(pool, want)


def test_copy_rows_needs_one_row_list_of_one_length():
    x = torch.zeros(3, 8, device=DEVICE)
    with pytest.raises(ValueError, match="source rows, the destination rows or both"):
        kda_blocks.copy_rows(x, None, x, None)
    with pytest.raises(ValueError, match="must all be"):
        kda_blocks.copy_rows(x, torch.zeros(2, dtype=torch.long, device=DEVICE), x, None,
                             live=torch.ones(3, device=DEVICE))
