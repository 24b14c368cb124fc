"""A MoE layer's input projections on the GPU path (`GpuLayerOps.moe_inputs`: router, latent down projection
and shared experts' gate/up as one stacked GEMM with the router's logits in fp32) against the reference
`LayerOps.moe_inputs`: the same experts and weights, the same latent input and shared activations; the stacked
weights are the modules' own. The layer's output (`GpuLayerOps.latent_output`: the latent norm written into the
GEMM input beside the shared activations, latent up and shared down as one GEMM over their weights stacked by
columns) against the reference's norm and two projections; and whole layers through the GPU ops against the
single-rank reference, on one rank and on two (threads taking turns, `Lockstep`), the latent projections
replicated or sharded. Without CUDA through Triton's interpreter (the GEMMs through torch); on the GPU too."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from kernel_rounding import as_kernel_rounds  # noqa: E402
from lockstep import Lockstep, LockstepCommunicator  # noqa: E402

from mstar.distributed.communicator import Communicator, NullCommunicator  # noqa: E402
from mstar.distributed.sharding import ShardingPlan  # noqa: E402
from mstar.kernels import attn_res_norm  # noqa: E402
from mstar.models.kimi_k3 import moe as moe_module  # noqa: E402
from mstar.models.kimi_k3.config import parse_config  # noqa: E402
from mstar.models.kimi_k3.gpu_ops import GpuLayerOps  # noqa: E402
from mstar.models.kimi_k3.layer_ops import REFERENCE_OPS  # noqa: E402
from mstar.models.kimi_k3.moe import LatentMoE, Routing  # noqa: E402
from mstar.models.kimi_k3.norm import rms_norm  # noqa: E402
from mstar.tools.make_tiny import tiny_k3_raw_config  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
CASES = [(torch.float32, 1e-5)] + ([(torch.bfloat16, 2e-2)] if DEVICE == "cuda" else [])
# the whole layer: bf16 on CPU too (torch GEMMs, the interpreter for the norm and the SiTU)
LAYER_CASES = [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)]


def rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


@pytest.mark.parametrize("rows", [1, 6])
@pytest.mark.parametrize("dtype, tol", CASES)
def test_stacked_moe_inputs_equal_the_reference(rows, dtype, tol):
    cfg = parse_config(tiny_k3_raw_config())
    moe = LatentMoE(cfg).to(DEVICE).requires_grad_(False)
    with torch.no_grad():
        moe.gate.e_score_correction_bias.normal_(0, 0.05)
    moe = moe.to(dtype)
    x = torch.randn(rows, cfg.hidden_size, device=DEVICE).to(dtype)
    routing, z, shared = REFERENCE_OPS.moe_inputs(moe, x)
    ops = GpuLayerOps()
    got_routing, got_z, got_shared = ops.moe_inputs(moe, x)
    order, want_order = got_routing.experts.sort(-1), routing.experts.sort(-1)
    assert torch.equal(order.values, want_order.values)
    torch.testing.assert_close(got_routing.weights.gather(1, order.indices),
                               routing.weights.gather(1, want_order.indices).float(), rtol=1e-5, atol=1e-6)
    assert got_z.shape == z.shape and rel(got_z, z) < tol
    assert got_shared.shape == shared.shape and rel(got_shared, shared) < tol
    # the stack holds the modules' weights (one copy): the reference reads the same numbers afterwards
    stack = ops._moe_inputs[moe].weight
    assert moe.gate.weight.untyped_storage().data_ptr() == stack.untyped_storage().data_ptr()
    assert rel(REFERENCE_OPS.moe_inputs(moe, x)[1], z) < 1e-6
    # the shared activations are the last columns of the GEMM input kept for latent_output, which takes it as it is
    kept, held = ops._latent_gemm_inputs[moe], moe.routed_expert_up_proj.in_features
    assert got_shared.data_ptr() == kept[:, held:].data_ptr() and kept.shape == (rows, held + shared.shape[1])
    assert GpuLayerOps._gemm_input(kept, got_shared, z, held, dtype) is kept


@pytest.mark.parametrize("rows", [1, 6])
@pytest.mark.parametrize("dtype, tol", CASES)
def test_latent_output_equals_the_reference(rows, dtype, tol):
    """Of shared activations in no kept buffer (copied into a new one), of none (an all-reduce between, the
    replicated layout on several ranks) and of one rank's columns of the norm (the sharded-latent layout)."""
    cfg = parse_config(tiny_k3_raw_config())
    moe = LatentMoE(cfg).to(DEVICE).requires_grad_(False)
    with torch.no_grad():
        moe.routed_expert_norm.weight.normal_(1, 0.2)
    moe = moe.to(dtype)
    r = (torch.randn(rows, cfg.moe_input_size, device=DEVICE) * 3).to(dtype)
    shared = torch.randn(rows, moe.shared_experts.down_proj.in_features, device=DEVICE).to(dtype)
    norm, up, down = moe.routed_expert_norm, moe.routed_expert_up_proj.weight, moe.shared_experts.down_proj.weight
    normed = rms_norm(r.double(), norm.weight.double(), norm.eps)
    expect = normed @ up.double().T + shared.double() @ down.double().T
    want = REFERENCE_OPS.latent_output(moe, r, shared)
    assert rel(want, expect) < tol
    ops = GpuLayerOps()
    got = ops.latent_output(moe, r, shared)
    assert got.shape == want.shape and got.dtype == dtype and rel(got, expect) < tol
    stack = ops._latent_output[moe]
    assert moe.routed_expert_up_proj.weight.untyped_storage().data_ptr() == stack.untyped_storage().data_ptr()
    assert rel(REFERENCE_OPS.latent_output(moe, r, shared), want) < 1e-6  # the modules read the stack
    assert rel(ops.latent_output(moe, r, None), normed @ up.double().T) < tol
    second = rank_moe(moe, ShardingPlan(2, 1, latent_sharded=True), NullCommunicator(2, 1))
    half, inter = slice(cfg.moe_input_size // 2, None), slice(shared.shape[1] // 2, None)  # the second rank's
    got = ops.latent_output(second, r, shared[:, inter], half)
    expect = normed[:, half] @ up[:, half].double().T + shared[:, inter].double() @ down[:, inter].double().T
    assert rel(got, expect) < tol and rel(REFERENCE_OPS.latent_output(second, r, shared[:, inter], half), expect) < tol


def rank_moe(whole: LatentMoE, plan: ShardingPlan, comm: Communicator) -> LatentMoE:
    """The layer as `plan`'s rank holds it (sharding.py's rules, as the checkpoint loader applies them)."""
    cfg = whole.config
    moe = LatentMoE(plan.rank_config(cfg), comm, plan.expert_sharding(cfg)).to(DEVICE)
    full = whole.state_dict()
    state = {}
    for name in moe.state_dict():
        split = plan.split_of(f"model.layers.1.block_sparse_moe.{name}", cfg)
        state[name] = full[name] if split is None else full[name][split.region(full[name].shape)]
    moe.load_state_dict(state)
    return moe.requires_grad_(False).to(whole.routed_expert_up_proj.weight.dtype)


def tiny_moe(dtype: torch.dtype) -> LatentMoE:
    moe = LatentMoE(parse_config(tiny_k3_raw_config())).to(DEVICE).requires_grad_(False)
    with torch.no_grad():
        moe.gate.e_score_correction_bias.normal_(0, 0.05)
        moe.routed_expert_norm.weight.normal_(1, 0.2)
    return moe.to(dtype)


@pytest.mark.parametrize("dtype, tol", LAYER_CASES)
@pytest.mark.parametrize("ranks, latent_sharded", [(1, False), (2, False), (2, True)],
                         ids=["one-rank", "tp2", "tp2-latent-sharded"])
def test_the_layer_through_gpu_ops_equals_the_single_rank_reference(dtype, tol, ranks, latent_sharded):
    """Every rank gets the reference's output; nothing is left kept for a later call."""
    whole = tiny_moe(dtype)
    x = torch.randn(3, whole.config.hidden_size, device=DEVICE).to(dtype)
    expect = whole(x)
    lockstep = Lockstep(ranks)
    opses = [GpuLayerOps() for _ in range(ranks)]
    plans = [ShardingPlan(ranks, rank, latent_sharded=latent_sharded) for rank in range(ranks)]
    moes = [rank_moe(whole, plans[rank], LockstepCommunicator(lockstep, rank)) for rank in range(ranks)]
    outputs = lockstep.run(lambda rank: moes[rank](x, opses[rank]))
    for out, ops in zip(outputs, opses, strict=True):
        assert out.dtype == dtype and rel(out, expect) < tol, rel(out, expect)
        assert not ops._latent_gemm_inputs


class CountingCommunicator(LockstepCommunicator):
    """Counts the reduce-scatters (the base class's: an all-reduce and this rank's piece of it)."""

    reduce_scatters = 0

    def reduce_scatter_rounded(self, x, dtype):
        self.reduce_scatters += 1
        return super().reduce_scatter_rounded(x, dtype)


@pytest.mark.parametrize("dtype, tol", LAYER_CASES)
@pytest.mark.parametrize("gpu_ops", [False, True], ids=["reference-ops", "gpu-ops"])
def test_large_steps_reduce_scatter_the_routed_latent(monkeypatch, dtype, tol, gpu_ops):
    """From REDUCE_SCATTER_MIN_TOKENS tokens (lowered here to fit a test) each sharded-latent rank gets only its
    columns of the routed sum and normalises them with the whole rows' square sums: every rank still gets the single
    rank's output, through the reference's ops and the GPU ops alike; below it, the all-reduce as before."""
    whole = tiny_moe(dtype)
    monkeypatch.setattr(moe_module, "REDUCE_SCATTER_MIN_TOKENS", 4)
    for rows, scatters in ((3, 0), (4, 1), (9, 1)):
        x = torch.randn(rows, whole.config.hidden_size, device=DEVICE).to(dtype)
        expect = whole(x)
        lockstep = Lockstep(2)
        comms = [CountingCommunicator(lockstep, rank) for rank in range(2)]
        moes = [rank_moe(whole, ShardingPlan(2, rank, latent_sharded=True), comms[rank]) for rank in range(2)]
        opses = [GpuLayerOps() if gpu_ops else REFERENCE_OPS for _ in range(2)]
        outputs = lockstep.run(lambda rank, m=moes, o=opses, x=x: m[rank](x, o[rank]))
        for out, comm in zip(outputs, comms, strict=True):
            assert comm.reduce_scatters == scatters
            assert out.dtype == dtype and rel(out, expect) < tol, (rows, rel(out, expect))


def test_square_sums_of_the_wrong_shape_are_refused():
    x, weight = torch.randn(3, 8, device=DEVICE), torch.ones(16, device=DEVICE)
    for sums, columns in ((torch.ones(3, device=DEVICE), slice(0, 16)), (torch.ones(4, device=DEVICE), slice(8, 16)),
                          (torch.ones(3, device=DEVICE).double(), slice(8, 16))):
        with pytest.raises(ValueError, match="with square_sums"):
            attn_res_norm.rms_norm_rows(x, weight, 1e-6, columns=columns, square_sums=sums)


def test_an_fp32_routed_sum_is_rounded_as_the_norm_loads_it():
    """On one rank the experts' kernel's fp32 sum goes to the norm as it is (no copy kernel), which rounds it to
    the model dtype as it loads it: the layer's output is, bit for bit, the one of the sum rounded first. In the
    sharded-latent layout it goes to `all_reduce_rounded` as it is (the next test); with the latent replicated
    over several ranks `routed` rounds it before the all-reduce."""
    moe = tiny_moe(torch.bfloat16)
    x = torch.randn(3, moe.config.hidden_size, device=DEVICE).to(torch.bfloat16)

    def fp32_sum(z, experts, weights):  # stands in for MXFP4Experts: an fp32 sum, finer than bf16
        r = moe.routed(z, Routing(experts, weights)).float()
        return r + r.abs() * 2**-11

    got = moe(x, GpuLayerOps({moe: fp32_sum}))
    want = moe(x, GpuLayerOps({moe: lambda *args: as_kernel_rounds(fp32_sum(*args), torch.bfloat16)}))
    assert torch.equal(got, want)
    assert rel(got, moe(x)) < 2e-2
    routing, z, _ = REFERENCE_OPS.moe_inputs(moe, x)
    assert GpuLayerOps({moe: fp32_sum}).routed(moe, z, routing).dtype == torch.float32
    rank = rank_moe(moe, ShardingPlan(2, 0), LockstepCommunicator(Lockstep(2), 0))
    assert GpuLayerOps({rank: fp32_sum}).routed(rank, z, routing).dtype == torch.bfloat16


def test_sharded_latent_ranks_reduce_their_fp32_sums_rounded_first():
    """In the sharded-latent layout each rank's fp32 routed sum goes to `all_reduce_rounded` as it is, which
    rounds it before summing (here in a cast; symmetric memory in its staging copy): every rank's output is, bit
    for bit, the one of sums rounded by the kernel itself."""
    whole = tiny_moe(torch.bfloat16)
    x = torch.randn(3, whole.config.hidden_size, device=DEVICE).to(torch.bfloat16)

    def outputs(round_in_kernel: bool) -> list[torch.Tensor]:
        lockstep = Lockstep(2)
        moes = [rank_moe(whole, ShardingPlan(2, rank, latent_sharded=True), LockstepCommunicator(lockstep, rank))
                for rank in range(2)]

        def kernel(rank):
            def fp32_sum(z, experts, weights):
                r = moes[rank].routed(z, Routing(experts, weights)).float()
                r = r + r.abs() * 2**-11
                return r.to(torch.bfloat16) if round_in_kernel else r
            return fp32_sum

        opses = [GpuLayerOps({moes[rank]: kernel(rank)}) for rank in range(2)]
        return lockstep.run(lambda rank: moes[rank](x, opses[rank]))

    for got, want in zip(outputs(False), outputs(True), strict=True):
        assert torch.equal(got, want)
