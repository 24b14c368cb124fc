"""How Kimi K3 is split over tensor-parallel ranks: every rule in one place.

A rank's model is the ordinary `KimiK3ForCausalLM` built from `ShardingPlan.rank_config` (heads /
tp, intermediate sizes / tp), an `ExpertSharding` and a `Communicator`. Its state_dict names are
the checkpoint's, and `split_of(name)` says which slice of that checkpoint tensor the rank holds.

What is split how (tp ranks, "rows" = dim 0 = output features, "cols" = dim 1 = input features):

    KDA     q/k/v_proj, g_proj (or g_b_proj), f_b_proj, b_proj   rows, by head (column parallel)
            q/k/v_conv1d, dt_bias, A_log                          by head (the channels of the heads held)
            o_proj                                                 cols, by head (row parallel)
            f_a_proj, g_a_proj (low rank 128), o_norm              replicated
    MLA     q_b_proj (or q_proj), kv_b_proj, g_proj                rows, by head
            o_proj                                                 cols, by head
            q_a_proj, kv_a_proj_with_mqa, q_a/kv_a_layernorm       replicated (the latent is shared by heads)
    dense MLP and shared experts: gate/up_proj rows, down_proj cols (intermediate dim)
    routed experts: `ExpertSharding` (EP groups own whole experts; a group's ranks split w1/w3 rows
            and w2 cols); the router and routed_expert_norm replicated; routed_expert_down/up_proj
            replicated, or with `latent_sharded` down_proj rows and up_proj cols (the latent dim)
    embed_tokens, lm_head: rows, by vocabulary (vocab_parallel.py)
    norms, AttnRes projections and norms, the final norm: replicated

The residual stream (AttnRes blocks and the partial sum) is replicated: every rank holds all of it.

Where ranks communicate, per forward (93 layers of K3: 187 all-reduces and one all-gather):

    1. the embedding: one all-reduce (each token's row lives on one rank; the others add zeros).
    2. each token mixer (KDA or MLA): one all-reduce of o_proj's partial sums, where the output joins
       the stream (`DecoderLayer`).
    3. each FFN: one all-reduce. The dense MLP reduces down_proj's partial sums. The latent MoE
       reduces ONE buffer [routed latent partial | shared-expert partial] (`LatentMoE`): the routed
       partial sum (over experts and intermediate slices) must be complete before
       `routed_expert_norm`, an RMSNorm of the whole latent vector; the shared experts' partial is
       ready at the same moment and rides along; after it, the norm and routed_expert_up_proj run
       replicated on every rank, so nothing is left to reduce.
    4. the lm_head: one all-gather of the vocabulary slices of the sampled rows' logits.

Why no fewer is exact: the next consumer of the stream after each mixer and each FFN is AttnRes,
which takes RMS norms and a softmax over whole vectors, so every sublayer's output must be complete
on every rank before the next one starts: at least one reduction per sublayer. The MoE reaches that
bound only because its two partial sums share one buffer and its up-projection is replicated (a
row-parallel up-projection would need a second all-reduce after the norm). The price: each rank
holds and reads the whole routed_expert_down_proj and up_proj, 2 x 7168 x 3584 x 2 B = 98 MiB per
MoE layer (9.0 GiB over K3's 92), 36% of a TP8 rank's bytes per decode step at batch 1.

`latent_sharded` is the other layout: each rank holds 1/tp of both projections (12.25 MiB per MoE
layer at TP8) and the MoE pays two more collectives, an all-gather of the latent z [T, 3584] before
the experts and a second all-reduce after the norm (LatentMoE.forward_sharded_latent): 2 x 92 more
per forward. Which one is faster depends on the collective's latency against the ~11 us of weight
reads it saves per projection at batch 1: mstar-emulate-rank --latent-sharded measures it.

The MLA latent cache is replicated: the 576-wide [c_kv | k_pe] row of a token is shared by all
heads, so every rank needs all of it and computes it itself (kv_a_proj is replicated). Per rank for
pruned75 at TP8: 24 MLA layers x 576 x 2 B = 27,648 B per token; the 1,792 pages x 64 tokens of
configs/kimi_k3_pruned75_tp8.yaml hold 114,688 tokens = 2.95 GiB per rank (the same on every rank).
Splitting it by tokens would cut that to 0.37 GiB but costs a log-sum-exp merge across ranks in
every MLA layer; the KDA state (3.4 GiB per rank for 65 slots, sharded by head) is the larger pool
anyway. The KDA recurrent state [H/tp, K, V] and conv windows [3, W-1, H/tp * K] are sharded by head:
each rank's pool holds only its heads, because the rank config has H/tp heads.

The embedding is vocabulary-parallel rather than replicated (a replicated K3 embedding is 2.2 GiB
per rank; the split costs the one all-reduce of step 1). The config's vocab_size stays the full
vocabulary: token ids, validation and sampling are about the whole vocabulary; only the two
vocabulary-parallel modules know their slice.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from mstar.models.kimi_k3.config import KimiK3Config

from .expert_sharding import ExpertSharding

TP, EXPERT = "tp", "expert"  # which index picks a split tensor's slice: the TP rank, or the rank in its EP group

# (pattern on the module / checkpoint name without the weight prefix, dim, axis)
_RULES: tuple[tuple[re.Pattern[str], int, str], ...] = tuple((re.compile(p), dim, axis) for p, dim, axis in (
    # token mixers: heads split (KDA and MLA share the names q_proj, g_proj, o_proj)
    (r"\.self_attn\.(q|k|v|g|g_b|f_b|b)_proj\.weight$", 0, TP),
    (r"\.self_attn\.(q|k|v)_conv1d\.weight$", 0, TP),
    (r"\.self_attn\.(dt_bias|A_log)$", 0, TP),
    (r"\.self_attn\.(q_b_proj|kv_b_proj)\.weight$", 0, TP),
    (r"\.self_attn\.o_proj\.weight$", 1, TP),
    # the dense MLP and the fused shared experts: intermediate dim split
    (r"\.(mlp|shared_experts)\.(gate|up)_proj\.weight$", 0, TP),
    (r"\.(mlp|shared_experts)\.down_proj\.weight$", 1, TP),
    # routed experts: a group's ranks split each expert's intermediate dim, dense or MXFP4 alike
    # (w2's packed bytes and scales split along their columns too: whole scale groups, check_mxfp4)
    (r"\.experts\.\d+\.w[13]\.weight(_packed|_scale)?$", 0, EXPERT),
    (r"\.experts\.\d+\.w2\.weight(_packed|_scale)?$", 1, EXPERT),
    # vocabulary
    (r"^model\.embed_tokens\.weight$", 0, TP),
    (r"^lm_head\.weight$", 0, TP),
))
# the latent projections, in the latent_sharded layout only: z's columns, and up_proj's matching inputs
_LATENT_RULES: tuple[tuple[re.Pattern[str], int, str], ...] = tuple((re.compile(p), dim, TP) for p, dim in (
    (r"\.block_sparse_moe\.routed_expert_down_proj\.weight$", 0),
    (r"\.block_sparse_moe\.routed_expert_up_proj\.weight$", 1),
))


def even_range(total: int, parts: int, index: int) -> tuple[int, int]:
    """[start, stop) of part `index` of `total` split into `parts` equal pieces."""
    if total % parts:
        raise ValueError(f"{total} does not split into {parts} equal parts")
    size = total // parts
    return index * size, (index + 1) * size


@dataclass(frozen=True)
class Split:
    """Part `index` of `parts` equal pieces along `dim`."""

    dim: int
    parts: int
    index: int

    def range(self, full_size: int) -> tuple[int, int]:
        return even_range(full_size, self.parts, self.index)

    def region(self, full_shape: tuple[int, ...]) -> tuple[slice, ...]:
        """Index of this piece into a tensor of `full_shape`."""
        start, stop = self.range(full_shape[self.dim])
        index = [slice(None)] * len(full_shape)
        index[self.dim] = slice(start, stop)
        return tuple(index)


@dataclass(frozen=True)
class ShardingPlan:
    """One rank's place: `tp_size` ranks hold the model, in `ep_size` expert-parallel groups; with
    `latent_sharded`, the latent MoE's down/up projections split over the ranks too (module doc)."""

    tp_size: int
    rank: int = 0
    ep_size: int = 1
    latent_sharded: bool = False

    def __post_init__(self) -> None:
        if self.tp_size < 1 or not 0 <= self.rank < self.tp_size:
            raise ValueError(f"rank {self.rank} must be in 0..tp_size-1 (tp_size={self.tp_size})")
        if self.ep_size < 1 or self.tp_size % self.ep_size:
            raise ValueError(f"ep_size={self.ep_size} must divide tp_size={self.tp_size}")

    def for_rank(self, rank: int) -> ShardingPlan:
        return replace(self, rank=rank)

    # --- the per-rank model -----------------------------------------------------------------------
    def check(self, config: KimiK3Config) -> None:
        """Raise, naming the config key, unless every split of `config` is even at this size."""
        tp = self.tp_size
        sizes = {
            "num_attention_heads": config.num_attention_heads,
            "linear_attn_config.num_heads": config.linear_attn.num_heads,
            "intermediate_size": config.intermediate_size,
            "moe_intermediate_size": config.moe_intermediate_size,
            "vocab_size": config.vocab_size,
        }
        if self.latent_sharded:
            if config.routed_expert_hidden_size is None:
                raise ValueError("latent_sharded needs a latent MoE (routed_expert_hidden_size); this model has none")
            sizes["routed_expert_hidden_size"] = config.routed_expert_hidden_size
        for key, size in sizes.items():
            if size % tp:
                raise ValueError(f"tp_size={tp} does not divide {key}={size}: choose a tp_size that divides it")
        self.expert_sharding(config)  # validates the expert split

    def rank_config(self, config: KimiK3Config) -> KimiK3Config:
        """`config` with this rank's head counts and intermediate sizes (vocab_size stays whole)."""
        self.check(config)
        tp = self.tp_size
        la = config.linear_attn
        return config.with_overrides(
            num_attention_heads=config.num_attention_heads // tp,
            linear_attn=replace(la, num_heads=la.num_heads // tp),
            intermediate_size=config.intermediate_size // tp,
            # sizes the shared experts (moe_intermediate_size x num_shared_experts, split over all ranks);
            # the routed experts' width comes from the ExpertSharding
            moe_intermediate_size=config.moe_intermediate_size // tp,
            latent_shards=tp if self.latent_sharded else 1,
        )

    def expert_sharding(self, config: KimiK3Config) -> ExpertSharding:
        return ExpertSharding(config.num_experts, config.moe_intermediate_size, self.tp_size, self.ep_size, self.rank)

    # --- the checkpoint --------------------------------------------------------------------------
    def split_of(self, name: str, config: KimiK3Config) -> Split | None:
        """The slice of checkpoint tensor `name` (without the weight prefix) this rank holds; None:
        the whole tensor (replicated). Routed experts the rank does not hold are not asked about."""
        if self.tp_size == 1:
            return None
        for pattern, dim, axis in _RULES + (_LATENT_RULES if self.latent_sharded else ()):
            if pattern.search(name):
                if axis == TP:
                    return Split(dim, self.tp_size, self.rank)
                experts = self.expert_sharding(config)
                return Split(dim, experts.group_size, experts.rank_in_group) if experts.group_size > 1 else None
        return None
