"""Temperature scaling keeps finite logits finite at any positive temperature; fresh logits each run."""

from __future__ import annotations

import pytest
import torch

from mstar.kernels.temperature import scale_by_temperature_finite


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("temperature", [1e-45, 3e-39, 1e-38, 1e-5, 0.7, 1.0, 5.0])
def test_finite_logits_stay_finite_and_masks_stay(dtype, temperature):
    rows, vocab = 8, 64
    magnitude = 10.0 ** torch.randint(0, 38, (rows, 1)).to(dtype)  # up to 1e37: overflows a small T
    logits = torch.randn(rows, vocab, dtype=dtype) * magnitude
    logits[:, 3] = float("-inf")  # a masked token
    logits[0, 7] = float("nan")
    out = scale_by_temperature_finite(logits, temperature)
    finite = torch.isfinite(logits)
    assert torch.isfinite(out[finite]).all()
    assert (out[:, 3] == float("-inf")).all() and out[0, 7].isnan()
    rows_ok = slice(1, None)  # row 0 holds the NaN
    assert out[0][finite[0]].amax() == 0
    assert (out[rows_ok].amax(-1) == 0).all()  # each row's best logit is 0
    plain = (logits[rows_ok] - logits[rows_ok].amax(-1, keepdim=True)) / temperature
    exact = finite[rows_ok] & torch.isfinite(plain)
    assert torch.equal(out[rows_ok][exact], plain[exact])  # where nothing overflowed: the shifted quotient
    # Order is kept (ties appear only among values clamped at the bottom, of probability 0).
    order = logits[rows_ok].argsort(dim=-1)
    assert (out[rows_ok].gather(-1, order).diff(dim=-1)[:, 1:] >= 0).all()


def test_tensor_temperatures_broadcast_per_row():
    logits = torch.randn(3, 10) * 1e36
    temperature = torch.tensor([[1e-40], [1.0], [2.0]])
    out = scale_by_temperature_finite(logits, temperature)
    assert torch.isfinite(out).all()
    shifted = logits[1:] - logits[1:].amax(-1, keepdim=True)
    torch.testing.assert_close(out[1:], shifted / temperature[1:])
    assert (out[0] <= 0).all() and out[0].amax() == 0
