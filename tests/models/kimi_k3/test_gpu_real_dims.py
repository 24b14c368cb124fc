"""The GPU kernels inside the serving path at one TP8 rank's true K3 shapes (bf16): each mixer (fla KDA,
paged Triton MLA) on a real step plan against the torch mixer on cloned pools, and the MXFP4 expert
kernel against the torch experts on the same routing. (Whole-model bf16 logits are not compared: the
router's top-k flips on near ties between any two bf16 paths, which changes outputs by design.)"""

import copy

import pytest
import torch
from packed_experts import hold_packed

from mstar.kernels import kda_fla
from mstar.models.kimi_k3.config import parse_config
from mstar.models.kimi_k3.gpu_ops import GpuLayerOps, GpuMixerOps, MXFP4Experts
from mstar.models.kimi_k3.kda import KimiDeltaAttention
from mstar.models.kimi_k3.mla import GatedMLA
from mstar.models.kimi_k3.moe import LatentMoE
from mstar.models.kimi_k3.serving import BatchPlan, TorchMixerOps
from mstar.resources.latent_kv import PagedLatentKV
from mstar.resources.recurrent_pool import RecurrentStatePool
from mstar.resources.step import SeqStep, StepDecl
from mstar.tools.make_tiny import real_dims_raw_config

pytestmark = pytest.mark.skipif(not kda_fla.available(), reason="needs CUDA and fla-core")
BF16 = torch.bfloat16
LENGTHS = (1, 9, 40, 300)


@pytest.fixture(scope="module")
def cfg():
    return parse_config(real_dims_raw_config(num_layers=4, num_experts=32, tp_size=8, tp_rank=0))


def plans(kv, pool):
    """A prefill step of 4 prompts, then a decode step and a verify step of 4 rows each."""
    prefill = StepDecl(tuple(SeqStep(f"r{i}", 0, tuple(range(n)), True) for i, n in enumerate(LENGTHS)))
    decode = StepDecl(tuple(SeqStep(f"r{i}", n, (1,), True) for i, n in enumerate(LENGTHS)))
    verify = StepDecl(tuple(SeqStep(f"r{i}", n + 1, (1,), True, verify=True, num_drafts=3)
                            for i, n in enumerate(LENGTHS)))
    for decl in (prefill, decode, verify):
        kv.admit(decl)
        pool.admit(decl)
        starts = [0]
        for s in decl.seqs:
            starts.append(starts[-1] + s.num_tokens)
        yield decl, BatchPlan(input_ids=None, seq_starts=tuple(starts), num_computed=tuple(s.num_computed for s in
                              decl.seqs), kv=kv.plan(decl), kda_slots=pool.plan(decl), sample_rows=None,
                              verify=tuple(s.verify for s in decl.seqs))


def rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


def chunked_plans(kv, pool):
    """Prefill steps the roofline gives MLA's expanded form: prompts of 1, 40 and 700 tokens, then the third one's
    next chunk of 500 after its 700 cached rows (a prefix ending inside a page) beside the others' decode rows."""
    fresh = StepDecl((SeqStep("r0", 0, (1,), True), SeqStep("r1", 0, tuple(range(40)), True),
                      SeqStep("r2", 0, tuple(range(700)), False)))
    chunk = StepDecl((SeqStep("r0", 1, (1,), True), SeqStep("r1", 40, (1,), True),
                      SeqStep("r2", 700, tuple(range(500)), True)))
    for decl in (fresh, chunk):
        kv.admit(decl)
        pool.admit(decl)
        starts = [0]
        for seq in decl.seqs:
            starts.append(starts[-1] + seq.num_tokens)
        yield decl, BatchPlan(input_ids=None, seq_starts=tuple(starts),
                              num_computed=tuple(seq.num_computed for seq in decl.seqs), kv=kv.plan(decl),
                              kda_slots=pool.plan(decl), sample_rows=None, verify=(False,) * len(decl.seqs))


