"""The AttnRes residual stream with each closed block's statistics computed once: `PrecomputedStream`.

Every sublayer input mixes all stored blocks and the live partial sum, and the mix's scores need, per source and
row, sum(V^2) and the dot with the sublayer's pseudo-query w = res_norm.weight * proj.weight (attn_res.py). A
closed block never changes, so when one closes, `kernels.attn_res_blocks.closed_block_stats` computes both for every
sublayer still to come in one pass over it, and each later mix reads only the partial sum for its statistics
(`attn_res_norm(..., closed=...)`); the mix itself still reads every source. What it saves is a read of every
closed block at every sublayer: at prefill rows most of the stats stage's bytes. At decode rows the mix and norm
take one launch that reads each source once anyway (kernels/attn_res_norm.py), so the GPU ops build this stream
only where the three launches run (`GpuLayerOps.residual_stream`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from mstar.kernels import attn_res_norm
from mstar.kernels.attn_res_blocks import closed_block_stats

from .attn_res import ResidualStream
from .sequence_parallel import RowShards

if TYPE_CHECKING:
    from mstar.distributed.communicator import Communicator

    from .model import KimiK3Model
    from .norm import RMSNorm


@dataclass(frozen=True)
class SublayerQueries:
    """The pseudo-queries of a model's mixes in the order its forward pass mixes (the q of `closed`)."""

    projections: tuple[nn.Linear, ...]  # each mix's AttnRes projection
    weights: torch.Tensor  # [Q, D] fp32: res_norm.weight * proj.weight of each, as the stats kernel computes w


def sublayer_queries(model: KimiK3Model) -> SublayerQueries:
    """Every mix of `model.forward`, in order: each layer's mixer input (once a block has closed: before that the
    input is the embedding itself) and FFN input, then the output head's."""
    cfg = model.config
    pairs: list[tuple[nn.Linear, RMSNorm]] = []
    closed = 0
    for layer in model.layers:
        if closed:
            pairs.append((layer.self_attention_res_proj, layer.self_attention_res_norm))
        if layer.layer_idx % cfg.attn_res_block_size == 0:  # ResidualStream.maybe_close_block's rule
            closed += 1
        pairs.append((layer.mlp_res_proj, layer.mlp_res_norm))
    pairs.append((model.output_attn_res_proj, model.output_attn_res_norm))
    weights = torch.stack([norm.weight.float() * proj.weight[0].float() for proj, norm in pairs]).contiguous()
    return SublayerQueries(tuple(proj for proj, _ in pairs), weights)


class PrecomputedStream(ResidualStream):
    """A `ResidualStream` whose mixes run the fused kernels over closed blocks' statistics (module doc)."""

    def __init__(self, embedding: torch.Tensor, block_size: int, num_layers: int, queries: SublayerQueries):
        super().__init__(embedding, block_size, num_layers, self._mix_norm)
        self.queries = queries
        # block j's row square sums and dots with every later pseudo-query (attn_res_blocks' table)
        self._stats = torch.empty(-(-num_layers // block_size), embedding.shape[0], 1 + queries.weights.shape[0],
                                  dtype=torch.float32, device=embedding.device)
        self._mixes = 0  # the mixes so far: the next one's query index

    def maybe_close_block(self, layer: int) -> None:
        before = self.num_blocks
        super().maybe_close_block(layer)
        if self.num_blocks > before:  # block `before` is stored for good
            closed_block_stats(self.stacked()[before], self.queries.weights, self._mixes, out=self._stats[before])

    def _mix_norm(self, sources: torch.Tensor, proj_weight: torch.Tensor, res_norm_weight: torch.Tensor,
                  res_eps: float, out_norm_weight: torch.Tensor, out_eps: float,
                  residual: torch.Tensor | None = None) -> torch.Tensor:
        """attn_res.MixNorm over the closed blocks' stats: the mix's query is the next in order."""
        query = self._mixes
        if query >= len(self.queries.projections) or self.queries.projections[query].weight is not proj_weight:
            raise RuntimeError(f"mix {query} of the forward pass is not the one the sublayer queries were stacked for "
                               "(sublayer_queries must follow KimiK3Model.forward's order)")
        self._mixes += 1
        return attn_res_norm.attn_res_norm(sources, proj_weight, res_norm_weight, res_eps, out_norm_weight, out_eps,
                                           residual=residual, closed=(self._stats, query))


class SequenceParallelPrecomputedStream(RowShards, PrecomputedStream):
    """A `PrecomputedStream` of this rank's rows of `embedding` [T, D] (sequence_parallel.py): its closed blocks'
    statistics are its rows'."""

    def __init__(self, embedding: torch.Tensor, block_size: int, num_layers: int, queries: SublayerQueries,
                 comm: Communicator):
        self.comm = comm
        super().__init__(comm.piece_rows(embedding), block_size, num_layers, queries)
