"""A MoE layer's input projections on the GPU path (`GpuLayerOps.moe_inputs`: router, latent down projection
and shared experts' gate/up as one stacked GEMM with the router's logits in fp32) against the reference
`LayerOps.moe_inputs`: the same experts and weights, the same latent input and shared activations; the stacked
weights are the modules' own. And the layer's output projections (`GpuLayerOps.latent_output`: latent up and
shared down as one GEMM over their weights stacked by columns) against the reference's two. Without CUDA
through Triton's interpreter (fp32); on the GPU in bf16 too."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from mstar.models.kimi_k3.config import parse_config  # noqa: E402
from mstar.models.kimi_k3.gpu_ops import GpuLayerOps  # noqa: E402
from mstar.models.kimi_k3.layer_ops import REFERENCE_OPS  # noqa: E402
from mstar.models.kimi_k3.moe import LatentMoE  # noqa: E402
from mstar.tools.make_tiny import tiny_k3_raw_config  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
CASES = [(torch.float32, 1e-5)] + ([(torch.bfloat16, 2e-2)] if DEVICE == "cuda" else [])


def rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


@pytest.mark.parametrize("rows", [1, 6])
@pytest.mark.parametrize("dtype, tol", CASES)
def test_stacked_moe_inputs_equal_the_reference(rows, dtype, tol):
    cfg = parse_config(tiny_k3_raw_config())
    moe = LatentMoE(cfg).to(DEVICE).requires_grad_(False)
    with torch.no_grad():
        moe.gate.e_score_correction_bias.normal_(0, 0.05)
    moe = moe.to(dtype)
    x = torch.randn(rows, cfg.hidden_size, device=DEVICE).to(dtype)
    routing, z, shared = REFERENCE_OPS.moe_inputs(moe, x)
    ops = GpuLayerOps()
    got_routing, got_z, got_shared = ops.moe_inputs(moe, x)
    order, want_order = got_routing.experts.sort(-1), routing.experts.sort(-1)
    assert torch.equal(order.values, want_order.values)
    torch.testing.assert_close(got_routing.weights.gather(1, order.indices),
                               routing.weights.gather(1, want_order.indices).float(), rtol=1e-5, atol=1e-6)
    assert got_z.shape == z.shape and rel(got_z, z) < tol
    assert got_shared.shape == shared.shape and rel(got_shared, shared) < tol
    # the stack holds the modules' weights (one copy): the reference reads the same numbers afterwards
    stack = ops._moe_inputs[moe].weight
    assert moe.gate.weight.untyped_storage().data_ptr() == stack.untyped_storage().data_ptr()
    assert rel(REFERENCE_OPS.moe_inputs(moe, x)[1], z) < 1e-6


@pytest.mark.parametrize("rows", [1, 6])
@pytest.mark.parametrize("dtype, tol", CASES)
def test_stacked_latent_output_equals_the_reference(rows, dtype, tol):
    cfg = parse_config(tiny_k3_raw_config())
    moe = LatentMoE(cfg).to(DEVICE).requires_grad_(False).to(dtype)
    r = torch.randn(rows, cfg.moe_input_size, device=DEVICE).to(dtype)
    shared = torch.randn(rows, moe.shared_experts.down_proj.in_features, device=DEVICE).to(dtype)
    want = REFERENCE_OPS.latent_output(moe, r, shared)
    expect = (r.double() @ moe.routed_expert_up_proj.weight.double().T
              + shared.double() @ moe.shared_experts.down_proj.weight.double().T)
    assert rel(want, expect) < tol
    ops = GpuLayerOps()
    got = ops.latent_output(moe, r, shared)
    assert got.shape == want.shape and got.dtype == dtype and rel(got, expect) < tol
    stack = ops._latent_output[moe]
    assert moe.routed_expert_up_proj.weight.untyped_storage().data_ptr() == stack.untyped_storage().data_ptr()
    assert rel(REFERENCE_OPS.latent_output(moe, r, shared), want) < 1e-6  # the modules read the stack
    assert rel(ops.latent_output(moe, r, None), r.double() @ moe.routed_expert_up_proj.weight.double().T) < tol
