"""The greedy Markov chain kernel (mstar/kernels/markov_chain.py) against the reference chain
`K3DSparkModel.markov_sample` (temperature 0) over a real `MarkovHead`: each slot's pick is the reference's
argmax given the kernel's previous pick (the bias's summation order differs, so a pick may differ only where
two corrected logits are within its rounding). Without CUDA through Triton's interpreter (fp32)."""

from __future__ import annotations

import os
import random

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from mstar.kernels.markov_chain import greedy_markov_chain  # noqa: E402
from mstar.models.dspark.model import MarkovHead  # noqa: E402
from mstar.models.kimi_k3.norm import at_least_fp32  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32] + ([torch.bfloat16] if DEVICE == "cuda" else [])


def reference_logits(head: MarkovHead, base: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
    """U_j + W2 W1[prev] as `K3DSparkModel.markov_logits` computes it."""
    return at_least_fp32(base) + at_least_fp32(head(prev))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("trial", range(3))
def test_chain_picks_the_reference_argmax(dtype, trial):
    rng = random.Random()
    B, k, V, r = rng.randint(1, 5), rng.randint(1, 4), rng.choice([300, 1000, 4096]), rng.choice([16, 48, 64])
    head = MarkovHead(V, r).to(DEVICE, dtype)
    torch.nn.init.normal_(head.markov_w1.weight, std=2.0)
    base = (torch.randn(B, k, V, device=DEVICE) * 3).to(dtype)
    anchors = torch.randint(0, V, (B,), device=DEVICE)
    tokens = torch.full((B, k), -7, dtype=torch.long, device=DEVICE)  # poisoned
    tokens.copy_(greedy_markov_chain(base, anchors, head.markov_w1.weight, head.markov_w2.weight))
    assert tokens.dtype == torch.long and ((tokens >= 0) & (tokens < V)).all()
    prev = anchors
    tol = 1e-5 if dtype == torch.float32 else 2e-2  # the bias rounded once more or less in its dtype
    with torch.no_grad():
        for j in range(k):
            z = reference_logits(head, base[:, j], prev)
            picked = z.gather(1, tokens[:, j : j + 1])[:, 0]
            best = z.max(dim=1).values
            assert (picked >= best - tol * best.abs().clamp(min=1)).all(), (j, picked, best)
            exact = z.argmax(dim=1)
            # where the maximum is clear, the pick is the reference's
            gap = best - z.scatter(1, exact[:, None], float("-inf")).max(dim=1).values
            clear = gap > 10 * tol * best.abs().clamp(min=1)
            assert torch.equal(tokens[clear, j], exact[clear])
            prev = tokens[:, j]


def test_ties_pick_the_first_id_and_anchors_out_of_range_are_clamped():
    V, r = 64, 16
    head = MarkovHead(V, r).to(DEVICE)
    torch.nn.init.zeros_(head.markov_w2.weight)  # no bias: the picks are U's argmax
    base = torch.zeros(2, 2, V, device=DEVICE)
    base[0, 0, [5, 9, 40]] = 1.0  # a three-way tie: torch's argmax takes the first
    base[1, :, 63] = 2.0
    anchors = torch.tensor([V + 10, -3], device=DEVICE)  # clamped before the W1 gather
    tokens = greedy_markov_chain(base, anchors, head.markov_w1.weight, head.markov_w2.weight)
    assert tokens.tolist() == [[5, 0], [63, 63]]


def test_bad_shapes_are_refused():
    head = MarkovHead(64, 16).to(DEVICE)
    with pytest.raises(ValueError, match="anchors"):
        greedy_markov_chain(torch.zeros(2, 3, 64, device=DEVICE), torch.zeros(3, dtype=torch.long, device=DEVICE),
                            head.markov_w1.weight, head.markov_w2.weight)
    with pytest.raises(ValueError, match="multiple of 16"):
        odd = MarkovHead(64, 12).to(DEVICE)
        greedy_markov_chain(torch.zeros(1, 1, 64, device=DEVICE), torch.zeros(1, dtype=torch.long, device=DEVICE),
                            odd.markov_w1.weight, odd.markov_w2.weight)
