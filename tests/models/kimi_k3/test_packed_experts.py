"""Routed experts stay MXFP4-packed from checkpoint to kernel: loading (whole and per rank), the torch
forward, saving, the per-rank byte count, and the stacked kernel weights (interpreted on the CPU)."""

from __future__ import annotations

import copy

import pytest
import torch
from packed_experts import hold_packed
from torch import nn

from mstar.checkpoint.safetensors_io import CheckpointReader
from mstar.distributed.communicator import NullCommunicator
from mstar.distributed.expert_sharding import ExpertSharding
from mstar.distributed.loader import load_rank_model
from mstar.distributed.sharding import ShardingPlan
from mstar.distributed.weight_bytes import rank_weight_bytes
from mstar.kernels import moe_mxfp4
from mstar.models.kimi_k3.config import load_config
from mstar.models.kimi_k3.gpu_ops import GpuLayerOps, MXFP4Experts, expert_kernel_fits
from mstar.models.kimi_k3.moe import LatentMoE
from mstar.models.kimi_k3.weights import checkpoint_tensors
from mstar.quant.mxfp4 import random_mxfp4
from mstar.quant.mxfp4_linear import MXFP4Linear
from mstar.quant.mxfp4_words import from_word_layout

KERNEL_DEVICE = "cpu" if moe_mxfp4._interpreted() else "cuda"
needs_kernel = pytest.mark.skipif(KERNEL_DEVICE == "cuda" and not torch.cuda.is_available(),
                                  reason="the MXFP4 kernel needs TRITON_INTERPRET=1 (set by conftest.py) or CUDA")


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def expert_state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: t for n, t in model.state_dict().items() if ".experts." in n}


def dequantized_copy(model: nn.Module) -> nn.Module:
    """`model` with every MXFP4Linear replaced by an nn.Linear holding its weight dequantized up front."""
    dense = copy.deepcopy(model)
    for name, module in list(dense.named_modules()):
        if isinstance(module, MXFP4Linear):
            parent, _, child = name.rpartition(".")
            linear = nn.Linear(module.in_features, module.out_features, bias=False)
            linear.weight = nn.Parameter(module.dequantized(torch.float32), requires_grad=False)
            setattr(dense.get_submodule(parent), child, linear)
    return dense


# ----------------------------------------------------------------------------------------------
# Loading, forward, saving
# ----------------------------------------------------------------------------------------------


def test_loaded_experts_are_held_packed(tiny_dir, tiny_model):
    state = expert_state(tiny_model)
    assert state and all(t.dtype == torch.uint8 for t in state.values())
    assert all(n.endswith((".weight_packed", ".weight_scale")) for n in state)
    assert not any(".experts." in n for n, _ in tiny_model.named_parameters())  # no dense expert weight
    # The buffers are the checkpoint's bytes, and nothing more.
    with CheckpointReader(tiny_dir) as reader:
        prefix = tiny_model.config.weight_prefix
        for name, t in state.items():
            assert torch.equal(t, reader.get(prefix + name)), name
        stored = tensor_bytes(reader.get(n) for n in reader.names() if ".experts." in n)
    assert tensor_bytes(state.values()) == stored
    expert = tiny_model.model.layers[1].block_sparse_moe.experts[0]
    assert all(isinstance(getattr(expert, w), MXFP4Linear) for w in ("w1", "w3", "w2"))


def test_forward_equals_experts_dequantized_up_front(tiny_model):
    dense = dequantized_copy(tiny_model)
    assert expert_state(dense) and all(t.dtype == torch.float32 for t in expert_state(dense).values())
    ids = torch.randint(0, tiny_model.config.vocab_size, (11,))
    with torch.no_grad():
        assert torch.equal(tiny_model(ids).logits, dense(ids).logits)


def test_packed_experts_save_as_they_are(tiny_dir, tiny_model):
    prefix = tiny_model.config.weight_prefix
    with CheckpointReader(tiny_dir) as reader:
        for quantize in (True, False):  # packed experts are written as held either way
            saved = checkpoint_tensors(tiny_model, quantize_experts=quantize)
            packed = {n: t for n, t in saved.items() if ".experts." in n}
            assert packed.keys() == {n for n in reader.names() if ".experts." in n}
            for name, t in packed.items():
                assert t.dtype == torch.uint8 and torch.equal(t, reader.get(name)), name
    assert all(n.startswith(prefix) for n in saved)


