"""The GPU backend's glue: the K3 modules' weights through the kernels of mstar/kernels.

Imported only where backend.py chooses a GPU backend (it imports Triton and fla-core). Which module runs
which kernel is decided there, in `select_backend`; the classes here carry that choice out:

- `GpuMixerOps`: KDA through fla-core and our block kernels (`mstar/kernels/kda_fla.py`; a decode step of up to
  64 rows after its input GEMM is one kernel, `mstar/kernels/kda_decode.py`'s `decode_step`), any dtype; MLA
  through the paged absorbed Triton kernels (`mstar/kernels/mla_attention.py`) for the layers it is given:
  new latent rows are normed and written to the pages first (one launch, `mstar/kernels/kv_slots.py`), then decode (one
  row per sequence, split-KV) or the multi-row causal kernel (prefill chunks, verify blocks) reads them; prefill
  steps the FLOP roofline gives to the expanded form (`step_metadata.expanded_form`) run
  `mstar/kernels/mla_expanded.py` instead (`_mla_expanded`).
- `GpuLayerOps`: every dense projection through `gemm` (the skinny GEMM kernel at the shapes and row counts
  where its H200 table beat cuBLAS, `mstar/kernels/skinny_gemm.py`; cuBLAS elsewhere); one-launch kernels
  for the norms, the AttnRes mix + norm, the routers' selection and the dense SiTU MLPs; the routed experts
  of the MoE layers it is given through `MXFP4Experts`: the MXFP4 W4A16
  Triton kernels (`mstar/kernels/moe_mxfp4.py`) over the experts' packed bytes, stacked as they are, never
  re-quantized; steps of more than MSTAR_MOE_BF16_TOKENS tokens run bf16 grouped GEMMs instead, on each
  layer's experts dequantized into one of two scratches a layer ahead, on a side stream (`mstar/kernels/moe_bf16.py`,
  dequant_ahead.py).

Stacked weights (projections of one input as one GEMM, a layer's experts as one tensor) are built once per
serving model from the reference's weights, holding the bytes once (kernels/stacked_linear.py): the
reference modules are only read.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from mstar.kernels import (
    attn_res_norm,
    gated_mlp,
    kda_decode,
    kda_fla,
    kv_slots,
    mla_attention,
    mla_expanded,
    moe_bf16,
    moe_mxfp4,
    router_topk,
    sigmoid_gate,
    skinny_gemm,
)
from mstar.kernels.stacked_linear import StackedLinear, rows_view, stack_columns
from mstar.quant.mxfp4_linear import MXFP4Linear
from mstar.resources.latent_kv import PagedLatentKV
from mstar.resources.recurrent_pool import RecurrentStatePool

from .attn_res import ResidualStream
from .dequant_ahead import Bf16Path, DequantAhead
from .kda import L2_NORM_EPS, KimiDeltaAttention
from .layer_ops import REFERENCE_OPS, LayerOps
from .mla import GatedMLA
from .mlp import GatedMLP
from .moe import LatentMoE, Router, Routing
from .norm import RMSNorm
from .precomputed_stream import (
    PrecomputedStream,
    SequenceParallelPrecomputedStream,
    SublayerQueries,
    sublayer_queries,
)
from .sequence_parallel import shards_rows
from .serving import BatchPlan, TorchMixerOps
from .step_metadata import KDAPath, MLAStep, StepMetadata, build_metadata, kda_step, mla_step

if TYPE_CHECKING:
    from .model import KimiK3Model


def stacked(linears: list[nn.Linear]) -> StackedLinear:
    if any(lin.bias is not None for lin in linears):
        raise ValueError("only bias-free projections are stacked into one GEMM")
    return StackedLinear([lin.weight for lin in linears])


class GpuMixerOps(TorchMixerOps):
    """The token mixers on the GPU. `mla_layers`: the MLA modules the Triton kernels run (the others take
    the torch path); `fused`: the input projections of a layer as one GEMM and the one-launch norms (bf16
    and fp16 models; fp32 ones keep the exact torch arithmetic there, except in a KDA decode step, whose
    kernel computes the gate's f_b projection and the head norm at any dtype)."""

    def __init__(self, mla_layers: frozenset[GatedMLA] = frozenset(), *, fused: bool = False):
        heads = {attn.num_heads for attn in mla_layers}
        if len(heads) > 1:
            raise ValueError(f"the MLA kernel layers have different head counts {sorted(heads)}: one step's "
                             "metadata serves them all")
        self.mla_layers = mla_layers
        self.mla_heads = heads.pop() if heads else None
        dims = {mla_dims(attn) for attn in mla_layers}
        # layers of several widths, or widths the expanded kernel does not take: the absorbed form only
        self.mla_dims = dims.pop() if len(dims) == 1 else None
        self.fused = fused
        self.layer_ops = GpuLayerOps() if fused else REFERENCE_OPS  # the norms inside the mixers
        # per layer module, built on first use, which is an eager step (CUDA-graph capture warms up eagerly
        # first): its parameters as the KDA kernels take them, its stacked input projections
        self._kda_weights: dict[KimiDeltaAttention, kda_fla.KDAWeights] = {}
        self._stacks: dict[nn.Module, StackedLinear] = {}

    def step_metadata(self, plan: BatchPlan, pool: RecurrentStatePool) -> StepMetadata:
        """The step's metadata for the mixers (ServingModel.forward builds it once per step; step_metadata.py)."""
        return build_metadata(plan, pool, self.mla_heads, self.mla_dims)

    # --- KDA ---
    def kda(self, attn: KimiDeltaAttention, layer: int, x: torch.Tensor, plan: BatchPlan,
            pool: RecurrentStatePool, meta: StepMetadata | None = None) -> torch.Tensor:
        """`meta`: the step's (a layer called on its own builds it)."""
        step = meta.kda if meta is not None else kda_step(plan, pool)
        w = self._weights(attn)
        conv, state = pool.conv[layer], pool.state[layer]
        if step.path is KDAPath.DECODE:
            return self._kda_decode(attn, x, conv, state, plan.kda_slots, w)
        if step.path is KDAPath.PREFILL:
            q, k, v, f, beta, gate = self._kda_inputs(attn, x)
            return self._kda_output(attn, kda_fla.prefill(q, k, v, f, beta, step.layout, conv, state, w), gate)
        if step.path is KDAPath.BLOCKS:  # short blocks and their pending prefixes in one pass
            layout = step.layout
            rows = kda_fla.block_rows(x, layout, pool.prefix_x[layer])
            q, k, v, f, beta, gate = self._kda_inputs(attn, rows)
            o = kda_fla.block_recurrence(q, k, v, f, beta, layout, conv, state, w)
            kda_fla.keep_block_inputs(x, layout, pool.prefix_x[layer])
            return self._kda_output(attn, o, gate, tokens=layout.x_dest)
        return self._kda_varlen(attn, layer, x, plan, pool, w)

    def _kda_varlen(self, attn: KimiDeltaAttention, layer: int, x: torch.Tensor, plan: BatchPlan,
                    pool: RecurrentStatePool, w: kda_fla.KDAWeights) -> torch.Tensor:
        """Any step (long prompts among verify blocks): each accepted pending prefix is folded into its
        checkpoint first, then the step's rows run; a verify block's inputs wait as the next pending prefix.
        Its lengths come from the host (a plan's `advance` is read back: it waits for the step in flight)."""
        slots = plan.host_slots()
        conv, state, prefix_x = pool.conv[layer], pool.state[layer], pool.prefix_x[layer]
        pending = plan.settled_pending(pool)
        with_prefix = [b for b, n in enumerate(pending) if n]
        if with_prefix:
            rows = torch.cat([prefix_x[slots[b], : pending[b]] for b in with_prefix])
            q, k, v, f, beta, _ = self._kda_inputs(attn, rows)
            kda_fla.varlen(q, k, v, f, beta, [pending[b] for b in with_prefix], tuple(slots[b] for b in with_prefix),
                           [True] * len(with_prefix), conv, state, w)
        starts = plan.seq_starts
        lengths = [starts[b + 1] - starts[b] for b in range(len(slots))]
        fold = [not (plan.verify and plan.verify[b]) for b in range(len(slots))]
        q, k, v, f, beta, gate = self._kda_inputs(attn, x)
        y = self._kda_output(attn, kda_fla.varlen(q, k, v, f, beta, lengths, slots, fold, conv, state, w), gate)
        for b, folded in enumerate(fold):
            if not folded:
                prefix_x[slots[b], : lengths[b]] = x[starts[b] : starts[b + 1]]
        return y

    def _weights(self, attn: KimiDeltaAttention) -> kda_fla.KDAWeights:
        if attn not in self._kda_weights:
            convs = (attn.q_conv1d, attn.k_conv1d, attn.v_conv1d)
            self._kda_weights[attn] = kda_fla.KDAWeights(
                conv_weight=torch.stack([c.weight[:, 0].T.float() for c in convs]).contiguous(),
                conv1d=tuple(c.weight for c in convs), a_log=attn.A_log.float(), dt_bias=attn.dt_bias.float(),
                num_heads=attn.num_heads, head_dim=attn.head_dim, scale=attn.scale,
                lower_bound=attn.gate_lower_bound, l2_eps=L2_NORM_EPS)
        return self._kda_weights[attn]

    def _kda_decode(self, attn: KimiDeltaAttention, x: torch.Tensor, conv: torch.Tensor, state: torch.Tensor,
                    slots: torch.Tensor, w: kda_fla.KDAWeights) -> torch.Tensor:
        """A decode step (one row per slot, no pending prefix): the input projections, then one kernel up to
        o_proj's input (the f_b projection, conv, recurrence and head norm), the pool updated in place; above
        DECODE_STEP_MAX_ROWS rows the chain it replaced (kda_decode's doc). The rows are the tensor's shape, a
        host int: a graph captured at B rows replays the path taken."""
        if x.shape[0] > kda_decode.DECODE_STEP_MAX_ROWS:
            q, k, v, f, beta, gate = self._kda_inputs(attn, x)
            return self._kda_output(attn, kda_fla.decode(q, k, v, f, beta, conv, state, slots, w), gate)
        q, k, v, f_a, beta, gate = self._kda_projections(attn, x)
        normed = kda_decode.decode_step(q, k, v, f_a, beta, gate, conv, state, slots, w.conv_weight,
                                        attn.f_b_proj.weight, w.a_log, w.dt_bias, attn.o_norm.weight, scale=w.scale,
                                        lower_bound=w.lower_bound, l2_eps=w.l2_eps, norm_eps=attn.o_norm.eps)
        return self.layer_ops.linear(attn.o_proj, normed)

    def _kda_inputs(self, attn: KimiDeltaAttention, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(q, k, v pre-conv, the gate f before the kernel's activation, beta before its sigmoid, the output
        gate) of rows x. Stacked, the blocks are strided views of one output: fla's kernels assume contiguous
        rows, so what goes to them straight (beta) is made contiguous there (`.float()` copies a bf16 beta but
        returns an fp32 one as it is; the H200 run that found this measured 11% error for fp32 models)."""
        q, k, v, f_a, beta, gate = self._kda_projections(attn, x)
        return q, k, v, self.layer_ops.linear(attn.f_b_proj, f_a), beta, gate

    def _kda_projections(self, attn: KimiDeltaAttention, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """`_kda_inputs` with the gate's low-rank input f_a [M, head_dim] in place of f (its f_b projection
        not run)."""
        first_gate = attn.g_proj if attn.use_full_rank_gate else attn.g_a_proj
        projections = [attn.q_proj, attn.k_proj, attn.v_proj, attn.f_a_proj, attn.b_proj, first_gate]
        if self.fused:
            q, k, v, f_a, beta, g = self._stacked(attn, projections)(x, self.layer_ops.gemm)
        else:
            q, k, v, f_a, beta, g = (p(x) for p in projections)
        gate = g if attn.use_full_rank_gate else self.layer_ops.linear(attn.g_b_proj, g)
        return q, k, v, f_a, beta, gate

    def _kda_output(self, attn: KimiDeltaAttention, o: torch.Tensor, gate: torch.Tensor,
                    tokens: torch.Tensor | None = None) -> torch.Tensor:
        """o_proj(o_norm(o, gate)) of the recurrence's output o [M, H, K]; with `tokens`, of those rows only."""
        o, gate = o.to(gate.dtype), gate.reshape(o.shape)
        if self.fused:
            normed = kda_decode.gated_head_norm(o, gate, attn.o_norm.weight, attn.o_norm.eps, tokens)
        else:
            normed = attn.o_norm(o, gate) if tokens is None else attn.o_norm(o[tokens], gate[tokens])
        return self.layer_ops.linear(attn.o_proj, normed.reshape(normed.shape[0], -1))

    def _stacked(self, module: nn.Module, linears: list[nn.Linear]) -> StackedLinear:
        if module not in self._stacks:
            self._stacks[module] = stacked(linears)
        return self._stacks[module]

    @staticmethod
    def capture_prefill_layout(max_rows: int, kda_slots: torch.Tensor) -> kda_fla.PrefillLayout:
        """The capture builder of STAGED_PREFILL steps: a prefill layout of up to `max_rows` rows over the
        staged `kda_slots`, whose row offsets each replay stages (`first_rows(n).stage(seq_starts)`)."""
        return kda_fla.PrefillLayout.allocate(max_rows, kda_slots)

    # --- MLA ---
    def mla(self, attn: GatedMLA, layer: int, x: torch.Tensor, plan: BatchPlan, kv: PagedLatentKV,
            meta: StepMetadata | None = None) -> torch.Tensor:
        """`meta`: the step's (a layer called on its own builds it)."""
        if attn not in self.mla_layers:
            return super().mla(attn, layer, x, plan, kv)
        step = meta.mla if meta is not None else mla_step(plan, attn.num_heads, x.device, self.mla_dims)
        q_first, kv_a, gate = self._mla_inputs(attn, x)
        cache, table, lens = kv.cache[layer], plan.kv.page_table, plan.kv.context_lens
        # the new rows' two parts go to their slots as they are (k_pe a view of kv_a): no cat, no index_put; fused,
        # the write applies kv_a_layernorm too, and its launch normalizes the query's first projection beside it
        query = None
        if self.fused:
            c_kv, k_pe = kv_a.split([attn.kv_lora_rank, attn.rope], dim=-1)
            norm = (attn.kv_a_layernorm.weight, attn.kv_a_layernorm.eps)
            query = self._query_norm(attn, q_first)
        else:
            (c_kv, k_pe), norm = attn.latent_rows(kv_a, self.layer_ops), None
        kv_slots.write_latent_rows(cache, plan.kv.slot_mapping, c_kv, k_pe, norm=norm, query=query)
        if query is None:
            q_nope, q_pe = attn.queries(q_first, self.layer_ops)
        else:
            q_normed = query[-1]  # what the write's launch left: q_a_layernorm(q_first)
            q_nope, q_pe = attn.query_heads(self.layer_ops.linear(attn.q_b_proj, q_normed))
        if step.expanded:  # a prefill step the roofline gives to the expanded form (step_metadata.expanded_form)
            return attn.output(self._mla_expanded(attn, q_nope, q_pe, cache, plan, step), gate, self.layer_ops)
        # the absorbed query's parts: the kernels read q_lat and q_pe apart, so no cat builds [q_lat | q_pe]
        q_lat, w_uv = attn.absorbed_query(q_nope)
        out = torch.empty(x.shape[0], attn.num_heads, attn.kv_lora_rank, device=x.device, dtype=x.dtype)
        if step.cu_seqlens is None:
            mla_attention.paged_mla_decode(q_lat, q_pe, cache, table, lens, attn.scale, out,
                                           num_splits=step.num_splits)
        else:
            mla_attention.paged_mla_prefill(q_lat, q_pe, cache, table, step.cu_seqlens, lens, attn.scale, out,
                                            max_query_len=step.max_query_len, num_splits=step.num_splits)
        o = torch.einsum("thr,hvr->thv", out, w_uv)
        return attn.output(o, gate, self.layer_ops)

    def _mla_expanded(self, attn: GatedMLA, q_nope: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor,
                      plan: BatchPlan, step: MLAStep) -> torch.Tensor:
        """o [N, H, v] of a prefill step in the expanded form (mstar/kernels/mla_expanded.py): the new rows read back
        from their slots (one gather: exactly the normed, cast rows the absorbed kernel would read, where the fused
        write never materialised them), K/V expanded through kv_b_proj (one GEMM), the prefixes' state from the
        absorbed kernel where a sequence may have one, then the causal kernel over the chunk, resuming from it."""
        rows = cache.view(-1, cache.shape[-1])[plan.kv.slot_mapping]
        c_kv, k_pe = rows.split([attn.kv_lora_rank, attn.rope], dim=-1)
        k_nope, v = mla_expanded.expand_kv(c_kv, attn.kv_b_proj.weight, attn.num_heads, attn.nope,
                                           gemm=self.layer_ops.gemm if self.fused else None)
        prefix = None
        if step.prefix_lens is not None:
            q_lat, w_uv = attn.absorbed_query(q_nope)
            prefix = mla_expanded.prefix_state(q_lat, q_pe, cache, plan.kv.page_table, step.cu_seqlens,
                                               step.prefix_lens, attn.scale, w_uv, max_query_len=step.max_query_len,
                                               num_splits=step.num_splits)
        out = torch.empty(q_nope.shape[0], attn.num_heads, attn.v_dim, device=q_nope.device, dtype=q_nope.dtype)
        return mla_expanded.mla_prefill_expanded(q_nope, q_pe, k_nope, v, k_pe, step.cu_seqlens, plan.kv.context_lens,
                                                 attn.scale, out, prefix=prefix, max_query_len=step.max_query_len)

    @staticmethod
    def _query_norm(attn: GatedMLA, q_first: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor, float, torch.Tensor] | None:
        """write_latent_rows' `query` for the layer's q_a_layernorm of q_first (its output a new tensor); None without a
        query LoRA or where the weight's dtype is not the rows' (the reference's norm then runs alone)."""
        if attn.q_lora_rank is None or attn.q_a_layernorm.weight.dtype != q_first.dtype:
            return None
        norm = attn.q_a_layernorm
        return q_first, norm.weight, norm.eps, torch.empty(q_first.shape, dtype=q_first.dtype, device=q_first.device)

    def _mla_inputs(self, attn: GatedMLA, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """attn.input_projections(x); with `fused`, as one GEMM (q_a or q, kv_a, the output gate)."""
        if not self.fused:
            return attn.input_projections(x)
        first = attn.q_proj if attn.q_lora_rank is None else attn.q_a_proj
        projections = [first, attn.kv_a_proj_with_mqa] + ([attn.g_proj] if attn.g_proj is not None else [])
        q, kv_a, *gate = self._stacked(attn, projections)(x, self.layer_ops.gemm)
        return q, kv_a, gate[0] if gate else None


def mla_dims(attn: GatedMLA) -> mla_expanded.MLADims | None:
    """The layer's widths the choice between the absorbed and the expanded form depends on; None where the expanded
    kernel does not take them (its nope, rope and v widths: `mla_attention.arange_width`)."""
    if not all(map(mla_attention.arange_width, (attn.nope, attn.rope, attn.v_dim))):
        return None
    return mla_expanded.MLADims(latent=attn.kv_lora_rank, rope=attn.rope, nope=attn.nope, v_dim=attn.v_dim)


def mla_kernel_fits(attn: GatedMLA, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the Triton MLA kernels run this layer; else the torch path (not graph-capturable).
    They take bf16 rows of [latent | k_pe] whose two parts are powers of two >= 16 (tl.arange widths):
    K3's 512 + 64, the mini's 64 + 16."""
    widths = (attn.kv_lora_rank, attn.rope)
    return (dtype == torch.bfloat16 and all(map(mla_attention.arange_width, widths))
            and mla_attention.supported(device))


class GpuLayerOps(LayerOps):
    """One-launch Triton kernels for the token-wise operations: every RMSNorm, every AttnRes mix + norm
    (kernels/attn_res_norm.py), ungrouped routers' selection (kernels/router_topk.py), the SiTU MLPs
    (kernels/gated_mlp.py, gate and up as one GEMM), MLA's output gate (kernels/sigmoid_gate.py); the routed
    experts of the layers in `experts`. A latent MoE layer's shared activations and normalised routed sum land
    in one buffer that its output GEMM reads as it is (`moe_inputs`, `latent_output`)."""

    def __init__(self, experts: dict[LatentMoE, MXFP4Experts] | None = None):
        self.experts = experts or {}
        self._gate_up: dict[GatedMLP, StackedLinear] = {}  # per MLP, on first use (an eager step)
        self._moe_inputs: dict[LatentMoE, StackedLinear] = {}  # per MoE layer, likewise
        self._latent_output: dict[LatentMoE, torch.Tensor] = {}  # per MoE layer: [up | shared down] by columns
        # per MoE layer, from moe_inputs to its latent_output: the GEMM input [T, held + I] whose last I columns the
        # SiTU wrote the shared experts' activations into, the first left for the latent norm
        self._latent_gemm_inputs: dict[LatentMoE, torch.Tensor] = {}
        self._queries: dict[KimiK3Model, SublayerQueries] = {}  # per model, its mixes' stacked pseudo-queries

    def gemm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """x @ weight^T: every dense projection of the serving model runs here (stacked ones included):
        the skinny GEMM kernel where its measured table beat cuBLAS at this shape and row count, else cuBLAS."""
        return skinny_gemm.linear(x, weight)

    def linear(self, proj: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        return self.gemm(x, proj.weight) if proj.bias is None else proj(x)

    def norm(self, norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
        return attn_res_norm.rms_norm_rows(x, norm.weight, norm.eps)

    def mix_norm(self, sources: torch.Tensor, proj_weight: torch.Tensor, res_norm_weight: torch.Tensor,
                 res_eps: float, out_norm_weight: torch.Tensor, out_eps: float,
                 residual: torch.Tensor | None = None) -> torch.Tensor:
        return attn_res_norm.attn_res_norm(sources, proj_weight, res_norm_weight, res_eps, out_norm_weight, out_eps,
                                           residual=residual)

    def residual_stream(self, model: KimiK3Model, embedding: torch.Tensor) -> ResidualStream:
        """On several ranks, a large step's rows split over them (sequence_parallel.py). Where the mixes (of the
        rows a rank holds) take the three launches (prefill chunks, large verify steps), a stream whose closed
        blocks' statistics are computed once (precomputed_stream.py); the plain one where they take one launch."""
        rows, width = embedding.shape
        cfg, comm = model.config, model.comm
        sharded = shards_rows(model, comm, rows)
        if attn_res_norm.prefers_one_launch(rows // comm.world_size if sharded else rows, width, embedding.device):
            return super().residual_stream(model, embedding)
        if model not in self._queries:
            self._queries[model] = sublayer_queries(model)
        if sharded:
            return SequenceParallelPrecomputedStream(embedding, cfg.attn_res_block_size, cfg.num_hidden_layers,
                                                     self._queries[model], comm)
        return PrecomputedStream(embedding, cfg.attn_res_block_size, cfg.num_hidden_layers, self._queries[model])

    def sigmoid_gate(self, o: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return sigmoid_gate.sigmoid_gate(o, gate)

    def route(self, router: Router, x: torch.Tensor) -> Routing:
        cfg = router.config
        if cfg.num_expert_group != 1:  # the kernel selects ungrouped (K3 has one group)
            return router(x)
        ids, weights = router_topk.route(x, router.weight, router.e_score_correction_bias, cfg.num_experts_per_token,
                                         cfg.moe_renormalize, cfg.routed_scaling_factor)
        return Routing(ids, weights)

    def moe_inputs(self, moe: LatentMoE, x: torch.Tensor) -> tuple[Routing, torch.Tensor, torch.Tensor | None]:
        """The router, the latent down projection and the shared experts' gate/up read the same x: one GEMM over
        their stacked weights (the router's logits kept in fp32, the rest rounded as each alone would be), then
        the selection and the shared experts' SiTU in one launch, the SiTU written where `latent_output`'s GEMM
        reads it. Layers without that shape: one each."""
        cfg, mlp = moe.config, moe.shared_experts if moe.config.num_shared_experts else None
        projections = [moe.routed_expert_down_proj] + ([mlp.gate_proj, mlp.up_proj] if mlp is not None else [])
        if (cfg.num_expert_group != 1 or cfg.routed_expert_hidden_size is None or mlp is None
                or mlp.config.hidden_act != "situ" or any(p.bias is not None for p in projections)):
            return super().moe_inputs(moe, x)
        if moe not in self._moe_inputs:
            self._moe_inputs[moe] = StackedLinear([moe.gate.weight] + [p.weight for p in projections])
        stack = self._moe_inputs[moe]
        num_experts, z_width, gate_up_width = stack.widths[0], stack.widths[1], sum(stack.widths[2:])
        logits, rest = skinny_gemm.linear_split(x, stack.weight, num_experts)
        z, gate_up, _ = rest.split([z_width, gate_up_width, stack.pad], dim=-1)
        act = mlp.config
        ids, weights, hidden = router_topk.select_with_situ(
            logits, moe.gate.e_score_correction_bias, cfg.num_experts_per_token, cfg.moe_renormalize,
            cfg.routed_scaling_factor, gate_up, act.activation_situ_beta, act.activation_situ_linear_beta,
            out=self._shared_hidden_out(moe, gate_up))
        return Routing(ids, weights), z, hidden

    def _shared_hidden_out(self, moe: LatentMoE, gate_up: torch.Tensor) -> torch.Tensor | None:
        """Where the SiTU of gate_up [T, 2I] goes: where the layer's `latent_output` takes the shared activations
        with the norm's columns, the last I columns of its GEMM input (kept for that call); else None (a tensor of
        their own)."""
        if not (moe.shared_in_latent_output and self._norm_feeds_gemm(moe)):
            return None
        held, inter = moe.routed_expert_up_proj.in_features, gate_up.shape[1] // 2
        gemm_input = torch.empty(gate_up.shape[0], held + inter, dtype=gate_up.dtype, device=gate_up.device)
        self._latent_gemm_inputs[moe] = gemm_input
        return gemm_input[:, held:]

    @staticmethod
    def _norm_feeds_gemm(moe: LatentMoE) -> bool:
        """Whether `latent_output` runs as its norm writing into its GEMM's input: a latent norm, bias-free
        projections."""
        mlp = moe.shared_experts if moe.config.num_shared_experts else None
        projections = [moe.routed_expert_up_proj] + ([mlp.down_proj] if mlp is not None else [])
        return moe.config.latent_moe_use_norm and all(p.bias is None for p in projections)

    def latent_output(self, moe: LatentMoE, r: torch.Tensor, shared: torch.Tensor | None,
                      columns: slice | None = None, square_sums: torch.Tensor | None = None) -> torch.Tensor:
        """The reference's function in two launches: the latent norm of whole rows of r writes `columns` of its
        output into the first columns of the GEMM input, whose last ones hold the shared activations (where
        moe_inputs' SiTU wrote them), then up(normed) + shared_down(shared) as one GEMM over the two weights stacked
        by columns: no cat, one fp32 accumulation. r may be the routed kernel's fp32 sum (`routed`): rounded to the
        model dtype as the norm loads it, as the reference's rounded copy. With `square_sums` r is a reduce-scatter's
        piece, `columns` alone, normed with the whole rows' statistics. Without a latent norm: the reference's."""
        gemm_input = self._latent_gemm_inputs.pop(moe, None)
        up = moe.routed_expert_up_proj
        if not self._norm_feeds_gemm(moe) or (shared is not None and shared.dtype != up.weight.dtype):
            return super().latent_output(moe, r.to(up.weight.dtype), shared, columns, square_sums)
        gemm_input = self._gemm_input(gemm_input, shared, r, up.in_features, up.weight.dtype)
        norm = moe.routed_expert_norm
        attn_res_norm.rms_norm_rows(r, norm.weight, norm.eps, out=gemm_input[:, : up.in_features], columns=columns,
                                    square_sums=square_sums)
        if shared is None:
            return self.gemm(gemm_input, up.weight)
        if moe not in self._latent_output:
            self._latent_output[moe] = stack_columns([up.weight, moe.shared_experts.down_proj.weight])
        return self.gemm(gemm_input, self._latent_output[moe])

    @staticmethod
    def _gemm_input(kept: torch.Tensor | None, shared: torch.Tensor | None, r: torch.Tensor, held: int,
                    dtype: torch.dtype) -> torch.Tensor:
        """latent_output's GEMM input [T, held (+ I)] for r's rows: `kept` (from moe_inputs) where `shared` is its
        last columns; else a new one, `shared` copied into it (one copy, as the cat it replaces)."""
        if shared is None:
            return torch.empty(r.shape[0], held, dtype=dtype, device=r.device)
        inter = shared.shape[1]
        if kept is not None and kept.shape[1] == held + inter and shared.data_ptr() == kept[:, held:].data_ptr():
            return kept
        gemm_input = torch.empty(r.shape[0], held + inter, dtype=dtype, device=r.device)
        gemm_input[:, held:] = shared
        return gemm_input

    def routed(self, moe: LatentMoE, z: torch.Tensor, routing: Routing) -> torch.Tensor:
        """The kernel's fp32 sum as it is where forward hands it to `latent_output` (a latent space, on one rank or
        in the sharded-latent layout): the latent norm rounds it to z's dtype as it loads it, and on several ranks
        `all_reduce_rounded` rounds each rank's partial sum first (symmetric memory in its staging copy), as the
        reference rounds them; no copy kernel either way. Else rounded to z's dtype here, as the reference's."""
        kernel = self.experts.get(moe)
        if kernel is None:
            return moe.routed(z, routing)
        r = kernel(z, routing.experts, routing.weights)
        return r if moe.shared_in_latent_output else r.to(z.dtype)

    def mlp(self, mlp: GatedMLP, x: torch.Tensor) -> torch.Tensor:
        return self.linear(mlp.down_proj, self.mlp_hidden(mlp, x))

    def mlp_hidden(self, mlp: GatedMLP, x: torch.Tensor) -> torch.Tensor:
        cfg = mlp.config
        if cfg.hidden_act != "situ":
            return mlp.hidden(x)
        if mlp not in self._gate_up:
            self._gate_up[mlp] = stacked([mlp.gate_proj, mlp.up_proj])
        gate_up = self.gemm(x, self._gate_up[mlp].weight)
        return gated_mlp.situ_and_mul(gate_up, cfg.activation_situ_beta, cfg.activation_situ_linear_beta)


EXPERT_PROJECTIONS = ("w1", "w3", "w2")


def expert_kernel_fits(moe: LatentMoE) -> bool:
    """Whether `MXFP4Experts` runs this layer's experts: held as MXFP4 (an unquantized checkpoint's dense experts
    keep the torch loop), the latent and this rank's expert width in whole 128-column scale words."""
    projections = [getattr(e, name) for e in moe.experts for name in EXPERT_PROJECTIONS]
    if not projections or not all(isinstance(p, MXFP4Linear) for p in projections):
        return False
    w1 = next(iter(moe.experts)).w1
    return not (w1.out_features % moe_mxfp4.SCALE_WORD or w1.in_features % moe_mxfp4.SCALE_WORD)


class MXFP4Experts:
    """A `LatentMoE`'s held routed experts as stacked MXFP4 tensors for the Triton kernels.

    The experts' packed buffers are stacked as they are; each expert's buffers then become views of
    the stack, so the layer's expert bytes are held once (and a second serving model over the same
    experts finds them stacked and takes the same stack). Under expert parallelism the stack holds
    only this rank's experts: router ids are mapped to stack indices, and pairs routed to another
    group's expert are dropped by the kernel (they add nothing here, as in `LatentMoE.routed`).

    With `bf16` set (`expert_kernels` does it where large steps can occur), steps of more than
    `bf16.above_tokens` tokens run bf16 grouped GEMMs on this layer's experts, dequantized a layer ahead
    (dequant_ahead.py).
    """

    def __init__(self, moe: LatentMoE):
        experts = list(moe.experts)  # the held experts, in global id order
        self.weights = _stacked_experts(experts)
        held_all = len(experts) == moe.config.num_experts
        # [num_experts] global id -> stack index, DROPPED where another rank holds the expert
        self.local_ids = None if held_all else moe.sharding.local_ids(self.weights.w13_packed.device)
        self.top_k = moe.config.num_experts_per_token
        self.bf16: Bf16Path | None = None

    def __call__(self, z: torch.Tensor, expert_ids: torch.Tensor, expert_weights: torch.Tensor) -> torch.Tensor:
        if self.local_ids is not None:
            expert_ids = self.local_ids[expert_ids]
        # T is the tensor's shape, a host int: a CUDA graph captured at T tokens replays the branch taken.
        if self.bf16 is not None and z.shape[0] > self.bf16.above_tokens:
            return self.bf16(z, expert_ids, expert_weights.float())
        return moe_mxfp4.moe_mxfp4(z, expert_ids, expert_weights.float(), *self.weights)

    def warm_bf16(self, num_tokens: int) -> None:
        """One step of `num_tokens` tokens (zeros, routed round-robin over the held experts) through the bf16
        path: its kernels compile and the caching allocator keeps its temporaries, so that the first large
        step served does neither."""
        num_experts, hidden, _ = moe_mxfp4.check_weights(*self.weights)
        device = self.weights.w13_packed.device
        z = torch.zeros(num_tokens, hidden, dtype=torch.bfloat16, device=device)
        ids = (torch.arange(num_tokens * self.top_k, device=device) % num_experts).view(num_tokens, self.top_k)
        weights = torch.full((num_tokens, self.top_k), 1.0 / self.top_k, device=device)
        self.bf16(z, ids, weights)


def _stacked_experts(experts: list[nn.Module]) -> moe_mxfp4.StackedExperts:
    """The experts' packed buffers as `StackedExperts` (w1 then w3 rows per expert in w13, codes in the word
    layout): views of the stack they already are (an earlier serving model's), else a new stack their buffers
    then point into, each projection marked `word_layout` (its torch path decodes the stack's bytes)."""
    def buffers(names: tuple[str, ...], attr: str) -> list[torch.Tensor]:
        return [getattr(getattr(e, name), attr) for e in experts for name in names]

    projections = [getattr(e, name) for e in experts for name in EXPERT_PROJECTIONS]
    views = [rows_view(buffers(names, attr)) for names in (("w1", "w3"), ("w2",))
             for attr in ("weight_packed", "weight_scale")]
    if all(p.word_layout for p in projections) and all(v is not None for v in views):
        return moe_mxfp4.StackedExperts(*(v.view(len(experts), -1, v.shape[-1]) for v in views))
    # (a projection stacked before but moved since, e.g. by .to(), holds the word layout outside any stack)
    pairs = {name: [(getattr(e, name).checkpoint_packed(), getattr(e, name).weight_scale) for e in experts]
             for name in EXPERT_PROJECTIONS}
    stack = moe_mxfp4.stack_experts(pairs["w1"], pairs["w3"], pairs["w2"])
    inter = stack.w13_packed.shape[1] // 2
    for i, expert in enumerate(experts):
        for proj, rows in ((expert.w1, slice(None, inter)), (expert.w3, slice(inter, None))):
            proj.weight_packed.data, proj.weight_scale.data = stack.w13_packed[i, rows], stack.w13_scale[i, rows]
        expert.w2.weight_packed.data, expert.w2.weight_scale.data = stack.w2_packed[i], stack.w2_scale[i]
    for proj in projections:
        proj.word_layout = True
    return stack


def expert_kernels(moes: list[LatentMoE], max_step_tokens: int | None,
                   bf16_above_tokens: int | None = None) -> dict[LatentMoE, MXFP4Experts]:
    """`MXFP4Experts` for each of `moes` (layers `expert_kernel_fits` accepts, on a GPU the kernel supports; in
    the order a step runs them).

    Where a step may hold more tokens (max_step_tokens: the scheduler's token budget) than `bf16_above_tokens`
    (MSTAR_MOE_BF16_TOKENS, `Environment.moe_bf16_tokens`; None: never) and the GPU runs `moe_bf16`, such
    steps run it, each expert shape's layers through one `DequantAhead` (K3: one for all layers; two bf16
    scratches, 3.44 GiB at one TP8 rank of pruned75, see DequantizedExperts.allocate), and a step of
    max_step_tokens runs through it once here, so that the first large step served compiles and allocates
    nothing. Otherwise nothing is allocated.
    """
    kernels = {moe: MXFP4Experts(moe) for moe in moes}
    above = bf16_above_tokens
    if not kernels or max_step_tokens is None or above is None or max_step_tokens <= above:
        return kernels
    device = next(iter(kernels.values())).weights.w13_packed.device
    if not moe_bf16.supported(device):
        return kernels
    by_shape: dict[tuple[int, int, int], list[MXFP4Experts]] = {}
    for kernel in kernels.values():
        by_shape.setdefault(moe_mxfp4.check_weights(*kernel.weights), []).append(kernel)
    for layers in by_shape.values():
        ahead = DequantAhead([kernel.weights for kernel in layers], device)
        for index, kernel in enumerate(layers):
            kernel.bf16 = Bf16Path(above, ahead, index)
        layers[0].warm_bf16(max_step_tokens)
    return kernels
