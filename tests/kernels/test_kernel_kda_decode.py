"""KDA decode kernels (mstar/kernels/kda_decode.py): the one-row conv against the ragged prefill conv and
its torch reference, the gated head norm against `GatedHeadNorm`, and the whole decode step against those
references and kda.py's recurrence. Without CUDA through Triton's interpreter (fp32; the decode step in
bf16 too, at small heads); on the GPU in bf16 at one TP8 rank's width."""

from __future__ import annotations

import os
import random

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from mstar.kernels import kda_decode as kd  # noqa: E402
from mstar.kernels.kda_fla import varlen_short_conv  # noqa: E402
from mstar.models.kimi_k3.kda import GatedHeadNorm, kda_gate, kda_recurrent, l2_normalize  # noqa: E402

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


# (heads, head_dim, f_a width) of decode_step cases: small in the interpreter, one TP8 rank of K3 on the GPU
STEP_SHAPES = [(3, 16, 8)] + ([(12, 128, 128)] if DEVICE == "cuda" else [])
STEP_WARPS = [None] + (list(kd.DECODE_STEP_WARP_CHOICES) if DEVICE == "cuda" else [])
L2_EPS, SLOTS, CONV_W = 1e-6, 9, 4


def decode_step_case(dtype, batch, heads, head_dim, low_rank, lower_bound):
    """Fresh inputs of one layer's decode step as decode_step takes them: the rows as column slices of one
    stacked projection, a pool of SLOTS states and windows, the step's slots never 0..B-1."""
    width = heads * head_dim
    proj = torch.randn(batch, 4 * width + low_rank + heads + 3, device=DEVICE).to(dtype)
    q, k, v, gate, rest = proj.split([width] * 4 + [proj.shape[1] - 4 * width], dim=1)
    norm = GatedHeadNorm(head_dim, 1e-5).to(DEVICE)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.2 * torch.randn(head_dim))
    return dict(
        q=q, k=k, v=v, f_a=rest[:, :low_rank], beta=rest[:, low_rank:low_rank + heads], gate=gate,
        conv=torch.randn(SLOTS, 3, CONV_W - 1, width, device=DEVICE).to(dtype),
        states=torch.randn(SLOTS, heads, head_dim, head_dim, device=DEVICE) * 0.3,
        slots=torch.tensor(random.sample(range(2, SLOTS), batch), device=DEVICE),
        conv_weight=torch.randn(3, CONV_W, width, device=DEVICE) * 0.5,
        f_b=(torch.randn(width, low_rank, device=DEVICE) * low_rank**-0.5).to(dtype),
        a_log=torch.randn(heads, device=DEVICE) * 0.5, dt_bias=torch.randn(width, device=DEVICE) * 0.5 - 1,
        norm_weight=norm.weight.detach().to(dtype), scale=head_dim**-0.5, lower_bound=lower_bound, l2_eps=L2_EPS,
        norm_eps=norm.eps,
    )


def decode_step_reference(c):
    """(output, states, windows) of the chain decode_step replaces, by the torch references: the f_b projection
    (rounded to the rows' dtype), decode_conv_reference, kda.py's gate, L2 norms and recurrence one sequence
    at a time, GatedHeadNorm. The pool tensors are copies (the kernel's are written in place)."""
    B, heads, head_dim = c["q"].shape[0], *c["states"].shape[1:3]
    states, conv, slots = c["states"].clone(), c["conv"].clone(), c["slots"]
    rows, windows = kd.decode_conv_reference(torch.stack([c["q"], c["k"], c["v"]], dim=1), conv[slots],
                                             c["conv_weight"])
    q, k, v = (x.view(B, heads, head_dim) for x in rows)
    g = kda_gate(F.linear(c["f_a"], c["f_b"]).view(B, heads, head_dim), c["a_log"], c["dt_bias"], c["lower_bound"])
    q, k, beta = l2_normalize(q, L2_EPS), l2_normalize(k, L2_EPS), torch.sigmoid(c["beta"].float())
    o = []
    for i, slot in enumerate(slots.tolist()):
        o_i, states[slot] = kda_recurrent(q[i:i + 1], k[i:i + 1], v[i:i + 1], g[i:i + 1], beta[i:i + 1], c["scale"],
                                          states[slot])
        o.append(o_i)
    conv[slots] = windows
    norm = GatedHeadNorm(head_dim, c["norm_eps"]).to(DEVICE, c["norm_weight"].dtype)
    with torch.no_grad():
        norm.weight.copy_(c["norm_weight"])
        y = norm(torch.cat(o), c["gate"].reshape(B, heads, head_dim))
    return y.reshape(B, -1), states, conv


# bf16: a conv output or f rounded the other way moves the whole head's o (~5e-3 seen in the interpreter)
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("lower_bound", [-5.0, None])
@pytest.mark.parametrize("batch", [1, 4, 7])
@pytest.mark.parametrize("shape", STEP_SHAPES)
@pytest.mark.parametrize("warps", STEP_WARPS)
def test_decode_step_equals_the_chain_of_references(dtype, tol, lower_bound, batch, shape, warps):
    """Output (poisoned first), the step's states and windows as the references leave them; the other slots'
    states and windows untouched."""
    c = decode_step_case(dtype, batch, *shape, lower_bound)
    expect, expect_states, expect_conv = decode_step_reference(c)
    before = c["states"].clone()
    out = torch.full(expect.shape, float("nan"), dtype=dtype, device=DEVICE)
    got = kd.decode_step(**c, out=out, warps=warps)
    assert got is out and rel(got, expect) < tol, rel(got, expect)
    slots = c["slots"].tolist()
    others = [s for s in range(SLOTS) if s not in slots]
    assert rel(c["states"][slots], expect_states[slots]) < tol, rel(c["states"][slots], expect_states[slots])
    assert torch.equal(c["states"][others], before[others])
    assert torch.equal(c["conv"], expect_conv)  # the windows are shifted copies, exact; the others untouched
