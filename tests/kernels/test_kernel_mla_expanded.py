"""The expanded MLA prefill (mstar/kernels/mla_expanded.py) against its torch references, the absorbed form it must
equal, and the roofline that picks it; the absorbed kernel's log-sum-exp output it starts from.

Without CUDA the kernels run on the CPU through Triton's interpreter (set before triton is imported) in fp32 and
fp16 (the interpreter multiplies bf16 tl.dot operands as raw bits: tests/kernels/test_kernel_mla.py), at small
head widths (the kernel takes them as constexprs) and once at K3's; pages of 16 rows, shuffled page tables,
prefixes that end inside a page. The GPU tests run K3's per-rank shapes (12 heads, bf16, pages of 64) and skip
without CUDA.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest
import torch
from paged_tables import make_pages, rel_err

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

triton = pytest.importorskip("triton")

from mstar.kernels import mla_attention as mla  # noqa: E402  (after TRITON_INTERPRET is settled)
from mstar.kernels import mla_expanded as mx  # noqa: E402
from mstar.models.kimi_k3.mla import expanded_attention  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
HAS_CUDA = torch.cuda.is_available()
SMALL = mx.MLADims(latent=64, rope=16, nope=32, v_dim=32)  # the tiny/mini models' widths
K3 = mx.K3_DIMS

tiny = pytest.mark.skipif(not (INTERPRET or HAS_CUDA), reason="needs CUDA or TRITON_INTERPRET=1")
gpu = pytest.mark.skipif(not HAS_CUDA or INTERPRET, reason="needs CUDA (and no TRITON_INTERPRET)")


# --- helpers ---------------------------------------------------------------------------------------------------


def tiny_device() -> str:
    return "cpu" if INTERPRET else "cuda"


def tolerance(dtype: torch.dtype) -> float:
    return {torch.float32: 2e-5, torch.float16: 3e-3, torch.bfloat16: 1.5e-2}[dtype]


def poisoned(shape, dtype, device) -> torch.Tensor:
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


@dataclass
class Case:
    """One prefill step: sequence b runs q_lens[b] new tokens after prefixes[b] cached rows (None: the bucket's
    padding sequence, no cached row, its rows on the sink slot 0); the new rows already in the cache."""

    dims: mx.MLADims
    q_lens: list[int]
    prefixes: list[int | None]
    cache: torch.Tensor
    table: torch.Tensor
    cu: torch.Tensor
    ctx: torch.Tensor
    slots: torch.Tensor
    q: torch.Tensor  # [N, H, nope + rope]: q_nope and q_pe are views of it, as the model's
    weight: torch.Tensor  # kv_b_proj [H (nope + v), latent]
    scale: float

    @classmethod
    def make(cls, dims, q_lens, prefixes, heads, page_size, dtype, device) -> Case:
        ctx = [0 if p is None else p + n for n, p in zip(q_lens, prefixes, strict=True)]
        table, num_pages = make_pages(ctx, page_size, device=device, keep_sink=True)
        cache = torch.randn(num_pages, page_size, dims.latent + dims.rope, device=device).to(dtype)
        slots = []
        for b, (n, p) in enumerate(zip(q_lens, prefixes, strict=True)):
            for pos in range(n):
                slots.append(0 if p is None else int(table[b, (p + pos) // page_size]) * page_size
                             + (p + pos) % page_size)
        cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
        q = torch.randn(sum(q_lens), heads, dims.nope + dims.rope, device=device).to(dtype)
        weight = (torch.randn(heads * (dims.nope + dims.v_dim), dims.latent, device=device)
                  * dims.latent**-0.5).to(dtype)
        return cls(dims, q_lens, prefixes, cache, table, cu, torch.tensor(ctx, dtype=torch.int32, device=device),
                   torch.tensor(slots, dtype=torch.long, device=device), q, weight, (dims.nope + dims.rope) ** -0.5)

    @property
    def heads(self) -> int:
        return self.q.shape[1]

    def queries(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.q[..., : self.dims.nope], self.q[..., self.dims.nope:]

    def w_uk_uv(self, dtype=None) -> tuple[torch.Tensor, torch.Tensor]:
        w = self.weight.view(self.heads, self.dims.nope + self.dims.v_dim, self.dims.latent)
        w = w if dtype is None else w.to(dtype)
        return w[:, : self.dims.nope], w[:, self.dims.nope:]

    def prefix_lens(self) -> torch.Tensor:
        return (self.ctx - (self.cu[1:] - self.cu[:-1])).clamp_min(0)

    def run(self, *, with_prefix: bool, config=None, num_splits: int = 1, out=None) -> torch.Tensor:
        """The three parts as GpuMixerOps.mla runs them: the new rows read back from their slots, K/V expanded,
        the prefix's state from the absorbed kernel, then the kernel."""
        d = self.dims
        rows = self.cache.view(-1, self.cache.shape[-1])[self.slots]
        c_kv, k_pe = rows.split([d.latent, d.rope], dim=-1)
        k_nope, v = mx.expand_kv(c_kv, self.weight, self.heads, d.nope)
        q_nope, q_pe = self.queries()
        max_q = max(self.q_lens)
        prefix = None
        if with_prefix:
            w_uk, w_uv = self.w_uk_uv()
            q_lat = torch.einsum("thd,hdr->thr", q_nope, w_uk)
            prefix = mx.prefix_state(q_lat, q_pe, self.cache, self.table, self.cu, self.prefix_lens(), self.scale,
                                     w_uv, max_query_len=max_q, num_splits=num_splits, min_split_tokens=16)
        out = poisoned((self.q.shape[0], self.heads, d.v_dim), self.q.dtype, self.q.device) if out is None else out
        return mx.mla_prefill_expanded(q_nope, q_pe, k_nope, v, k_pe, self.cu, self.ctx, self.scale, out,
                                       prefix=prefix, max_query_len=max_q, config=config)

    def reference(self, up: torch.dtype) -> torch.Tensor:
        """The expanded form over every row in `up` (float64 on CPU, float32 on the GPU)."""
        q_nope, q_pe = self.queries()
        w_uk, w_uv = self.w_uk_uv(up)
        return mx.paged_mla_expanded_reference(q_nope.to(up), q_pe.to(up), self.cache.to(up), self.table,
                                               self.cu.cpu(), self.ctx.cpu(), self.scale, w_uk, w_uv)

    def absorbed(self, up: torch.dtype) -> torch.Tensor:
        """W_UV of the absorbed reference (the path the expanded one replaces)."""
        q_nope, q_pe = self.queries()
        w_uk, w_uv = self.w_uk_uv(up)
        q_abs = torch.cat([torch.einsum("thd,hdr->thr", q_nope.to(up), w_uk), q_pe.to(up)], dim=-1)
        o_lat = mla.paged_mla_prefill_reference(q_abs, self.cache.to(up), self.table, self.cu.cpu(), self.ctx.cpu(),
                                                self.scale, rope_dim=self.dims.rope)
        return torch.einsum("thr,hvr->thv", o_lat, w_uv)


