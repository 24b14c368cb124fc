"""The Kimi K3 decoder as a dense, readable PyTorch reference (one sequence at a time).

    P := embed(tokens)
    for each layer l:
        a_in = AttnRes(blocks, P)            (P alone before the first block closes)
        close a block at l % B == 0           (blocks += [P]; P := 0)
        P += Mixer_l(RMSNorm(a_in))           KDA or gated NoPE MLA
        P += FFN_l(RMSNorm(AttnRes(blocks, P)))   dense MLP (layer 0) or latent MoE
    logits = lm_head(RMSNorm(AttnRes(blocks, P)))

Kimi-Linear (`variant == "kimi_linear"`) is the same stack with plain residual adds.
State between calls (KDA recurrent state and conv window, MLA cached latent rows) is explicit, so
running a prefix and then its continuation gives the same logits as one pass. On request the
forward also returns the DSpark taps: the raw prefix-sum stream after each named layer.

Tensor parallelism enters through a `Communicator` (mstar/distributed): one rank's model is this
class built from that rank's config (heads / tp, ...) with its `ExpertSharding`; the sublayers'
row-parallel outputs are all-reduced where they join the replicated stream (`DecoderLayer`; the
latent MoE reduces its own, before its norm), and the embedding and lm_head are vocabulary-parallel.
On one rank the communicator is the null one, every collective is the identity, and the stack is
exactly the single-rank reference. mstar/distributed/sharding.py says what is split how.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from mstar.distributed.communicator import Communicator, NullCommunicator
from mstar.distributed.expert_sharding import ExpertSharding
from mstar.distributed.vocab_parallel import VocabParallelEmbedding, VocabParallelLMHead

from .attn_res import ResidualStream
from .config import KimiK3Config
from .kda import KDAState, KimiDeltaAttention
from .layer_ops import REFERENCE_OPS, LayerOps
from .mla import GatedMLA, MLACache
from .mlp import GatedMLP
from .moe import LatentMoE
from .norm import RMSNorm

LayerState = KDAState | MLACache | None
Mixer = Callable[[int, torch.Tensor], torch.Tensor]  # (layer index, normed input [T, D]) -> mixer output


@dataclass
class ModelState:
    """Per-layer sequence state of one request, plus how many tokens it has seen."""

    layers: list[LayerState]
    num_tokens: int = 0


@dataclass
class ModelOutput:
    logits: torch.Tensor  # [T, vocab]
    state: ModelState
    taps: torch.Tensor | None = None  # [T, len(tap_layers) * hidden]
    hidden: torch.Tensor | None = field(default=None, repr=False)  # final-normed [T, hidden]


class DecoderLayer(nn.Module):
    def __init__(self, config: KimiK3Config, layer_idx: int, comm: Communicator | None = None,
                 experts: ExpertSharding | None = None):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.comm = comm or NullCommunicator()
        d, eps = config.hidden_size, config.rms_norm_eps
        self.is_kda = config.is_kda_layer(layer_idx)
        self.self_attn = KimiDeltaAttention(config, layer_idx) if self.is_kda else GatedMLA(config, layer_idx)
        self.input_layernorm = RMSNorm(d, eps)
        self.post_attention_layernorm = RMSNorm(d, eps)
        if config.is_moe_layer(layer_idx):
            self.block_sparse_moe = LatentMoE(config, self.comm, experts)
        else:
            self.mlp = GatedMLP(config, d, config.intermediate_size)
        if config.attn_res_block_size is not None:
            # Checkpoint names: self_attention_res_{proj,norm}, mlp_res_{proj,norm}.
            self.self_attention_res_proj = nn.Linear(d, 1, bias=False)
            self.self_attention_res_norm = RMSNorm(d, eps)
            self.mlp_res_proj = nn.Linear(d, 1, bias=False)
            self.mlp_res_norm = RMSNorm(d, eps)

    def ffn(self, x: torch.Tensor, ops: LayerOps = REFERENCE_OPS) -> torch.Tensor:
        """The FFN output, complete on every rank (the MoE reduces its partial sums itself)."""
        if hasattr(self, "block_sparse_moe"):
            return self.block_sparse_moe(x, ops)
        return self.comm.all_reduce(ops.mlp(self.mlp, x))

    def mixer(self, mix: Mixer, x: torch.Tensor) -> torch.Tensor:
        """The token mixer's output (row-parallel o_proj partial sums, reduced over ranks)."""
        return self.comm.all_reduce(mix(self.layer_idx, x))

    def forward_attn_res(self, stream: ResidualStream, mix: Mixer, ops: LayerOps = REFERENCE_OPS) -> None:
        """The layer on an AttnRes stream, which completes each sublayer's partial sums over the ranks as it adds
        them (attn_res.ResidualStream.add_partial)."""
        if stream.num_blocks:
            x = stream.normed_input(self.self_attention_res_proj, self.self_attention_res_norm, self.input_layernorm)
        else:  # before the first block closes, the input is the embedding itself
            x = stream.normed_partial(self.input_layernorm, ops)
        stream.maybe_close_block(self.layer_idx)
        stream.add_partial(mix(self.layer_idx, x), self.comm)
        normed = stream.normed_input(self.mlp_res_proj, self.mlp_res_norm, self.post_attention_layernorm)
        moe = getattr(self, "block_sparse_moe", None)
        if moe is None:
            stream.add_partial(ops.mlp(self.mlp, normed), self.comm)
        elif moe.output_is_partial:
            stream.add_partial(moe(normed, ops, reduce=False), self.comm)
        else:  # a layout that reduces inside
            stream.add_complete(moe(normed, ops))

    def forward_plain(self, h: torch.Tensor, mix: Mixer, ops: LayerOps = REFERENCE_OPS) -> torch.Tensor:
        h = h + self.mixer(mix, ops.norm(self.input_layernorm, h))
        return h + self.ffn(ops.norm(self.post_attention_layernorm, h), ops)


