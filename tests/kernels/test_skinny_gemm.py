"""The skinny GEMM (mstar/kernels/skinny_gemm.py) through Triton's interpreter on the CPU: y = x W^T against
torch in fp32, at small shapes whose N and K are not multiples of the tiles, with grids that make programs
share tiles (the semaphore reduction), split a tile over many programs, or own whole tiles; outputs poisoned
first. The GPU test at the rank's shapes is test_kernel_skinny_gemm.py."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from mstar.kernels import skinny_gemm  # noqa: E402
from mstar.kernels.skinny_gemm import SkinnyConfig  # noqa: E402

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter test; GPU: test_kernel_skinny_gemm")

SMALL = SkinnyConfig(block_n=16, block_k=32, stages=1)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def poisoned(rows: int, n: int) -> torch.Tensor:
    return torch.full((rows, n), float("nan"))


@pytest.mark.parametrize("rows", [1, 3, 16])
@pytest.mark.parametrize("n, k, ctas", [
    (40, 70, 1),  # one program: every tile whole, K's last tile partial
    (37, 96, 3),  # 3 tiles x 3 k tiles over 3 programs: tiles whole, N's last tile partial
    (50, 100, 5),  # 4 x 4 units over 5 programs: ranges start and end inside tiles (both partial slots)
    (21, 300, 13),  # 2 tiles x 10 k tiles over 13 programs: 7 programs on one tile (more than one reduce round)
])
def test_equals_torch_fp32(rows, n, k, ctas):
    x, w = torch.randn(rows, k), torch.randn(n, k)
    out = poisoned(rows, n)
    got = skinny_gemm.skinny_linear(x, w, config=SMALL, ctas=ctas, out=out)
    assert got.data_ptr() == out.data_ptr() and torch.isfinite(got).all()
    assert rel(got, x @ w.T) < 1e-5


@pytest.mark.parametrize("rows", [1, 5])
@pytest.mark.parametrize("n, fp32_cols, ctas", [(40, 7, 1), (50, 21, 5), (37, 36, 3)])
def test_split_output_keeps_the_first_columns_in_fp32(rows, n, fp32_cols, ctas):
    """skinny_linear_split: columns below fp32_cols (here inside a tile, so one tile stores to both outputs,
    whole or through the shared-tile reduction) in fp32, the rest in x's dtype, as one product."""
    k = 100
    x, w = torch.randn(rows, k), torch.randn(n, k)
    y32, y = skinny_gemm.skinny_linear_split(x, w, fp32_cols, config=SMALL, ctas=ctas)
    assert y32.dtype == torch.float32 and y32.shape == (rows, fp32_cols) and y.shape == (rows, n - fp32_cols)
    assert rel(y32, x @ w[:fp32_cols].T) < 1e-5 and rel(y, x @ w[fp32_cols:].T) < 1e-5
    with pytest.raises(ValueError, match="fp32_cols"):
        skinny_gemm.skinny_linear_split(x, w, n)


def test_counters_are_zero_again_and_repeat_calls_agree():
    """The last program of each shared tile resets its counter: the next launch (here: fresh inputs, then the
    same inputs again) reduces correctly, and the fixed summation order gives the same bits twice."""
    n, k = 45, 200
    for _ in range(2):
        x, w = torch.randn(16, k), torch.randn(n, k)
        first = skinny_gemm.skinny_linear(x, w, config=SMALL, ctas=11)
        assert rel(first, x @ w.T) < 1e-5
        assert torch.equal(skinny_gemm.skinny_linear(x, w, config=SMALL, ctas=11), first)
        assert not skinny_gemm._workspace(x.device).counters.any()


def test_rows_of_a_strided_view_and_leading_dims():
    """x may be a column block of a wider activation (the stacked projections' outputs) and have leading dims."""
    wide = torch.randn(2, 3, 90)
    x = wide[..., 10:74]  # rows of stride 90
    w = torch.randn(33, 64)
    got = skinny_gemm.skinny_linear(x, w, config=SMALL, ctas=4)
    assert got.shape == (2, 3, 33) and rel(got, x @ w.T) < 1e-5


def test_default_config_rows_up_to_64():
    x, w = torch.randn(64, 256), torch.randn(80, 256)
    assert rel(skinny_gemm.skinny_linear(x, w, ctas=3), x @ w.T) < 1e-5


def test_bad_calls_say_what_is_wrong():
    w = torch.randn(8, 32)
    with pytest.raises(ValueError, match="1..64 rows"):
        skinny_gemm.skinny_linear(torch.randn(65, 32), w)
    with pytest.raises(ValueError, match="x has 16 columns"):
        skinny_gemm.skinny_linear(torch.randn(1, 16), w)
    with pytest.raises(ValueError, match="cast one"):
        skinny_gemm.skinny_linear(torch.randn(1, 32, dtype=torch.float64), w)
    with pytest.raises(ValueError, match="pdl=True needs a GPU"):
        skinny_gemm.skinny_linear(torch.randn(1, 32), w, pdl=True)


def test_the_measured_table_by_row_count():
    """A call of r rows takes the entry of the first measured row count >= r; past MAX_ROWS, and for shapes the
    table does not name, cuBLAS runs."""
    kda_inputs, mla_inputs = (6288, 7168), (3648, 7168)
    assert skinny_gemm.measured_choice(1, *kda_inputs) == skinny_gemm.H200_TABLE[kda_inputs][0]
    assert skinny_gemm.measured_choice(40, *kda_inputs) == skinny_gemm.H200_TABLE[kda_inputs][3]
    assert skinny_gemm.measured_choice(1, *mla_inputs) is None  # cuBLAS at 1 row, the kernel at 2..16
    assert all(skinny_gemm.measured_choice(r, *mla_inputs) == skinny_gemm.H200_TABLE[mla_inputs][1] for r in (2, 8))
    assert skinny_gemm.measured_choice(65, *kda_inputs) is None
    assert skinny_gemm.measured_choice(1, 7168, 1536) is None  # o_proj: cuBLAS was faster
    assert skinny_gemm.measured_choice(1, 100, 200) is None  # not measured


def test_linear_takes_cublas_off_the_gpu():
    """`use_kernel` picks the kernel only on a Hopper GPU; elsewhere `linear` is F.linear."""
    assert not skinny_gemm.use_kernel(1, 6288, 7168, torch.bfloat16, "cpu")
    x, w = torch.randn(3, 32), torch.randn(8, 32)
    assert torch.equal(skinny_gemm.linear(x, w), torch.nn.functional.linear(x, w))
