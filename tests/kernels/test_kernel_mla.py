"""Paged absorbed-MLA kernels (decode and verify/prefill) against their torch references.

Without CUDA the kernels run on the CPU through Triton's interpreter (set before triton is imported), at
tiny batches but the real row width (512 latent + 64 rope), page size 16, shuffled page tables. The
interpreter multiplies bf16 operands of tl.dot as raw bits (triton-lang/triton#11584), so it runs fp16 and
fp32; bf16 is checked on the GPU. The GPU tests use the K3 per-rank shapes (12 heads for TP8, 96 for TP1,
page size 64) and skip without CUDA.
"""

from __future__ import annotations

import os

import pytest
import torch
from paged_tables import make_pages, rel_err

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

triton = pytest.importorskip("triton")

from mstar.kernels import mla_attention as mla  # noqa: E402  (after TRITON_INTERPRET is settled)
from mstar.models.kimi_k3.mla import absorbed_attention  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
HAS_CUDA = torch.cuda.is_available()
LATENT, ROPE = 512, 64
WIDTH = LATENT + ROPE
SCALE = 192**-0.5  # (qk_nope + qk_rope)^-0.5, also in absorbed form

tiny = pytest.mark.skipif(not (INTERPRET or HAS_CUDA), reason="needs CUDA or TRITON_INTERPRET=1")
gpu = pytest.mark.skipif(not HAS_CUDA or INTERPRET, reason="needs CUDA (and no TRITON_INTERPRET)")


# --- helpers ---------------------------------------------------------------------------------------------


def tiny_device() -> str:
    return "cpu" if INTERPRET else "cuda"


def tiny_dtypes() -> list[torch.dtype]:
    return [torch.float32, torch.float16] if INTERPRET or not HAS_CUDA else [torch.bfloat16, torch.float16]


def tolerance(dtype: torch.dtype) -> float:
    return {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 1e-2}[dtype]


