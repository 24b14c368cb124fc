"""Expanded MLA prefill: FlashAttention-2 over per-head K/V rebuilt from a chunk's latent rows, and the torch
functions it must equal.

The absorbed form (mla_attention.py) attends every head over the cached rows [c_kv | k_pe]: 2 (2 latent + rope)
FLOPs a (query, key) pair and head (K3: 2 x 1,088). The expanded form rebuilds each head's key
k = [W_UK c_kv | k_pe] (nope + rope = 192 columns) and value v = W_UV c_kv (128) and attends at
2 (nope + rope + v) = 2 x 320 FLOPs a pair: 3.4x fewer, once a chunk is long enough to pay for the expansion
GEMM (2 latent (nope + v) FLOPs a row and head; `prefers_expanded` is that roofline: from 341 tokens in one
sequence at K3's widths). Decode and verify/draft blocks stay absorbed.

A prefill step's chunk runs in three parts, the way vLLM's MLA prefill does:

1. `expand_kv`: k_nope and v of the chunk's new rows from their normalised latent c_kv, one GEMM through
   kv_b_proj's weight (both halves), as views of its output; k_pe [N, rope] is shared by every head and stays
   one row a token.
2. `prefix_state` (where a sequence has rows cached before its chunk: chunked prefill, a prefix-cache hit, a
   decode row of a mixed step): the absorbed kernel over the prefix only, every query seeing all of it
   (`paged_mla_prefill(causal=False)` with the prefix lengths as contexts), returning the normalised o_lat and
   its log-sum-exp; o_lat through W_UV gives o_prefix [N, H, v].
3. `mla_prefill_expanded`: the causal attention of the chunk over its own rows, each row's online softmax
   starting from the prefix's state (m = lse, l = 1, acc = o_prefix; an empty prefix has lse = -inf and the
   state starts empty), so the merge costs nothing extra.

Layout of one kernel program: BLOCK_M query tokens of one sequence and one head. It walks its sequence's key
tiles of BLOCK_N rows up to its last query: the tiles below its first query unmasked, the diagonal ones with the
causal mask; scores q_nope.k_nope^T + q_pe.k_pe^T (fp32 accumulate), online softmax in fp32 in the exp2
domain, acc += p.v. The tiles of a sequence are launched last one first (the longest first), the heads of one
tile side by side (they share the k_pe rows in L2). Lengths are read on the device, the grid and every buffer
depend only on N, H and the static `max_query_len`: one CUDA-graph capture per token bucket replays any step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from mstar.kernels import mla_attention
from mstar.kernels.mla_attention import KernelConfig

try:
    import triton
    import triton.language as tl

    from mstar.kernels import pdl
except ImportError:  # the torch references and the roofline stay usable without triton
    triton = None

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


# --- the roofline ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MLADims:
    """The widths of an MLA layer the two forms' FLOPs depend on (K3: latent 512, rope 64, nope 128, v 128)."""

    latent: int  # kv_lora_rank: c_kv, the absorbed query and value width
    rope: int  # qk_rope_head_dim: k_pe, shared by every head
    nope: int  # qk_nope_head_dim: the per-head key part expanded from c_kv
    v_dim: int  # v_head_dim


K3_DIMS = MLADims(latent=512, rope=64, nope=128, v_dim=128)


