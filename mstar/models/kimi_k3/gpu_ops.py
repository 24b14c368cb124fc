"""Token mixers and experts on the GPU: the kernels that replace the torch path of the serving model.

- KDA runs through fla-core (`mstar/kernels/kda_fla.py`), any dtype.
- MLA runs the paged absorbed Triton kernels (`mstar/kernels/mla_attention.py`) for bf16 models: new
  latent rows are written to the pages first, then decode (one row per sequence, split-KV) or the
  multi-row causal kernel (prefill chunks, verify blocks) reads them.
- Routed experts run the MXFP4 W4A16 Triton kernels (`mstar/kernels/moe_mxfp4.py`) for bf16 models
  whose experts are held packed (`MXFP4Linear`, loaded from an MXFP4 checkpoint): their bytes are
  stacked as they are, never re-quantized. Steps of more than MSTAR_MOE_BF16_TOKENS tokens run bf16
  grouped GEMMs instead, on each layer's experts dequantized into one shared scratch
  (`mstar/kernels/moe_bf16.py`). Dense experts keep the torch path.
The torch path is the reference every kernel is tested against, and the fallback where a kernel
does not support the device or dtype.
"""

from __future__ import annotations

import torch
from torch import nn

from mstar.kernels import (
    attn_res_norm,
    gated_mlp,
    kda_decode,
    kda_fla,
    mla_attention,
    moe_bf16,
    moe_mxfp4,
    router_topk,
)
from mstar.kernels.stacked_linear import StackedLinear
from mstar.quant.mxfp4_linear import MXFP4Linear
from mstar.resources.latent_kv import PagedLatentKV
from mstar.resources.recurrent_pool import RecurrentStatePool

from .kda import GatedHeadNorm, KimiDeltaAttention
from .mla import GatedMLA
from .mlp import GatedMLP
from .model import KimiK3ForCausalLM
from .moe import LatentMoE, Router, Routing
from .norm import RMSNorm
from .serving import BatchPlan, TorchMixerOps


