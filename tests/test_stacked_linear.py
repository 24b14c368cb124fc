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
