"""The shifted KV addressing kernel (mstar/kernels/kv_slots.py) against the torch arithmetic it replaces
(resources/latent_kv.shift_slots on the CPU): random page tables, ragged rows per sequence, shifts up to
the furthest a verify step in flight may keep; outputs poisoned first (the allocator's freed blocks on the
GPU). Without CUDA through Triton's interpreter."""

from __future__ import annotations

import os
import random

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from mstar.kernels.kv_slots import shifted_slots  # noqa: E402
from mstar.resources.latent_kv import shift_slots  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def random_step(rng: random.Random, page_size: int):
    B = rng.randint(1, 9)
    rows = [rng.choice([1, 1, 4, 8, rng.randint(1, 300)]) for _ in range(B)]
    computed = [rng.randint(0, 600) for _ in range(B)]
    advance = [rng.randint(0, 8) for _ in range(B)]
    pages = [-(-(c + n + a) // page_size) for c, n, a in zip(computed, rows, advance, strict=True)]
    width = max(pages) + rng.randint(0, 2)
    table = torch.zeros(B, width, dtype=torch.long)
    for b, n in enumerate(pages):
        table[b, :n] = torch.randperm(4096)[:n] + 1
    row_seq = torch.tensor([b for b, n in enumerate(rows) for _ in range(n)])
    positions = torch.tensor([c + j for c, n in zip(computed, rows, strict=True) for j in range(n)])
    lens = torch.tensor([c + n for c, n in zip(computed, rows, strict=True)])
    return table, row_seq, positions, lens, torch.tensor(advance)


@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_shifted_slots_match_the_torch_arithmetic(page_size):
    rng = random.Random(page_size)
    for _ in range(20):
        step = random_step(rng, page_size)
        expected = shift_slots(*step, page_size)
        if DEVICE == "cuda":
            junk = [torch.full((n,), -7, dtype=torch.long, device=DEVICE) for n in (8, 64, 512, 4096)]
            del junk
        got = shifted_slots(*(t.to(DEVICE) for t in step), page_size)
        for g, e in zip(got, expected, strict=True):
            assert torch.equal(g.cpu(), e)


def test_shapes_that_do_not_match_are_refused():
    table, row_seq, positions, lens, advance = random_step(random.Random(0), 16)
    with pytest.raises(ValueError, match="shifted_slots takes"):
        shifted_slots(table, row_seq[:-1], positions, lens, advance, 16)