class GpuMixerOps(TorchMixerOps):
    def __init__(self):
        # per KDA layer (pool index): its parameters converted for the decode kernels on first use,
        # which is an eager step (CUDA-graph capture warms up eagerly first)
        self.kda_constants: dict[int, kda_fla.DecodeConstants] = {}
        self._layout: tuple[BatchPlan, kda_fla.BlockLayout | None] | None = None  # the current step's, if short

    def kda(self, attn: KimiDeltaAttention, layer: int, x: torch.Tensor, plan: BatchPlan,
            pool: RecurrentStatePool) -> torch.Tensor:
        if layer not in self.kda_constants:
            self.kda_constants[layer] = kda_fla.DecodeConstants.of(attn)
        consts = self.kda_constants[layer]
        if plan.decode:
            return kda_fla.kda_decode(attn, layer, x, plan.kda_slots, pool, consts)
        if isinstance(plan.kda_layout, kda_fla.PrefillLayout):  # a captured prefill step: its layout is staged
            return kda_fla.kda_prefill_step(attn, layer, x, plan.kda_layout, pool, consts)
        if plan.kda_layout is not None:  # a captured verify step: its layout is staged
            return kda_fla.kda_block_step(attn, layer, x, plan.kda_layout, pool, consts)
        layout = self._short_block_layout(plan, pool, x.device)
        if layout is not None:  # verify blocks and their pending prefixes: one pass
            return kda_fla.kda_block_step(attn, layer, x, layout, pool, consts)
        return kda_fla.kda_step(attn, layer, x, plan.seq_starts, plan.host_slots(), plan.verify, pool)

    def _short_block_layout(self, plan: BatchPlan, pool: RecurrentStatePool,
                            device: torch.device) -> kda_fla.BlockLayout | None:
        """The step's short-block layout, or None when a sequence (with its pending prefix) is too long for
        it; decided once per step for all its KDA layers."""
        if self._layout is None or self._layout[0] is not plan:
            slots = plan.host_slots()
            pending = [pool.prefix_len[s] for s in slots]
            longest = max(pending[b] + plan.seq_starts[b + 1] - plan.seq_starts[b] for b in range(len(slots)))
            layout = None
            if longest <= kda_fla.RECURRENT_MAX_ROWS:
                layout = kda_fla.BlockLayout.build(plan.seq_starts, slots, pending, plan.verify,
                                                   pool.prefix_x.shape[2], device)
            self._layout = plan, layout
        return self._layout[1]

    @staticmethod
    def mla_kernel_fits(attn: GatedMLA, dtype: torch.dtype, device: torch.device) -> bool:
        """Whether the Triton MLA kernels run this layer; else the torch path (not graph-capturable).
        They are built for bf16 and K3's latent row: 64 k_pe columns after the latent (512 in K3)."""
        return dtype == torch.bfloat16 and attn.rope == 64 and mla_attention.supported(device)

    def mla(self, attn: GatedMLA, layer: int, x: torch.Tensor, plan: BatchPlan, kv: PagedLatentKV) -> torch.Tensor:
        if not self.mla_kernel_fits(attn, x.dtype, x.device):
            return super().mla(attn, layer, x, plan, kv)
        q_first, kv_a, gate = attn.input_projections(x)
        c_kv, k_pe = attn.latent_rows(kv_a)
        kv.write(layer, plan.kv.slot_mapping, torch.cat([c_kv, k_pe], dim=-1))
        q_nope, q_pe = attn.queries(q_first)
        w_uk, w_uv = attn.kv_b_weights()  # [H, nope, R], [H, v, R]
        q_abs = torch.cat([torch.einsum("thd,hdr->thr", q_nope, w_uk), q_pe], dim=-1).contiguous()
        out = torch.empty(x.shape[0], attn.num_heads, attn.kv_lora_rank, device=x.device, dtype=x.dtype)
        cache, table, lens = kv.cache[layer], plan.kv.page_table, plan.kv.context_lens
        scale = attn.scale
        rows = [plan.seq_starts[b + 1] - plan.seq_starts[b] for b in range(len(plan.num_computed))]
        if plan.max_query_len is not None:  # a captured prefill step: its lengths are on the device only
            mla_attention.paged_mla_prefill(q_abs, cache, table, plan.cu_seqlens, lens, scale, out,
                                            max_query_len=plan.max_query_len)
        elif max(rows) == 1:
            splits = mla_attention.num_splits_for(len(rows), attn.num_heads, max(plan.num_computed) + 1)
            mla_attention.paged_mla_decode(q_abs, cache, table, lens, scale, out, num_splits=splits)
        else:
            cu = plan.cu_seqlens if plan.cu_seqlens is not None else torch.tensor(plan.seq_starts, device=x.device)
            mla_attention.paged_mla_prefill(q_abs, cache, table, cu, lens, scale, out, max_query_len=max(rows))
        o = torch.einsum("thr,hvr->thv", out, w_uv)
        return attn.output(o, gate)


EXPERT_PROJECTIONS = ("w1", "w3", "w2")


class MXFP4Experts:
    """A `LatentMoE`'s held routed experts as stacked MXFP4 tensors for the Triton kernels.

    The experts' packed buffers are stacked as they are; each expert's buffers then become views of
    the stack, so the layer's expert bytes are held once. Under expert parallelism the stack holds
    only this rank's experts: router ids are mapped to stack indices, and pairs routed to another
    group's expert are dropped by the kernel (they add nothing here, as in `LatentMoE.routed`).

    With `bf16` set (install_expert_kernels does it where large steps can occur), steps of more than
    `bf16.above_tokens` tokens run `moe_bf16` on this layer's experts dequantized into `bf16.scratch`.
    """

    def __init__(self, moe: LatentMoE):
        experts = list(moe.experts)  # the held experts, in global id order
        pairs = {name: [_packed_pair(moe, e, name) for e in experts] for name in EXPERT_PROJECTIONS}
        self.weights = moe_mxfp4.stack_experts(pairs["w1"], pairs["w3"], pairs["w2"])
        _share_stacked_storage(experts, self.weights)
        held_all = len(experts) == moe.config.num_experts
        # [num_experts] global id -> stack index, DROPPED where another rank holds the expert
        self.local_ids = None if held_all else moe.sharding.local_ids(self.weights.w13_packed.device)
        self.top_k = moe.config.num_experts_per_token
        self.bf16: moe_bf16.Bf16Path | None = None

    def __call__(self, z: torch.Tensor, expert_ids: torch.Tensor, expert_weights: torch.Tensor) -> torch.Tensor:
        if self.local_ids is not None:
            expert_ids = self.local_ids[expert_ids]
        # T is the tensor's shape, a host int: a CUDA graph captured at T tokens replays the branch taken.
        if self.bf16 is not None and z.shape[0] > self.bf16.above_tokens:
            return moe_bf16.moe_bf16(z, expert_ids, expert_weights.float(), *self.weights, scratch=self.bf16.scratch)
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
        moe_bf16.moe_bf16(z, ids, weights, *self.weights, scratch=self.bf16.scratch)