def check_rows(out: torch.Tensor, ref: torch.Tensor, c: Case, dtype: torch.dtype) -> None:
    """Every row written and finite, the padding sequence's zero, each sequence within the dtype's bound."""
    assert torch.isfinite(out).all(), "some outputs were never written"
    cu = c.cu.tolist()
    for b, (n, p) in enumerate(zip(c.q_lens, c.prefixes, strict=True)):
        sl = slice(cu[b], cu[b + 1])
        if p is None:
            assert (out[sl] == 0).all(), f"padding sequence {b} must come out zero"
        elif n:
            assert rel_err(out[sl], ref[sl]) <= 3 * tolerance(dtype), f"sequence {b} (q_len {n}, prefix {p})"
    assert rel_err(out, ref) <= tolerance(dtype)


def random_lengths(low: int, high: int, count: int) -> list[int]:
    return torch.randint(low, high + 1, (count,)).tolist()


# --- the roofline ----------------------------------------------------------------------------------------------


def test_the_roofline_picks_the_expanded_form_for_long_chunks():
    """One K3 sequence takes the expanded form from 341 tokens; many short sequences keep the absorbed one;
    a bucket's padding rows count in the expansion GEMM; a layer whose expanded pair costs more never does."""
    assert mx.expanded_from(K3) == 341
    assert mx.prefers_expanded([341], K3) and not mx.prefers_expanded([340], K3)
    assert not mx.prefers_expanded([1] * 4096, K3)  # a decode-like step: no pairs to save
    assert not mx.prefers_expanded([100] * 64, K3)
    assert mx.prefers_expanded([4000] + [1] * 63, K3)  # a long chunk with decode rows riding along
    assert mx.prefers_expanded([512], K3, rows=512) and not mx.prefers_expanded([300], K3, rows=512)
    assert mx.expanded_from(SMALL) == 128  # the tiny model: (n + 1) 64 > 8,192
    assert mx.prefers_expanded([128], SMALL) and not mx.prefers_expanded([127], SMALL)
    assert mx.expanded_from(mx.MLADims(latent=64, rope=16, nope=64, v_dim=64)) is None
    assert not mx.prefers_expanded([10_000], mx.MLADims(latent=64, rope=16, nope=64, v_dim=64))
    for n in random_lengths(1, 5000, 20):  # the closed form and the FLOP comparison agree
        assert mx.prefers_expanded([n], K3) == (n >= 341)


