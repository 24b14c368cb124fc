"""StackedLinear: one GEMM for several projections of one input, weights held once."""

import pytest
import torch
from torch import nn

from mstar.kernels.stacked_linear import StackedLinear


def test_stacked_outputs_equal_the_separate_projections_and_share_storage():
    linears = [nn.Linear(24, n, bias=False).double() for n in (7, 16, 1)]
    x = torch.randn(5, 24, dtype=torch.float64)
    expect = [lin(x) for lin in linears]
    stacked = StackedLinear(linears)
    for got, want in zip(stacked(x), expect, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert all(lin.weight.untyped_storage().data_ptr() == stacked.weight.untyped_storage().data_ptr()
               for lin in linears)
    with torch.no_grad():
        stacked.weight[7:23] = 0  # the modules read the stack
    assert torch.equal(linears[1](x), torch.zeros(5, 16, dtype=torch.float64))


def test_mismatched_inputs_or_biases_are_refused():
    with pytest.raises(ValueError, match="one input width"):
        StackedLinear([nn.Linear(4, 2, bias=False), nn.Linear(5, 2, bias=False)])
    with pytest.raises(ValueError, match="bias-free"):
        StackedLinear([nn.Linear(4, 2, bias=True)])


def test_an_mla_layer_with_stacked_inputs_computes_what_it_did():
    """GatedMLA's q_a, kv_a and output-gate projections as one GEMM (gpu_ops.stack_mla_inputs): the same
    outputs and cache rows, prefill then a decode row, in fp64."""
    from mstar.models.kimi_k3.config import parse_config
    from mstar.models.kimi_k3.gpu_ops import stack_mla_inputs
    from mstar.models.kimi_k3.mla import GatedMLA
    from mstar.tools.make_tiny import k3_fixture

    cfg = parse_config(k3_fixture())
    layer = next(i for i, kind in enumerate(cfg.layer_kinds) if kind == "mla")
    attn = GatedMLA(cfg, layer).double()
    assert attn.g_proj is not None and attn.q_lora_rank is not None  # all three projections stack
    x, step = torch.randn(6, cfg.hidden_size, dtype=torch.float64), torch.randn(1, cfg.hidden_size, dtype=torch.float64)
    y, cache = attn(x)
    y_next, _ = attn(step, cache, absorbed=True)
    stack_mla_inputs(attn)
    assert attn.stacked_inputs is not None
    got, got_cache = attn(x)
    got_next, _ = attn(step, got_cache, absorbed=True)
    torch.testing.assert_close(got, y, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(got_cache.rows(), cache.rows(), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(got_next, y_next, rtol=1e-10, atol=1e-12)