def parts(q: torch.Tensor, rope: int = ROPE) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernels' query parts (q_lat, q_pe) of a whole q_abs [N, H, latent + rope], as views (the addresses
    the kernel read before it took the parts apart)."""
    return q[..., :-rope], q[..., -rope:]


def poisoned(shape, dtype, device) -> torch.Tensor:
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


def decode_case(context_lens, heads, page_size, dtype, device, *, pt_dtype=torch.int32):
    table, num_pages = make_pages(context_lens, page_size, dtype=pt_dtype, device=device)
    cache = torch.randn(num_pages, page_size, WIDTH, device=device).to(dtype)
    q = torch.randn(len(context_lens), heads, WIDTH, device=device).to(dtype)
    lens = torch.tensor(context_lens, dtype=torch.int32, device=device)
    return q, cache, table, lens


def reference_fp64(q, cache, table, lens, cu=None):
    """The torch reference on upcast inputs (float64 on CPU, float32 on the GPU)."""
    up = torch.float64 if q.device.type == "cpu" else torch.float32
    if cu is None:
        return mla.paged_mla_decode_reference(q.to(up), cache.to(up), table, lens, SCALE)
    return mla.paged_mla_prefill_reference(q.to(up), cache.to(up), table, cu, lens, SCALE)


# --- the torch references ----------------------------------------------------------------------------------


def test_paged_reference_equals_dense_absorbed_attention():
    """Gathering shuffled pages and attending equals absorbed_attention over the dense rows."""
    ctx, page_size, heads, q_len = 37, 8, 3, 5
    rows = torch.randn(ctx, WIDTH, dtype=torch.float64)
    table, num_pages = make_pages([ctx], page_size)
    cache = torch.randn(num_pages, page_size, WIDTH, dtype=torch.float64)
    for i in range(ctx):
        cache[table[0, i // page_size], i % page_size] = rows[i]
    q = torch.randn(q_len, heads, WIDTH, dtype=torch.float64)
    dense = absorbed_attention(q, rows, ctx - q_len, SCALE, kv_lora_rank=LATENT)
    paged = mla.paged_mla_prefill_reference(q, cache, table, torch.tensor([0, q_len]), torch.tensor([ctx]), SCALE)
    torch.testing.assert_close(paged, dense, rtol=1e-12, atol=1e-12)
    last = mla.paged_mla_decode_reference(q[-1:], cache, table, torch.tensor([ctx]), SCALE)
    torch.testing.assert_close(last, dense[-1:], rtol=1e-12, atol=1e-12)


def test_prefill_chunks_take_wider_key_tiles_than_verify_blocks():
    """Prefill chunks (PREFILL_QUERY_ROWS query rows a sequence and more) walk 64 keys a tile, verify/draft blocks
    32; pages shorter than the tile cap it."""
    chunk = mla.default_config(12, 64, multi_query=True, query_rows=mla.PREFILL_QUERY_ROWS)
    block = mla.default_config(12, 64, multi_query=True, query_rows=8)
    assert (chunk.block_m, chunk.block_n) == (64, 64) and (block.block_m, block.block_n) == (64, 32)
    assert mla.default_config(12, 16, multi_query=True, query_rows=1024).block_n == 16


def test_num_splits_fill_the_machine_and_respect_the_minimum_piece():
    for batch in (1, 2, 16, 64, 256):
        for ctx in (1, 100, 1024, 8192, 32768, 131072):
            s = mla.num_splits_for(batch, 12, ctx, num_sms=132)
            assert 1 <= s <= 128
            assert s == 1 or -(-ctx // s) >= mla.DEFAULT_MIN_SPLIT_TOKENS * 0.5
            if batch >= 256:  # 256 programs already fill two per SM
                assert s == 1
    assert mla.num_splits_for(1, 12, 32768, num_sms=132) >= 64
    # a verify block of 8 rows x 12 heads is two 64-row programs: split its context as decode's is
    assert mla.num_splits_for(1, 12, 1024, query_rows=8, num_sms=132) == 1024 // mla.DEFAULT_MIN_SPLIT_TOKENS
    assert mla.num_splits_for(64, 12, 1024, query_rows=8, num_sms=132) == 1  # 128 programs: one wave already
    with pytest.raises(ValueError, match="max_context"):
        mla.num_splits_for(1, 12, 0)
    with pytest.raises(ValueError, match="query_rows"):
        mla.num_splits_for(1, 12, 64, query_rows=0)


# --- tiny shapes: interpreter on CPU, or compiled on a GPU -------------------------------------------------------


@tiny
@pytest.mark.parametrize("dtype", tiny_dtypes(), ids=str)
@pytest.mark.parametrize("block_n", [16, 32], ids=["tile_in_page", "tile_spans_pages"])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_tiny(dtype, block_n, num_splits):
    device = tiny_device()
    heads = 3 if num_splits == 1 else 4
    lens = [1, 15, 16, 17, 40, int(torch.randint(1, 41, ()).item())]
    q, cache, table, ctx = decode_case(lens, heads, 16, dtype, device,
                                       pt_dtype=torch.int32 if block_n == 16 else torch.int64)
    out = poisoned((len(lens), heads, LATENT), dtype, device)
    cfg = mla.KernelConfig(block_m=16, block_n=block_n, num_warps=4, num_stages=2)
    mla.paged_mla_decode(*parts(q), cache, table, ctx, SCALE, out, num_splits=num_splits, min_split_tokens=16,
                         config=cfg)
    assert torch.isfinite(out).all(), "some outputs were never written"
    ref = reference_fp64(q, cache, table, ctx)
    assert rel_err(out, ref) <= tolerance(dtype)
    for b in range(len(lens)):  # every sequence on its own, not only on average
        assert rel_err(out[b], ref[b]) <= 3 * tolerance(dtype), f"sequence {b} (context {lens[b]})"


@tiny
def test_decode_many_splits_tiny():
    """More splits than the merge reads at once (16): its running max must rescale earlier chunks."""
    device = tiny_device()
    dtype = torch.float32 if INTERPRET else torch.float16
    lens = [300, 137]
    q, cache, table, ctx = decode_case(lens, 2, 16, dtype, device)
    # Rows 256.. of sequence 0 (splits 16..18, the merge's second chunk) align with head 0's query, so
    # their log-sum-exp exceeds the first chunk's and the running max must move.
    for pos in range(256, 300):
        page, slot = table[0, pos // 16], pos % 16
        cache[page, slot] = (cache[page, slot].float() + 0.05 * q[0, 0].float()).to(dtype)
    out = poisoned((2, 2, LATENT), dtype, device)
    cfg = mla.KernelConfig(block_m=16, block_n=16, num_warps=4, num_stages=2)
    mla.paged_mla_decode(*parts(q), cache, table, ctx, SCALE, out, num_splits=20, min_split_tokens=16,
                         config=cfg)
    assert torch.isfinite(out).all()
    ref = reference_fp64(q, cache, table, ctx)
    for b in range(2):
        assert rel_err(out[b], ref[b]) <= tolerance(dtype), f"sequence {b} (context {lens[b]})"


@tiny
def test_decode_zero_context_writes_zeros():
    """Bucket padding rows (context 0) come out as zeros, with and without splits."""
    device = tiny_device()
    dtype = torch.float32 if INTERPRET else torch.bfloat16
    q, cache, table, ctx = decode_case([0, 20], 2, 16, dtype, device)
    for splits in (1, 2):
        out = poisoned((2, 2, LATENT), dtype, device)
        mla.paged_mla_decode(*parts(q), cache, table, ctx, SCALE, out, num_splits=splits, min_split_tokens=16)
        assert (out[0] == 0).all()
        assert rel_err(out[1], reference_fp64(q, cache, table, ctx)[1]) <= tolerance(dtype)


@tiny
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("block_m,block_n", [(16, 16), (32, 32)])
def test_prefill_tiny(num_splits, block_m, block_n):
    """Verify blocks and prefill chunks over existing pages: causal, ragged, with bucket padding rows."""
    device = tiny_device()
    dtype = torch.float16
    heads = 3
    q_lens = [1, 5, 8, 12]  # 12: a whole prompt (q_len == context)
    lens = [9, 16, 40, 12]
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    n_rows = int(cu[-1]) + 2  # two padding rows past cu[-1]
    table, num_pages = make_pages(lens, 16, device=device)
    cache = torch.randn(num_pages, 16, WIDTH, device=device).to(dtype)
    q = torch.randn(n_rows, heads, WIDTH, device=device).to(dtype)
    ctx = torch.tensor(lens, dtype=torch.int32, device=device)
    out = poisoned((n_rows, heads, LATENT), dtype, device)
    cfg = mla.KernelConfig(block_m=block_m, block_n=block_n, num_warps=4, num_stages=2)
    mla.paged_mla_prefill(*parts(q), cache, table, cu.to(device), ctx, SCALE, out, max_query_len=max(q_lens),
                          num_splits=num_splits, min_split_tokens=16, config=cfg)
    rows = int(cu[-1])
    assert torch.isfinite(out[:rows]).all(), "some outputs were never written"
    assert torch.isnan(out[rows:]).all(), "rows past cu_seqlens[-1] must stay untouched"
    ref = reference_fp64(q, cache, table, ctx, cu)
    assert rel_err(out[:rows], ref[:rows]) <= tolerance(dtype)
    for b in range(len(lens)):
        sl = slice(int(cu[b]), int(cu[b + 1]))
        assert rel_err(out[sl], ref[sl]) <= 3 * tolerance(dtype), f"sequence {b}"


def noncausal_case(q_lens, lens, heads, page_size, dtype, device):
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    table, num_pages = make_pages(lens, page_size, device=device)
    cache = torch.randn(num_pages, page_size, WIDTH, device=device).to(dtype)
    q = torch.randn(int(cu[-1]), heads, WIDTH, device=device).to(dtype)
    return q, cache, table, cu, torch.tensor(lens, dtype=torch.int32, device=device)


@tiny
@pytest.mark.parametrize("num_splits", [1, 3])
def test_noncausal_blocks_see_every_row(num_splits):
    """causal=False (DSpark draft blocks): every query of a sequence sees all its rows, whatever its place,
    also when the block holds more query rows than its sequence has rows (padding slots)."""
    device, dtype = tiny_device(), torch.float16
    q_lens, lens = [4, 4, 7], [23, 3, 40]
    q, cache, table, cu, ctx = noncausal_case(q_lens, lens, 2, 16, dtype, device)
    out = poisoned((q.shape[0], 2, LATENT), dtype, device)
    mla.paged_mla_prefill(*parts(q), cache, table, cu.to(device), ctx, SCALE, out, max_query_len=max(q_lens),
                          num_splits=num_splits, min_split_tokens=16, causal=False)
    up = torch.float64
    ref = mla.paged_mla_prefill_reference(q.to(up), cache.to(up), table, cu, ctx, SCALE, causal=False)
    assert torch.isfinite(out).all()
    assert rel_err(out, ref) <= tolerance(dtype)
    # a sequence that a causal block fits too: its last query sees every row either way, the others see fewer
    # rows when causal (the flag is no no-op; 1e-3: random keys hold far more of the softmax than that)
    first = slice(0, q_lens[0])
    causal = mla.paged_mla_prefill_reference(q[first].to(up), cache.to(up), table[:1], cu[:2], ctx[:1], SCALE)
    assert rel_err(causal[-1:], ref[first][-1:]) < 1e-12 and rel_err(causal[:-1], ref[first][:-1]) > 1e-3
    # each query row equals a decode of the whole sequence (one query at the last row)
    for b, (first, n) in enumerate(zip(cu[:-1].tolist(), q_lens, strict=True)):
        whole = mla.paged_mla_decode_reference(q[first : first + n].to(up), cache.to(up), table[b].repeat(n, 1),
                                               ctx[b].repeat(n), SCALE)
        assert rel_err(ref[first : first + n], whole) < 1e-12


@tiny
def test_prefill_rows_equal_decode_rows():
    """The last query of a verify block sees what a decode of the same sequence sees."""
    device = tiny_device()
    dtype = torch.float32 if INTERPRET else torch.float16
    lens = [23, 7]
    table, num_pages = make_pages(lens, 16, device=device)
    cache = torch.randn(num_pages, 16, WIDTH, device=device).to(dtype)
    q = torch.randn(6, 2, WIDTH, device=device).to(dtype)
    cu = torch.tensor([0, 4, 6], dtype=torch.int32, device=device)
    ctx = torch.tensor(lens, dtype=torch.int32, device=device)
    block = mla.paged_mla_prefill(*parts(q), cache, table, cu, ctx, SCALE, poisoned((6, 2, LATENT), dtype, device))
    last = mla.paged_mla_decode(*parts(q[[3, 5]]), cache, table, ctx, SCALE,
                                poisoned((2, 2, LATENT), dtype, device), num_splits=1)
    torch.testing.assert_close(block[[3, 5]], last, rtol=1e-3, atol=1e-3)


def apart(q: torch.Tensor, nope: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """q_abs's parts as GpuMixerOps hands them to the kernels: q_lat head-major (the einsum's output, [N, H, latent]
    with strides (latent, N latent, 1)), q_pe the last columns of a wider [N, H, nope + rope] query projection."""
    q_lat = torch.empty(q.shape[1], q.shape[0], LATENT, dtype=q.dtype, device=q.device).transpose(0, 1)
    q_lat.copy_(q[..., :LATENT])
    projection = torch.randn(*q.shape[:2], nope + ROPE, device=q.device).to(q.dtype)
    projection[..., nope:] = q[..., LATENT:]
    return q_lat, projection[..., nope:]


@tiny
@pytest.mark.parametrize("num_splits", [1, 3])
def test_query_parts_are_read_where_they_lie(num_splits):
    """Decode and causal blocks give bit-identical outputs whether q_lat and q_pe are views of one q_abs (the
    addresses of the single-tensor form) or tensors of their own in the layouts the serving model makes."""
    with torch.random.fork_rng():  # seeded; the later tests draw what they drew before this one
        torch.manual_seed(num_splits)
        check_query_parts(num_splits)


def check_query_parts(num_splits: int) -> None:
    """Decode, then causal blocks, each from both forms of the same query (the test above)."""
    device = tiny_device()
    dtype = torch.float32 if INTERPRET else torch.bfloat16
    lens, q_lens = [5, 40, 23], [1, 4, 3]
    table, num_pages = make_pages(lens, 16, device=device)
    cache = torch.randn(num_pages, 16, WIDTH, device=device).to(dtype)
    ctx = torch.tensor(lens, dtype=torch.int32, device=device)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    for rows, cu_seqlens in ((len(lens), None), (sum(q_lens), cu)):
        q = torch.randn(rows, 2, WIDTH, device=device).to(dtype)
        outs = []
        for q_lat, q_pe in (parts(q), apart(q)):
            out = poisoned((rows, 2, LATENT), dtype, device)
            if cu_seqlens is None:
                mla.paged_mla_decode(q_lat, q_pe, cache, table, ctx, SCALE, out, num_splits=num_splits,
                                     min_split_tokens=16)
            else:
                mla.paged_mla_prefill(q_lat, q_pe, cache, table, cu_seqlens, ctx, SCALE, out,
                                      max_query_len=max(q_lens), num_splits=num_splits, min_split_tokens=16)
            outs.append(out)
        assert torch.isfinite(outs[0]).all() and torch.equal(outs[0], outs[1])
        ref = reference_fp64(q, cache, table, ctx, None if cu_seqlens is None else cu.cpu())
        assert rel_err(outs[0], ref) <= tolerance(dtype)


MINI_LATENT, MINI_ROPE = 64, 16  # kimi_k3_mini's MLA rows (kv_lora_rank 64, qk_rope_head_dim 16), 4 heads


@tiny
@pytest.mark.parametrize("num_splits", [1, 3])
def test_small_row_widths_tiny(num_splits):
    """Rows narrower than K3's ([64 | 16], the mini's): decode, causal verify blocks and non-causal draft blocks
    all equal the references at that rope width (gpu_ops.mla_kernel_fits lets these layers take the kernel)."""
    device = tiny_device()
    dtype = torch.float32 if INTERPRET else torch.float16
    width, heads, up = MINI_LATENT + MINI_ROPE, 4, torch.float64 if INTERPRET else torch.float32
    lens = [1, 17, 40, int(torch.randint(1, 41, ()).item())]
    table, num_pages = make_pages(lens, 16, device=device)
    cache = torch.randn(num_pages, 16, width, device=device).to(dtype)
    ctx = torch.tensor(lens, dtype=torch.int32, device=device)
    cfg = mla.KernelConfig(block_m=16, block_n=16, num_warps=4, num_stages=2)

    q = torch.randn(len(lens), heads, width, device=device).to(dtype)
    out = poisoned((len(lens), heads, MINI_LATENT), dtype, device)
    mla.paged_mla_decode(*parts(q, MINI_ROPE), cache, table, ctx, SCALE, out, num_splits=num_splits,
                         min_split_tokens=16, config=cfg)
    ref = mla.paged_mla_decode_reference(q.to(up), cache.to(up), table, ctx, SCALE, rope_dim=MINI_ROPE)
    assert torch.isfinite(out).all() and rel_err(out, ref) <= tolerance(dtype)

    q_lens = [1, 4, 4, 1]
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    q = torch.randn(sum(q_lens), heads, width, device=device).to(dtype)
    for causal in (True, False):
        out = poisoned((sum(q_lens), heads, MINI_LATENT), dtype, device)
        mla.paged_mla_prefill(*parts(q, MINI_ROPE), cache, table, cu, ctx, SCALE, out, max_query_len=max(q_lens),
                              num_splits=num_splits, min_split_tokens=16, config=cfg, causal=causal)
        ref = mla.paged_mla_prefill_reference(q.to(up), cache.to(up), table, cu.cpu(), ctx, SCALE,
                                              rope_dim=MINI_ROPE, causal=causal)
        assert torch.isfinite(out).all() and rel_err(out, ref) <= tolerance(dtype), f"causal={causal}"


def test_bad_arguments_say_what_is_wrong():
    if mla.triton is None:
        pytest.skip("triton missing")
    q = torch.zeros(2, 2, WIDTH)
    cache = torch.zeros(4, 16, WIDTH)
    table = torch.zeros(2, 2, dtype=torch.int32)
    lens = torch.ones(2, dtype=torch.int32)
    with pytest.raises(ValueError, match="cache"):
        mla.paged_mla_decode(*parts(q), torch.zeros(4, 16, 520), table, lens, SCALE, torch.zeros(2, 2, LATENT),
                             num_splits=1)
    with pytest.raises(ValueError, match="latent"):
        mla.paged_mla_decode(*parts(q), cache, table, lens, SCALE, torch.zeros(2, 2, 500), num_splits=1)
    with pytest.raises(ValueError, match="q_pe"):
        mla.paged_mla_decode(q[..., :LATENT], q[..., LATENT:].double(), cache, table, lens, SCALE,
                             torch.zeros(2, 2, LATENT), num_splits=1)
    with pytest.raises(ValueError, match="num_splits"):
        mla.paged_mla_decode(*parts(q), cache, table, lens, SCALE, torch.zeros(2, 2, LATENT), num_splits=0)
    with pytest.raises(ValueError, match="page_table"):
        mla.paged_mla_decode(*parts(q), cache, table.float(), lens, SCALE, torch.zeros(2, 2, LATENT), num_splits=1)
    with pytest.raises(ValueError, match="cu_seqlens"):
        mla.paged_mla_prefill(*parts(q), cache, table, torch.tensor([0, 1], dtype=torch.int32), lens, SCALE,
                              torch.zeros(2, 2, LATENT))


# --- GPU: K3 per-rank shapes --------------------------------------------------------------------------------

GPU_CONTEXTS = [1, 63, 64, 65, 1000, 8192]


def gpu_decode_check(lens: list[int], heads: int, num_splits: int) -> float:
    q, cache, table, ctx = decode_case(lens, heads, 64, torch.bfloat16, "cuda")
    out = poisoned((len(lens), heads, LATENT), torch.bfloat16, "cuda")
    mla.paged_mla_decode(*parts(q), cache, table, ctx, SCALE, out, num_splits=num_splits)
    torch.cuda.synchronize()
    assert torch.isfinite(out).all(), "some outputs were never written"
    ref = reference_fp64(q, cache, table, ctx)
    for b in range(len(lens)):
        assert rel_err(out[b], ref[b]) <= 1.5e-2, f"sequence {b} (context {lens[b]}), heads {heads}"
    return rel_err(out, ref)


@gpu
@pytest.mark.parametrize("heads", [12, 96])
@pytest.mark.parametrize("context", GPU_CONTEXTS)
@pytest.mark.parametrize("splits", ["one", "auto", "many"])
def test_gpu_decode_single_sequence(heads, context, splits):
    num_splits = {"one": 1, "auto": mla.num_splits_for(1, heads, context), "many": 16}[splits]
    assert gpu_decode_check([context], heads, num_splits) <= 1e-2


@gpu
@pytest.mark.parametrize("heads", [12, 96])
@pytest.mark.parametrize("batch", [16, 64])
@pytest.mark.parametrize("splits", ["one", "auto", "many"])
def test_gpu_decode_mixed_batch(heads, batch, splits):
    lens = GPU_CONTEXTS + torch.randint(1, 8193, (batch - len(GPU_CONTEXTS),)).tolist()
    lens = [lens[i] for i in torch.randperm(batch).tolist()]
    num_splits = {"one": 1, "auto": mla.num_splits_for(batch, heads, max(lens)), "many": 8}[splits]
    assert gpu_decode_check(lens, heads, num_splits) <= 1e-2


@gpu
@pytest.mark.parametrize("heads", [12, 96])
@pytest.mark.parametrize("num_splits", [1, 4])
@pytest.mark.parametrize("case", ["verify", "chunk"])
def test_gpu_prefill(heads, num_splits, case):
    """Verify blocks (1..8 rows over contexts up to 8192) and prefill chunks over existing pages."""
    if case == "verify":
        q_lens = torch.randint(1, 9, (16,)).tolist()
        lens = [max(q, c) for q, c in zip(q_lens, GPU_CONTEXTS * 2 + torch.randint(1, 8193, (4,)).tolist(),
                                           strict=True)]
    else:
        q_lens, lens = [512, 300, 64], [1000, 300, 4096]
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    n_rows = int(cu[-1]) + 3
    table, num_pages = make_pages(lens, 64, device="cuda")
    cache = torch.randn(num_pages, 64, WIDTH, device="cuda").bfloat16()
    q = torch.randn(n_rows, heads, WIDTH, device="cuda").bfloat16()
    ctx = torch.tensor(lens, dtype=torch.int32, device="cuda")
    out = poisoned((n_rows, heads, LATENT), torch.bfloat16, "cuda")
    mla.paged_mla_prefill(*parts(q), cache, table, cu, ctx, SCALE, out, max_query_len=max(q_lens),
                          num_splits=num_splits)
    torch.cuda.synchronize()
    rows = int(cu[-1])
    assert torch.isfinite(out[:rows]).all() and torch.isnan(out[rows:]).all()
    ref = reference_fp64(q, cache, table, ctx, cu.cpu())
    for b in range(len(lens)):
        sl = slice(int(cu[b]), int(cu[b + 1]))
        assert rel_err(out[sl], ref[sl]) <= 1.5e-2, f"sequence {b} (q_len {q_lens[b]}, context {lens[b]})"
    assert rel_err(out[:rows], ref[:rows]) <= 1e-2


@gpu
@pytest.mark.parametrize("num_splits", [1, 4])
def test_gpu_noncausal_draft_blocks(num_splits):
    """The DSpark draft's shape: 64 heads, 16 blocks of 8 rows, contexts up to 8192, bf16."""
    lens = torch.randint(8, 8193, (16,)).tolist()
    q, cache, table, cu, ctx = noncausal_case([8] * 16, lens, 64, 64, torch.bfloat16, "cuda")
    out = poisoned((q.shape[0], 64, LATENT), torch.bfloat16, "cuda")
    mla.paged_mla_prefill(*parts(q), cache, table, cu.cuda(), ctx, SCALE, out, max_query_len=8,
                          num_splits=num_splits, causal=False)
    torch.cuda.synchronize()
    ref = mla.paged_mla_prefill_reference(q.float(), cache.float(), table, cu, ctx, SCALE, causal=False)
    assert torch.isfinite(out).all() and rel_err(out, ref) <= 1e-2