def prefers_expanded(q_lens: Sequence[int], dims: MLADims, rows: int | None = None) -> bool:
    """Whether the expanded form costs fewer FLOPs than the absorbed one for a step whose sequences run
    q_lens[b] new tokens each; `rows`: the rows the expansion GEMM runs (default sum(q_lens); a captured bucket
    expands all of its rows, padding included).

    Per head, with the chunk's causal pairs P = sum_b n_b (n_b + 1) / 2 (n_b = q_lens[b]):

        absorbed = 2 P (2 latent + rope)                                  scores over latent + rope, values over latent
        expanded = 2 P (nope + rope + v) + 2 rows latent (nope + v)       attention + the K/V expansion GEMM

    The pairs of each chunk's queries with its prefix (rows cached before it) run absorbed in both forms and
    cancel, as do the projections both share (W_UV of the output; W_UK^T q_nope, which the expanded form skips
    only without a prefix, is left out: the rule stays a function of the chunk lengths). At K3's widths that is
    2,176 P against 640 P + 262,144 rows: one sequence of n tokens takes the expanded form from n = 341
    (`expanded_from`), a step of many short sequences keeps the absorbed one.
    """
    pairs = sum(n * (n + 1) // 2 for n in q_lens)
    rows = sum(q_lens) if rows is None else rows
    absorbed = 2 * pairs * (2 * dims.latent + dims.rope)
    expanded = 2 * pairs * (dims.nope + dims.rope + dims.v_dim) + 2 * rows * dims.latent * (dims.nope + dims.v_dim)
    return expanded < absorbed


def expanded_from(dims: MLADims) -> int | None:
    """The fewest tokens of one sequence for which `prefers_expanded` holds (None: never, where the expanded
    form's pair costs at least the absorbed one's): the smallest n with
    (n + 1) (2 latent - nope - v) > 2 latent (nope + v)."""
    saving = 2 * dims.latent - dims.nope - dims.v_dim
    if saving <= 0:
        return None
    return 2 * dims.latent * (dims.nope + dims.v_dim) // saving  # n + 1 > bound: n >= floor(bound)


# --- configuration -------------------------------------------------------------------------------------


def default_config(max_query_len: int, num_heads: int, num_sms: int = 132) -> KernelConfig:
    """128 query rows a program (8 warps: the fp32 accumulator [128, v] is 64 registers a thread at K3's v of
    128), 64 keys a tile; 64 rows where 128-row tiles would not give every SM of an H200 a program (short
    chunks). Both compile for sm_90 without spills (benchmarks/kernels/sass_mla_expanded.py); neither timed
    yet (benchmarks/kernels/bench_mla_prefill.py)."""
    if -(-max_query_len // 128) * num_heads >= num_sms:
        return KernelConfig(block_m=128, block_n=64, num_warps=8, num_stages=2)
    return KernelConfig(block_m=64, block_n=64, num_warps=4, num_stages=2)


# --- torch references -------------------------------------------------------------------------------------


def expanded_prefill_reference(q_nope: Tensor, q_pe: Tensor, k_nope: Tensor, v: Tensor, k_pe: Tensor,
                               cu_seqlens: Tensor, context_lens: Tensor, scale: float,
                               prefix: tuple[Tensor, Tensor] | None = None) -> Tensor:
    """What `mla_prefill_expanded` computes, in at least fp32: o [N, H, v] in q_nope's dtype.

    Query i of sequence b (rows cu_seqlens[b]:cu_seqlens[b+1]) attends causally to the chunk's keys 0..i and to
    the prefix state prefix = (o_prefix [N, H, v], lse [N, H] base 2): that state weighs as one more key of
    logit lse ln 2 and value o_prefix. A sequence with fewer cached rows than queries (context_lens[b] < q_len:
    a bucket's padding sequence) and rows past cu_seqlens[-1] come out zero.
    """
    out = torch.zeros(*q_nope.shape[:2], v.shape[-1], dtype=q_nope.dtype, device=q_nope.device)
    up = torch.promote_types(q_nope.dtype, torch.float32)
    cu = cu_seqlens.tolist()
    for b, ctx in enumerate(context_lens.tolist()):
        rows = slice(cu[b], cu[b + 1])
        n = cu[b + 1] - cu[b]
        if n == 0 or ctx < n:
            continue
        logits = (torch.einsum("thd,shd->ths", q_nope[rows].to(up), k_nope[rows].to(up))
                  + torch.einsum("thd,sd->ths", q_pe[rows].to(up), k_pe[rows].to(up))) * scale
        hidden = torch.ones(n, n, dtype=torch.bool, device=logits.device).triu(1)
        logits = logits.masked_fill(hidden[:, None, :], float("-inf"))
        values = v[rows].to(up)
        if prefix is not None:
            o_prefix, lse = prefix
            logits = torch.cat([lse[rows].to(up)[..., None] * LN2, logits], dim=-1)
            p = torch.softmax(logits, dim=-1)
            o = p[..., 0, None] * o_prefix[rows].to(up) + torch.einsum("ths,shv->thv", p[..., 1:], values)
        else:
            o = torch.einsum("ths,shv->thv", torch.softmax(logits, dim=-1), values)
        out[rows] = o.to(out.dtype)
    return out


def paged_mla_expanded_reference(q_nope: Tensor, q_pe: Tensor, cache: Tensor, page_table: Tensor,
                                 cu_seqlens: Tensor, context_lens: Tensor, scale: float, w_uk: Tensor,
                                 w_uv: Tensor) -> Tensor:
    """The expanded form over every row each chunk sees (prefix and chunk): o [N, H, v], causal, in q's dtype.

    Sequence b's context_lens[b] rows are gathered from its pages, K = [W_UK c_kv | k_pe] and V = W_UV c_kv
    per head (w_uk [H, nope, latent], w_uv [H, v, latent]: kv_b_proj's halves), and its queries (rows
    cu_seqlens[b]:cu_seqlens[b+1], its last positions) attend causally: equal, mathematically, to
    W_UV paged_mla_prefill_reference(q_abs = [W_UK^T q_nope | q_pe]) (the absorbed form) and to
    models/kimi_k3/mla.py's `GatedMLA.attend_expanded`. Rows past cu_seqlens[-1] are zeros.
    """
    latent = w_uk.shape[-1]
    out = torch.zeros(*q_nope.shape[:2], w_uv.shape[1], dtype=q_nope.dtype, device=q_nope.device)
    cu = cu_seqlens.tolist()
    for b, ctx in enumerate(context_lens.tolist()):
        rows = slice(cu[b], cu[b + 1])
        n = cu[b + 1] - cu[b]
        if n == 0 or ctx == 0:
            continue
        kv = mla_attention.gather_rows(cache, page_table[b], ctx).to(q_nope.dtype)
        c_kv, k_pe = kv[:, :latent], kv[:, latent:]
        k_nope = torch.einsum("sr,hnr->shn", c_kv, w_uk.to(c_kv.dtype))
        values = torch.einsum("sr,hvr->shv", c_kv, w_uv.to(c_kv.dtype))
        logits = (torch.einsum("thd,shd->ths", q_nope[rows], k_nope)
                  + torch.einsum("thd,sd->ths", q_pe[rows], k_pe))
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32)) * scale
        positions = torch.arange(ctx, device=logits.device)
        hidden = positions[None, :] > positions[ctx - n:, None]  # query i sits at ctx - n + i
        p = torch.softmax(logits.masked_fill(hidden[:, None, :], float("-inf")), dim=-1).to(values.dtype)
        out[rows] = torch.einsum("ths,shv->thv", p, values)
    return out


