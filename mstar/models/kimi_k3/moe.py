"""K3's latent mixture of experts (and Kimi-Linear's plain one).

Router (`noaux_tc`, fp32): scores s = sigmoid(x W_r^T); experts are *selected* on s + bias
(`e_score_correction_bias`, optionally group-limited), but *weighted* by s alone, renormalised over
the top-k and scaled by `routed_scaling_factor`.

Latent path (K3): the routed experts work in a narrower latent space,
    z = down(x);  r = sum_k w_k * expert_k(z)  (fp32 combine);  r = RMSNorm(r);  r = up(r)
and the fused shared experts run on the full hidden state: y = r + shared(x).
Without a latent width (Kimi-Linear) z = x and there is no norm or up-projection.

On tensor-parallel ranks (an `ExpertSharding` and a `Communicator`) the router, the latent down/up
projections and the norm are replicated; a rank runs only the experts (and the slice of each) it
holds, and the shared experts' slice of the intermediate dim. Both give partial sums, reduced in ONE
all-reduce of [routed latent | shared] before `routed_expert_norm`, which needs the whole latent
vector; the norm and the up-projection then run on complete values (mstar/distributed/sharding.py).

With `latent_shards` > 1 (the sharded-latent layout, `ShardingPlan(latent_sharded=True)`) each rank holds
a slice of both latent projections instead: down_proj's output columns (z's slice, gathered whole
because every expert reads all of z) and up_proj's matching input columns (row parallel). Three
collectives then replace the one: all-gather z, all-reduce the routed latent (the norm needs it
whole), all-reduce [up_proj's partial + the shared experts' partial]. What it buys: a rank reads
1/tp of 2 x hidden x latent weights per MoE layer (sharding.py says how much). From
REDUCE_SCATTER_MIN_TOKENS tokens the routed latent is reduce-scattered instead: a rank's up_proj slice reads
only its own columns of the sum, and the norm takes the whole rows' sums of squares from a [T] all-reduce of each
rank's share, half the link traffic of the all-reduce it replaces for one more (small) collective.

Each expert projection is an nn.Linear, or an `MXFP4Linear` where the checkpoint holds it as MXFP4
(weights.py). A serving backend computes the routed sum with its kernels instead of the per-expert torch
loop (`LayerOps.routed`, models/kimi_k3/backend.py), over the same held experts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from mstar.distributed.communicator import Communicator, NullCommunicator
from mstar.distributed.expert_sharding import ExpertSharding

from .config import KimiK3Config
from .layer_ops import REFERENCE_OPS, LayerOps
from .mlp import Expert, GatedMLP
from .norm import RMSNorm, at_least_fp32

# From here the routed latent sum is reduce-scattered (module doc): at K3's latent of 3,584 bf16 columns a step of
# 512 tokens moves 3.7 MB, whose half-traffic saving (~12 us at an NVLink ring's 150 GB/s) outweighs the extra
# collective's latency (~6 us) and the square sums' launch; decode and verify steps keep the one all-reduce.
REDUCE_SCATTER_MIN_TOKENS = 512


@dataclass(frozen=True)
class Routing:
    experts: torch.Tensor  # [T, k] expert ids
    weights: torch.Tensor  # [T, k] combine weights (at least fp32)


def select_experts(
    scores: torch.Tensor, bias: torch.Tensor, top_k: int, num_groups: int, top_groups: int
) -> torch.Tensor:
    """Top-k expert ids per row by `scores + bias`, limited to the best groups when grouping is on."""
    choice = scores + bias
    if num_groups > 1 and top_groups < num_groups:
        t, e = choice.shape
        grouped = choice.view(t, num_groups, e // num_groups)
        # A group's merit is the sum of its two best biased scores (DeepSeek-V3 noaux_tc).
        group_merit = grouped.topk(min(2, e // num_groups), dim=-1).values.sum(-1)
        keep = torch.zeros_like(group_merit, dtype=torch.bool)
        keep.scatter_(1, group_merit.topk(top_groups, dim=-1).indices, True)
        choice = grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(t, e)
    return choice.topk(top_k, dim=-1, sorted=False).indices


class Router(nn.Module):
    """`block_sparse_moe.gate`: weight [E, D] and the fp32 selection bias [E]."""

    def __init__(self, config: KimiK3Config):
        super().__init__()
        self.config = config
        self.weight = nn.Parameter(torch.empty(config.num_experts, config.hidden_size))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(config.num_experts))
        nn.init.normal_(self.weight, std=config.hidden_size**-0.5)

    def forward(self, x: torch.Tensor) -> Routing:
        cfg = self.config
        logits = at_least_fp32(x) @ at_least_fp32(self.weight).T
        scores = torch.sigmoid(logits)
        ids = select_experts(scores, at_least_fp32(self.e_score_correction_bias), cfg.num_experts_per_token,
                             cfg.num_expert_group, cfg.topk_group)
        weights = scores.gather(1, ids)
        if cfg.moe_renormalize and cfg.num_experts_per_token > 1:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return Routing(ids, weights * cfg.routed_scaling_factor)


class HeldExperts(nn.ModuleDict):
    """The routed experts a tensor-parallel rank holds (a slice of each), by global expert id:
    `experts[e]` is expert e, iteration yields the held experts in id order (as the whole model's
    ModuleList does), and the state_dict names stay the checkpoint's `experts.{e}.*`."""

    def __getitem__(self, e: int | str) -> Expert:
        return super().__getitem__(str(e))

    def __contains__(self, e: object) -> bool:
        return super().__contains__(str(e))

    def __iter__(self):
        return iter(self.values())


