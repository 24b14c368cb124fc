"""The DSpark draft's blocks over the paged draft KV, attention through the paged MLA kernel (the GPU path).

`K3DSparkModel.blocks_hidden` gathers every block's context rows from the pages into a padded [B, S, 576]
copy per layer, appends the block's own rows and masks what a block may not see: dozens of small ops and a
copy of the whole context per layer and step. Here each layer instead writes the block's own latent rows
into the draft KV at the block's positions (p .. p + k - 1: the pages the step admitted for its anchor and
drafts; later overwritten by `write_context` with the committed rows, so nothing stale is ever read) and
attends with `paged_mla_prefill(causal=False)`: every query of block b sees rows 0 .. p_b + k_b - 1, which is
its context and its own real slots, exactly the visibility of `BlockBatch.visibility`. Padding slots of a
shorter block write their rows to the sink page and see the same rows (their outputs are dropped).

The shapes depend only on (B, k_max) and the page table's width, never on the context lengths, so one
CUDA graph per bucket replays any step (speculative/draft_graphs.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from mstar.kernels import mla_attention
from mstar.models.kimi_k3.norm import RMSNorm
from mstar.resources.transfer import to_device

from .model import DSparkMLA, Embed, GreedyChain, K3DSparkModel, Rope

SINK = 0  # page 0 of the draft KV: padding rows write there


@dataclass(frozen=True)
class PagedBlocks:
    """B blocks of k_max slots over the draft's paged KV (all on the draft's device).

    anchors, starts  [B] long: the anchor token and its position p_b (context rows 0 .. p_b - 1 are cached)
    page_table       [B, P] the draft KV pages of each block's sequence, in position order
    slots            [B * k_max] the KV slot of each block row (row j of block b: position p_b + j; the sink
                     page for padding rows j >= k_b)
    lens             [B] p_b + k_b: the rows every query of block b sees
    cu               [B + 1] = 0, k_max, 2 k_max, ...: the block rows' offsets
    """

    anchors: Tensor
    starts: Tensor
    page_table: Tensor
    slots: Tensor
    lens: Tensor
    cu: Tensor
    k_max: int

    @classmethod
    def build(cls, anchors: Tensor, starts: Tensor, num_drafts: tuple[int, ...], page_table: Tensor,
              row_slots: Tensor, page_size: int) -> PagedBlocks:
        """From host draft counts and the device row slots [B, k_max] of positions p_b + j (padding rows are
        sent to the sink here)."""
        k_max = max(num_drafts)
        device = anchors.device
        counts = to_device(list(num_drafts), starts.dtype, device)  # queued: the host waits for no step in flight
        real = torch.arange(k_max, device=device)[None, :] < counts[:, None]
        sink = torch.arange(k_max, device=device) % page_size + SINK * page_size
        slots = torch.where(real, row_slots, sink[None, :]).flatten()
        lens = starts + counts
        cu = torch.arange(0, len(num_drafts) * k_max + 1, k_max, device=device)
        return cls(anchors, starts, page_table, slots, lens, cu, k_max)


def kernel_norm(norm: RMSNorm, x: Tensor) -> Tensor:
    """`norm(x)` in one launch (the torch RMSNorm is ~6 kernels): every norm of the paged path and of the context
    rows it reads."""
    from mstar.kernels.attn_res_norm import rms_norm_rows  # imports triton: the serving path must load without it

    return rms_norm_rows(x, norm.weight, norm.eps)


def kernel_rope(draft: K3DSparkModel, positions: Tensor) -> Rope:
    """RoPE at `positions` [T] for every layer of a step in one launch a tensor: the cos/sin tables are built
    once here (every draft layer shares the rope config), the torch rotation is ~8 launches and its tables ~12
    more, per tensor."""
    from mstar.kernels.rope import rotate_interleaved  # imports triton (see kernel_norm)

    rotary = draft.layers[0].self_attn.rotary
    cos, sin = rotary.cos_sin(positions, torch.float32)
    return lambda x: rotate_interleaved(x, cos, sin)


def kernel_chain(draft: K3DSparkModel) -> GreedyChain:
    """The greedy Markov chain in one launch a slot (kernels/markov_chain.py) over the draft's Markov head."""
    from mstar.kernels.markov_chain import greedy_markov_chain  # imports triton (see kernel_norm)

    head = draft.markov_head
    return lambda base_logits, anchors: greedy_markov_chain(base_logits, anchors, head.markov_w1.weight,
                                                            head.markov_w2.weight)


