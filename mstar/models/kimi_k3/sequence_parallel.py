"""Sequence parallelism for the AttnRes stream of a large step: each tensor-parallel rank mixes its share of the rows.

On tensor-parallel ranks every row-wise operation between two sublayers (the AttnRes mix and its norms, the residual
adds) runs on all T rows on every rank: work repeated world_size times. At prefill sizes that is most of AttnRes's
time (tens of microseconds a mix at 1,024 rows, hundreds at 8,192). Here each rank keeps only its run of the rows
(`Communicator.piece_rows`) of every stored block and the partial sum, and the all-reduce that completed each
sublayer's output becomes its two halves around the row-wise work, as Megatron-LM's sequence parallelism and vLLM's
sequence-parallel pass do:

    partial [T, D] --reduce_scatter_rows--> rank's rows --(add, mix, norm on T / world_size rows)--> normed rows
        --all_gather_rows--> the next sublayer's input [T, D], whole on every rank

The pair moves the link traffic of the one all-reduce (half each) for one more collective's latency, so it pays
from a few hundred rows (`shards_rows`). It needs every sublayer's output as a partial sum: the mixers' and the
dense MLP's always are, a MoE layer's in the sharded-latent layout (`LatentMoE.output_is_partial`). DSpark's taps
and the output head's input are gathered whole.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from mstar.distributed.communicator import Communicator

from .attn_res import MixNorm, ResidualStream, attn_res_norm

if TYPE_CHECKING:
    from torch import nn

    from .layer_ops import LayerOps
    from .model import KimiK3Model
    from .norm import RMSNorm

# From here a step's rows are split over the ranks: at K3's width the mix of 1,024 rows took ~60 us a sublayer on
# one rank (benchmarks/emulate_rank, session 16), against ~6 us of the second collective's latency; decode and
# verify steps (a few to a hundred rows) keep the all-reduce.
SEQUENCE_PARALLEL_MIN_ROWS = 512


def shards_rows(model: KimiK3Model, comm: Communicator, rows: int) -> bool:
    """Whether a step of `rows` token rows runs its AttnRes stream sequence-parallel: several ranks, rows enough and
    dividing evenly, and every MoE layer's output a partial sum."""
    return (comm.world_size > 1 and rows >= SEQUENCE_PARALLEL_MIN_ROWS and rows % comm.world_size == 0
            and all(moe.output_is_partial for moe in model.moe_layers()))


class RowShards:
    """What sequence parallelism changes in a stream (mixed in before a `ResidualStream`): it holds this rank's rows
    (the class below builds it from them), completes outputs by a reduce-scatter and gathers the rows it hands out."""

    comm: Communicator

    def add_partial(self, partial: torch.Tensor, comm: Communicator) -> None:
        self.add(comm.reduce_scatter_rows(partial))

    def add_complete(self, output: torch.Tensor) -> None:
        self.add(self.comm.piece_rows(output))

    def normed_input(self, proj: nn.Linear, res_norm: RMSNorm, out_norm: RMSNorm) -> torch.Tensor:
        return self.comm.all_gather_rows(super().normed_input(proj, res_norm, out_norm))

    def normed_partial(self, norm: RMSNorm, ops: LayerOps) -> torch.Tensor:
        return self.comm.all_gather_rows(super().normed_partial(norm, ops))

    def raw_sum(self) -> torch.Tensor:
        return self.comm.all_gather_rows(super().raw_sum())


class SequenceParallelStream(RowShards, ResidualStream):
    """A `ResidualStream` of this rank's rows of `embedding` [T, D] (module doc)."""

    def __init__(self, embedding: torch.Tensor, block_size: int, num_layers: int, comm: Communicator,
                 mix_norm: MixNorm = attn_res_norm):
        self.comm = comm
        super().__init__(comm.piece_rows(embedding), block_size, num_layers, mix_norm)
