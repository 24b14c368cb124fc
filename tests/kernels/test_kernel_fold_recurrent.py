"""kernels/kda_blocks.py's fold_recurrent (the gated delta rule over short blocks, from each slot's state, the
state stored after the folded rows only) against kda.py's torch recurrence, at every tile the benchmark
times: fresh ragged layouts, both gate forms, slots the call does not own poisoned and checked untouched.
Without CUDA through Triton's interpreter."""

from __future__ import annotations

import os
import random

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from mstar.kernels import kda_blocks  # noqa: E402
from mstar.models.kimi_k3.kda import kda_gate, kda_recurrent, l2_normalize  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
EPS = 1e-6


def reference(q, k, v, f, beta, a_log, dt_bias, scale, lower_bound, states, slots, starts, ends, folds):
    """(o rows of each sequence, the states after the call) by kda.py, one sequence at a time."""
    states = states.clone()
    outs = {}
    for slot, start, end, fold in zip(slots, starts, ends, folds, strict=True):
        rows = slice(start, end)
        qn, kn = l2_normalize(q[rows], EPS), l2_normalize(k[rows], EPS)
        g = kda_gate(f[rows], a_log, dt_bias, lower_bound)
        b = torch.sigmoid(beta[rows].float())
        o, _ = kda_recurrent(qn, kn, v[rows], g, b, scale, states[slot])
        outs[(start, end)] = o
        if fold:
            _, folded = kda_recurrent(qn[:fold], kn[:fold], v[rows][:fold], g[:fold], b[:fold], scale, states[slot])
            states[slot] = folded
    return outs, states


@pytest.mark.parametrize("tile", kda_blocks.FOLD_TILES)
@pytest.mark.parametrize("lower_bound", [-5.0, None])
def test_fold_recurrent_matches_torch(tile, lower_bound):
    rng = random.Random()
    H, K, V = rng.choice([1, 3]), 16, rng.choice([16, 40])  # V = 40: a partial column tile at every tile width
    B = rng.randint(1, 4)
    lengths = [rng.randint(1, 6) for _ in range(B)]
    folds = [rng.randint(0, n) for n in lengths]
    starts, ends, row = [], [], rng.randint(0, 2)  # rows before, between and after the sequences are unused
    for n in lengths:
        starts.append(row)
        ends.append(row + n)
        row += n + rng.randint(0, 1)
    M = row + 1
    slots = rng.sample(range(1, B + 3), B)
    q, k, f = (torch.randn(M, H, K, device=DEVICE) for _ in range(3))
    v = torch.randn(M, H, V, device=DEVICE)
    beta = torch.randn(M, H, device=DEVICE)
    a_log = torch.randn(H, device=DEVICE) * 0.5
    dt_bias = torch.randn(H * K, device=DEVICE) * 0.5
    states = torch.randn(B + 3, H, K, V, device=DEVICE) * 0.1
    states[[s for s in range(B + 3) if s not in slots]] = -777.0  # no one's: must stay as they are
    scale = K**-0.5
    want_o, want_states = reference(q, k, v, f, beta, a_log, dt_bias, scale, lower_bound, states, slots, starts,
                                    ends, folds)

    def as_t(xs):
        return torch.tensor(xs, device=DEVICE, dtype=torch.int32)

    got = kda_blocks.fold_recurrent(q, k, v, f, beta, a_log, dt_bias, scale, lower_bound, EPS, states, as_t(slots),
                                    as_t(starts), as_t(ends), as_t(folds), tile=tile)
    for (start, end), o in want_o.items():
        torch.testing.assert_close(got[start:end], o, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(states, want_states, rtol=1e-4, atol=1e-5)
