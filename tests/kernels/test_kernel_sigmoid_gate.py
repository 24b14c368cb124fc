"""MLA's output gate kernel (mstar/kernels/sigmoid_gate.py) against the reference `LayerOps.sigmoid_gate`:
o in the head-strided layout the value projection leaves, the gate a strided view of a stacked projection.
Without CUDA through Triton's interpreter (fp32); on the GPU in bf16 too."""

from __future__ import annotations

import os
import random

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from mstar.kernels.sigmoid_gate import sigmoid_gate  # noqa: E402
from mstar.models.kimi_k3.layer_ops import REFERENCE_OPS  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32] + ([torch.bfloat16] if DEVICE == "cuda" else [])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("trial", range(3))
def test_sigmoid_gate_equals_the_reference(dtype, trial):
    rng = random.Random()
    T, H, V = rng.randint(1, 9), rng.randint(1, 6), rng.choice([16, 100, 128])
    o = (torch.randn(H, T, V, device=DEVICE) * 3).to(dtype).transpose(0, 1)  # [T, H, V], heads strided
    stacked = (torch.randn(T, H * V + 40, device=DEVICE) * 4).to(dtype)
    gate = stacked[:, 24: 24 + H * V]  # a view into a wider projection output
    expect = REFERENCE_OPS.sigmoid_gate(o, gate)
    got = sigmoid_gate(o, gate)
    assert got.dtype == dtype and got.shape == (T, H * V)
    if dtype == torch.float32:
        torch.testing.assert_close(got, expect, rtol=1e-6, atol=1e-6)
    else:  # one rounding of the same fp32 value; exp's last bits may differ between the two
        torch.testing.assert_close(got, expect, rtol=8e-3, atol=1e-5)


def test_bad_shapes_are_refused():
    o = torch.randn(2, 3, 16, device=DEVICE)
    with pytest.raises(ValueError, match=r"o \[T, H, V\] and gate \[T, H V\]"):
        sigmoid_gate(o, torch.randn(2, 40, device=DEVICE))
