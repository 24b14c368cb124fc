"""KDA decode kernels (mstar/kernels/kda_decode.py): the one-row conv against the ragged prefill conv and
its torch reference, and the gated head norm against `GatedHeadNorm`. Without CUDA through Triton's
interpreter (fp32); on the GPU in bf16 at one TP8 rank's width."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from mstar.kernels import kda_decode as kd  # noqa: E402
from mstar.kernels.kda_fla import varlen_short_conv  # noqa: E402
from mstar.models.kimi_k3.kda import GatedHeadNorm  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
CASES = [(torch.float32, 4, 16, 1e-6)] + ([(torch.bfloat16, 12, 128, 1e-2)] if DEVICE == "cuda" else [])


def rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


@pytest.mark.parametrize("dtype, heads, head_dim, tol", CASES)
def test_decode_conv_reference_equals_the_ragged_conv(dtype, heads, head_dim, tol):
    B, width, W = 5, heads * head_dim, 4
    rows = torch.randn(B, 3, width, device=DEVICE).to(dtype)
    windows = torch.randn(B, 3, W - 1, width, device=DEVICE).to(dtype)
    weight = torch.randn(3, W, width, device=DEVICE)
    out, new = kd.decode_conv_reference(rows, windows, weight)
    for i in range(3):
        expect, expect_win = varlen_short_conv(rows[:, i], weight[i].T[:, None].to(dtype), windows[:, i], [1] * B)
        assert rel(out[i], expect) < tol
        assert torch.equal(new[:, i], expect_win.to(new.dtype))


@pytest.mark.parametrize("dtype, heads, head_dim, tol", CASES)
def test_decode_conv_kernel_updates_the_slots_in_place(dtype, heads, head_dim, tol):
    B, width, W, slots_total = 4, heads * head_dim, 4, 9
    proj = torch.randn(B, 3 * width + 8, device=DEVICE).to(dtype)  # q, k, v as column slices of one output
    q, k, v = proj[:, :width], proj[:, width:2 * width], proj[:, 2 * width:3 * width]
    conv = torch.randn(slots_total, 3, W - 1, width, device=DEVICE).to(dtype)
    weight = torch.randn(3, W, width, device=DEVICE)
    slots = torch.tensor([6, 1, 8, 3], device=DEVICE)
    before = conv.clone()
    expect, expect_win = kd.decode_conv_reference(torch.stack([q, k, v], dim=1), conv[slots], weight)
    got = kd.decode_conv(q, k, v, conv, slots, weight)
    assert rel(got, expect) < tol, rel(got, expect)
    assert torch.equal(conv[slots], expect_win)
    others = [s for s in range(slots_total) if s not in slots.tolist()]
    assert torch.equal(conv[others], before[others])


def norm_case(dtype, heads, head_dim, rows):
    """A GatedHeadNorm of random weights and rows o [rows, heads, head_dim], gate [rows, heads * head_dim]."""
    norm = GatedHeadNorm(head_dim, 1e-6).to(DEVICE)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.2 * torch.randn(head_dim))
    o = torch.randn(rows, heads, head_dim, device=DEVICE).to(dtype) * 3
    return norm.to(dtype), o, torch.randn(rows, heads * head_dim, device=DEVICE).to(dtype)


@pytest.mark.parametrize("dtype, heads, head_dim, tol", CASES)
@pytest.mark.parametrize("chosen", [False, True])
def test_gated_head_norm_equals_the_module(dtype, heads, head_dim, tol, chosen):
    """All rows, or (`tokens`) chosen ones: the rows of a verify step's combined layout that are the step's own,
    in any order."""
    norm, o, gate = norm_case(dtype, heads, head_dim, 9)
    tokens = torch.randperm(9, device=DEVICE)[:5] if chosen else None
    with torch.no_grad():
        expect = norm(o, gate.view(9, heads, head_dim))
    expect = expect[tokens] if chosen else expect
    got = kd.gated_head_norm(o, gate, norm.weight, norm.eps, tokens)
    assert got.shape == expect.shape and got.dtype == expect.dtype
    assert rel(got, expect) < tol, rel(got, expect)