def paged_context_kv(draft: K3DSparkModel, taps: Tensor, positions: Tensor) -> list[Tensor]:
    """`K3DSparkModel.context_kv` with this path's norm and RoPE kernels: the rows `write_context` stores."""
    return draft.context_kv(taps, positions, kernel_norm, kernel_rope(draft, positions))


def kernel_fits(draft: K3DSparkModel, device: torch.device) -> bool:
    """Whether the paged kernel runs this draft here: a supported GPU, bf16/fp16, power-of-two row parts."""
    cfg = draft.config
    pow2 = all(w >= 16 and w & (w - 1) == 0 for w in (cfg.kv_lora_rank, cfg.qk_rope_head_dim))
    return pow2 and draft.dtype in (torch.bfloat16, torch.float16) and mla_attention.supported(device)


@torch.no_grad()
def paged_blocks_hidden(draft: K3DSparkModel, cache: Tensor, blocks: PagedBlocks, embed: Embed) -> Tensor:
    """Final-normed hidden states [B, k_max, D] of the blocks; `cache` is the draft KV [layers, pages, page, W].
    The same function as `K3DSparkModel.blocks_hidden` over the same rows (to bf16 rounding)."""
    n, k = blocks.anchors.shape[0], blocks.k_max
    x = draft.block_inputs(blocks.anchors, k, embed).flatten(0, 1)  # [B * k, D]
    positions = (blocks.starts[:, None] + torch.arange(k, device=x.device)).flatten()
    rope = kernel_rope(draft, positions)
    for index, layer in enumerate(draft.layers):
        h = kernel_norm(layer.input_layernorm, x)
        x = x + _paged_attention(layer.self_attn, h, positions, rope, cache[index], blocks)
        x = x + layer.mlp(kernel_norm(layer.post_attention_layernorm, x))
    return kernel_norm(draft.final_norm, x).view(n, k, -1)


def _paged_attention(attn: DSparkMLA, h: Tensor, positions: Tensor, rope: Rope, cache: Tensor,
                     blocks: PagedBlocks) -> Tensor:
    from mstar.kernels import kv_slots  # imports triton (see kernel_norm)

    rows = attn.latent_rows(h, positions, kernel_norm, rope)
    # one launch, as the target's MLA layers write theirs (torch's index_put was a gather-scatter kernel)
    kv_slots.write_latent_rows(cache, blocks.slots, *rows.split([attn.kv_lora_rank, attn.rope_dim], dim=-1))
    q_nope, q_pe = attn.queries(h, positions, kernel_norm, rope)
    w_uk, w_uv = attn.kv_b_weights()
    q_lat = torch.einsum("thn,hnr->thr", q_nope, w_uk)  # the kernel reads it and q_pe apart: no cat
    out = torch.empty(h.shape[0], attn.num_heads, attn.kv_lora_rank, device=h.device, dtype=h.dtype)
    # The context is cut over several programs per block as the target's verify blocks are (unsplit, the few
    # programs of a small batch each walk the whole context alone); the count follows from the shapes (the
    # page table's width), so a captured graph replays any context length.
    capacity = blocks.page_table.shape[1] * cache.shape[1]
    splits = mla_attention.num_splits_for(blocks.anchors.shape[0], attn.num_heads, capacity, query_rows=blocks.k_max)
    mla_attention.paged_mla_prefill(q_lat, q_pe, cache, blocks.page_table, blocks.cu, blocks.lens, attn.scale, out,
                                    max_query_len=blocks.k_max, num_splits=splits, causal=False)
    return attn.o_proj(torch.einsum("thr,hvr->thv", out, w_uv).flatten(-2))
