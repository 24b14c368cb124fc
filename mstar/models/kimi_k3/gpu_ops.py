"""Token mixers and experts on the GPU: the kernels that replace the torch path of the serving model.

- KDA runs through fla-core (`mstar/kernels/kda_fla.py`), any dtype.
- MLA runs the paged absorbed Triton kernels (`mstar/kernels/mla_attention.py`) for bf16 models: new
  latent rows are written to the pages first, then decode (one row per sequence, split-KV) or the
  multi-row causal kernel (prefill chunks, verify blocks) reads them.
- Routed experts run the MXFP4 W4A16 Triton kernels (`mstar/kernels/moe_mxfp4.py`) for bf16 models,
  on packed weights re-derived from the loaded ones (exact: the loaded experts are MXFP4 values).
The torch path is the reference every kernel is tested against, and the fallback where a kernel
does not support the device or dtype.
"""

from __future__ import annotations

import torch

from mstar.kernels import kda_fla, mla_attention, moe_mxfp4
from mstar.quant.mxfp4 import quantize_mxfp4
from mstar.resources.latent_kv import PagedLatentKV
from mstar.resources.recurrent_pool import RecurrentStatePool

from .kda import KimiDeltaAttention
from .mla import GatedMLA
from .model import KimiK3ForCausalLM
from .moe import LatentMoE
from .serving import BatchPlan, TorchMixerOps


class GpuMixerOps(TorchMixerOps):
    def kda(self, attn: KimiDeltaAttention, layer: int, x: torch.Tensor, plan: BatchPlan,
            pool: RecurrentStatePool) -> torch.Tensor:
        return kda_fla.kda_step(attn, layer, x, plan.seq_starts, plan.kda_slots, plan.verify, pool)

    def mla(self, attn: GatedMLA, layer: int, x: torch.Tensor, plan: BatchPlan, kv: PagedLatentKV) -> torch.Tensor:
        # The kernels are built for K3's latent row: 64 k_pe columns after the latent (512 in K3).
        if x.dtype != torch.bfloat16 or attn.rope != 64 or not mla_attention.supported(x.device):
            return super().mla(attn, layer, x, plan, kv)
        c_kv, k_pe = attn.latent_rows(x)
        kv.write(layer, plan.kv.slot_mapping, torch.cat([c_kv, k_pe], dim=-1))
        q_nope, q_pe = attn.queries(x)
        w_uk, w_uv = attn.kv_b_weights()  # [H, nope, R], [H, v, R]
        q_abs = torch.cat([torch.einsum("thd,hdr->thr", q_nope, w_uk), q_pe], dim=-1).contiguous()
        out = torch.empty(x.shape[0], attn.num_heads, attn.kv_lora_rank, device=x.device, dtype=x.dtype)
        cache, table, lens = kv.cache[layer], plan.kv.page_table, plan.kv.context_lens
        scale = attn.scale
        rows = [plan.seq_starts[b + 1] - plan.seq_starts[b] for b in range(len(plan.num_computed))]
        if max(rows) == 1:
            splits = mla_attention.num_splits_for(len(rows), attn.num_heads, max(plan.num_computed) + 1)
            mla_attention.paged_mla_decode(q_abs, cache, table, lens, scale, out, num_splits=splits)
        else:
            cu = torch.tensor(plan.seq_starts, device=x.device)
            mla_attention.paged_mla_prefill(q_abs, cache, table, cu, lens, scale, out, max_query_len=max(rows))
        o = torch.einsum("thr,hvr->thv", out, w_uv)
        return attn.output(o, x)


class MXFP4Experts:
    """A `LatentMoE`'s routed experts as stacked MXFP4 tensors for the Triton kernels."""

    def __init__(self, moe: LatentMoE):
        pairs = {name: [quantize_mxfp4(getattr(e, name).weight.detach().float()) for e in moe.experts]
                 for name in ("w1", "w3", "w2")}
        device = moe.experts[0].w1.weight.device
        stacked = moe_mxfp4.stack_experts(pairs["w1"], pairs["w3"], pairs["w2"])
        self.weights = moe_mxfp4.StackedExperts(*(t.to(device) for t in stacked))

    def __call__(self, z: torch.Tensor, expert_ids: torch.Tensor, expert_weights: torch.Tensor) -> torch.Tensor:
        return moe_mxfp4.moe_mxfp4(z, expert_ids, expert_weights.float(), *self.weights)


def install_expert_kernels(model: KimiK3ForCausalLM) -> int:
    """Route every latent MoE's experts through the MXFP4 kernels (bf16 models on a supported GPU).
    Returns how many layers were switched."""
    param = next(model.parameters())
    if param.dtype != torch.bfloat16 or not moe_mxfp4.supported(param.device):
        return 0
    count = 0
    for layer in model.model.layers:
        moe = getattr(layer, "block_sparse_moe", None)
        if moe is None or len(moe.experts) != model.config.num_experts:
            continue  # dense layer, or expert parallelism (the kernel indexes all experts by global id)
        # The kernels tile both the latent and this rank's expert width by whole 128-column scale words.
        inter, latent = next(iter(moe.experts)).w1.weight.shape
        if inter % 128 or latent % 128:
            continue
        moe.expert_kernel = MXFP4Experts(moe)
        count += 1
    return count


def default_mixer_ops(device: torch.device) -> TorchMixerOps:
    """The fastest mixers this device supports (GPU kernels on CUDA when fla-core imports)."""
    if device.type == "cuda" and kda_fla.available():
        return GpuMixerOps()
    return TorchMixerOps()
