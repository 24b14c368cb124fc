"""The dense SiTU MLP's GPU path (mstar/kernels/gated_mlp.py): the stacked gate/up GEMM + the SiTU kernel
against `GatedMLP`'s torch forward, and the stacking keeps one copy of the weights. Without CUDA through
Triton's interpreter (fp32); on the GPU in bf16 at one TP8 rank's shared-expert width."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from mstar.kernels import gated_mlp  # noqa: E402
from mstar.models.kimi_k3.config import parse_config  # noqa: E402
from mstar.models.kimi_k3.gpu_ops import GpuLayerOps  # noqa: E402
from mstar.models.kimi_k3.mlp import GatedMLP, situ  # noqa: E402
from mstar.tools.make_tiny import k3_fixture  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
CASES = [(torch.float32, 64, 96, 1e-5)] + ([(torch.bfloat16, 7168, 768, 1e-2)] if DEVICE == "cuda" else [])


def rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


@pytest.mark.parametrize("dtype, hidden, inter, tol", CASES)
def test_situ_kernel_equals_torch_including_clipped_values(dtype, hidden, inter, tol):
    gu = (torch.randn(5, 2 * inter, device=DEVICE) * 20).to(dtype)  # far into both tanh clips
    expect = situ(gu[:, :inter], gu[:, inter:], 4.0, 25.0)
    assert rel(gated_mlp.situ_and_mul(gu, 4.0, 25.0), expect) < tol


@pytest.mark.parametrize("dtype, hidden, inter, tol", CASES)
def test_fused_mlp_equals_the_module_and_holds_one_copy(dtype, hidden, inter, tol):
    cfg = parse_config(k3_fixture())
    mlp = GatedMLP(cfg, hidden, inter).to(DEVICE, dtype).requires_grad_(False)
    x = torch.randn(3, hidden, device=DEVICE).to(dtype)
    expect = mlp(x)
    got = GpuLayerOps().mlp(mlp, x)
    assert mlp.gate_proj.weight.untyped_storage().data_ptr() == mlp.up_proj.weight.untyped_storage().data_ptr()
    assert got.dtype == expect.dtype and rel(got, expect) < tol, rel(got, expect)
    assert rel(mlp(x), expect) < 1e-6  # the module's own forward reads the same (now stacked) weights