# --- the three parts of a chunk -------------------------------------------------------------------------------


def expand_kv(c_kv: Tensor, kv_b_weight: Tensor, num_heads: int, nope: int, gemm=None) -> tuple[Tensor, Tensor]:
    """(k_nope [N, H, nope], v [N, H, v]) of the new rows' normalised latent c_kv [N, latent] (any row stride):
    one GEMM with kv_b_proj's weight [H (nope + v), latent] (per head: W_UK's rows, then W_UV's), both halves
    views of its output [N, H, nope + v]. `gemm(x, weight)`: the backend's projection (default F.linear)."""
    if c_kv.dim() != 2 or kv_b_weight.dim() != 2 or kv_b_weight.shape[1] != c_kv.shape[1] \
            or kv_b_weight.shape[0] % num_heads or kv_b_weight.shape[0] // num_heads <= nope:
        raise ValueError(f"expand_kv takes c_kv [N, latent] and kv_b_proj's weight [H (nope + v), latent] with "
                         f"H={num_heads} and nope={nope}; got c_kv {tuple(c_kv.shape)}, weight "
                         f"{tuple(kv_b_weight.shape)}")
    kv = (gemm or torch.nn.functional.linear)(c_kv, kv_b_weight)
    kv = kv.view(c_kv.shape[0], num_heads, -1)
    return kv[..., :nope], kv[..., nope:]