@gpu
def test_gpu_decode_replays_in_a_cuda_graph():
    """One capture (fixed buffers, fixed num_splits) replays correctly for new lengths and page tables."""
    batch, heads, page_size, max_pages = 16, 12, 64, 130
    num_pages = batch * max_pages + 7
    cache = torch.randn(num_pages, page_size, WIDTH, device="cuda").bfloat16()
    q = torch.empty(batch, heads, WIDTH, device="cuda", dtype=torch.bfloat16)
    table = torch.zeros(batch, max_pages, dtype=torch.int32, device="cuda")
    ctx = torch.ones(batch, dtype=torch.int32, device="cuda")
    out = torch.empty(batch, heads, LATENT, device="cuda", dtype=torch.bfloat16)
    num_splits = mla.num_splits_for(batch, heads, max_pages * page_size)
    workspace = mla.split_workspace(num_splits, batch, heads, LATENT, "cuda")

    def step():
        mla.paged_mla_decode(*parts(q), cache, table, ctx, SCALE, out, num_splits=num_splits, workspace=workspace)

    step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for _ in range(3):
        lens = torch.randint(1, max_pages * page_size + 1, (batch,))
        lens[0] = 0  # a padding row
        q.copy_(torch.randn_like(q, dtype=torch.float32))
        table.copy_(torch.randperm(num_pages, device="cuda")[: batch * max_pages].view(batch, max_pages))
        ctx.copy_(lens)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert (out[0] == 0).all() and torch.isfinite(out).all()
        ref = reference_fp64(q, cache, table, ctx)
        assert rel_err(out[1:], ref[1:]) <= 1e-2