def test_mla_expanded_form_matches_torch_on_step_plans(cfg):
    """The expanded MLA form inside GpuMixerOps.mla (bf16, one TP8 rank's K3 widths) on prefill steps its roofline
    picks, fresh and after cached rows, against the torch mixer on a cloned cache."""
    from mstar.models.kimi_k3.gpu_ops import mla_dims
    from mstar.models.kimi_k3.step_metadata import mla_step

    with torch.device("cuda"):
        attn = GatedMLA(cfg, 3).to(BF16)
        la = cfg.linear_attn
        kv = PagedLatentKV(1, 64, 64, cfg.kv_cache_width, BF16, "cuda")
        pool = RecurrentStatePool(1, 5, la.num_heads, la.head_dim, 4, torch.float32, BF16, "cuda",
                                  hidden_size=cfg.hidden_size, max_block=4)
    ref_kv, ref_pool = copy.deepcopy(kv), copy.deepcopy(pool)
    gpu, cpu_path = GpuMixerOps(frozenset({attn}), fused=True), TorchMixerOps()
    with torch.no_grad():
        for (decl, plan), (_, ref_plan) in zip(chunked_plans(kv, pool), chunked_plans(ref_kv, ref_pool), strict=True):
            step = mla_step(plan, attn.num_heads, torch.device("cuda"), mla_dims(attn))
            assert step.expanded and (step.prefix_lens is not None) == any(plan.num_computed)
            x = torch.randn(plan.seq_starts[-1], cfg.hidden_size, device="cuda", dtype=BF16)
            y, expect = gpu.mla(attn, 0, x, plan, kv), cpu_path.mla(attn, 0, x, ref_plan, ref_kv)
            assert torch.isfinite(y).all()
            assert rel(y, expect) < 3e-2, rel(y, expect)
            for res in (kv, pool, ref_kv, ref_pool):
                res.commit(decl)
    assert rel(kv.cache, ref_kv.cache) < 1e-2


@pytest.mark.parametrize("kind", ["kda", "mla"])
def test_mixer_kernels_match_torch_on_step_plans(cfg, kind):
    layer = 0 if kind == "kda" else 3
    with torch.device("cuda"):
        attn = (KimiDeltaAttention if kind == "kda" else GatedMLA)(cfg, layer).to(BF16)
        la = cfg.linear_attn
        kv = PagedLatentKV(1, 64, 64, cfg.kv_cache_width, BF16, "cuda")
        pool = RecurrentStatePool(1, 5, la.num_heads, la.head_dim, 4, torch.float32, BF16, "cuda",
                                  hidden_size=cfg.hidden_size, max_block=4)
    ref_kv, ref_pool = copy.deepcopy(kv), copy.deepcopy(pool)
    gpu, cpu_path = GpuMixerOps(frozenset({attn}) if kind == "mla" else frozenset()), TorchMixerOps()
    with torch.no_grad():
        for (decl, plan), (_, ref_plan) in zip(plans(kv, pool), plans(ref_kv, ref_pool), strict=True):
            x = torch.randn(plan.seq_starts[-1], cfg.hidden_size, device="cuda", dtype=BF16)
            if kind == "kda":
                y, expect = gpu.kda(attn, 0, x, plan, pool), cpu_path.kda(attn, 0, x, ref_plan, ref_pool)
            else:
                y, expect = gpu.mla(attn, 0, x, plan, kv), cpu_path.mla(attn, 0, x, ref_plan, ref_kv)
            assert torch.isfinite(y).all()
            assert rel(y, expect) < 3e-2, rel(y, expect)
            for res in (kv, pool, ref_kv, ref_pool):
                res.commit(decl)
    if kind == "kda":
        assert rel(pool.state[0, 1:5], ref_pool.state[0, 1:5]) < 3e-2
    else:
        assert rel(kv.cache, ref_kv.cache) < 1e-2


def test_expert_kernel_matches_torch_experts(cfg):
    with torch.device("cuda"):
        moe = LatentMoE(cfg).to(BF16)
    gen = torch.Generator(device="cuda").manual_seed(int(torch.randint(0, 2**31, ())))
    hold_packed(moe.experts, gen)  # held packed, as loaded from an MXFP4 checkpoint
    with torch.no_grad():
        for tokens in (1, 8, 64, 300):
            x = torch.randn(tokens, cfg.hidden_size, device="cuda", dtype=BF16)
            routing = moe.gate(x)
            z = moe.routed_expert_down_proj(x)
            expect = moe.routed(z, routing)
            got = GpuLayerOps({moe: MXFP4Experts(moe)}).routed(moe, z, routing)
            assert rel(got, expect) < 1e-2, (tokens, rel(got, expect))
