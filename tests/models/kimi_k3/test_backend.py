"""The kernel backend (models/kimi_k3/backend.py): the one selection function, and that serving with kernels
leaves the reference model as it was."""

import copy
import os

import pytest
import torch
from engine_run import greedy, numbered, run_to_completion
from greedy_ties import assert_greedy_matches, random_jobs

from mstar.config import EngineConfig
from mstar.engine.core import EngineCore
from mstar.models.kimi_k3.backend import REFERENCE, select_backend
from mstar.models.kimi_k3.generate import greedy_generate
from mstar.models.kimi_k3.mla import GatedMLA
from mstar.models.kimi_k3.moe import LatentMoE
from mstar.models.kimi_k3.tokenizer import KimiTokenizer


def test_a_cpu_model_gets_the_reference_path(tiny_model):
    assert select_backend(tiny_model) is REFERENCE
    assert select_backend(tiny_model, "torch") is REFERENCE
    with pytest.raises(ValueError, match="kernels='triton'"):
        select_backend(tiny_model, "triton")


def test_gpu_kernels_are_refused_where_the_device_dtype_or_weights_do_not_fit(tiny_model):
    pytest.importorskip("triton")  # gpu_ops imports the kernel modules
    from mstar.models.kimi_k3 import gpu_ops

    attn = next(m for m in tiny_model.modules() if isinstance(m, GatedMLA))
    assert not gpu_ops.mla_kernel_fits(attn, torch.bfloat16, torch.device("cpu"))  # no CUDA device
    assert not gpu_ops.mla_kernel_fits(attn, torch.float32, torch.device("cpu"))
    assert not gpu_ops.moe_mxfp4.supported("cpu")
    moe = next(m for m in tiny_model.modules() if isinstance(m, LatentMoE))
    assert not gpu_ops.expert_kernel_fits(moe)  # dense experts: the MXFP4 kernel does not take them


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the GPU kernels through Triton's interpreter")
def test_serving_with_every_gpu_op_leaves_the_reference_as_it_was(tiny_model, tiny_dir):
    """An engine whose serving model runs the GPU backend's ops (fused norms, AttnRes, router, SiTU MLP, stacked
    projections; here under the interpreter in fp32) serves a prompt; the reference model then computes the
    same logits as before, from the same parameter objects, with the same state_dict."""
    pytest.importorskip("fla.ops.kda")
    from mstar.engine.params import SamplingParams
    from mstar.models.kimi_k3.gpu_ops import GpuLayerOps, GpuMixerOps

    model = copy.deepcopy(tiny_model)
    prompt = torch.arange(5, 17)
    before = model(prompt).logits
    params = dict(model.named_parameters())
    state = {k: v.clone() for k, v in model.state_dict().items()}
    config = EngineConfig(max_seq_len=64, resources={"mla_kv": {"page_size": 16, "max_num_pages": 16}})
    core = EngineCore(model, KimiTokenizer.from_dir(tiny_dir), config)
    mla = frozenset(m for m in model.modules() if isinstance(m, GatedMLA))
    core.runner.serving.ops, core.runner.serving.layer_ops = GpuMixerOps(mla, fused=True), GpuLayerOps()
    core.add_request("r", prompt.tolist(), SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    served = run_to_completion(core).tokens("r")
    # the MLA layers through the paged kernels (their rows normed and written in one launch), the rest fused
    assert_greedy_matches(model, [(prompt.tolist(), 3, greedy_generate(model, prompt.tolist(), 3))], [served])
    assert all(p is params[name] for name, p in model.named_parameters())  # stacking moved storage only
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    assert torch.equal(model(prompt).logits, before)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the GPU kernels through Triton's interpreter")
def test_long_prefill_chunks_through_the_expanded_mla_form_serve_the_reference_greedy(tiny_model, tiny_dir):
    """Prefill steps long enough for MLA's expanded form (the tiny model's widths: from 128 tokens a sequence,
    step_metadata.expanded_form) run it under the interpreter, fp32, fused (the new rows normed as they are
    written, then read back): a fresh chunk beside a short prompt, then the prompt's next chunk after 146 cached
    rows (a prefix ending inside a page) beside the short request's decode row (a prefix of its own); the served
    tokens equal the reference's greedy ones. The KDA layers and the other sublayers take the torch path (the
    test above runs them interpreted; at these lengths that would take minutes)."""
    from mstar.models.kimi_k3.gpu_ops import GpuMixerOps
    from mstar.models.kimi_k3.serving import TorchMixerOps

    class MLAKernelsOnly(GpuMixerOps):
        kda = TorchMixerOps.kda

        def step_metadata(self, plan, pool):
            return None  # each MLA layer builds the MLA part itself; the torch KDA path reads the plan

    model = copy.deepcopy(tiny_model)
    jobs = random_jobs(model, [9, 290], (2, 2))
    config = EngineConfig(max_seq_len=320, resources={"mla_kv": {"page_size": 16, "max_num_pages": 32}},
                          scheduler={"max_num_batched_tokens": 155}, model_kwargs={"cuda_graphs": False})
    core = EngineCore(model, KimiTokenizer.from_dir(tiny_dir), config)
    ops = MLAKernelsOnly(frozenset(m for m in model.modules() if isinstance(m, GatedMLA)), fused=True)
    core.runner.serving.ops = ops
    expanded_steps = []  # per expanded call: whether a prefix pass ran
    run_expanded = ops._mla_expanded

    def counted(attn, q_nope, q_pe, cache, plan, step):
        expanded_steps.append(step.prefix_lens is not None)
        return run_expanded(attn, q_nope, q_pe, cache, plan, step)

    ops._mla_expanded = counted
    run = run_to_completion(core, numbered(jobs, greedy))
    mla_layers = len(ops.mla_layers)
    assert expanded_steps.count(False) >= mla_layers and expanded_steps.count(True) >= mla_layers, expanded_steps
    assert_greedy_matches(model, jobs, run.numbered_tokens(len(jobs)))


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the GPU kernels through Triton's interpreter")
def test_a_captured_prefill_buckets_mla_step_takes_the_expanded_form_like_the_torch_mixer(tiny_model):
    """An MLA layer of a staged prefill step (what a prefill graph replays: lengths on the device only) whose bucket
    the roofline gives to the expanded form: a fresh 150-token prompt, a decode row after 20 cached rows and a
    140-token chunk after 37, then the bucket's padding sequence (on the sink, no cached row) and an empty one.
    The real rows equal the torch mixer's on the plan itself, the padding rows come out finite, the rows written
    to the cache are the same."""
    from mstar.models.kimi_k3.gpu_ops import GpuMixerOps
    from mstar.models.kimi_k3.serving import BatchPlan, StagedLayout, StepKind, TorchMixerOps
    from mstar.models.kimi_k3.step_metadata import mla_step
    from mstar.resources.latent_kv import LatentKVPlan, PagedLatentKV

    attn = next(m for m in tiny_model.modules() if isinstance(m, GatedMLA))
    page, pages_per_seq, bucket = 16, 12, 320
    lengths, cached = [150, 1, 140], [0, 20, 37]
    kv = PagedLatentKV(1, 1 + 3 * pages_per_seq, page, attn.kv_lora_rank + attn.rope, torch.float32)
    kv.cache.normal_()
    ref_kv = copy.deepcopy(kv)
    table = 1 + torch.randperm(3 * pages_per_seq).view(3, pages_per_seq)
    starts, slots = [0], []
    for b, (n, c) in enumerate(zip(lengths, cached, strict=True)):
        positions = torch.arange(c, c + n)
        slots.append(table[b, positions // page] * page + positions % page)
        starts.append(starts[-1] + n)
    real = BatchPlan(input_ids=None, seq_starts=tuple(starts), num_computed=tuple(cached),
                     kv=LatentKVPlan(table, torch.cat(slots), torch.tensor(lengths) + torch.tensor(cached)),
                     kda_slots=None, sample_rows=None, verify=(False,) * 3)
    rows = starts[-1]
    staged_kv = LatentKVPlan(torch.cat([table, torch.zeros(2, pages_per_seq, dtype=table.dtype)]),
                             torch.cat([real.kv.slot_mapping, torch.zeros(bucket - rows, dtype=torch.long)]),
                             torch.cat([real.kv.context_lens, torch.zeros(2, dtype=torch.long)]))
    cu = torch.tensor(starts + [bucket, bucket])
    staged = BatchPlan(input_ids=None, seq_starts=(0,) + (bucket,) * 5, num_computed=(0,) * 5, kv=staged_kv,
                       kda_slots=None, sample_rows=None, kind=StepKind.STAGED_PREFILL,
                       staged=StagedLayout(cu, None, max_query_len=bucket))
    ops = GpuMixerOps(frozenset({attn}), fused=True)
    assert mla_step(staged, attn.num_heads, torch.device("cpu"), ops.mla_dims).expanded
    x = torch.randn(bucket, tiny_model.config.hidden_size)
    with torch.no_grad():
        got = ops.mla(attn, 0, x, staged, kv)  # the layer builds the step's MLA metadata itself
        expect = TorchMixerOps().mla(attn, 0, x[:rows], real, ref_kv)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got[:rows], expect, rtol=1e-4, atol=1e-5)
    written = real.kv.slot_mapping
    torch.testing.assert_close(kv.cache.view(-1, kv.cache.shape[-1])[written],
                               ref_kv.cache.view(-1, ref_kv.cache.shape[-1])[written], rtol=1e-5, atol=1e-6)