def prefix_state(q_lat: Tensor, q_pe: Tensor, cache: Tensor, page_table: Tensor, cu_seqlens: Tensor,
                 prefix_lens: Tensor, scale: float, w_uv: Tensor, *, max_query_len: int | None = None,
                 num_splits: int = 1, min_split_tokens: int = mla_attention.DEFAULT_MIN_SPLIT_TOKENS,
                 workspace: tuple[Tensor, Tensor] | None = None,
                 config: KernelConfig | None = None) -> tuple[Tensor, Tensor]:
    """The state each chunk row's softmax starts from: (o_prefix [N, H, v] in q_lat's dtype, lse [N, H] fp32).

    The absorbed kernel over each sequence's prefix only: its queries (q_lat = W_UK^T q_nope and q_pe, as
    `paged_mla_prefill` takes them) all see the sequence's first prefix_lens[b] cached rows (causal=False with
    prefix_lens as the contexts), giving the normalised o_lat and its base-2 log-sum-exp (-inf for an empty
    prefix, whose o_lat is zeros); o_prefix = W_UV o_lat (w_uv [H, v, latent]), as the absorbed path projects
    its output. prefix_lens [B] = context_lens - q_lens (>= 0, on the device: no host sync).
    """
    num_tokens, num_heads, latent = q_lat.shape
    o_lat = torch.empty(num_tokens, num_heads, latent, dtype=q_lat.dtype, device=q_lat.device)
    lse = torch.empty(num_tokens, num_heads, dtype=torch.float32, device=q_lat.device)
    mla_attention.paged_mla_prefill(q_lat, q_pe, cache, page_table, cu_seqlens, prefix_lens, scale, o_lat,
                                    max_query_len=max_query_len, num_splits=num_splits,
                                    min_split_tokens=min_split_tokens, workspace=workspace, config=config,
                                    causal=False, lse=lse)
    return torch.einsum("thr,hvr->thv", o_lat, w_uv), lse


# --- Triton kernel ----------------------------------------------------------------------------------------------

