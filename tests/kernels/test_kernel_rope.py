"""The draft's RoPE kernel (mstar/kernels/rope.py) against the torch rotation `YarnRotaryEmbedding.rotate` with the
same tables: bit-identical (the kernel rounds every product as torch does). q_pe as the strided view of the
q projection, k_pe as a slice of the kv_a projection. Without CUDA through Triton's interpreter (fp32)."""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from mstar.kernels.rope import rotate_interleaved  # noqa: E402
from mstar.models.dspark import config as config_module  # noqa: E402
from mstar.models.dspark.config import load_dspark_config  # noqa: E402
from mstar.models.dspark.rope import YarnRotaryEmbedding  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32] + ([torch.bfloat16] if DEVICE == "cuda" else [])
FIXTURE = Path(config_module.__file__).parent / "fixtures" / "kimi_k3_dspark_config.json"


def rotary(dim: int) -> YarnRotaryEmbedding:
    return YarnRotaryEmbedding(load_dspark_config(FIXTURE).rope, dim)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("trial", range(4))
def test_rotation_equals_torch(dtype, trial):
    rng = random.Random()
    T, H, nope, dim = rng.randint(1, 9), rng.choice([1, 3, 8]), rng.choice([0, 16]), rng.choice([16, 64])
    rope = rotary(dim)
    positions = torch.randint(0, 1 << 20, (T,), device=DEVICE)
    cos, sin = rope.cos_sin(positions, torch.float32)
    q = (torch.randn(T, H * (nope + dim), device=DEVICE) * 4).to(dtype)
    q_pe = q.unflatten(-1, (H, -1))[..., nope:]  # [T, H, dim], heads strided
    kv = (torch.randn(T, 40 + dim, device=DEVICE) * 4).to(dtype)
    k_pe = kv[:, 40:]  # [T, dim], rows strided
    for x in (q_pe, k_pe):
        got = rotate_interleaved(x, cos, sin)
        expect = rope.rotate(x, cos, sin)
        assert got.dtype == dtype and got.shape == x.shape and got.is_contiguous()
        assert torch.equal(got, expect)
        assert torch.equal(expect, rope(x, positions))  # the reference's call is the same rotation


def test_bad_inputs_are_refused():
    cos = torch.zeros(2, 8, device=DEVICE)
    with pytest.raises(ValueError, match="cos, sin"):
        rotate_interleaved(torch.zeros(2, 3, 16, device=DEVICE), cos[:1], cos[:1])
    with pytest.raises(ValueError, match="fp32 tables"):
        rotate_interleaved(torch.zeros(2, 16, device=DEVICE), cos.double(), cos.double())
    with pytest.raises(ValueError, match="unit inner stride"):
        rotate_interleaved(torch.zeros(2, 32, device=DEVICE)[:, ::2], cos, cos)