class LatentMoE(nn.Module):
    """`block_sparse_moe` of one layer. With `experts` (an ExpertSharding), only the routed experts
    and the slice of each that this rank holds (`HeldExperts`)."""

    def __init__(self, config: KimiK3Config, comm: Communicator | None = None,
                 experts: ExpertSharding | None = None):
        super().__init__()
        self.config = config
        self.comm = comm or NullCommunicator()
        self.sharding = experts if experts is not None and not experts.is_whole else None
        d, latent = config.hidden_size, config.moe_input_size
        self.gate = Router(config)
        if config.routed_expert_hidden_size is not None:
            held = latent // config.latent_shards  # this rank's slice of the latent columns
            self.routed_expert_down_proj = nn.Linear(d, held, bias=False)
            self.routed_expert_up_proj = nn.Linear(held, d, bias=False)
            if config.latent_moe_use_norm:
                self.routed_expert_norm = RMSNorm(latent, config.rms_norm_eps)
        if self.sharding is None:
            self.experts = nn.ModuleList(
                Expert(config, latent, config.moe_intermediate_size) for _ in range(config.num_experts)
            )
        else:
            width = self.sharding.local_intermediate_size
            self.experts = HeldExperts({str(e): Expert(config, latent, width) for e in self.sharding.local_experts})
        if config.num_shared_experts:
            self.shared_experts = GatedMLP(config, d, config.moe_intermediate_size * config.num_shared_experts)

    def local_expert(self, e: int) -> Expert | None:
        """Expert `e` (global id) as this rank holds it; None when another rank holds it."""
        return self.experts[e] if self.sharding is None or self.sharding.owns(e) else None

    def routed(self, z: torch.Tensor, routing: Routing) -> torch.Tensor:
        """sum_k w_k * expert_k(z), accumulated in at least fp32, one pass per expert hit (over the
        experts held here: a partial sum on a tensor-parallel rank)."""
        out = torch.zeros(z.shape, dtype=routing.weights.dtype, device=z.device)
        for e in routing.experts.unique().tolist():
            expert = self.local_expert(e)
            if expert is None:
                continue
            rows, slot = (routing.experts == e).nonzero(as_tuple=True)
            y = at_least_fp32(expert(z[rows]))
            out.index_add_(0, rows, y * routing.weights[rows, slot].unsqueeze(-1))
        return out.to(z.dtype)

    def reduce_partials(self, r: torch.Tensor, shared: torch.Tensor | None
                        ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Complete the routed and shared partial sums over the ranks in one all-reduce (identity on one
        rank). Without a latent space both live in the hidden space and are added first."""
        if self.comm.world_size == 1:
            return r, shared
        if shared is None:
            return self.comm.all_reduce(r), None
        if self.config.routed_expert_hidden_size is None:
            return self.comm.all_reduce(r + shared), None
        both = self.comm.all_reduce(torch.cat([r, shared], dim=-1))
        r, shared = both.split([r.shape[-1], shared.shape[-1]], dim=-1)
        return r, shared

    def latent_norm(self, r: torch.Tensor, ops: LayerOps) -> torch.Tensor:
        return ops.norm(self.routed_expert_norm, r) if self.config.latent_moe_use_norm else r

    @property
    def shared_in_latent_output(self) -> bool:
        """Whether `forward` hands the shared experts' activations to `LayerOps.latent_output`, beside the routed sum
        (a latent space, on one rank or in the sharded-latent layout); else they are projected and reduced apart."""
        return self.config.routed_expert_hidden_size is not None and (
            self.comm.world_size == 1 or self.config.latent_shards > 1)

    @property
    def output_is_partial(self) -> bool:
        """Whether `forward(reduce=False)` can hand out its output as a partial sum over the ranks (the
        sharded-latent layout, whose last step is an all-reduce; one rank trivially); the replicated layouts reduce
        in the middle and return complete outputs only."""
        return self.comm.world_size == 1 or self.config.latent_shards > 1

    def forward(self, x: torch.Tensor, ops: LayerOps = REFERENCE_OPS, reduce: bool = True) -> torch.Tensor:
        """The layer's output, complete on every rank; with `reduce=False` each rank's partial sum of it, whose sum
        over the ranks is the output (where `output_is_partial`)."""
        if not reduce and not self.output_is_partial:
            raise ValueError("this MoE layout reduces its partial sums before the latent norm: it has no partial "
                             "output (reduce=False needs latent_shards > 1)")
        if self.config.latent_shards > 1:
            return self.forward_sharded_latent(x, ops, reduce)
        routing, z, hidden = ops.moe_inputs(self, x)
        r = ops.routed(self, z, routing)
        if self.shared_in_latent_output:  # one rank, nothing to reduce: the norm, up and shared experts' down together
            return ops.latent_output(self, r, hidden)
        shared = None if hidden is None else ops.linear(self.shared_experts.down_proj, hidden)
        r, shared = self.reduce_partials(r, shared)
        if self.config.routed_expert_hidden_size is not None:
            r = ops.latent_output(self, r, None)
        return r if shared is None else r + shared

    def forward_sharded_latent(self, x: torch.Tensor, ops: LayerOps = REFERENCE_OPS, reduce: bool = True
                               ) -> torch.Tensor:
        """The same function with the latent projections split over the ranks (module doc)."""
        comm, cfg = self.comm, self.config
        if comm.world_size != cfg.latent_shards:
            raise ValueError(f"latent_shards={cfg.latent_shards} needs a communicator over as many ranks, "
                             f"got world_size={comm.world_size}")
        routing, z_held, hidden = ops.moe_inputs(self, x)
        z = comm.all_gather(z_held)  # [T, latent], every rank's slice in order
        partial = ops.routed(self, z, routing)
        held = self.routed_expert_up_proj.in_features
        columns = slice(comm.rank * held, (comm.rank + 1) * held)
        # each rank's partial sum rounded to the model dtype first
        if z.shape[0] < REDUCE_SCATTER_MIN_TOKENS:  # whole: the norm reads every latent column
            y = ops.latent_output(self, comm.all_reduce_rounded(partial, z.dtype), hidden, columns)
        elif cfg.latent_moe_use_norm:  # this rank's columns, and the rows' sums of squares over all of them
            r_held = comm.reduce_scatter_rounded(partial, z.dtype)
            square_sums = comm.all_reduce(at_least_fp32(r_held).pow(2).sum(-1))
            y = ops.latent_output(self, r_held, hidden, columns, square_sums)
        else:
            y = ops.latent_output(self, comm.reduce_scatter_rounded(partial, z.dtype), hidden)
        return comm.all_reduce(y) if reduce else y