if triton is not None:

    @triton.jit
    def _key_tiles(acc, l_i, m_i, q_nope, q_pe, kn_ptr, kp_ptr, v_ptr, stride_knt, stride_kpt, stride_vt,
                   first, start, end, queries, scale_log2,
                   NOPE: tl.constexpr, ROPE: tl.constexpr, VDIM: tl.constexpr, BLOCK_N: tl.constexpr,
                   CAUSAL: tl.constexpr):
        """The online softmax over the chunk's keys start..end-1 (tiles of BLOCK_N from `start`): all of them
        visible to every query (CAUSAL False: below the tile's first query, whole tiles), or key j to query i
        only where j <= i and j < end (the diagonal tiles)."""
        d_nope = tl.arange(0, NOPE)
        d_pe = tl.arange(0, ROPE)
        d_v = tl.arange(0, VDIM)
        for n0 in range(start, end, BLOCK_N):
            keys = n0 + tl.arange(0, BLOCK_N)
            row = (first + keys).to(tl.int64)
            if CAUSAL:
                key_ok = keys < end
                k_nope = tl.load(kn_ptr + row[:, None] * stride_knt + d_nope[None, :], mask=key_ok[:, None], other=0.0)
                k_pe = tl.load(kp_ptr + row[:, None] * stride_kpt + d_pe[None, :], mask=key_ok[:, None], other=0.0)
                v = tl.load(v_ptr + row[:, None] * stride_vt + d_v[None, :], mask=key_ok[:, None], other=0.0)
            else:
                k_nope = tl.load(kn_ptr + row[:, None] * stride_knt + d_nope[None, :])
                k_pe = tl.load(kp_ptr + row[:, None] * stride_kpt + d_pe[None, :])
                v = tl.load(v_ptr + row[:, None] * stride_vt + d_v[None, :])
            s = tl.dot(q_pe, tl.trans(k_pe), tl.dot(q_nope, tl.trans(k_nope))) * scale_log2
            if CAUSAL:
                s = tl.where(key_ok[None, :] & (keys[None, :] <= queries[:, None]), s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
            m_i = m_new
        return acc, l_i, m_i

    @triton.jit
    def _mla_expanded_kernel(
        qn_ptr, qp_ptr, kn_ptr, kp_ptr, v_ptr, cu_ptr, ctx_ptr, op_ptr, lse_ptr, out_ptr, scale_log2,
        stride_qnt, stride_qnh, stride_qpt, stride_qph, stride_knt, stride_knh, stride_kpt, stride_vt, stride_vh,
        stride_opt, stride_oph, stride_lt, stride_ot, stride_oh,
        NOPE: tl.constexpr, ROPE: tl.constexpr, VDIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        PREFIX: tl.constexpr, PDL: tl.constexpr,
    ):
        pdl.wait_for_inputs(PDL)
        head = tl.program_id(0)
        seq = tl.program_id(2)
        first = tl.load(cu_ptr + seq)
        q_len = tl.load(cu_ptr + seq + 1) - first
        tile = tl.cdiv(q_len, BLOCK_M) - 1 - tl.program_id(1)  # the sequence's last (longest) tile first
        if tile >= 0:
            queries = tile * BLOCK_M + tl.arange(0, BLOCK_M)
            row_ok = queries < q_len
            token = (first + queries).to(tl.int64)
            d_nope = tl.arange(0, NOPE)
            d_pe = tl.arange(0, ROPE)
            d_v = tl.arange(0, VDIM)
            q_nope = tl.load(qn_ptr + token[:, None] * stride_qnt + head * stride_qnh + d_nope[None, :],
                             mask=row_ok[:, None], other=0.0)
            q_pe = tl.load(qp_ptr + token[:, None] * stride_qpt + head * stride_qph + d_pe[None, :],
                           mask=row_ok[:, None], other=0.0)
            if PREFIX:  # resume from the prefix's normalised output and log-sum-exp: m = lse, l = 1, acc = o
                lse = tl.load(lse_ptr + token * stride_lt + head, mask=row_ok, other=float("-inf"))
                seen = lse > float("-inf")
                # A finite floor for the running max keeps exp2(m_old - m_new) free of inf - inf.
                m_i = tl.where(seen, lse, -1.0e30)
                l_i = tl.where(seen, 1.0, 0.0)
                acc = tl.load(op_ptr + token[:, None] * stride_opt + head * stride_oph + d_v[None, :],
                              mask=seen[:, None], other=0.0).to(tl.float32)
            else:
                m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
                l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
                acc = tl.zeros([BLOCK_M, VDIM], dtype=tl.float32)
            # a sequence with fewer cached rows than queries is a bucket's padding: it sees no key
            keys_end = tl.where(tl.load(ctx_ptr + seq) >= q_len, q_len, 0)
            diagonal = tile * BLOCK_M  # a multiple of BLOCK_N (checked by the launcher)
            kn_head, v_head = kn_ptr + head * stride_knh, v_ptr + head * stride_vh
            acc, l_i, m_i = _key_tiles(acc, l_i, m_i, q_nope, q_pe, kn_head, kp_ptr, v_head, stride_knt, stride_kpt,
                                       stride_vt, first, 0, tl.minimum(diagonal, keys_end), queries, scale_log2,
                                       NOPE, ROPE, VDIM, BLOCK_N, False)
            acc, l_i, m_i = _key_tiles(acc, l_i, m_i, q_nope, q_pe, kn_head, kp_ptr, v_head, stride_knt, stride_kpt,
                                       stride_vt, first, diagonal, tl.minimum(diagonal + BLOCK_M, keys_end), queries,
                                       scale_log2, NOPE, ROPE, VDIM, BLOCK_N, True)
            o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
            tl.store(out_ptr + token[:, None] * stride_ot + head * stride_oh + d_v[None, :],
                     o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


# --- launcher ----------------------------------------------------------------------------------------------------


def _power_of_two(name: str, width: int) -> None:
    if not mla_attention.arange_width(width):
        raise ValueError(f"{name} is {width}; the kernel needs a power of two >= 16 (K3: nope 128, rope 64, v 128)")


def _check(q_nope: Tensor, q_pe: Tensor, k_nope: Tensor, v: Tensor, k_pe: Tensor, cu_seqlens: Tensor,
           context_lens: Tensor, out: Tensor, prefix: tuple[Tensor, Tensor] | None, config: KernelConfig) -> None:
    """Raise a ValueError saying what is wrong unless the arguments are what `mla_prefill_expanded` takes."""
    if triton is None:
        raise RuntimeError("mla_expanded's kernel needs triton; install it or use expanded_prefill_reference")
    shapes = {name: tuple(t.shape) for name, t in (("q_nope", q_nope), ("q_pe", q_pe), ("k_nope", k_nope),
                                                   ("v", v), ("k_pe", k_pe), ("out", out))}
    if q_nope.dim() != 3:
        raise ValueError(f"q_nope must be [N, H, nope]; got {shapes['q_nope']}")
    n, h, nope = q_nope.shape
    rope, v_dim = q_pe.shape[-1], v.shape[-1]
    want = {"q_pe": (n, h, rope), "k_nope": (n, h, nope), "v": (n, h, v_dim), "k_pe": (n, rope), "out": (n, h, v_dim)}
    if any(shapes[name] != shape for name, shape in want.items()):
        raise ValueError(f"q_nope [N, H, nope], q_pe [N, H, rope], k_nope [N, H, nope], v and out [N, H, v] and k_pe "
                         f"[N, rope] must agree; got {shapes}")
    for name, width in (("nope (q_nope width)", nope), ("rope (q_pe width)", rope), ("v (v width)", v_dim)):
        _power_of_two(name, width)
    dtypes = {t.dtype for t in (q_nope, q_pe, k_nope, v, k_pe)}
    if len(dtypes) != 1 or q_nope.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"q_nope, q_pe, k_nope, v and k_pe must share one of bf16/fp16/fp32; got "
                         f"{[str(t.dtype) for t in (q_nope, q_pe, k_nope, v, k_pe)]}")
    for name, t in (("q_nope", q_nope), ("q_pe", q_pe), ("k_nope", k_nope), ("v", v), ("k_pe", k_pe), ("out", out)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dimension; got strides {t.stride()}")
    if cu_seqlens.dim() != 1 or context_lens.dim() != 1 or cu_seqlens.shape[0] != context_lens.shape[0] + 1:
        raise ValueError(f"cu_seqlens must be [B+1] and context_lens [B]; got {tuple(cu_seqlens.shape)} and "
                         f"{tuple(context_lens.shape)}")
    for name, t in (("cu_seqlens", cu_seqlens), ("context_lens", context_lens)):
        if t.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} must be int32/int64; got {t.dtype}")
    tensors = [q_nope, q_pe, k_nope, v, k_pe, cu_seqlens, context_lens, out]
    if prefix is not None:
        o_prefix, lse = prefix
        if o_prefix.shape != (n, h, v_dim) or o_prefix.stride(-1) != 1 or not o_prefix.is_floating_point():
            raise ValueError(f"the prefix's output must be [N, H, v] = {(n, h, v_dim)} with unit column stride; got "
                             f"{tuple(o_prefix.shape)} {o_prefix.dtype} strides {o_prefix.stride()}")
        if lse.shape != (n, h) or lse.dtype != torch.float32 or lse.stride(-1) != 1:
            raise ValueError(f"the prefix's lse must be fp32 [N, H] = {(n, h)} with unit head stride; got "
                             f"{tuple(lse.shape)} {lse.dtype} strides {lse.stride()}")
        tensors += [o_prefix, lse]
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device; got {sorted(map(str, devices))}")
    m, bn = config.block_m, config.block_n
    if m < 16 or bn < 16 or m & (m - 1) or bn & (bn - 1) or m % bn:
        raise ValueError(f"block_m and block_n must be powers of two >= 16, block_n dividing block_m; got {config}")


def mla_prefill_expanded(q_nope: Tensor, q_pe: Tensor, k_nope: Tensor, v: Tensor, k_pe: Tensor, cu_seqlens: Tensor,
                         context_lens: Tensor, scale: float, out: Tensor, *,
                         prefix: tuple[Tensor, Tensor] | None = None, max_query_len: int | None = None,
                         config: KernelConfig | None = None) -> Tensor:
    """Causal attention of a prefill step's new tokens over their own expanded rows; writes and returns `out`.

    q_nope, q_pe   [N, H, nope], [N, H, rope]  the queries as the model computes them (views of the query
                   projection: any token and head strides, unit column stride)
    k_nope, v      [N, H, nope], [N, H, v]  the new rows' keys and values (`expand_kv`'s views)
    k_pe           [N, rope]  the new rows' shared key part (any row stride: a view of the cached rows)
    cu_seqlens     [B+1] int32/int64  sequence b owns rows cu_seqlens[b]:cu_seqlens[b+1] (its chunk)
    context_lens   [B] rows cached after the step; a sequence with fewer than its q_len (a bucket's padding
                   sequence) sees no key and comes out zero
    scale          the softmax scale, (nope + rope)^-0.5
    out            [N, H, v] in any float dtype (the model's); rows past cu_seqlens[-1] are left untouched
    prefix         (o_prefix [N, H, v], lse [N, H] fp32 base 2) from `prefix_state`; None: no sequence has rows
                   cached before its chunk (its queries see their chunk only)
    max_query_len  a static upper bound of every q_len (defaults to N; it sizes the grid)
    No host sync: lengths are read on the device.
    """
    cfg = config or default_config(q_nope.shape[0] if max_query_len is None else max_query_len, q_nope.shape[1])
    _check(q_nope, q_pe, k_nope, v, k_pe, cu_seqlens, context_lens, out, prefix, cfg)
    num_tokens, num_heads, nope = q_nope.shape
    num_seqs = context_lens.shape[0]
    max_q = num_tokens if max_query_len is None else min(int(max_query_len), num_tokens)
    if num_tokens == 0 or num_seqs == 0 or max_q <= 0:
        return out
    o_prefix, lse = prefix if prefix is not None else (out, out[..., 0])  # unread stand-ins without a prefix
    grid = (num_heads, triton.cdiv(max_q, cfg.block_m), num_seqs)
    _mla_expanded_kernel[grid](
        q_nope, q_pe, k_nope, k_pe, v, cu_seqlens, context_lens, o_prefix, lse, out, float(scale) * LOG2E,
        q_nope.stride(0), q_nope.stride(1), q_pe.stride(0), q_pe.stride(1), k_nope.stride(0), k_nope.stride(1),
        k_pe.stride(0), v.stride(0), v.stride(1), o_prefix.stride(0), o_prefix.stride(1), lse.stride(0),
        out.stride(0), out.stride(1),
        NOPE=nope, ROPE=q_pe.shape[-1], VDIM=v.shape[-1], BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        PREFIX=prefix is not None, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **pdl.options(_mla_expanded_kernel, q_nope.device),
    )
    return out


def expanded_flops(q_len: int, num_heads: int, dims: MLADims = K3_DIMS, prefix: int = 0) -> float:
    """FLOPs of one sequence's chunk of q_len tokens in the expanded path: its causal pairs at 2 (nope + rope + v),
    the expansion GEMM, and (with `prefix` cached rows) the absorbed pass over the prefix plus its W_UV
    projection and the queries' W_UK^T (a benchmark's floor)."""
    pairs = q_len * (q_len + 1) / 2
    flops = 2 * pairs * (dims.nope + dims.rope + dims.v_dim) + 2 * q_len * dims.latent * (dims.nope + dims.v_dim)
    if prefix:
        flops += 2 * q_len * prefix * (2 * dims.latent + dims.rope) + 2 * q_len * dims.latent * (dims.nope + dims.v_dim)
    return flops * num_heads


__all__ = [
    "MLADims", "K3_DIMS", "prefers_expanded", "expanded_from", "default_config", "expanded_prefill_reference",
    "paged_mla_expanded_reference", "expand_kv", "prefix_state", "mla_prefill_expanded", "expanded_flops",
]