# --- the torch references ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("dims", [SMALL, K3], ids=["small", "k3"])
def test_expanded_reference_equals_the_absorbed_one(dims):
    """In float64 the expanded form over the paged rows equals W_UV of the absorbed reference, and
    models/kimi_k3/mla.py's expanded attention over the dense rows, for chunks with and without prefixes."""
    c = Case.make(dims, [5, 9, 1, 4], [0, 13, 30, None], heads=3, page_size=8, dtype=torch.float64, device="cpu")
    ref = c.reference(torch.float64)
    torch.testing.assert_close(ref, c.absorbed(torch.float64), rtol=1e-10, atol=1e-12)
    q_nope, q_pe = c.queries()
    w_uk, w_uv = c.w_uk_uv()
    for b in range(3):
        rows = mla.gather_rows(c.cache, c.table[b], int(c.ctx[b]))
        latent, k_pe = rows[:, : dims.latent], rows[:, dims.latent:]
        k = torch.cat([torch.einsum("sr,hnr->shn", latent, w_uk), k_pe[:, None].expand(-1, c.heads, -1)], dim=-1)
        v = torch.einsum("sr,hvr->shv", latent, w_uv)
        sl = slice(int(c.cu[b]), int(c.cu[b + 1]))
        dense = expanded_attention(torch.cat([q_nope[sl], q_pe[sl]], dim=-1), k, v, c.prefixes[b], c.scale)
        torch.testing.assert_close(ref[sl], dense, rtol=1e-10, atol=1e-12)


def test_the_kernels_reference_resumes_from_the_prefix_state():
    """expanded_prefill_reference started from the prefix's (o, base-2 lse), computed in torch, equals the
    expanded form over prefix and chunk together."""
    c = Case.make(SMALL, [6, 1, 11], [19, 7, 0], heads=2, page_size=8, dtype=torch.float64, device="cpu")
    q_nope, q_pe = c.queries()
    w_uk, w_uv = c.w_uk_uv()
    o_prefix = torch.zeros(c.q.shape[0], c.heads, SMALL.v_dim, dtype=torch.float64)
    lse = torch.full((c.q.shape[0], c.heads), float("-inf"), dtype=torch.float64)
    cu = c.cu.tolist()
    for b, p in enumerate(c.prefixes):
        if not p:
            continue
        rows = mla.gather_rows(c.cache, c.table[b], p)
        k = torch.einsum("sr,hnr->shn", rows[:, : SMALL.latent], w_uk)
        sl = slice(cu[b], cu[b + 1])
        logits = (torch.einsum("thd,shd->ths", q_nope[sl], k)
                  + torch.einsum("thd,sd->ths", q_pe[sl], rows[:, SMALL.latent:])) * c.scale
        lse[sl] = torch.logsumexp(logits, dim=-1) * mx.LOG2E
        o_prefix[sl] = torch.einsum("ths,sr,hvr->thv", torch.softmax(logits, -1), rows[:, : SMALL.latent], w_uv)
    rows = c.cache.view(-1, c.cache.shape[-1])[c.slots]
    k_nope, v = mx.expand_kv(rows[:, : SMALL.latent], c.weight, c.heads, SMALL.nope)
    got = mx.expanded_prefill_reference(q_nope, q_pe, k_nope, v, rows[:, SMALL.latent:], c.cu, c.ctx, c.scale,
                                        prefix=(o_prefix, lse.float()))
    torch.testing.assert_close(got, c.reference(torch.float64), rtol=1e-6, atol=1e-7)  # lse passed in fp32


