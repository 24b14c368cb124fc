"""The fused AttnRes + RMSNorm kernel and the one-launch RMSNorm (mstar/kernels/attn_res_norm.py) against
the torch reference. Without CUDA through Triton's interpreter (fp32); on the GPU in bf16 at K3's width."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from kernel_rounding import as_kernel_rounds  # noqa: E402

from mstar.kernels import attn_res_norm as k  # noqa: E402
from mstar.models.kimi_k3.attn_res import attn_res_norm as reference  # noqa: E402
from mstar.models.kimi_k3.norm import rms_norm  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# (dtype, width, relative bound): fp32 differs from torch only in summation order; bf16 by a rounding
# of the mix or of the normalised value where the two orders land on either side of a bf16 step.
CASES = [(torch.float32, 160, 1e-5), (torch.float32, 1100, 1e-5)] + (
    [(torch.bfloat16, 7168, 1e-2)] if DEVICE == "cuda" else [])


def rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


def weights(d, dtype):
    proj = torch.randn(1, d, device=DEVICE).to(dtype) * d**-0.5
    res_w, out_w = ((1 + 0.2 * torch.randn(d, device=DEVICE)).to(dtype) for _ in range(2))
    return proj, res_w, out_w


@pytest.mark.parametrize("dtype, d, tol", CASES)
@pytest.mark.parametrize("n, t", [(1, 1), (2, 3), (9, 5), (16, 2)])
@pytest.mark.parametrize("splits", [None, 1, 3, 64])
@pytest.mark.parametrize("tile", [None, (256, 4)])
def test_fused_mix_and_norm_equal_torch(dtype, d, tol, n, t, splits, tile):
    """Any split of the row's columns into chunks (None: the default for t rows; 1: one program per
    row, the mix normalising its own row; more chunks than tiles: one tile each), with the default
    tiles or wide ones (every source of a column in one thread on the GPU)."""
    # sources of very different scales (as blocks of a deep stream are) and a strided view of a larger buffer
    buffer = torch.randn(n + 2, t, d, device=DEVICE) * torch.logspace(-1, 1, n + 2, device=DEVICE)[:, None, None]
    sources = buffer.to(dtype)[:n]
    proj, res_w, out_w = weights(d, dtype)
    expect = reference(sources, proj, res_w, 1e-6, out_w, 1e-5)
    got = k.attn_res_norm(sources, proj, res_w, 1e-6, out_w, 1e-5, out=torch.full_like(expect, float("nan")),
                          splits=splits, tile=tile)
    assert got.dtype == expect.dtype and got.shape == expect.shape and torch.isfinite(got).all()
    assert rel(got, expect) < tol, rel(got, expect)


@pytest.mark.parametrize("dtype, d, tol", CASES)
@pytest.mark.parametrize("n, t", [(1, 1), (3, 2), (9, 4)])
@pytest.mark.parametrize("splits", [None, 1, 3])
@pytest.mark.parametrize("tile", [None, (256, 4)])
def test_the_residual_add_is_fused_into_the_mix(dtype, d, tol, n, t, splits, tile):
    """With `residual`, the partial sum (the last source) becomes partial + residual in place, rounded as the
    torch add rounds it (bit for bit), and the output is the mix of the updated sources."""
    buffer = torch.randn(n + 1, t, d, device=DEVICE) * torch.logspace(-1, 1, n + 1, device=DEVICE)[:, None, None]
    sources = buffer.to(dtype)[:n]
    residual = (torch.randn(t, d, device=DEVICE) * 2).to(dtype)
    proj, res_w, out_w = weights(d, dtype)
    reference_sources = sources.clone()
    expect = reference(reference_sources, proj, res_w, 1e-6, out_w, 1e-5, residual)
    got = k.attn_res_norm(sources, proj, res_w, 1e-6, out_w, 1e-5, out=torch.full_like(expect, float("nan")),
                          splits=splits, residual=residual, tile=tile)
    assert torch.equal(sources[-1], reference_sources[-1])  # the add, in place, the same bits
    assert torch.equal(sources[:-1], reference_sources[:-1])  # stored blocks untouched
    assert rel(got, expect) < tol, rel(got, expect)


@pytest.mark.parametrize("dtype, d, tol", CASES)
def test_prefill_rows_take_wide_tiles_one_a_program(dtype, d, tol):
    """From WIDE_TILE_ROWS rows the default is the wide tiling, every chunk one tile (with the residual add)."""
    t, n = k.WIDE_TILE_ROWS, 5
    (block, warps), splits = k.three_launch_tiling(t, d, 8)
    assert (block, warps) == (min(k.WIDE_TILE, 1 << (d - 1).bit_length()), k.WIDE_WARPS) and splits == -(-d // block)
    sources = (torch.randn(n, t, d, device=DEVICE) * torch.logspace(-1, 1, n, device=DEVICE)[:, None, None]).to(dtype)
    residual = torch.randn(t, d, device=DEVICE).to(dtype)
    proj, res_w, out_w = weights(d, dtype)
    reference_sources = sources.clone()
    expect = reference(reference_sources, proj, res_w, 1e-6, out_w, 1e-5, residual)
    got = k.attn_res_norm(sources, proj, res_w, 1e-6, out_w, 1e-5, out=torch.full_like(expect, float("nan")),
                          residual=residual, one_launch=False)
    assert torch.equal(sources, reference_sources)
    assert rel(got, expect) < tol, rel(got, expect)


def test_a_tile_that_is_not_a_power_of_two_is_refused():
    proj, res_w, out_w = weights(8, torch.float32)
    with pytest.raises(ValueError, match=r"tile=\(96, 4\)"):
        k.attn_res_norm(torch.randn(2, 3, 8, device=DEVICE), proj, res_w, 1e-6, out_w, 1e-6, tile=(96, 4))


def test_a_residual_of_the_wrong_shape_is_refused():
    proj, res_w, out_w = weights(8, torch.float32)
    with pytest.raises(ValueError, match="residual must be"):
        k.attn_res_norm(torch.randn(2, 3, 8, device=DEVICE), proj, res_w, 1e-6, out_w, 1e-6,
                        residual=torch.randn(3, 7, device=DEVICE))


@pytest.mark.parametrize("dtype, d, tol", CASES)
def test_rms_norm_rows_equals_torch_on_strided_rows(dtype, d, tol):
    wide = torch.randn(7, d + 64, device=DEVICE).to(dtype) * 3
    x = wide[:, :d]  # rows with a stride, as the latent part of kv_a's output
    w = (1 + 0.2 * torch.randn(d, device=DEVICE)).to(dtype)
    got = k.rms_norm_rows(x, w, 1e-6, out=torch.full(x.shape, float("nan"), device=DEVICE, dtype=dtype))
    assert rel(got, rms_norm(x, w, 1e-6)) < tol
    x3 = torch.randn(3, 4, d, device=DEVICE).to(dtype)
    assert rel(k.rms_norm_rows(x3, w, 1e-6), rms_norm(x3, w, 1e-6)) < tol


# (input dtype, output dtype, width, relative bound): the output's dtype is the one the input is rounded to as it is
# loaded; bf16 outputs differ from torch by a rounding of the normalised value (also in the interpreter)
ROUNDING_CASES = [(torch.float32, torch.float32, 160, 1e-5), (torch.float32, torch.bfloat16, 1100, 1e-2),
                  (torch.bfloat16, torch.bfloat16, 160, 1e-2)]


@pytest.mark.parametrize("x_dtype, out_dtype, d, tol", ROUNDING_CASES)
@pytest.mark.parametrize("columns", [None, slice(0, 96), slice(64, None)])
def test_rms_norm_rows_writes_chosen_columns_into_a_wider_buffer(x_dtype, out_dtype, d, tol, columns):
    """The norm of whole rows, x rounded to out's dtype as it is loaded (an fp32 sum normalised bit for bit as its
    rounded copy is), only `columns` written, into a column slice of a wider buffer (poisoned: the columns around
    it stay untouched)."""
    x = (torch.randn(5, d, device=DEVICE) * 3).to(x_dtype)
    w = (1 + 0.2 * torch.randn(d, device=DEVICE)).to(out_dtype)
    chosen = columns or slice(None)
    width = len(range(d)[chosen])
    wide = torch.full((5, width + 40), float("nan"), device=DEVICE, dtype=out_dtype)
    got = k.rms_norm_rows(x, w, 1e-6, out=wide[:, 16 : 16 + width], columns=columns)
    assert got.data_ptr() == wide[:, 16:].data_ptr()
    assert wide[:, :16].isnan().all() and wide[:, 16 + width :].isnan().all()
    expect = rms_norm(x.to(out_dtype), w, 1e-6)[:, chosen]
    assert torch.isfinite(got).all() and rel(got, expect) < tol, rel(got, expect)
    assert torch.equal(got, k.rms_norm_rows(as_kernel_rounds(x, out_dtype), w, 1e-6)[:, chosen])


def test_rms_norm_rows_refuses_columns_that_are_not_a_run():
    x, w = torch.randn(2, 32, device=DEVICE), torch.ones(32, device=DEVICE)
    with pytest.raises(ValueError, match="consecutive columns"):
        k.rms_norm_rows(x, w, 1e-6, columns=slice(0, 32, 2))
    with pytest.raises(ValueError, match="consecutive columns"):
        k.rms_norm_rows(x, w, 1e-6, columns=slice(40, 50))


def test_too_many_sources_is_refused():
    proj, res_w, out_w = weights(8, torch.float32)
    with pytest.raises(ValueError, match="1..16 sources"):
        k.attn_res_norm(torch.randn(17, 1, 8, device=DEVICE), proj, res_w, 1e-6, out_w, 1e-6)


@pytest.mark.parametrize("rows, splits, expect", [
    (1, None, (256, 28)), (64, None, (256, 28)), (1024, None, (3584, 2)), (4096, None, (7168, 1)),
    (1, 3, (2560, 3)), (1, 100, (256, 28)),
])
def test_column_chunks_fill_the_gpu_at_few_rows(rows, splits, expect):
    """(columns per chunk, chunks per row) at K3's width and 9 sources (256-column tiles)."""
    assert k._chunks(rows, 7168, 256, splits) == expect


