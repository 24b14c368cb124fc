"""The token-wise operations of the decoder stack, as its forward passes call them: `LayerOps`.

The reference model (model.py, moe.py, mla.py) computes each norm, AttnRes mix, routing, routed-expert
sum, dense MLP and the dense projections between them through a `LayerOps` it is given. These are the
reference's own: each calls the module it is handed. A serving backend (backend.py) passes a subclass
whose methods run kernels over the same modules' weights instead; the modules are only read, so the
reference is never changed by a backend, and any number of serving models can share one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .attn_res import ResidualStream, attn_res_norm
from .norm import at_least_fp32, rms_norm
from .sequence_parallel import SequenceParallelStream, shards_rows

if TYPE_CHECKING:
    from torch import nn

    from .mlp import GatedMLP
    from .model import KimiK3Model
    from .moe import LatentMoE, Router, Routing
    from .norm import RMSNorm


class LayerOps:
    def linear(self, proj: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        """proj(x): one dense projection."""
        return proj(x)

    def norm(self, norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
        return norm(x)

    def mix_norm(self, sources: torch.Tensor, proj_weight: torch.Tensor, res_norm_weight: torch.Tensor,
                 res_eps: float, out_norm_weight: torch.Tensor, out_eps: float,
                 residual: torch.Tensor | None = None) -> torch.Tensor:
        """out_norm(AttnRes(sources)) after sources[-1] += residual (attn_res.MixNorm)."""
        return attn_res_norm(sources, proj_weight, res_norm_weight, res_eps, out_norm_weight, out_eps, residual)

    def residual_stream(self, model: KimiK3Model, embedding: torch.Tensor) -> ResidualStream:
        """The AttnRes residual stream of one forward pass of `model` (its mixes through `mix_norm`): a large step's
        rows split over the tensor-parallel ranks where `shards_rows` says so (sequence_parallel.py)."""
        cfg, comm = model.config, model.comm
        if shards_rows(model, comm, embedding.shape[0]):
            return SequenceParallelStream(embedding, cfg.attn_res_block_size, cfg.num_hidden_layers, comm,
                                          self.mix_norm)
        return ResidualStream(embedding, cfg.attn_res_block_size, cfg.num_hidden_layers, self.mix_norm)

    def sigmoid_gate(self, o: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """An MLA layer's output gate: o [T, H, v] * sigmoid(gate [T, H v]) in at least fp32, rounded to gate's
        dtype, [T, H v]."""
        o = o.reshape(gate.shape)
        return (at_least_fp32(o) * torch.sigmoid(at_least_fp32(gate))).to(gate.dtype)

    def route(self, router: Router, x: torch.Tensor) -> Routing:
        return router(x)

    def moe_inputs(self, moe: LatentMoE, x: torch.Tensor) -> tuple[Routing, torch.Tensor, torch.Tensor | None]:
        """What a MoE layer computes from its input x alone: the routing, the routed experts' input (the latent
        down projection, or x itself without a latent space) and the shared experts' activations, the input of
        their down projection (None without shared experts)."""
        z = self.linear(moe.routed_expert_down_proj, x) if moe.config.routed_expert_hidden_size is not None else x
        shared = self.mlp_hidden(moe.shared_experts, x) if moe.config.num_shared_experts else None
        return self.route(moe.gate, x), z, shared

    def latent_output(self, moe: LatentMoE, r: torch.Tensor, shared: torch.Tensor | None,
                      columns: slice | None = None, square_sums: torch.Tensor | None = None) -> torch.Tensor:
        """The latent up projection of the normalised routed sum r [T, latent] plus the shared experts' down
        projection of their activations `shared` (when there are shared experts): both land in the hidden space.
        `columns`: the latent columns this rank's up projection takes (the sharded-latent layout; the norm needs
        whole rows). With `square_sums` [T] fp32, r holds only those columns and these are the whole rows' sums of
        squares (the reduce-scatter of moe.py)."""
        if square_sums is not None:
            norm = moe.routed_expert_norm
            normed = rms_norm(r, norm.weight[columns], norm.eps, square_sums.unsqueeze(-1) / norm.weight.shape[0])
        else:
            normed = moe.latent_norm(r, self)
            normed = normed if columns is None else normed[:, columns]
        y = self.linear(moe.routed_expert_up_proj, normed)
        return y if shared is None else y + self.linear(moe.shared_experts.down_proj, shared)

    def routed(self, moe: LatentMoE, z: torch.Tensor, routing: Routing) -> torch.Tensor:
        """The routed experts' weighted sum [T, latent] (a partial sum on a tensor-parallel rank)."""
        return moe.routed(z, routing)

    def mlp(self, mlp: GatedMLP, x: torch.Tensor) -> torch.Tensor:
        return mlp(x)

    def mlp_hidden(self, mlp: GatedMLP, x: torch.Tensor) -> torch.Tensor:
        """act(gate(x), up(x)) of a gated MLP: the input of its down projection."""
        return mlp.hidden(x)


REFERENCE_OPS = LayerOps()
