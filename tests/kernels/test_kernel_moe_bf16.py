"""moe_bf16 (large steps: bf16 grouped GEMMs on experts dequantized once per layer) against dequantize_mxfp4,
the torch references and the MXFP4 kernel; MSTAR_MOE_BF16_TOKENS and the selection in MXFP4Experts.

Without CUDA the Triton kernels run in the interpreter (conftest.py sets TRITON_INTERPRET=1) and
torch._grouped_mm runs its CPU loop. Every run draws fresh weights, activations and routing (the seed is
printed); outputs and the bf16 scratch are filled with NaN before each call. The GPU tests run at one TP8
rank's expert shapes of pruned75 (H_lat = 3584, I = 384, top-16) over 32 experts, and skip elsewhere.
"""

from __future__ import annotations

import copy

import pytest
import torch
from packed_experts import hold_packed
from test_kernel_moe_mxfp4 import (
    BF16_BOUND,
    INTERPRET,
    RANK_H,
    RANK_I,
    RANK_K,
    TINY_DEVICE,
    TINY_H,
    TINY_I,
    drop_some,
    gpu,
    needs_kernel_device,
    new_generator,
    relative_error,
    routing,
    run_kernel,
    tiny_experts,
)

from mstar.config import Environment, ServeConfigError
from mstar.distributed.communicator import NullCommunicator
from mstar.distributed.expert_sharding import ExpertSharding
from mstar.kernels import moe_bf16
from mstar.kernels import moe_mxfp4 as moe
from mstar.models.kimi_k3.dequant_ahead import Bf16Path, DequantAhead
from mstar.models.kimi_k3.gpu_ops import GpuLayerOps, MXFP4Experts, expert_kernel_fits, expert_kernels
from mstar.models.kimi_k3.moe import LatentMoE
from mstar.quant.mxfp4 import dequantize_mxfp4, random_mxfp4
from mstar.quant.mxfp4_words import from_word_layout

GPU_E = 32  # experts in the GPU tests: real per-rank expert shapes, fewer of them to keep it quick
hopper = pytest.mark.skipif(not (torch.cuda.is_available() and moe_bf16.supported("cuda")) or INTERPRET,
                            reason="the bf16 path serves on sm_90 only (CUDA graphs, install)")


def poisoned_scratch(stacked: moe.StackedExperts) -> moe_bf16.DequantizedExperts:
    scratch = moe_bf16.DequantizedExperts.allocate(*moe.check_weights(*stacked), stacked.w13_packed.device)
    scratch.w13.fill_(float("nan"))
    scratch.w2.fill_(float("nan"))
    return scratch


def run_bf16(z, ids, weights, stacked, scratch=None) -> torch.Tensor:
    """moe_bf16 into a NaN-filled output, through a NaN-filled scratch unless one is given."""
    out = torch.full((z.shape[0], z.shape[1]), float("nan"), device=z.device)
    result = moe_bf16.moe_bf16(z, ids, weights, *stacked, scratch=scratch or poisoned_scratch(stacked), out=out)
    assert result.data_ptr() == out.data_ptr()
    return out


# ----------------------------------------------------------------------------------------------
# Tiny shapes: interpreter on the CPU, compiled on a GPU
# ----------------------------------------------------------------------------------------------