def test_zero_splits_is_refused():
    with pytest.raises(ValueError, match="at least 1 chunk"):
        k._chunks(1, 7168, 256, 0)


# The one-launch path: on the GPU at K3's width (rows whose tiles wait for each other at the barriers; from 19
# rows several tiles a program); under the interpreter one program a row (its barriers wait for no one), which
# runs the several-tile loop where the row has more than one tile (d = 1100 at 9 sources: two, the last partial).
ONE_LAUNCH_CASES = [(torch.float32, 160, 1e-5), (torch.float32, 1100, 1e-5)] + (
    [(torch.bfloat16, 7168, 1e-2)] if DEVICE == "cuda" else [])


@pytest.mark.parametrize("dtype, d, tol", ONE_LAUNCH_CASES)
@pytest.mark.parametrize("n, t", [(1, 1), (2, 3), (9, 1), (9, 8), (16, 2), (9, 40), (9, 64), (2, 130)])
@pytest.mark.parametrize("add", [False, True])
def test_one_launch_equals_torch_and_repeats_bit_for_bit(dtype, d, tol, n, t, add):
    """Fresh inputs, poisoned output; the same call again (the counters left zero) gives the same bits."""
    buffer = torch.randn(n + 1, t, d, device=DEVICE) * torch.logspace(-1, 1, n + 1, device=DEVICE)[:, None, None]
    sources = buffer.to(dtype)[:n]
    residual = (torch.randn(t, d, device=DEVICE) * 2).to(dtype) if add else None
    proj, res_w, out_w = weights(d, dtype)
    reference_sources = sources.clone()
    expect = reference(reference_sources, proj, res_w, 1e-6, out_w, 1e-5, residual)
    before = sources.clone()
    got = k.attn_res_norm(sources, proj, res_w, 1e-6, out_w, 1e-5, out=torch.full_like(expect, float("nan")),
                          residual=residual, one_launch=True)
    assert torch.equal(sources, reference_sources)  # the add in place (if any), the same bits as torch's
    assert got.dtype == expect.dtype and torch.isfinite(got).all()
    assert rel(got, expect) < tol, rel(got, expect)
    sources.copy_(before)
    again = k.attn_res_norm(sources, proj, res_w, 1e-6, out_w, 1e-5, residual=residual, one_launch=True)
    assert torch.equal(again, got)