def _packed_pair(moe: LatentMoE, expert: nn.Module, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    proj = getattr(expert, name)
    if not isinstance(proj, MXFP4Linear):
        raise TypeError(f"MXFP4Experts needs experts held as MXFP4 (MXFP4Linear), but {name} of an expert of "
                        f"{type(moe).__name__} is {type(proj).__name__}: load the model from an MXFP4 checkpoint")
    return proj.weight_packed, proj.weight_scale


def _share_stacked_storage(experts: list[nn.Module], stacked: moe_mxfp4.StackedExperts) -> None:
    """Point each expert's buffers at its rows of the stack (w1 then w3 in w13), freeing the originals."""
    inter = stacked.w13_packed.shape[1] // 2
    for i, expert in enumerate(experts):
        expert.w1.weight_packed, expert.w1.weight_scale = stacked.w13_packed[i, :inter], stacked.w13_scale[i, :inter]
        expert.w3.weight_packed, expert.w3.weight_scale = stacked.w13_packed[i, inter:], stacked.w13_scale[i, inter:]
        expert.w2.weight_packed, expert.w2.weight_scale = stacked.w2_packed[i], stacked.w2_scale[i]


def install_expert_kernels(model: KimiK3ForCausalLM, max_step_tokens: int | None = None, *,
                           bf16_above_tokens: int | None = None) -> int:
    """Route every latent MoE's packed experts through the MXFP4 kernels (bf16 models on a supported
    GPU). Returns how many layers were switched.

    Where a step may hold more tokens (max_step_tokens: the scheduler's token budget) than
    `bf16_above_tokens` (MSTAR_MOE_BF16_TOKENS, `Environment.moe_bf16_tokens`) and the GPU runs `moe_bf16`,
    such steps run it: one bf16 scratch for one
    layer's experts (1.72 GiB at one TP8 rank of pruned75, see DequantizedExperts.allocate) is allocated
    for all layers, and a step of max_step_tokens runs through it once here, so that the first large step
    served compiles and allocates nothing. Otherwise nothing is allocated.
    """
    param = next(model.parameters())
    if param.dtype != torch.bfloat16 or not moe_mxfp4.supported(param.device):
        return 0
    switched = [layer.block_sparse_moe for layer in model.model.layers
                if hasattr(layer, "block_sparse_moe") and install_layer_kernel(layer.block_sparse_moe)]
    large = max_step_tokens is not None and bf16_above_tokens is not None and max_step_tokens > bf16_above_tokens
    if large and moe_bf16.supported(param.device):
        _install_bf16_path([moe.expert_kernel for moe in switched], bf16_above_tokens, max_step_tokens)
    return len(switched)


def _install_bf16_path(kernels: list[MXFP4Experts], above: int, max_step_tokens: int) -> None:
    """Give every layer's kernel the bf16 path, one scratch per expert shape (K3: one for all layers), and
    warm each scratch once. A kernel that has a path keeps it (another engine over the same model gave it)."""
    scratches: dict[tuple[int, int, int], moe_bf16.DequantizedExperts] = {}
    for kernel in kernels:
        if kernel.bf16 is not None:
            continue
        shape = moe_mxfp4.check_weights(*kernel.weights)
        fresh = shape not in scratches
        if fresh:
            scratches[shape] = moe_bf16.DequantizedExperts.allocate(*shape, kernel.weights.w13_packed.device)
        kernel.bf16 = moe_bf16.Bf16Path(above, scratches[shape])
        if fresh:
            kernel.warm_bf16(max_step_tokens)


def install_layer_kernel(moe: LatentMoE) -> bool:
    """Set `moe.expert_kernel` where the kernel fits this layer's experts; whether it did.
    Idempotent: a layer that has its kernel keeps it, because re-stacking would free the stack that
    captured CUDA graphs of another engine over the same model still read."""
    if moe.expert_kernel is not None:
        return True
    projections = [getattr(e, name) for e in moe.experts for name in EXPERT_PROJECTIONS]
    if not all(isinstance(p, MXFP4Linear) for p in projections):
        return False  # dense experts (an unquantized checkpoint): the kernel is MXFP4 only
    # The kernels tile both the latent and this rank's expert width by whole 128-column scale words.
    w1 = next(iter(moe.experts)).w1
    if w1.out_features % moe_mxfp4.SCALE_WORD or w1.in_features % moe_mxfp4.SCALE_WORD:
        return False
    moe.expert_kernel = MXFP4Experts(moe)
    return True


def install_fused_kernels(model: KimiK3ForCausalLM) -> bool:
    """One-launch Triton kernels for the small operations of a bf16/fp16 model on CUDA: every RMSNorm,
    every AttnRes mix + norm (kernels/attn_res_norm.py), KDA's gated head norms (kernels/kda_decode.py),
    the routers' selection (kernels/router_topk.py) and the dense SiTU MLPs (kernels/gated_mlp.py);
    KDA's and MLA's input projections become one GEMM each (kernels/stacked_linear.py). Whether they were
    installed. fp32/fp64 models keep the torch path, whose exact summation order the CPU reference shares."""
    param = next(model.parameters())
    if param.dtype not in (torch.bfloat16, torch.float16) or param.device.type != "cuda":
        return False
    for module in model.modules():
        if isinstance(module, RMSNorm):
            module.kernel = attn_res_norm.rms_norm_rows
        elif isinstance(module, GatedHeadNorm):
            module.kernel = kda_decode.gated_head_norm
        elif isinstance(module, Router) and module.config.num_expert_group == 1:
            module.kernel = _router_kernel(module)
        elif isinstance(module, GatedMLP) and module.config.hidden_act == "situ" and module.kernel is None:
            module.kernel = gated_mlp.fused_forward(module)  # once: it restacks the weights
        elif isinstance(module, KimiDeltaAttention) and module.stacked_inputs is None:
            kda_fla.stack_input_projections(module)
        elif isinstance(module, GatedMLA) and module.stacked_inputs is None:
            stack_mla_inputs(module)
    if model.config.attn_res_block_size is not None:
        model.model.mix_norm = attn_res_norm.attn_res_norm
    return True


def stack_mla_inputs(attn: GatedMLA) -> None:
    """Make x's projections in an MLA layer one GEMM (q_a or q, kv_a, the output gate; `StackedLinear`)."""
    first = attn.q_proj if attn.q_lora_rank is None else attn.q_a_proj
    attn.stacked_inputs = StackedLinear([first, attn.kv_a_proj_with_mqa] + ([attn.g_proj] if attn.g_proj else []))


def _router_kernel(router: Router):
    cfg = router.config

    def run(x: torch.Tensor) -> Routing:
        ids, weights = router_topk.route(x, router.weight, router.e_score_correction_bias, cfg.num_experts_per_token,
                                         cfg.moe_renormalize, cfg.routed_scaling_factor)
        return Routing(ids, weights)

    return run


def default_mixer_ops(device: torch.device) -> TorchMixerOps:
    """The fastest mixers this device supports (GPU kernels on CUDA when fla-core imports)."""
    if device.type == "cuda" and kda_fla.available():
        return GpuMixerOps()
    return TorchMixerOps()