# --- tiny shapes: interpreter on CPU, or compiled on a GPU -------------------------------------------------------


@tiny
# fp32 only through the interpreter: on the GPU tl.dot takes fp32 operands as TF32 (~1e-3), and serving runs the
# kernel in bf16 only (gpu_ops.mla_kernel_fits)
@pytest.mark.parametrize("dtype", [torch.float32 if INTERPRET else torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("tile", [(16, 16), (32, 16)], ids=["16x16", "32x16"])
def test_expanded_prefill_tiny(dtype, tile):
    """Several sequences of fresh random lengths: fresh prompts, chunks after prefixes that end inside a page,
    a decode row (q_len 1) after its context, a bucket's padding sequence (no cached row) and an empty one."""
    q_lens = [1, *random_lengths(2, 40, 3), 1, 3, 0]
    prefixes = [int(torch.randint(1, 50, ()).item()), 0, *random_lengths(1, 45, 2), 0, None, 0]
    c = Case.make(SMALL, q_lens, prefixes, heads=3, page_size=16, dtype=dtype, device=tiny_device())
    out = c.run(with_prefix=True, config=mla.KernelConfig(*tile, num_warps=4, num_stages=2))
    check_rows(out, c.reference(torch.float64 if INTERPRET else torch.float32), c, dtype)


@tiny
def test_expanded_prefill_without_prefixes_tiny():
    """Fresh prompts only: the kernel runs without the prefix's state (the step whose host knows no sequence has
    cached rows skips the absorbed call); rows past cu_seqlens[-1] stay untouched."""
    dtype = torch.float32 if INTERPRET else torch.float16
    q_lens = random_lengths(1, 50, 3) + [33]
    c = Case.make(SMALL, q_lens, [0] * 4, heads=2, page_size=16, dtype=dtype, device=tiny_device())
    n = c.q.shape[0]
    out = poisoned((n + 2, 2, SMALL.v_dim), dtype, c.q.device)
    c.run(with_prefix=False, out=out[:n], config=mla.KernelConfig(16, 16, num_warps=4, num_stages=2))
    assert torch.isnan(out[n:]).all()
    check_rows(out[:n], c.reference(torch.float64 if INTERPRET else torch.float32), c, dtype)


@tiny
def test_split_prefix_state_tiny():
    """The prefix's state through the split-KV kernel and its merge (long prefixes, few queries): the same."""
    dtype = torch.float32 if INTERPRET else torch.float16
    c = Case.make(SMALL, [3, 1, 5], [70, 45, 0], heads=2, page_size=16, dtype=dtype, device=tiny_device())
    out = c.run(with_prefix=True, num_splits=3)
    check_rows(out, c.reference(torch.float64 if INTERPRET else torch.float32), c, dtype)


@tiny
def test_k3_widths_tiny():
    """K3's widths (latent 512, rope 64, nope 128, v 128) at a few tokens and heads."""
    dtype = torch.float32 if INTERPRET else torch.float16
    c = Case.make(K3, [int(torch.randint(10, 25, ()).item()), 1], [21, 40], heads=2, page_size=16, dtype=dtype,
                  device=tiny_device())
    out = c.run(with_prefix=True, config=mla.KernelConfig(16, 16, num_warps=4, num_stages=2))
    check_rows(out, c.reference(torch.float64 if INTERPRET else torch.float32), c, dtype)


@tiny
@pytest.mark.parametrize("num_splits", [1, 3])
def test_absorbed_kernel_returns_the_log_sum_exp(num_splits):
    """paged_mla_prefill's lse output: each row's base-2 log-sum-exp of its scaled logits, from the kernel or
    from the split merge; -inf for a row that saw no cached row; rows past cu_seqlens[-1] untouched."""
    device = tiny_device()
    dtype = torch.float32 if INTERPRET else torch.float16
    width, heads = SMALL.latent + SMALL.rope, 2
    lens, q_lens = [37, 0, 50], [3, 2, 4]
    table, num_pages = make_pages(lens, 16, device=device, keep_sink=True)
    cache = torch.randn(num_pages, 16, width, device=device).to(dtype)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    ctx = torch.tensor(lens, dtype=torch.int32, device=device)
    n = sum(q_lens)
    q = torch.randn(n, heads, width, device=device).to(dtype)
    out = poisoned((n, heads, SMALL.latent), dtype, device)
    lse = poisoned((n + 1, heads), torch.float32, device)
    mla.paged_mla_prefill(q[..., : SMALL.latent], q[..., SMALL.latent:], cache, table, cu, ctx, 0.2, out,
                          max_query_len=max(q_lens), num_splits=num_splits, min_split_tokens=16, causal=False,
                          lse=lse[:n])
    assert torch.isnan(lse[n:]).all()
    for b, (first, rows) in enumerate(zip(cu[:-1].tolist(), q_lens, strict=True)):
        sl = slice(first, first + rows)
        if lens[b] == 0:
            assert (lse[sl] == float("-inf")).all() and (out[sl] == 0).all()
            continue
        kv = mla.gather_rows(cache, table[b], lens[b]).double()
        want = torch.logsumexp(torch.einsum("thc,sc->ths", q[sl].double(), kv) * 0.2, dim=-1) * mx.LOG2E
        torch.testing.assert_close(lse[sl].double(), want, rtol=1e-5 if dtype == torch.float32 else 2e-3, atol=1e-4)


def test_bad_arguments_say_what_is_wrong():
    if mx.triton is None:
        pytest.skip("triton missing")
    c = Case.make(SMALL, [4, 3], [0, 2], heads=2, page_size=16, dtype=torch.float32, device="cpu")
    q_nope, q_pe = c.queries()
    rows = c.cache.view(-1, c.cache.shape[-1])[c.slots]
    k_nope, v = mx.expand_kv(rows[:, :64], c.weight, 2, SMALL.nope)
    k_pe = rows[:, 64:]
    out = torch.zeros(7, 2, SMALL.v_dim)

    def call(**changes):
        args = dict(q_nope=q_nope, q_pe=q_pe, k_nope=k_nope, v=v, k_pe=k_pe, cu_seqlens=c.cu, context_lens=c.ctx,
                    scale=c.scale, out=out)
        args.update(changes)
        return mx.mla_prefill_expanded(**args)

    with pytest.raises(ValueError, match="must agree"):
        call(k_pe=k_pe[:, :8])
    with pytest.raises(ValueError, match="must agree"):
        call(out=torch.zeros(7, 2, 16))
    with pytest.raises(ValueError, match="share one of"):
        call(v=v.double())
    with pytest.raises(ValueError, match="last dimension"):
        call(q_nope=q_nope.transpose(1, 2).contiguous().transpose(1, 2))
    with pytest.raises(ValueError, match="power of two"):
        call(q_nope=q_nope[..., :24], k_nope=k_nope[..., :24])
    with pytest.raises(ValueError, match="cu_seqlens"):
        call(cu_seqlens=c.cu[:2])
    with pytest.raises(ValueError, match="context_lens must be int32"):
        call(context_lens=c.ctx.float())
    with pytest.raises(ValueError, match="lse must be fp32"):
        call(prefix=(out, torch.zeros(7, 2, dtype=torch.float64)))
    with pytest.raises(ValueError, match="prefix's output"):
        call(prefix=(torch.zeros(7, 2, 16), torch.zeros(7, 2)))
    with pytest.raises(ValueError, match="block_n dividing block_m"):
        call(config=mla.KernelConfig(16, 32, 4, 2))
    with pytest.raises(ValueError, match="expand_kv"):
        mx.expand_kv(rows[:, :64], c.weight, 3, SMALL.nope)
    with pytest.raises(ValueError, match="lse must be fp32"):
        mla.paged_mla_prefill(torch.zeros(7, 2, 64), torch.zeros(7, 2, 16), c.cache, c.table, c.cu, c.ctx, 0.1,
                              torch.zeros(7, 2, 64), lse=torch.zeros(7, 3))


# --- GPU: K3 per-rank shapes --------------------------------------------------------------------------------------


def gpu_case(q_lens, prefixes) -> Case:
    return Case.make(K3, q_lens, prefixes, heads=12, page_size=64, dtype=torch.bfloat16, device="cuda")


@gpu
@pytest.mark.parametrize("shape", ["1024", "8192", "prefix", "mixed"])
def test_gpu_expanded_prefill(shape):
    """K3 per TP8 rank: one prompt of 1,024 or 8,192 tokens; a 2,048-token chunk after 3,000 cached rows; a mixed
    step (two chunks, decode rows, the padding sequence). Against the fp32 reference and the absorbed form."""
    q_lens, prefixes = {"1024": ([1024], [0]), "8192": ([8192], [0]), "prefix": ([2048], [3000]),
                        "mixed": ([700, 1, 513, 1, 1, 30], [0, 4000, 77, 1, 9000, None])}[shape]
    c = gpu_case(q_lens, prefixes)
    out = c.run(with_prefix=any(prefixes))
    torch.cuda.synchronize()
    ref = c.reference(torch.float32)
    check_rows(out, ref, c, torch.bfloat16)
    assert rel_err(out, c.absorbed(torch.float32)) <= 1.5e-2


@gpu
def test_gpu_expanded_prefill_replays_in_a_cuda_graph():
    """The three parts captured once for a bucket of 1,024 rows (every buffer sized by the bucket) replay for new
    lengths, prefixes and page tables; the rows past the step are the padding sequence."""
    bucket, heads, page, max_pages, seqs = 1024, 12, 64, 80, 4
    num_pages = seqs * max_pages + 1
    d = K3
    cache = torch.randn(num_pages, page, d.latent + d.rope, device="cuda").bfloat16()
    weight = (torch.randn(heads * (d.nope + d.v_dim), d.latent, device="cuda") * d.latent**-0.5).bfloat16()
    w = weight.view(heads, d.nope + d.v_dim, d.latent)
    w_uk, w_uv = w[:, : d.nope], w[:, d.nope:]
    q = torch.empty(bucket, heads, d.nope + d.rope, device="cuda", dtype=torch.bfloat16)
    table = torch.zeros(seqs + 1, max_pages, dtype=torch.int32, device="cuda")
    slots = torch.zeros(bucket, dtype=torch.long, device="cuda")
    cu = torch.zeros(seqs + 2, dtype=torch.int32, device="cuda")
    ctx = torch.zeros(seqs + 1, dtype=torch.int32, device="cuda")
    out = torch.empty(bucket, heads, d.v_dim, device="cuda", dtype=torch.bfloat16)

    scale = (d.nope + d.rope) ** -0.5

    def step():
        rows = cache.view(-1, cache.shape[-1])[slots]
        k_nope, v = mx.expand_kv(rows[:, : d.latent], weight, heads, d.nope)
        q_nope, q_pe = q[..., : d.nope], q[..., d.nope:]
        prefix_lens = (ctx - (cu[1:] - cu[:-1])).clamp_min(0)
        q_lat = torch.einsum("thd,hdr->thr", q_nope, w_uk)
        prefix = mx.prefix_state(q_lat, q_pe, cache, table, cu, prefix_lens, scale, w_uv, max_query_len=bucket)
        mx.mla_prefill_expanded(q_nope, q_pe, k_nope, v, rows[:, d.latent:], cu, ctx, scale, out, prefix=prefix,
                                max_query_len=bucket)

    q.normal_()
    step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for q_lens, prefixes in (([600, 1, 200], [0, 4000, 130]), ([1000], [37]), ([1, 1, 1, 900], [5, 64, 0, 2000])):
        c = Case.make(K3, q_lens + [bucket - sum(q_lens)], prefixes + [None], heads, page, torch.bfloat16, "cuda")
        c.cache, c.weight = cache, weight  # the captured buffers' contents, new addressing
        c.table, used = make_pages(c.ctx.tolist(), page, device="cuda", keep_sink=True)
        assert used <= num_pages and c.table.shape[1] <= max_pages
        c.slots = torch.tensor([0 if p is None else int(c.table[b, (p + i) // page]) * page + (p + i) % page
                                for b, (n, p) in enumerate(zip(c.q_lens, c.prefixes, strict=True)) for i in range(n)],
                               device="cuda")
        table.zero_()
        ctx.zero_()
        table[: len(c.q_lens), : c.table.shape[1]].copy_(c.table)
        slots.copy_(c.slots)
        cu[: len(c.q_lens) + 1].copy_(c.cu)
        cu[len(c.q_lens) + 1:] = bucket
        ctx[: len(c.q_lens)].copy_(c.ctx)
        q.copy_(c.q)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        check_rows(out, c.reference(torch.float32), c, torch.bfloat16)