@pytest.mark.skipif(DEVICE != "cuda", reason="the default path choice and CUDA graphs need a GPU")
@pytest.mark.parametrize("rows", [4, 64])  # one tile a program; several
def test_one_launch_is_the_default_at_decode_rows_and_replays_in_a_graph(rows):
    d, n = 7168, 9
    capacity = k.ONE_LAUNCH_CTAS_PER_SM * torch.cuda.get_device_properties(0).multi_processor_count
    assert k._one_launch_fits(rows, d, 16, torch.device("cuda"))
    assert k._one_launch_fits(capacity, d, 16, torch.device("cuda"))  # a program a row
    assert not k._one_launch_fits(capacity + 1, d, 16, torch.device("cuda"))
    proj, res_w, out_w = weights(d, torch.bfloat16)
    sources = (torch.randn(n, rows, d, device=DEVICE)).to(torch.bfloat16)
    out = torch.empty(rows, d, device=DEVICE, dtype=torch.bfloat16)
    k.attn_res_norm(sources, proj, res_w, 1e-6, out_w, 1e-5, out=out)  # eager first: allocates the counters
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        k.attn_res_norm(sources, proj, res_w, 1e-6, out_w, 1e-5, out=out)
    for _ in range(3):  # fresh inputs each replay
        sources.copy_(torch.randn(n, rows, d, device=DEVICE))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert rel(out, reference(sources, proj, res_w, 1e-6, out_w, 1e-5)) < 1e-2


def test_one_launch_plan_bounds_the_grid_to_what_is_resident():
    """(tile columns, tiles a program, programs a row) at K3's width and 9 sources: one 512-column tile a
    program while the rows' 14 tiles fit, then wide tiles (WIDE_TILE) shared out; no plan past one program a row."""
    wide = k.WIDE_TILE
    if DEVICE != "cuda":
        assert k._one_launch_plan(64, 7168, 16, torch.device("cpu")) == (wide, 7168 // wide, 1)  # a row a program
        assert not k._one_launch_fits(8, 7168, 16, torch.device("cpu"))  # never the default off the GPU
        return
    capacity = k.ONE_LAUNCH_CTAS_PER_SM * torch.cuda.get_device_properties(0).multi_processor_count
    for rows in (1, 8, capacity // 14, capacity // 14 + 1, 64, capacity):
        block, tiles, per_row = k._one_launch_plan(rows, 7168, 16, torch.device("cuda"))
        assert rows * per_row <= capacity and (per_row - 1) * tiles * block < 7168 <= per_row * tiles * block
        assert (block, tiles) == ((512, 1) if rows <= capacity // 14 else (wide, tiles))
    assert k._one_launch_plan(capacity + 1, 7168, 16, torch.device("cuda")) is None
