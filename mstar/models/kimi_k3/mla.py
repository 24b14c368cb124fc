"""Gated NoPE Multi-head Latent Attention (Kimi K3 full-attention layers), in two equivalent forms.

Per token x (already `input_layernorm`-ed), with H heads:

    c_q  = RMSNorm(W_qa x)              q_h = W_qb,h c_q = [q_nope,h | q_pe,h]    (q = W_q x without q_lora)
    [c | k_pe] = W_kva x                c_kv = RMSNorm(c)                         (k_pe: not normed, not rotated)
    k_h  = [W_UK,h c_kv | k_pe]         v_h = W_UV,h c_kv                         (W_UK,h, W_UV,h: rows of kv_b_proj)
    o_h  = sum_s softmax_s(q_h . k_h,s * (nope + rope)^-0.5) v_h,s               (causal)
    y    = W_o (o * sigmoid(W_g x))                                               (gate only if mla_use_output_gate)

There is no rotary embedding: the "rope" dims are a 64-wide query/key part whose key is shared by all heads.

Only [c_kv | k_pe] is cached (576 wide in the real model). The *expanded* form rebuilds per-head K/V from it
with kv_b_proj; the *absorbed* form folds W_UK into the query and W_UV after the attention, so every head
attends directly over the cached rows:

    q_abs,h = [W_UK,h^T q_nope,h | q_pe,h],   o_lat,h = sum_s p_s c_kv,s,   o_h = W_UV,h o_lat,h

The scale stays (nope + rope)^-0.5 in the absorbed form (not (kv_lora_rank + rope)^-0.5), since the scores
are the same numbers. `absorbed_attention` is that core on its own, the oracle for paged/GPU kernels.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from .config import KimiK3Config
from .layer_ops import REFERENCE_OPS, LayerOps
from .norm import RMSNorm, at_least_fp32

# Moonshot's HF code builds q_a_layernorm and kv_a_layernorm without an eps argument, so they take
# KimiRMSNorm's default 1e-6, not config.rms_norm_eps (1e-5); vLLM passes 1e-5, which is a parity bug
# (research notes kimi_k3.md, sections 8 and 9.1).
LATENT_NORM_EPS = 1e-6


# --- the cache -------------------------------------------------------------------------------------


@dataclass
class MLACache:
    """The cached rows of one sequence for one MLA layer: the real model's 576-wide entry, split in two.

    latent: [L, kv_lora_rank]  c_kv after kv_a_layernorm.
    k_pe:   [L, qk_rope_head_dim]  the shared key part, never rotated.
    Row i belongs to position i of the sequence.
    """

    latent: Tensor
    k_pe: Tensor

    def __post_init__(self) -> None:
        if self.latent.dim() != 2 or self.k_pe.dim() != 2 or self.latent.shape[0] != self.k_pe.shape[0]:
            raise ValueError(
                f"MLACache: latent must be [L, kv_lora_rank] and k_pe [L, rope] with the same L; got "
                f"latent {tuple(self.latent.shape)} and k_pe {tuple(self.k_pe.shape)}"
            )

    @classmethod
    def empty(cls, kv_lora_rank: int, rope_dim: int, *, dtype: torch.dtype, device=None) -> MLACache:
        return cls(
            latent=torch.empty(0, kv_lora_rank, dtype=dtype, device=device),
            k_pe=torch.empty(0, rope_dim, dtype=dtype, device=device),
        )

    @classmethod
    def from_rows(cls, rows: Tensor, kv_lora_rank: int) -> MLACache:
        """Split [L, kv_lora_rank + rope] rows back into (latent, k_pe)."""
        return cls(latent=rows[:, :kv_lora_rank], k_pe=rows[:, kv_lora_rank:])

    def __len__(self) -> int:
        return self.latent.shape[0]

    @property
    def kv_lora_rank(self) -> int:
        return self.latent.shape[1]

    @property
    def rope_dim(self) -> int:
        return self.k_pe.shape[1]

    def append(self, latent: Tensor, k_pe: Tensor) -> MLACache:
        """A new cache holding these rows followed by `latent`/`k_pe`; `self` is left unchanged."""
        return MLACache(latent=torch.cat([self.latent, latent]), k_pe=torch.cat([self.k_pe, k_pe]))

    def rows(self) -> Tensor:
        """The cache as one [L, kv_lora_rank + rope] tensor: [c_kv | k_pe] per row."""
        return torch.cat([self.latent, self.k_pe], dim=-1)


# --- attention cores -------------------------------------------------------------------------------


def causal_softmax(scores: Tensor, offset: int, scale: float) -> Tensor:
    """softmax over keys of scores [T, H, S] * scale, where query t sees keys 0..offset+t.

    Computed in at least fp32 and returned in the scores' dtype.
    """
    t, _, s = scores.shape
    if offset < 0 or offset + t > s:
        raise ValueError(f"causal offset={offset} with {t} queries needs 0 <= offset and offset + {t} <= {s} keys")
    query_pos = offset + torch.arange(t, device=scores.device)
    key_pos = torch.arange(s, device=scores.device)
    hidden = key_pos[None, :] > query_pos[:, None]  # [T, S]
    logits = at_least_fp32(scores) * scale
    logits = logits.masked_fill(hidden[:, None, :], float("-inf"))
    return torch.softmax(logits, dim=-1).to(scores.dtype)


def expanded_attention(q: Tensor, k: Tensor, v: Tensor, offset: int, scale: float) -> Tensor:
    """Per-head attention: q [T, H, dk], k [S, H, dk], v [S, H, dv] -> o [T, H, dv]."""
    p = causal_softmax(torch.einsum("thd,shd->ths", q, k), offset, scale)
    return torch.einsum("ths,shd->thd", p, v)


def absorbed_attention(q_abs: Tensor, rows: Tensor, offset: int, scale: float, *, kv_lora_rank: int) -> Tensor:
    """The absorbed MLA core: every head attends over the shared latent rows.

    q_abs  [T, H, kv_lora_rank + rope]  = [W_UK,h^T q_nope,h | q_pe,h]
    rows   [S, kv_lora_rank + rope]     = [c_kv | k_pe], the cache including the T new tokens
    offset  rows before the first query (query t sees rows 0..offset+t)
    scale   (nope + rope)^-0.5, the same as the expanded form
    returns o_lat [T, H, kv_lora_rank] = sum_s p_s c_kv,s: the value is the first kv_lora_rank columns of a row.
    """
    if q_abs.shape[-1] != rows.shape[-1] or not 0 < kv_lora_rank < rows.shape[-1]:
        raise ValueError(
            f"q_abs width {q_abs.shape[-1]} must equal the cache row width {rows.shape[-1]}, which must exceed "
            f"kv_lora_rank={kv_lora_rank}"
        )
    p = causal_softmax(torch.einsum("thc,sc->ths", q_abs, rows), offset, scale)
    return torch.einsum("ths,sc->thc", p, rows[:, :kv_lora_rank])


# --- the layer -------------------------------------------------------------------------------------


class GatedMLA(nn.Module):
    """One K3 (or Kimi-Linear) MLA layer; attribute names match the checkpoint under `self_attn.`."""

    def __init__(self, config: KimiK3Config, layer_idx: int):
        super().__init__()
        if config.is_kda_layer(layer_idx):
            raise ValueError(
                f"layer_idx={layer_idx} (1-based {layer_idx + 1}) is a KDA layer in linear_attn_config; "
                "GatedMLA is only for full_attn_layers"
            )
        self.layer_idx = layer_idx
        self.num_heads = h = config.num_attention_heads
        self.nope = config.qk_nope_head_dim
        self.rope = config.qk_rope_head_dim
        self.v_dim = config.v_head_dim
        self.kv_lora_rank = config.kv_lora_rank
        self.q_lora_rank = config.q_lora_rank
        self.scale = config.mla_softmax_scale
        d, qk = config.hidden_size, config.qk_head_dim

        if config.q_lora_rank is None:
            self.q_proj = nn.Linear(d, h * qk, bias=False)
        else:
            self.q_a_proj = nn.Linear(d, config.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(config.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(config.q_lora_rank, h * qk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(d, self.kv_lora_rank + self.rope, bias=False)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = nn.Linear(self.kv_lora_rank, h * (self.nope + self.v_dim), bias=False)
        self.g_proj = nn.Linear(d, h * self.v_dim, bias=False) if config.mla_use_output_gate else None
        self.o_proj = nn.Linear(h * self.v_dim, d, bias=False)

    # --- projections ---
    def input_projections(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor | None]:
        """x [T, D] -> (q_a(x), or q(x) without a query LoRA; kv_a(x) = [latent | k_pe]; g(x) or None)."""
        first = self.q_proj if self.q_lora_rank is None else self.q_a_proj
        return first(x), self.kv_a_proj_with_mqa(x), self.g_proj(x) if self.g_proj is not None else None

    def queries(self, q_first: Tensor, ops: LayerOps = REFERENCE_OPS) -> tuple[Tensor, Tensor]:
        """q's first projection [T, *] -> (q_nope [T, H, nope], q_pe [T, H, rope])."""
        q = q_first if self.q_lora_rank is None else ops.linear(self.q_b_proj, ops.norm(self.q_a_layernorm, q_first))
        return self.query_heads(q)

    def query_heads(self, q: Tensor) -> tuple[Tensor, Tensor]:
        """The full query [T, H (nope + rope)] -> (q_nope [T, H, nope], q_pe [T, H, rope]), views."""
        q = q.view(q.shape[0], self.num_heads, self.nope + self.rope)
        return q[..., : self.nope], q[..., self.nope :]

    def latent_rows(self, kv: Tensor, ops: LayerOps = REFERENCE_OPS) -> tuple[Tensor, Tensor]:
        """kv_a(x) [T, kv_lora_rank + rope] -> the new cache rows (c_kv normed, k_pe as projected)."""
        c, k_pe = kv.split([self.kv_lora_rank, self.rope], dim=-1)
        return ops.norm(self.kv_a_layernorm, c), k_pe

    def kv_b_weights(self) -> tuple[Tensor, Tensor]:
        """kv_b_proj per head: (W_UK [H, nope, kv_lora_rank], W_UV [H, v, kv_lora_rank])."""
        w = self.kv_b_proj.weight.view(self.num_heads, self.nope + self.v_dim, self.kv_lora_rank)
        return w[:, : self.nope], w[:, self.nope :]

    def absorbed_query(self, q_nope: Tensor) -> tuple[Tensor, Tensor]:
        """W_UK folded into the query: (q_lat = q_nope W_UK per head [T, H, kv_lora_rank], W_UV [H, v, kv_lora_rank],
        which takes the latent output back to v)."""
        w_uk, w_uv = self.kv_b_weights()
        return torch.einsum("thn,hnr->thr", q_nope, w_uk), w_uv

    # --- the two attention forms over the cache (which already holds the new tokens) ---
    def attend_expanded(self, q_nope: Tensor, q_pe: Tensor, cache: MLACache, offset: int) -> Tensor:
        """Rebuild per-head k = [W_UK c_kv | k_pe], v = W_UV c_kv, then attend. Returns o [T, H, v]."""
        w_uk, w_uv = self.kv_b_weights()
        k_nope = torch.einsum("sr,hnr->shn", cache.latent, w_uk)
        v = torch.einsum("sr,hvr->shv", cache.latent, w_uv)
        k_pe = cache.k_pe[:, None, :].expand(-1, self.num_heads, -1)
        q = torch.cat([q_nope, q_pe], dim=-1)
        return expanded_attention(q, torch.cat([k_nope, k_pe], dim=-1), v, offset, self.scale)

    def attend_absorbed(self, q_nope: Tensor, q_pe: Tensor, cache: MLACache, offset: int) -> Tensor:
        """Fold W_UK into the query, attend over the latent rows, then apply W_UV. Returns o [T, H, v]."""
        q_lat, w_uv = self.absorbed_query(q_nope)
        q_abs = torch.cat([q_lat, q_pe], dim=-1)
        o_lat = absorbed_attention(q_abs, cache.rows(), offset, self.scale, kv_lora_rank=self.kv_lora_rank)
        return torch.einsum("thr,hvr->thv", o_lat, w_uv)

    def output(self, o: Tensor, gate: Tensor | None, ops: LayerOps = REFERENCE_OPS) -> Tensor:
        """o [T, H, v] -> y [T, D]: the sigmoid output gate g(x) (computed in at least fp32), then o_proj."""
        # the gate's product is [T, H v] in gate's dtype, x.dtype: g(x) is in it
        flat = ops.sigmoid_gate(o, gate) if gate is not None else o.reshape(o.shape[0], self.num_heads * self.v_dim)
        return ops.linear(self.o_proj, flat)

    def forward(self, x: Tensor, cache: MLACache | None = None, absorbed: bool = False) -> tuple[Tensor, MLACache]:
        """x [T, D] (after input_layernorm) -> (y [T, D], the cache extended by these T tokens).

        The T tokens sit at positions len(cache)..len(cache)+T-1 and attend causally to every cached row
        and to themselves. `absorbed` picks the form; both give the same result.
        """
        if cache is None:
            cache = MLACache.empty(self.kv_lora_rank, self.rope, dtype=x.dtype, device=x.device)
        self._check_cache(cache, x)
        offset = len(cache)
        q_first, kv, gate = self.input_projections(x)
        cache = cache.append(*self.latent_rows(kv))
        q_nope, q_pe = self.queries(q_first)
        attend = self.attend_absorbed if absorbed else self.attend_expanded
        return self.output(attend(q_nope, q_pe, cache, offset), gate), cache

    def _check_cache(self, cache: MLACache, x: Tensor) -> None:
        if x.dim() != 2:
            raise ValueError(f"x must be [T, hidden_size] (one sequence), got shape {tuple(x.shape)}")
        if (cache.kv_lora_rank, cache.rope_dim) != (self.kv_lora_rank, self.rope):
            raise ValueError(
                f"cache rows are latent {cache.kv_lora_rank} + k_pe {cache.rope_dim} wide; layer {self.layer_idx} "
                f"needs kv_lora_rank {self.kv_lora_rank} + qk_rope_head_dim {self.rope}"
            )
        if cache.latent.dtype != x.dtype:
            raise ValueError(f"cache dtype {cache.latent.dtype} differs from the activations' dtype {x.dtype}")
