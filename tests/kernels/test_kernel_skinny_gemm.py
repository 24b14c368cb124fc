"""The skinny GEMM (mstar/kernels/skinny_gemm.py) on the GPU at one TP8 rank of pruned75's decode projection
shapes: bf16 and fp16 against torch in fp32, outputs poisoned first; with and without programmatic dependent
launch; a chain of dependent launches captured in a CUDA graph (each GEMV reads the previous one's output, the
order PDL must keep); tile configs whose programs share tiles. The interpreter test is test_skinny_gemm.py."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from mstar.kernels import skinny_gemm  # noqa: E402
from mstar.kernels.skinny_gemm import SkinnyConfig  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

# (N, K) of a TP8 rank: KDA inputs stacked, MLA inputs stacked, o_proj, shared-expert gate/up and down, latent
# down/up (sharded), KDA f_b, MLA q_b, lm_head (benchmarks/kernels/bench_skinny_gemm.py lists all with counts)
SHAPES = [(6284, 7168), (3648, 7168), (7168, 1536), (1536, 7168), (7168, 768), (448, 7168), (7168, 448),
          (1536, 128), (2304, 1536), (20480, 7168)]
TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def operands(rows: int, n: int, k: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(rows, k, device="cuda").to(dtype)
    w = (torch.randn(n, k, device="cuda") * k**-0.5).to(dtype)
    return x, w


@pytest.mark.parametrize("n, k", SHAPES)
@pytest.mark.parametrize("rows", [1, 3, 8, 16, 64])
def test_rank_shapes_bf16(n, k, rows):
    check(rows, n, k, torch.bfloat16)


def check(rows: int, n: int, k: int, dtype: torch.dtype, **kwargs) -> None:
    x, w = operands(rows, n, k, dtype)
    out = torch.full((rows, n), float("nan"), device="cuda", dtype=dtype)
    skinny_gemm.skinny_linear(x, w, out=out, **kwargs)
    assert torch.isfinite(out).all() and rel(out, x.float() @ w.float().T) < TOL[dtype], (rows, n, k, kwargs)


@pytest.mark.parametrize("pdl", [False, True])
@pytest.mark.parametrize("config, ctas", [  # configs of the benchmark's sweep (compiled once for both)
    (SkinnyConfig(32, 256, 4, ctas_per_sm=2), None),
    (SkinnyConfig(128, 128, 4), None),
    (SkinnyConfig(64, 128, 3, ctas_per_sm=3), None),  # many programs on each tile
    (SkinnyConfig(), 7),  # few programs: many units each
])
def test_configs_and_pdl(config, ctas, pdl):
    for rows, n, k in ((1, 448, 7168), (16, 7168, 1536), (5, 1000, 1000)):  # the last: N, K off the tiles
        check(rows, n, k, torch.bfloat16, config=config, ctas=ctas, pdl=pdl)


@pytest.mark.parametrize("rows, n, k", [(1, 6284, 7168), (16, 448, 7168), (64, 7168, 448), (5, 1000, 1000)])
def test_fp16(rows, n, k):
    check(rows, n, k, torch.float16)


@pytest.mark.parametrize("pdl", [False, True])
def test_dependent_chain_in_a_cuda_graph(pdl):
    """h0 -> W1 -> W2 -> W1 -> ... captured once and replayed on fresh inputs: each launch reads what the one
    before it wrote, so a read before `gdc_wait` (or a workspace race between launches) shows as an error."""
    rows, d, e = 4, 7168, 448
    w1 = (torch.randn(e, d, device="cuda") * d**-0.5).bfloat16()
    w2 = (torch.randn(d, e, device="cuda") * e**-0.5).bfloat16()
    x = torch.empty(rows, d, device="cuda", dtype=torch.bfloat16)

    def chain():
        h = x
        for _ in range(6):
            h = skinny_gemm.skinny_linear(skinny_gemm.skinny_linear(h, w1, pdl=pdl), w2, pdl=pdl)
        return h

    x.copy_(torch.randn(rows, d))
    chain()  # compile and make the workspace before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = chain()
    for _ in range(3):
        x.copy_(torch.randn(rows, d))
        out.fill_(float("nan"))
        graph.replay()
        expect = x.float()
        for _ in range(6):
            expect = (expect @ w1.float().T).bfloat16().float() @ w2.float().T
            expect = expect.bfloat16().float()
        assert torch.isfinite(out).all() and rel(out, expect) < 2e-2


def test_same_bits_every_launch():
    """The partials are added in program order: repeated launches on the same inputs give the same bits."""
    x, w = operands(16, 448, 7168, torch.bfloat16)
    first = skinny_gemm.skinny_linear(x, w)
    for _ in range(5):
        assert torch.equal(skinny_gemm.skinny_linear(x, w), first)


def test_linear_chooses_and_matches():
    """`linear` runs the table's config where it names one (the KDA inputs), cuBLAS elsewhere (o_proj, fp32)."""
    for rows, n, k in ((1, 6288, 7168), (2, 7168, 1536)):
        x, w = operands(rows, n, k, torch.bfloat16)
        expect = x.float() @ w.float().T
        assert skinny_gemm.use_kernel(rows, n, k, x.dtype, x.device) == (n == 6288)
        assert rel(skinny_gemm.linear(x, w), expect) < 1e-2
        assert rel(skinny_gemm.linear(x.float(), w.float()), expect) < 1e-5  # fp32: cuBLAS