def random_stacked_bytes(gen, num_experts: int, hidden: int, inter: int, top_scale: int) -> moe.StackedExperts:
    """Stacked experts of uniformly random bytes (read in the word layout): every code at every place of a word
    (negative zero too), and scale bytes from 64 to top_scale."""

    def u8(*shape, low=0, high=256):
        return torch.randint(low, high, shape, generator=gen, device=gen.device, dtype=torch.int32).to(torch.uint8)

    return moe.StackedExperts(
        u8(num_experts, 2 * inter, hidden // 2), u8(num_experts, 2 * inter, hidden // 32, low=64, high=top_scale + 1),
        u8(num_experts, hidden, inter // 2), u8(num_experts, hidden, inter // 32, low=64, high=top_scale + 1))


@needs_kernel_device
@pytest.mark.parametrize("decode", ["subnormal", "select"])
def test_dequantize_experts_is_exact(decode):
    gen = new_generator(TINY_DEVICE)
    top = moe.MAX_SUBNORMAL_DECODE_SCALE if decode == "subnormal" else 192
    stacked = random_stacked_bytes(gen, 3, 256, TINY_I, top)
    scratch = moe_bf16.dequantize_experts(stacked, poisoned_scratch(stacked), decode=decode)
    for e in range(3):
        w13 = from_word_layout(stacked.w13_packed[e]), stacked.w13_scale[e]
        w2 = from_word_layout(stacked.w2_packed[e]), stacked.w2_scale[e]
        assert torch.equal(scratch.w13[e], dequantize_mxfp4(*w13, torch.bfloat16))
        assert torch.equal(scratch.w2[e], dequantize_mxfp4(*w2, torch.bfloat16))


@needs_kernel_device
def test_sort_by_expert_groups_pairs():
    """Unpadded sort at one rank's routing (224 experts, top-16; skewed, some pairs DROPPED): each expert's
    pairs in pair order between its end rows, each pair's row pointing back at it."""
    gen = new_generator(TINY_DEVICE)
    num_tokens, num_experts = 300, 224
    ids, _ = routing(num_tokens, num_experts, RANK_K, gen, "skewed")
    ids = drop_some(ids, gen)
    pairs = ids.numel()
    sorted_pair = torch.full((pairs,), -7, dtype=torch.int32, device=TINY_DEVICE)
    pair_row = torch.full((pairs,), -7, dtype=torch.int32, device=TINY_DEVICE)
    expert_end = torch.full((num_experts,), -7, dtype=torch.int32, device=TINY_DEVICE)
    moe.sort_by_expert(ids, num_experts, sorted_pair, expert_end, pair_row)
    flat, ends = ids.reshape(-1).cpu(), expert_end.cpu()
    counts = torch.bincount(flat[flat >= 0], minlength=num_experts)
    assert torch.equal(ends, counts.cumsum(0).to(torch.int32))
    kept = (flat >= 0).nonzero().flatten()
    order = kept[torch.argsort(flat[kept], stable=True)]  # by expert, then pair
    assert torch.equal(sorted_pair[: kept.numel()].cpu(), order.to(torch.int32))
    assert torch.equal(pair_row.cpu()[order], torch.arange(kept.numel(), dtype=torch.int32))
    assert (sorted_pair[kept.numel():] == -7).all() and (pair_row.cpu()[flat < 0] == -7).all()


@needs_kernel_device
@pytest.mark.parametrize(("num_tokens", "pattern", "drop"), [(3, "random", False), (20, "skewed", False),
                                                             (20, "hot", False), (9, "random", True),
                                                             (7, "repeat_in_token", True)])
def test_tiny_matches_reference_and_mxfp4(num_tokens, pattern, drop):
    """8 experts at top-2: some experts get no token ("hot": all on 2 experts), DROPPED pairs (other ranks'
    experts) add nothing; equal to the fp32 reference and to the MXFP4 kernel within bf16 bounds."""
    gen = new_generator(TINY_DEVICE)
    stacked = tiny_experts(gen, 8)
    z = torch.randn(num_tokens, TINY_H, generator=gen, device=TINY_DEVICE).to(torch.bfloat16)
    ids, weights = routing(num_tokens, 8, 2, gen, pattern)
    if drop:
        ids = drop_some(ids, gen)
    out = run_bf16(z, ids, weights, stacked)
    assert relative_error(out, moe.moe_mxfp4_reference(z, ids, weights, *stacked)) < BF16_BOUND
    kernel, _, _ = run_kernel(z, ids, weights, stacked)
    assert relative_error(out, kernel) < BF16_BOUND


@needs_kernel_device
def test_all_pairs_dropped_give_zero():
    gen = new_generator(TINY_DEVICE)
    stacked = tiny_experts(gen)
    z = torch.randn(4, TINY_H, generator=gen, device=TINY_DEVICE).to(torch.bfloat16)
    ids, weights = routing(4, 4, 2, gen)
    out = run_bf16(z, torch.full_like(ids, moe.DROPPED), weights, stacked)
    assert torch.equal(out, torch.zeros_like(out))


def test_scratch_and_out_are_checked():
    gen = new_generator("cpu")
    stacked = tiny_experts(gen)
    wrong = moe_bf16.DequantizedExperts.allocate(3, TINY_H, TINY_I, "cpu")
    with pytest.raises(ValueError, match="DequantizedExperts.allocate"):
        moe_bf16.dequantize_experts(stacked, wrong)
    z = torch.zeros(2, TINY_H, dtype=torch.bfloat16)
    ids, weights = torch.zeros(2, 1, dtype=torch.int64), torch.ones(2, 1)
    with pytest.raises(ValueError, match="out must be"):
        moe_bf16.moe_bf16(z, ids, weights, *stacked, scratch=poisoned_scratch(stacked), out=torch.empty(2, 3))
    with pytest.raises(ValueError, match="z must be bf16"):
        moe_bf16.moe_bf16(z.float(), ids, weights, *stacked, scratch=poisoned_scratch(stacked))


# ----------------------------------------------------------------------------------------------
# MSTAR_MOE_BF16_TOKENS and the selection in MXFP4Experts
# ----------------------------------------------------------------------------------------------


def test_threshold_from_env():
    assert Environment.read({}).moe_bf16_tokens == 6144
    assert Environment.read({"MSTAR_MOE_BF16_TOKENS": " 2048"}).moe_bf16_tokens == 2048
    for bad in ("-1", "1.5", "many"):
        with pytest.raises(ServeConfigError, match="MSTAR_MOE_BF16_TOKENS must be a non-negative integer"):
            Environment.read({"MSTAR_MOE_BF16_TOKENS": bad})
    assert not moe_bf16.supported("cpu")


def packed_latent_moe(tiny_model, gen, sharding: ExpertSharding | None = None) -> LatentMoE:
    """A bf16 LatentMoE at kernel-sized widths (latent and expert width 128, 4 experts, top-2) whose experts
    hold random canonical MXFP4 tensors."""
    config = tiny_model.config.with_overrides(
        routed_expert_hidden_size=TINY_H, moe_intermediate_size=TINY_I, num_experts=4, num_experts_per_token=2,
        num_expert_group=1, topk_group=1)
    comm = None if sharding is None else NullCommunicator(sharding.tp_size, sharding.rank)
    with torch.device(TINY_DEVICE):
        layer = LatentMoE(config, comm, sharding).to(torch.bfloat16)
    hold_packed(layer.experts, gen)
    return layer


@needs_kernel_device
@pytest.mark.parametrize("layout", ["whole", "ep2_rank1"])
def test_layer_takes_bf16_path_above_threshold(tiny_model, layout):
    """MXFP4Experts with a bf16 path above 8 tokens: 8 tokens run the MXFP4 kernel (the scratch stays NaN),
    9 the bf16 path (the scratch then holds the layer's experts); both equal the torch experts of an fp32
    copy of the layer (under EP, a rank's partial sum: pairs of the other rank's experts dropped)."""
    gen = new_generator(TINY_DEVICE)
    sharding = ExpertSharding(4, TINY_I, 2, 2, 1) if layout == "ep2_rank1" else None
    layer = packed_latent_moe(tiny_model, gen, sharding)
    reference = copy.deepcopy(layer).float()  # fp32 activations; the MXFP4 weights are exact in any float
    assert expert_kernel_fits(layer)
    kernel = MXFP4Experts(layer)
    ahead = DequantAhead([kernel.weights], TINY_DEVICE)
    (scratch,) = ahead.scratches
    scratch.w13.fill_(float("nan"))
    kernel.bf16 = Bf16Path(8, ahead, 0)
    for num_tokens, bf16_path in ((8, False), (9, True)):
        x = torch.randn(num_tokens, layer.config.hidden_size, generator=gen, device=TINY_DEVICE).to(torch.bfloat16)
        with torch.no_grad():
            route = layer.gate(x)
            z = layer.routed_expert_down_proj(x)
            got = GpuLayerOps({layer: kernel}).routed(layer, z, route)
            expect = reference.routed(z.float(), route)
        assert relative_error(got, expect) < BF16_BOUND
        assert bool(scratch.w13.isnan().all()) != bf16_path
    w13 = from_word_layout(kernel.weights.w13_packed[0]), kernel.weights.w13_scale[0]
    assert torch.equal(scratch.w13[0], dequantize_mxfp4(*w13, torch.bfloat16))


# ----------------------------------------------------------------------------------------------
# DequantAhead: each layer's experts dequantized a layer ahead into one of two scratches
# ----------------------------------------------------------------------------------------------


def layer_inputs(gen, num_layers: int, num_tokens: int, num_experts: int, top_k: int, hidden: int):
    """Per layer: (z, ids, weights) drawn afresh, some pairs DROPPED."""
    inputs = []
    for _ in range(num_layers):
        z = torch.randn(num_tokens, hidden, generator=gen, device=gen.device).to(torch.bfloat16)
        ids, weights = routing(num_tokens, num_experts, top_k, gen)
        inputs.append((z, drop_some(ids, gen), weights))
    return inputs


def run_layers(ahead: DequantAhead, order: list[int], inputs) -> dict[int, torch.Tensor]:
    """The layers of `order` through `ahead`'s bf16 path (one step), each output by layer."""
    return {i: Bf16Path(0, ahead, i)(*inputs[i]) for i in order}


@needs_kernel_device
def test_dequant_ahead_serves_each_layer_its_own_experts():
    """Three layers of different experts, two steps and a step that starts at the middle layer (nothing queued
    ahead for it): each layer's output equals moe_bf16 on its own experts bit for bit, and once a layer has taken
    its experts the next layer's are already in the other scratch."""
    gen = new_generator(TINY_DEVICE)
    layers = [tiny_experts(gen, 8) for _ in range(3)]
    inputs = layer_inputs(gen, 3, 5, 8, 2, TINY_H)
    expected = {i: run_bf16(*inputs[i], layers[i]) for i in range(3)}
    ahead = DequantAhead(layers, TINY_DEVICE)
    assert len(ahead.scratches) == 2
    for scratch in ahead.scratches:
        scratch.w13.fill_(float("nan"))
        scratch.w2.fill_(float("nan"))
    for order in ([0, 1, 2], [0, 1, 2], [1, 2]):
        got = run_layers(ahead, order, inputs)
        assert all(torch.equal(got[i], expected[i]) for i in order), order
    for i in range(2):
        ahead.experts(i)
        following = moe_bf16.dequantize_experts(layers[i + 1], poisoned_scratch(layers[i + 1]))
        assert torch.equal(ahead.scratches[(i + 1) % 2].w13, following.w13)
        assert torch.equal(ahead.scratches[(i + 1) % 2].w2, following.w2)
        ahead.release(i)


def test_dequant_ahead_takes_one_expert_shape():
    gen = new_generator("cpu")
    with pytest.raises(ValueError, match="one expert shape"):
        DequantAhead([tiny_experts(gen, 4), tiny_experts(gen, 8)], "cpu")
    assert len(DequantAhead([tiny_experts(gen, 4)], "cpu").scratches) == 1


# ----------------------------------------------------------------------------------------------
# GPU: real per-rank expert shapes
# ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gpu_experts():
    gen = new_generator("cuda")
    w13_packed, w13_scale = random_mxfp4(GPU_E * 2 * RANK_I, RANK_H, gen)
    w2_packed, w2_scale = random_mxfp4(GPU_E * RANK_H, RANK_I, gen)
    return moe.StackedExperts(w13_packed.view(GPU_E, 2 * RANK_I, -1), w13_scale.view(GPU_E, 2 * RANK_I, -1),
                              w2_packed.view(GPU_E, RANK_H, -1), w2_scale.view(GPU_E, RANK_H, -1))


def gpu_inputs(num_tokens: int, pattern: str = "random", drop: bool = False):
    gen = new_generator("cuda")
    z = torch.randn(num_tokens, RANK_H, generator=gen, device="cuda").to(torch.bfloat16)
    ids, weights = routing(num_tokens, GPU_E, RANK_K, gen, pattern)
    return z, drop_some(ids, gen) if drop else ids, weights


@gpu
def test_gpu_selects_only_on_hopper():
    assert moe_bf16.supported("cuda") == (torch.cuda.get_device_capability() == (9, 0))


@gpu
@pytest.mark.parametrize(("num_tokens", "pattern", "drop"), [(6145, "random", False), (8192, "skewed", True)])
def test_gpu_bf16_matches_mxfp4(gpu_experts, num_tokens, pattern, drop):
    z, ids, weights = gpu_inputs(num_tokens, pattern, drop)
    out = run_bf16(z, ids, weights, gpu_experts)
    kernel, _, config = run_kernel(z, ids, weights, gpu_experts)
    ref = moe.moe_mxfp4_reference(z, ids, weights, *gpu_experts)
    err_kernel, err_ref = relative_error(out, kernel), relative_error(out, ref)
    print(f"T={num_tokens} {pattern} drop={drop}: vs moe_mxfp4 ({config}) {err_kernel:.2e}, vs fp32 {err_ref:.2e}")
    assert err_kernel < BF16_BOUND and err_ref < BF16_BOUND


@hopper
def test_gpu_cuda_graph_replay(gpu_experts):
    """Captured at 6145 tokens (no host sync: torch._grouped_mm reads the offsets on the device), replayed on
    new routing with DROPPED pairs."""
    num_tokens = 6145
    scratch = poisoned_scratch(gpu_experts)
    z, ids, weights = gpu_inputs(num_tokens)
    out = torch.empty(num_tokens, RANK_H, device="cuda")
    moe_bf16.moe_bf16(z, ids, weights, *gpu_experts, scratch=scratch, out=out)  # compile outside
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        moe_bf16.moe_bf16(z, ids, weights, *gpu_experts, scratch=scratch, out=out)
    for pattern in ("skewed", "hot"):
        new_z, new_ids, new_weights = gpu_inputs(num_tokens, pattern, drop=True)
        z.copy_(new_z)
        ids.copy_(new_ids)
        weights.copy_(new_weights)
        out.fill_(float("nan"))
        scratch.w13.fill_(float("nan"))
        graph.replay()
        assert relative_error(out, moe.moe_mxfp4_reference(new_z, new_ids, new_weights, *gpu_experts)) < BF16_BOUND


@hopper
def test_gpu_dequant_ahead_in_a_captured_step():
    """Three layers of real per-rank expert shapes through DequantAhead inside one CUDA graph (the next layer's
    dequantization on the side stream, joined by events), replayed on fresh activations and routing with the
    scratches poisoned: each layer's output equals moe_bf16 run alone on its experts, bit for bit."""
    gen = new_generator("cuda")
    layers = []
    for _ in range(3):
        w13_packed, w13_scale = random_mxfp4(GPU_E * 2 * RANK_I, RANK_H, gen)
        w2_packed, w2_scale = random_mxfp4(GPU_E * RANK_H, RANK_I, gen)
        layers.append(moe.StackedExperts(w13_packed.view(GPU_E, 2 * RANK_I, -1), w13_scale.view(GPU_E, 2 * RANK_I, -1),
                                         w2_packed.view(GPU_E, RANK_H, -1), w2_scale.view(GPU_E, RANK_H, -1)))
    ahead = DequantAhead(layers, "cuda")
    inputs = layer_inputs(gen, 3, 6145, GPU_E, RANK_K, RANK_H)
    run_layers(ahead, [0, 1, 2], inputs)  # compile and allocate outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = run_layers(ahead, [0, 1, 2], inputs)
    for _ in range(2):
        for (z, ids, weights), (new_z, new_ids, new_weights) in zip(inputs, layer_inputs(gen, 3, 6145, GPU_E, RANK_K,
                                                                                         RANK_H), strict=True):
            z.copy_(new_z)
            ids.copy_(new_ids)
            weights.copy_(new_weights)
        for scratch in ahead.scratches:
            scratch.w13.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        for i in range(3):
            assert torch.equal(outs[i], run_bf16(*inputs[i], layers[i])), i


@hopper
def test_gpu_install_allocates_only_for_large_steps():
    """expert_kernels gives the bf16 path (one scratch for all layers) only when steps may exceed the
    threshold; the layers then take it above the threshold."""
    from mstar.models.kimi_k3.config import parse_config
    from mstar.models.kimi_k3.model import KimiK3ForCausalLM
    from mstar.tools.make_tiny import real_dims_raw_config

    cfg = parse_config(real_dims_raw_config(num_layers=4, num_experts=GPU_E, tp_size=8, tp_rank=0))
    gen = new_generator("cuda")
    for max_step_tokens, expect_path in ((64, False), (256, True)):
        with torch.device("cuda"):
            model = KimiK3ForCausalLM(cfg).to(torch.bfloat16).eval()
        layers = [layer.block_sparse_moe for layer in model.model.layers if hasattr(layer, "block_sparse_moe")]
        hold_packed((e for layer in layers for e in layer.experts), gen)
        kernels = expert_kernels(layers, max_step_tokens, bf16_above_tokens=64)
        assert len(kernels) == len(layers)
        paths = [kernels[layer].bf16 for layer in layers]
        if not expect_path:
            assert paths == [None] * len(layers)
            continue
        assert all(p is not None and p.above_tokens == 64 and p.ahead is paths[0].ahead for p in paths)
        assert [p.index for p in paths] == list(range(len(layers))) and len(paths[0].ahead.scratches) == 2
        layer = layers[-1]
        scratch = paths[0].ahead.scratches[paths[-1].index % 2]
        reference = copy.deepcopy(layer).float()  # the torch experts (their buffers: copies of the stack's rows)
        for num_tokens, bf16_path in ((64, False), (65, True)):
            scratch.w13.fill_(float("nan"))
            x = torch.randn(num_tokens, cfg.hidden_size, generator=gen, device="cuda").to(torch.bfloat16)
            with torch.no_grad():
                route = layer.gate(x)
                z = layer.routed_expert_down_proj(x)
                got = GpuLayerOps(kernels).routed(layer, z, route)
                expect = reference.routed(z.float(), route)
            assert bool(scratch.w13.isnan().all()) != bf16_path  # which path the step took
            assert relative_error(got, expect) < BF16_BOUND
