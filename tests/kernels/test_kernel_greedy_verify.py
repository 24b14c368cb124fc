"""The greedy verification kernels (mstar/kernels/greedy_verify.py) against the torch rule
(speculative/verify.py `verify_greedy` on the CPU): random blocks whose drafts follow the target's argmax for
a random prefix, ties inside and across the kernel's chunks, unequal draft counts; on the GPU the allocator's blocks are
poisoned first (the kernels allocate their outputs).
Without CUDA through Triton's interpreter (fp32); on the GPU in bf16 too."""

from __future__ import annotations

import os
import random

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from mstar.kernels import greedy_verify as kernels  # noqa: E402
from mstar.speculative.verify import reference_verify_greedy  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32] + ([torch.bfloat16] if DEVICE == "cuda" else [])


def poison_allocator() -> None:
    """Leave freed blocks full of garbage ids, which the kernels' outputs then reuse (CUDA's caching allocator)."""
    if DEVICE == "cuda":
        junk = [torch.full((n,), 0x7EADBEEF, dtype=torch.long, device=DEVICE) for n in (8, 64, 512, 4096)]
        del junk


def random_case(rng: random.Random, dtype: torch.dtype):
    B, L, V = rng.randint(1, 6), rng.randint(0, 7), rng.choice([1, 7, 100, 2048, 3000, 5003])
    # small integers: many exact ties, in bf16 as in fp32
    logits = torch.randint(-6, 6, (B, L + 1, V)).to(dtype)
    if V > 2100 and rng.random() < 0.5:  # the row's maximum also in a later chunk: the earlier one must win
        logits[:, :, 2100] = logits[:, :, 5] = 50
    best = logits.float().argmax(-1)
    drafts = torch.randint(0, V, (B, L))
    for b in range(B):
        keep = rng.randint(0, L)
        drafts[b, :keep] = best[b, :keep]
    num_drafts = torch.tensor([rng.randint(0, L) for _ in range(B)])
    return logits, drafts, num_drafts


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("trial", range(8))
def test_greedy_verify_equals_the_torch_rule(dtype, trial):
    rng = random.Random()
    logits, drafts, num_drafts = random_case(rng, dtype)
    expect = reference_verify_greedy(logits, drafts, num_drafts)
    poison_allocator()
    got_tokens, got_accepted, finite = kernels.greedy_verify(logits.to(DEVICE), drafts.to(DEVICE),
                                                             num_drafts.to(DEVICE))
    assert got_tokens.tolist() == expect.tokens.tolist()
    assert got_accepted.tolist() == expect.num_accepted.tolist()
    assert finite.all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_rows_holding_nan_or_inf_are_marked_not_finite(dtype):
    rng = random.Random()
    for _ in range(6):
        logits, drafts, num_drafts = random_case(rng, dtype)
        B, W, V = logits.shape
        for _ in range(rng.randint(1, B * W)):  # some rows get a NaN or an infinity anywhere, the last column too
            logits[rng.randrange(B), rng.randrange(W), rng.choice([0, V - 1, rng.randrange(V)])] = rng.choice(
                [float("nan"), float("inf"), float("-inf")])
        poison_allocator()
        _, _, finite = kernels.greedy_verify(logits.to(DEVICE), drafts.to(DEVICE), num_drafts.to(DEVICE))
        assert finite.cpu().tolist() == torch.isfinite(logits).all(-1).tolist()


def test_a_strided_view_of_the_step_logits_is_read_in_place():
    """The engine passes its [rows, V] logits viewed as blocks, a slice of a wider buffer."""
    rng = random.Random()
    logits, drafts, num_drafts = random_case(rng, torch.float32)
    B, W, V = logits.shape
    wide = torch.full((B, W, V + 64), -1e9)
    wide[:, :, :V] = logits
    view = wide.to(DEVICE)[:, :, :V]
    tokens, accepted, _ = kernels.greedy_verify(view, drafts.to(DEVICE), num_drafts.to(DEVICE))
    expect = reference_verify_greedy(logits, drafts, num_drafts)
    assert tokens.tolist() == expect.tokens.tolist() and accepted.tolist() == expect.num_accepted.tolist()


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="greedy_verify takes"):
        kernels.greedy_verify(torch.zeros(2, 3, 10, device=DEVICE), torch.zeros(2, 3, dtype=torch.long,
                              device=DEVICE), torch.zeros(2, dtype=torch.long, device=DEVICE))
