"""A closed block's AttnRes statistics for the later sublayers (mstar/kernels/attn_res_blocks.py) against torch,
and the mix that reads them (attn_res_norm's `closed`) against the reference mix. Without CUDA through Triton's
interpreter (fp32); on the GPU also bf16 blocks at K3's width."""

from __future__ import annotations

import os
import random

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from mstar.kernels import attn_res_norm as k  # noqa: E402
from mstar.kernels.attn_res_blocks import closed_block_stats, closed_block_stats_reference  # noqa: E402
from mstar.models.kimi_k3.attn_res import attn_res_norm as reference  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32] + ([torch.bfloat16] if DEVICE == "cuda" else [])


def rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


def pseudo_queries(q, d):
    """[q, d] fp32 rows as res_norm.weight * proj.weight make them (weights of bf16 checkpoints, any scale)."""
    proj = torch.randn(q, d, device=DEVICE).to(torch.bfloat16) * d**-0.5
    res_w = (1 + 0.2 * torch.randn(q, d, device=DEVICE)).to(torch.bfloat16)
    return (res_w.float() * proj.float()).contiguous()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, d, queries", [(1, 160, 3), (70, 160, 70), (5, 1100, 130)] + (
    [(300, 7168, 187), (128, 7168, 187)] if DEVICE == "cuda" else []))
@pytest.mark.parametrize("parts", [None, 1, 3], ids=["parts=fill", "parts=1", "parts=3"])
def test_closed_block_stats_equal_torch(dtype, rows, d, queries, parts):
    """Square sums and the dots with every query from `first` on, fp32-accurate (tf32x3 on the GPU), whole or
    over parts of D added after; the columns of earlier queries are left as they were (NaN here); a strided block
    and a strided table."""
    rng = random.Random()
    first = rng.choice([0, 1, queries // 2, queries - 1])
    buffer = torch.randn(rows, d + 8, device=DEVICE) * torch.logspace(-1, 1, rows, device=DEVICE)[:, None]
    block = buffer.to(dtype)[:, 4: 4 + d]
    w = pseudo_queries(queries, d)
    table = torch.full((rows, 2 + queries), float("nan"), device=DEVICE)
    got = closed_block_stats(block, w, first, out=table[:, : 1 + queries], parts=parts)
    expect = closed_block_stats_reference(block, w, first)
    assert got.isnan()[:, 1: 1 + first].all() and table[:, -1].isnan().all()
    live = torch.cat([got[:, :1], got[:, 1 + first:]], dim=1)
    assert torch.isfinite(live).all()
    torch.testing.assert_close(live, torch.cat([expect[:, :1], expect[:, 1 + first:]], dim=1), rtol=2e-5,
                               atol=2e-5 * float(expect.abs().max()))


def test_bad_closed_block_arguments_are_refused():
    block, w = torch.randn(4, 32, device=DEVICE), pseudo_queries(3, 32)
    out = torch.empty(4, 4, device=DEVICE)
    with pytest.raises(ValueError, match="queries must be"):
        closed_block_stats(block, w.to(torch.bfloat16), 0, out)
    with pytest.raises(ValueError, match="first=4"):
        closed_block_stats(block, w, 4, out)
    with pytest.raises(ValueError, match="out must be"):
        closed_block_stats(block, w, 0, torch.empty(4, 3, device=DEVICE))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n, t, d", [(1, 3, 160), (2, 5, 160), (9, 4, 1100)] + (
    [(9, 256, 7168)] if DEVICE == "cuda" else []))
@pytest.mark.parametrize("splits, tile", [(None, None), (1, None), (3, (256, 4))])
@pytest.mark.parametrize("add", [False, True])
def test_a_mix_over_closed_stats_equals_the_reference(dtype, n, t, d, splits, tile, add):
    """The first n - 1 sources' stats from closed_block_stats (each block closed before mix `query`, at a table
    row of its own), the last read (and the residual added into it, in place, the same bits): the output is the
    reference's mix and norm, as when every source is read."""
    queries, query = 7, random.randrange(1, 7)
    sources = (torch.randn(n, t, d, device=DEVICE) * torch.logspace(-1, 1, n, device=DEVICE)[:, None, None]).to(dtype)
    w = pseudo_queries(queries, d)
    proj = torch.randn(1, d, device=DEVICE).to(dtype) * d**-0.5
    res_w = (1 + 0.2 * torch.randn(d, device=DEVICE)).to(dtype)
    w[query] = res_w.float() * proj[0].float()  # this mix's pseudo-query, as the model stacks it
    out_w = (1 + 0.2 * torch.randn(d, device=DEVICE)).to(dtype)
    table = torch.full((n + 1, t, 1 + queries), float("nan"), device=DEVICE)
    for j in range(n - 1):
        closed_block_stats(sources[j], w, random.randrange(query + 1), out=table[j])
    residual = (torch.randn(t, d, device=DEVICE) * 2).to(dtype) if add else None
    reference_sources = sources.clone()
    expect = reference(reference_sources, proj, res_w, 1e-6, out_w, 1e-5, residual)
    got = k.attn_res_norm(sources, proj, res_w, 1e-6, out_w, 1e-5, out=torch.full_like(expect, float("nan")),
                          splits=splits, tile=tile, residual=residual, closed=(table, query))
    assert torch.equal(sources, reference_sources)
    assert torch.isfinite(got).all()
    assert rel(got, expect) < (1e-5 if dtype == torch.float32 else 1e-2), rel(got, expect)


def test_closed_stats_of_the_wrong_shape_are_refused():
    sources, proj, res_w = torch.randn(3, 2, 8, device=DEVICE), torch.randn(1, 8, device=DEVICE), torch.ones(8)
    res_w = res_w.to(DEVICE)
    for table, query in ((torch.zeros(1, 2, 4, device=DEVICE), 0), (torch.zeros(2, 2, 4, device=DEVICE), 3),
                         (torch.zeros(2, 3, 4, device=DEVICE), 0), (torch.zeros(2, 2, 4, device=DEVICE).double(), 0)):
        with pytest.raises(ValueError, match="closed stats must be"):
            k.attn_res_norm(sources, proj, res_w, 1e-6, res_w, 1e-6, closed=(table, query))
    with pytest.raises(ValueError, match="not the one launch"):
        k.attn_res_norm(sources, proj, res_w, 1e-6, res_w, 1e-6, one_launch=True,
                        closed=(torch.zeros(2, 2, 4, device=DEVICE), 0))