class KimiK3Model(nn.Module):
    """`model.*`: embeddings, decoder layers, output AttnRes and final norm."""

    def __init__(self, config: KimiK3Config, comm: Communicator | None = None,
                 experts: ExpertSharding | None = None):
        super().__init__()
        self.config = config
        comm = comm or NullCommunicator()
        self.comm = comm
        if comm.world_size == 1:
            self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        else:
            self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, comm)
        self.layers = nn.ModuleList(DecoderLayer(config, i, comm, experts) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if config.attn_res_block_size is not None:
            self.output_attn_res_proj = nn.Linear(config.hidden_size, 1, bias=False)
            self.output_attn_res_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def moe_layers(self) -> list[LatentMoE]:
        return [layer.block_sparse_moe for layer in self.layers if hasattr(layer, "block_sparse_moe")]

    def forward(self, input_ids: torch.Tensor, mix: Mixer, tap_layers: Sequence[int] = (),
                ops: LayerOps = REFERENCE_OPS) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Final-normed hidden states [T, D] and the requested taps; `mix` runs each token mixer, `ops` the
        token-wise operations (the reference's own unless a serving backend passes its kernels)."""
        cfg = self.config
        h = self.embed_tokens(input_ids)
        taps: list[torch.Tensor] = []
        if cfg.attn_res_block_size is None:
            for i, layer in enumerate(self.layers):
                h = layer.forward_plain(h, mix, ops)
                if i in tap_layers:
                    taps.append(h)
            return ops.norm(self.norm, h), taps
        stream = ops.residual_stream(self, h)
        for i, layer in enumerate(self.layers):
            layer.forward_attn_res(stream, mix, ops)
            if i in tap_layers:
                taps.append(stream.raw_sum())
        return stream.normed_input(self.output_attn_res_proj, self.output_attn_res_norm, self.norm), taps


def dense_mixer(model: KimiK3Model, state: ModelState, absorbed: bool) -> Mixer:
    """Token mixers over one sequence's explicit state (the reference path); updates `state`."""

    def mix(layer_idx: int, x: torch.Tensor) -> torch.Tensor:
        attn = model.layers[layer_idx].self_attn
        previous = state.layers[layer_idx]
        if isinstance(attn, KimiDeltaAttention):
            y, state.layers[layer_idx] = attn(x, previous)
        else:
            y, state.layers[layer_idx] = attn(x, previous, absorbed=absorbed)
        return y

    return mix


class KimiK3ForCausalLM(nn.Module):
    """The text decoder with its untied `lm_head`: the oracle every served path is tested against.

    `comm` and `experts` make it one tensor-parallel rank's model (config: that rank's, from
    `ShardingPlan.rank_config`); without them it is the whole single-rank model.
    """

    def __init__(self, config: KimiK3Config, comm: Communicator | None = None,
                 experts: ExpertSharding | None = None):
        super().__init__()
        self.config = config
        self.comm = comm or NullCommunicator()
        self.model = KimiK3Model(config, self.comm, experts)
        if self.comm.world_size == 1:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        else:
            self.lm_head = VocabParallelLMHead(config.hidden_size, config.vocab_size, self.comm)

    def new_state(self) -> ModelState:
        return ModelState(layers=[None] * self.config.num_hidden_layers)

    @torch.no_grad()
    def forward(
        self,
        input_ids: torch.Tensor,
        state: ModelState | None = None,
        *,
        absorbed: bool = False,
        tap_layers: Sequence[int] = (),
    ) -> ModelOutput:
        """Run `input_ids` ([T]) after whatever `state` has seen. `absorbed` picks the MLA form."""
        if input_ids.dim() != 1:
            raise ValueError(f"input_ids must be 1-D [T] (one sequence), got shape {tuple(input_ids.shape)}")
        last = self.config.num_hidden_layers - 1
        bad = [i for i in tap_layers if not 0 <= i < last]
        if bad:
            raise ValueError(f"tap_layers {bad} out of range: taps come after layers 0..{last - 1}, never the last")
        state = state if state is not None else self.new_state()
        hidden, taps = self.model(input_ids, dense_mixer(self.model, state, absorbed), tuple(tap_layers))
        state.num_tokens += input_ids.numel()
        return ModelOutput(
            logits=self.lm_head(hidden),
            state=state,
            taps=torch.cat(taps, dim=-1) if taps else None,
            hidden=hidden,
        )