@pytest.mark.parametrize("tp, ep", [(2, 1), (2, 2)])
def test_rank_models_hold_packed_slices(tiny_dir, tiny_model, tp, ep):
    config = load_config(tiny_dir)
    for rank in range(tp):
        model = load_rank_model(tiny_dir, ShardingPlan(tp, rank, ep), NullCommunicator(tp, rank))
        state = expert_state(model)
        assert state and all(t.dtype == torch.uint8 for t in state.values())
        experts = model.model.layers[1].block_sparse_moe.experts
        sharding = ExpertSharding(config.num_experts, config.moe_intermediate_size, tp, ep, rank)
        assert list(map(int, experts.keys())) == list(sharding.local_experts)  # HeldExperts iterates values
        e = sharding.local_experts[0]
        c0, c1 = sharding.intermediate_range
        whole = tiny_model.model.layers[1].block_sparse_moe.experts[e]
        assert torch.equal(experts[e].w1.weight_packed, whole.w1.weight_packed[c0:c1])
        assert torch.equal(experts[e].w2.weight_packed, whole.w2.weight_packed[:, c0 // 2 : c1 // 2])
        assert torch.equal(experts[e].w2.weight_scale, whole.w2.weight_scale[:, c0 // 32 : c1 // 32])


def test_down_proj_slices_must_be_whole_scale_groups(tiny_dir):
    config = load_config(tiny_dir)
    ranks_per_expert = 4  # the tiny experts' 64 intermediate columns in 16-column slices
    assert config.moe_intermediate_size // ranks_per_expert % 32
    with pytest.raises(ValueError, match="32-wide scale groups.*raise ep_size"):
        load_rank_model(tiny_dir, ShardingPlan(4, 0), NullCommunicator(4, 0))


# ----------------------------------------------------------------------------------------------
# Per-rank weight bytes
# ----------------------------------------------------------------------------------------------


def test_weight_bytes_match_the_loaded_models(tiny_dir, tiny_model):
    config = load_config(tiny_dir)
    counted = rank_weight_bytes(config, ShardingPlan(1), dtype=torch.float32)
    assert counted.experts == tensor_bytes(expert_state(tiny_model).values())
    assert counted.total == tensor_bytes(tiny_model.state_dict().values())
    plan = ShardingPlan(2, 1, 2)
    rank = load_rank_model(tiny_dir, plan, NullCommunicator(2, 1), dtype=torch.bfloat16)
    counted = rank_weight_bytes(config, plan, dtype=torch.bfloat16)
    assert counted.experts == tensor_bytes(expert_state(rank).values())
    assert counted.total == tensor_bytes(rank.state_dict().values())
    # Dense bf16 experts: 2 bytes per weight against 1/2 + 1/32 packed.
    dense = rank_weight_bytes(config, plan, dtype=torch.bfloat16, packed_experts=False)
    assert dense.other == counted.other and dense.experts * 17 == counted.experts * 64


# ----------------------------------------------------------------------------------------------
# Stacked kernel weights (TRITON_INTERPRET on the CPU; compiled where CUDA is)
# ----------------------------------------------------------------------------------------------

KERNEL_E, KERNEL_K, KERNEL_WIDTH = 4, 2, 128  # the kernels tile latent and expert widths by 128


def kernel_moe(tiny_model, gen: torch.Generator, sharding: ExpertSharding | None = None) -> LatentMoE:
    """A bf16 LatentMoE at kernel-sized widths whose experts hold random canonical MXFP4 tensors."""
    config = tiny_model.config.with_overrides(
        routed_expert_hidden_size=KERNEL_WIDTH, moe_intermediate_size=KERNEL_WIDTH, num_experts=KERNEL_E,
        num_experts_per_token=KERNEL_K, num_expert_group=1, topk_group=1)
    comm = None if sharding is None else NullCommunicator(sharding.tp_size, sharding.rank)
    with torch.device(KERNEL_DEVICE):
        moe = LatentMoE(config, comm, sharding).to(torch.bfloat16)
    hold_packed(moe.experts, gen)
    return moe


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm())


@needs_kernel
@pytest.mark.parametrize("layout", ["whole", "ep2_rank1"])
def test_stacked_packed_experts_match_the_torch_experts(tiny_model, layout):
    gen = torch.Generator(device=KERNEL_DEVICE).manual_seed(7)
    sharding = ExpertSharding(KERNEL_E, KERNEL_WIDTH, 2, 2, 1) if layout == "ep2_rank1" else None
    moe = kernel_moe(tiny_model, gen, sharding)
    held = list(map(int, moe.experts.keys())) if sharding else list(range(KERNEL_E))
    packed_before = [e.w2.weight_packed.clone() for e in moe.experts]
    x = torch.randn(9, moe.config.hidden_size, generator=gen, device=KERNEL_DEVICE).to(torch.bfloat16)
    routing = moe.gate(x)
    z = moe.routed_expert_down_proj(x)
    with torch.no_grad():
        expect = moe.routed(z, routing)  # the torch loop over the held experts: a partial sum under EP
        assert expert_kernel_fits(moe)
        kernel = MXFP4Experts(moe)
        got = GpuLayerOps({moe: kernel}).routed(moe, z, routing)
    assert relative_error(got, expect) < 1e-2
    if sharding is not None:
        elsewhere = ~torch.isin(routing.experts, torch.tensor(held, device=KERNEL_DEVICE))
        assert bool(elsewhere.any())  # some pairs were dropped
    # The stack holds the held experts' own codes (in the word layout), and the experts now read them from it:
    # their torch path decodes that layout, and their state_dict is still the checkpoint's.
    stack = kernel.weights
    assert stack.w13_packed.shape[0] == len(held)
    # A second serving model over the same experts takes the same stack (nothing copied, nothing freed).
    assert all(a.data_ptr() == b.data_ptr() for a, b in zip(MXFP4Experts(moe).weights, stack, strict=True))
    for i, expert in enumerate(moe.experts):
        assert torch.equal(from_word_layout(stack.w2_packed[i]), packed_before[i])
        assert torch.equal(expert.w2.state_dict()["weight_packed"], packed_before[i])
        assert expert.w2.weight_packed.data_ptr() == stack.w2_packed[i].data_ptr()
        assert expert.w3.weight_scale.data_ptr() == stack.w13_scale[i, KERNEL_WIDTH:].data_ptr()
    with torch.no_grad():
        assert torch.equal(moe.routed(z, routing), expect)
    # Buffers moved out of the stack since (as .to() to another device does): stacked again from their codes.
    for expert in moe.experts:
        for name in ("w1", "w3", "w2"):
            proj = getattr(expert, name)
            proj.weight_packed = proj.weight_packed.clone()
    restacked = MXFP4Experts(moe)
    assert restacked.weights.w2_packed.data_ptr() != stack.w2_packed.data_ptr()
    assert all(torch.equal(a, b) for a, b in zip(restacked.weights, stack, strict=True))
    with torch.no_grad():
        assert torch.equal(moe.routed(z, routing), expect)


def test_dense_experts_keep_the_torch_path(tiny_model):
    config = tiny_model.config.with_overrides(routed_expert_hidden_size=KERNEL_WIDTH,
                                              moe_intermediate_size=KERNEL_WIDTH)
    moe = LatentMoE(config).to(torch.bfloat16)
    assert not expert_kernel_fits(moe)


@needs_kernel
@pytest.mark.parametrize("combine", ["atomic", "reduce"])
def test_kernel_drops_pairs_of_experts_held_elsewhere(combine):
    gen = torch.Generator(device=KERNEL_DEVICE).manual_seed(3)
    w1, w3, w2 = ([random_mxfp4(KERNEL_WIDTH, KERNEL_WIDTH, gen) for _ in range(KERNEL_E)] for _ in range(3))
    stacked = moe_mxfp4.stack_experts(w1, w3, w2)
    tokens = 6
    z = torch.randn(tokens, KERNEL_WIDTH, generator=gen, device=KERNEL_DEVICE).to(torch.bfloat16)
    # Every expert keeps real pairs, so that a misplaced dropped pair would displace one.
    ids = (torch.arange(tokens)[:, None] + torch.arange(KERNEL_K)[None, :]).to(KERNEL_DEVICE) % KERNEL_E
    ids[::2, 0] = moe_mxfp4.DROPPED
    ids[-1, :] = moe_mxfp4.DROPPED  # a token with nothing held here, after every expert's real pairs
    weights = torch.rand(tokens, KERNEL_K, generator=gen, device=KERNEL_DEVICE)
    base = moe_mxfp4.default_config(tokens, KERNEL_K, KERNEL_E)
    config = moe_mxfp4.MoEConfig(base.block_m, base.gate_up, base.down, combine=combine)
    got = moe_mxfp4.moe_mxfp4(z, ids, weights, *stacked, config=config)
    # A dropped pair adds what a zero-weight pair adds: nothing.
    dropped = ids == moe_mxfp4.DROPPED
    want = moe_mxfp4.moe_mxfp4_reference(z, ids.masked_fill(dropped, 0), weights.masked_fill(dropped, 0), *stacked)
    assert relative_error(got, want) < 1e-2
    assert torch.equal(got[-1], torch.zeros_like(got[-1]))
