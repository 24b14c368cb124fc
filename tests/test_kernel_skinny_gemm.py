"""The skinny GEMM (mstar/kernels/skinny_gemm.py: a few rows of x against a weight read once) against
torch. Without CUDA through Triton's interpreter (fp32, exact products); on the GPU in bf16 at the
K3 rank's projection shapes."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from mstar.kernels import skinny_gemm as k  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


def operands(m, n, kk, dtype, *, strided=False):
    x = torch.randn(m, kk + (8 if strided else 0), device=DEVICE)[:, :kk].to(dtype)
    w = (torch.randn(n, kk, device=DEVICE) * kk**-0.5).to(dtype)
    return x, w


@pytest.mark.parametrize("m, n, kk, splits", [(1, 200, 300, None), (5, 130, 1100, 3), (16, 64, 256, 1),
                                              (3, 7, 513, 2), (2, 70, 600, 64)])
def test_fp32_equals_torch_for_any_k_split(m, n, kk, splits):
    """Ragged N and K (masked tiles), 1..16 rows, K split into parts (more parts than tiles: one each)."""
    x, w = operands(m, n, kk, torch.float32, strided=True)
    got = k.skinny_linear(x, w, out=torch.full((m, n), float("nan"), device=DEVICE), splits=splits)
    assert got.shape == (m, n) and torch.isfinite(got).all()
    assert rel(got, x @ w.T) < 1e-5


def test_leading_dims_and_bad_inputs():
    x, w = operands(6, 40, 96, torch.float32)
    assert rel(k.skinny_linear(x.view(2, 3, 96), w), (x @ w.T).view(2, 3, 40)) < 1e-5
    with pytest.raises(ValueError, match="1..16 rows"):
        k.skinny_linear(torch.randn(17, 96, device=DEVICE), w)
    with pytest.raises(ValueError, match="96 columns"):
        k.skinny_linear(x, w[:, :90])


def test_linear_takes_the_kernel_only_for_few_16_bit_rows():
    w = torch.randn(8, 32, device=DEVICE, dtype=torch.bfloat16)
    assert k.supported(torch.randn(16, 32, device=DEVICE, dtype=torch.bfloat16), w)
    assert not k.supported(torch.randn(17, 32, device=DEVICE, dtype=torch.bfloat16), w)
    assert not k.supported(torch.randn(1, 32, device=DEVICE), w)  # fp32 keeps torch's summation order
    x = torch.randn(20, 32, device=DEVICE)
    assert torch.equal(k.linear(x, w.float()), F.linear(x, w.float()))


@pytest.mark.parametrize("n, parts", [(1536, (768, 10)), (4096, (1536, 5)), (20480, (7168, 1))])
def test_k_parts_give_the_gpu_enough_programs(n, parts):
    """(K columns per part, parts) at K = 7168: N tiles of 64 times parts reach ~264 programs."""
    assert k._k_parts(n, 7168, None) == parts


@pytest.mark.skipif(DEVICE != "cuda", reason="bf16 on the GPU")
@pytest.mark.parametrize("m", [1, 8, 16])
@pytest.mark.parametrize("n, kk", [(6284, 7168), (7168, 1536), (576, 7168), (2304, 1536), (3584, 7168),
                                   (7168, 3584), (20480, 7168), (1536, 128)])
def test_bf16_at_rank_shapes(m, n, kk):
    x, w = operands(m, n, kk, torch.bfloat16)
    got = k.skinny_linear(x, w, out=torch.full((m, n), float("nan"), device=DEVICE, dtype=torch.bfloat16))
    assert rel(got, x.float() @ w.float().T) < 1e-2
