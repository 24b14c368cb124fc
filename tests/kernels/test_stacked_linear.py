"""StackedLinear: one GEMM for several projections of one input, weights held once, a second stack free."""

import pytest
import torch
from torch import nn

from mstar.kernels.stacked_linear import StackedLinear, columns_view, rows_view, stack_columns, stack_rows


def test_stacked_outputs_equal_the_separate_projections_and_share_storage():
    linears = [nn.Linear(24, n, bias=False).double() for n in (7, 16, 1)]
    params = [lin.weight for lin in linears]
    x = torch.randn(5, 24, dtype=torch.float64)
    expect = [lin(x) for lin in linears]
    stacked = StackedLinear(params)
    for got, want in zip(stacked(x), expect, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert [lin.weight for lin in linears] == params  # the same parameters, now rows of the stack
    assert all(lin.weight.untyped_storage().data_ptr() == stacked.weight.untyped_storage().data_ptr()
               for lin in linears)
    with torch.no_grad():
        stacked.weight[7:23] = 0  # the modules read the stack
    assert torch.equal(linears[1](x), torch.zeros(5, 16, dtype=torch.float64))


def test_a_row_stack_is_padded_with_zero_rows_to_aligned_outputs():
    """24 rows of weights become 24 (aligned already); 7 + 16 + 2 = 25 become 32, the last 7 zeros; the outputs'
    rows are then a multiple of ROW_ALIGN apart, and a second stack of the same weights is the first one."""
    from mstar.kernels.stacked_linear import ROW_ALIGN

    aligned = StackedLinear([torch.randn(n, 8) for n in (8, 16)])
    assert aligned.pad == 0 and aligned.weight.shape == (24, 8)
    weights = [torch.randn(n, 8) for n in (7, 16, 2)]
    stacked = StackedLinear(weights)
    assert stacked.weight.shape == (32, 8) and stacked.pad == 7 and ROW_ALIGN == 8
    assert torch.equal(stacked.weight[25:], torch.zeros(7, 8))
    x = torch.randn(3, 8)
    outs = stacked(x)
    assert [o.shape[-1] for o in outs] == [7, 16, 2] and all(o.stride(0) == 32 for o in outs)
    for got, w in zip(outs, weights, strict=True):
        torch.testing.assert_close(got, x @ w.T)
    again = StackedLinear(weights)
    assert again.weight.data_ptr() == stacked.weight.data_ptr() and again.weight.shape == (32, 8)
    assert rows_view(weights, 40) is None  # past the storage's end
    inside = torch.randn(40, 8)  # consecutive rows of a storage that goes on: its next rows are not zeros of ours
    assert rows_view([inside[:7], inside[7:25]]) is not None and rows_view([inside[:7], inside[7:25]], 32) is None


def test_stacking_the_same_weights_again_is_a_view_of_the_first_stack():
    weights = [torch.randn(n, 8) for n in (3, 5)]
    values = [w.clone() for w in weights]
    first = stack_rows(weights)
    again = stack_rows(weights)
    assert again.data_ptr() == first.data_ptr() and again.shape == (8, 8)
    assert all(torch.equal(w, v) for w, v in zip(weights, values, strict=True))
    assert rows_view([weights[1], weights[0]]) is None  # out of order: not one view
    assert rows_view([torch.randn(3, 8), torch.randn(5, 8)]) is None  # two storages


def test_column_stacks_sum_the_projections_of_concatenated_inputs_and_share_storage():
    linears = [nn.Linear(k, 12, bias=False).double() for k in (5, 9, 2)]
    params = [lin.weight for lin in linears]
    xs = [torch.randn(4, lin.in_features, dtype=torch.float64) for lin in linears]
    expect = sum(lin(x) for lin, x in zip(linears, xs, strict=True))
    stacked = stack_columns(params)
    assert stacked.shape == (12, 16) and stacked.is_contiguous()
    torch.testing.assert_close(torch.cat(xs, dim=-1) @ stacked.T, expect, rtol=1e-12, atol=1e-12)
    assert [lin.weight for lin in linears] == params  # the same parameters, now column blocks of the stack
    torch.testing.assert_close(sum(lin(x) for lin, x in zip(linears, xs, strict=True)), expect, rtol=1e-12,
                               atol=1e-12)  # the modules read the same values through the strided views
    with torch.no_grad():
        stacked[:, 5:14] = 0
    assert torch.equal(linears[1](xs[1]), torch.zeros(4, 12, dtype=torch.float64))
    again = stack_columns(params)
    assert again.data_ptr() == stacked.data_ptr() and again.shape == stacked.shape
    assert columns_view([params[1], params[0]]) is None  # out of order
    assert columns_view([torch.randn(12, 5), torch.randn(12, 9)]) is None  # two storages
    with pytest.raises(ValueError, match="one row count"):
        stack_columns([torch.zeros(2, 4), torch.zeros(3, 4)])


def test_mismatched_inputs_or_biases_are_refused():
    from mstar.models.kimi_k3.gpu_ops import stacked

    with pytest.raises(ValueError, match="one input width"):
        StackedLinear([torch.zeros(2, 4), torch.zeros(2, 5)])
    with pytest.raises(ValueError, match="bias-free"):
        stacked([nn.Linear(4, 2, bias=True)])


def test_an_mla_layer_with_stacked_inputs_computes_what_it_did():
    """GatedMLA's q_a, kv_a and output-gate projections as one GEMM (GpuMixerOps with `fused`): the same
    projections, in fp64; the module's own forward afterwards too."""
    pytest.importorskip("triton")  # gpu_ops imports the kernels
    from mstar.models.kimi_k3.config import parse_config
    from mstar.models.kimi_k3.gpu_ops import GpuMixerOps
    from mstar.models.kimi_k3.mla import GatedMLA
    from mstar.tools.make_tiny import k3_fixture

    cfg = parse_config(k3_fixture())
    layer = next(i for i, kind in enumerate(cfg.layer_kinds) if kind == "mla")
    attn = GatedMLA(cfg, layer).double()
    assert attn.g_proj is not None and attn.q_lora_rank is not None  # all three projections stack
    x, step = torch.randn(6, cfg.hidden_size, dtype=torch.float64), torch.randn(1, cfg.hidden_size, dtype=torch.float64)
    y, cache = attn(x)
    y_next, _ = attn(step, cache, absorbed=True)
    expect = attn.input_projections(x)
    got = GpuMixerOps(fused=True)._mla_inputs(attn, x)
    for a, b in zip(got, expect, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    got, got_cache = attn(x)
    got_next, _ = attn(step, got_cache, absorbed=True)
    torch.testing.assert_close(got, y, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(got_cache.rows(), cache.rows(), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(got_next, y_next, rtol=1e-10, atol=1e-12)
