"""Block attention residuals (AttnRes): a softmax over depth instead of a plain residual add.

K3 keeps the residual stream as a list of stored blocks (block 0 is the token embedding, block j
the sum of every mixer and FFN output of layers B(j-1) .. Bj-1) plus the live partial sum P of
the current block. Before each mixer, each FFN and at the output, the input is a learned convex
mix of these sources:

    s_i = <RMSNorm(V_i), w>            w = norm.weight * proj.weight[0]   (a pseudo-query)
    alpha = softmax_i(s_i)             over the n+1 sources [blocks..., P]
    out = sum_i alpha_i V_i            the mix is over the raw, unnormalised sources

All of it in at least fp32, cast back to the stream dtype at the end.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from .norm import RMSNorm, at_least_fp32, rms_norm

if TYPE_CHECKING:
    from mstar.distributed.communicator import Communicator

    from .layer_ops import LayerOps

# (sources [n, T, D], proj weight [1, D], res norm weight, res eps, out norm weight, out eps, residual [T, D] or
# None) -> [T, D]: the input of the next sublayer, out_norm(AttnRes(sources)), after adding `residual` (the last
# sublayer's output) into the live partial sum sources[-1] in place. A serving backend passes a fused kernel
# (layer_ops.py).
MixNorm = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float, torch.Tensor, float, torch.Tensor | None],
                   torch.Tensor]


def attn_res_mix(sources: list[torch.Tensor], proj_weight: torch.Tensor, norm_weight: torch.Tensor,
                 eps: float) -> torch.Tensor:
    """Mix `sources` (each [T, D]) with one AttnRes (proj [1, D], norm [D]) -> [T, D]."""
    v = at_least_fp32(torch.stack(sources))  # [N, T, D]
    w = at_least_fp32(norm_weight) * at_least_fp32(proj_weight[0])
    scores = (v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps) * w).sum(-1)  # [N, T]
    alpha = torch.softmax(scores, dim=0)
    return (alpha.unsqueeze(-1) * v).sum(0).to(sources[-1].dtype)


def attn_res_norm(sources: torch.Tensor, proj_weight: torch.Tensor, res_norm_weight: torch.Tensor, res_eps: float,
                  out_norm_weight: torch.Tensor, out_eps: float, residual: torch.Tensor | None = None) -> torch.Tensor:
    """The reference `MixNorm`: `residual` added into the partial sum sources[-1] (in place), the AttnRes mix of
    the stacked sources [n, T, D], then the sublayer's RMSNorm."""
    if residual is not None:
        sources[-1].add_(residual)
    mixed = attn_res_mix(list(sources.unbind(0)), proj_weight, res_norm_weight, res_eps)
    return rms_norm(mixed, out_norm_weight, out_eps)


class ResidualStream:
    """The AttnRes residual state of one forward pass: stored blocks plus the live partial sum.

    All sources live in one buffer [max blocks + 1, T, D] (block j at index j, the partial sum after
    the last block), so the mix reads them without stacking copies, and sublayer outputs are added
    to the partial sum in place. An output's add waits for what reads the partial sum next: the next
    mix takes it as its `residual` (a fused kernel adds it in the pass that reads the sources anyway);
    anything else that reads the partial sum applies it first."""

    def __init__(self, embedding: torch.Tensor, block_size: int, num_layers: int, mix_norm: MixNorm = attn_res_norm):
        self.block_size = block_size
        self.mix_norm = mix_norm
        max_blocks = -(-num_layers // block_size)  # a block closes at layers 0, B, 2B, ...
        self._buffer = embedding.new_empty(max_blocks + 1, *embedding.shape)
        self._buffer[0] = embedding
        self.num_blocks = 0
        self._pending: torch.Tensor | None = None  # a sublayer output not yet added to the partial sum

    @property
    def partial(self) -> torch.Tensor:
        """The live partial sum, every output added."""
        self._apply_pending()
        return self._buffer[self.num_blocks]

    @property
    def blocks(self) -> list[torch.Tensor]:
        return list(self._buffer[: self.num_blocks].unbind(0))

    def stacked(self) -> torch.Tensor:
        """[blocks..., partial] as one [n, T, D] view."""
        return self._buffer[: self.num_blocks + 1]

    def normed_input(self, proj: torch.nn.Linear, res_norm: RMSNorm, out_norm: RMSNorm) -> torch.Tensor:
        """out_norm(AttnRes(sources)): what the next sublayer (or the output head) reads."""
        pending, self._pending = self._pending, None
        return self.mix_norm(self.stacked(), proj.weight, res_norm.weight, res_norm.eps, out_norm.weight, out_norm.eps,
                             pending)

    def maybe_close_block(self, layer: int) -> None:
        """At the first layer of each block the partial sum is stored and a new one starts at 0."""
        self._apply_pending()
        if layer % self.block_size == 0:
            self.num_blocks += 1
            self._buffer[self.num_blocks].zero_()

    def add(self, output: torch.Tensor) -> None:
        """Add a sublayer's output to the partial sum (when the partial sum is next read: class doc)."""
        self._apply_pending()
        self._pending = output

    def add_partial(self, partial: torch.Tensor, comm: Communicator) -> None:
        """Add a sublayer's output given as each rank's partial sum of it: completed by an all-reduce here."""
        self.add(comm.all_reduce(partial))

    def add_complete(self, output: torch.Tensor) -> None:
        """Add a sublayer's output that every rank already holds whole."""
        self.add(output)

    def normed_partial(self, norm: RMSNorm, ops: LayerOps) -> torch.Tensor:
        """norm(the live partial sum): the first layer's input, before any block has closed."""
        return ops.norm(norm, self.partial)

    def _apply_pending(self) -> None:
        if self._pending is not None:
            self._buffer[self.num_blocks].add_(self._pending)
            self._pending = None

    def raw_sum(self) -> torch.Tensor:
        """The raw prefix-sum stream (embedding + every output so far): what DSpark taps."""
        total = self.partial.clone()  # a copy: the partial sum is updated in place later
        for block in self.blocks:
            total += block
        return total
