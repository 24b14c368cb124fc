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

import torch

from .norm import at_least_fp32


def attn_res_mix(sources: list[torch.Tensor], proj_weight: torch.Tensor, norm_weight: torch.Tensor,
                 eps: float) -> torch.Tensor:
    """Mix `sources` (each [T, D]) with one AttnRes (proj [1, D], norm [D]) -> [T, D]."""
    v = at_least_fp32(torch.stack(sources))  # [N, T, D]
    w = at_least_fp32(norm_weight) * at_least_fp32(proj_weight[0])
    scores = (v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps) * w).sum(-1)  # [N, T]
    alpha = torch.softmax(scores, dim=0)
    return (alpha.unsqueeze(-1) * v).sum(0).to(sources[-1].dtype)


class ResidualStream:
    """The AttnRes residual state of one forward pass: stored blocks plus the live partial sum."""

    def __init__(self, embedding: torch.Tensor, block_size: int):
        self.block_size = block_size
        self.blocks: list[torch.Tensor] = []
        self.partial = embedding

    def sources(self) -> list[torch.Tensor]:
        return [*self.blocks, self.partial]

    def maybe_close_block(self, layer: int) -> None:
        """At the first layer of each block the partial sum is stored and a new one starts at 0."""
        if layer % self.block_size == 0:
            self.blocks.append(self.partial)
            self.partial = torch.zeros_like(self.partial)

    def add(self, output: torch.Tensor) -> None:
        self.partial = self.partial + output

    def raw_sum(self) -> torch.Tensor:
        """The raw prefix-sum stream (embedding + every output so far): what DSpark taps."""
        total = self.partial
        for block in self.blocks:
            total = total + block
        return total
