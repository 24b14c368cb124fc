"""fla-core KDA over the state pool (mstar/kernels/kda_fla.py, through models/kimi_k3/gpu_ops.py) against the
torch mixer. Needs CUDA + fla."""

from dataclasses import replace

import pytest
import torch

from mstar.kernels import kda_decode, kda_fla
from mstar.models.kimi_k3.config import parse_config
from mstar.models.kimi_k3.gpu_ops import GpuMixerOps
from mstar.models.kimi_k3.kda import KimiDeltaAttention
from mstar.models.kimi_k3.serving import BatchPlan, StagedLayout, StepKind, TorchMixerOps
from mstar.resources.recurrent_pool import RecurrentStatePool
from mstar.tools.make_tiny import k3_fixture

pytestmark = pytest.mark.skipif(not kda_fla.available(), reason="needs CUDA and fla-core")


def layer_and_pool(heads, head_dim, hidden, dtype, slots=9, block=8):
    raw = k3_fixture()
    t = raw["text_config"]
    t.update(hidden_size=hidden, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4)
    t["linear_attn_config"].update(head_dim=head_dim, num_heads=heads, kda_layers=[1], full_attn_layers=[2])
    cfg = parse_config(raw)
    attn = KimiDeltaAttention(cfg, 0).to("cuda", dtype)
    with torch.no_grad():
        for name, p in attn.named_parameters():
            if name == "dt_bias":
                p.copy_(torch.randn_like(p) * 0.5 - 3)
            elif "conv1d" in name:
                p.copy_(torch.randn_like(p) * 0.5)
            elif "norm" in name:
                p.copy_(1 + 0.1 * torch.randn_like(p))
            elif name != "A_log":
                p.copy_(torch.randn_like(p) * p.shape[-1] ** -0.5)
    pool = RecurrentStatePool(1, slots, heads, head_dim, 4, torch.float32, dtype, "cuda", hidden_size=hidden,
                              max_block=block)
    pool.state.normal_(0, 0.3)
    pool.conv.normal_(0, 1)
    return attn, pool


def clone_pool(pool):
    other = RecurrentStatePool(1, pool.max_slots, *pool.state.shape[2:4], pool.conv.shape[3] + 1, pool.state.dtype,
                               pool.conv.dtype, "cuda", hidden_size=pool.prefix_x.shape[-1],
                               max_block=pool.prefix_x.shape[2])
    other.state.copy_(pool.state)
    other.conv.copy_(pool.conv)
    other.prefix_x.copy_(pool.prefix_x)
    other.prefix_len = list(pool.prefix_len)
    return other


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("shape", [(4, 32, 128), (12, 128, 1024)])
def test_kda_step_matches_torch(dtype, tol, shape):
    heads, head_dim, hidden = shape
    attn, pool = layer_and_pool(heads, head_dim, hidden, dtype)
    lengths = [1, 5, 40, 100, 1, 8]
    verify = (False, False, False, False, True, True)
    # slots 5 and 6 carry an accepted pending prefix of 3 rows from a previous verify step
    pool.prefix_x.normal_()
    for slot in (5, 6):
        pool.prefix_len[slot] = 3
    starts = [0]
    for n in lengths:
        starts.append(starts[-1] + n)
    x = torch.randn(starts[-1], hidden, device="cuda", dtype=dtype)
    slots = torch.tensor([1, 2, 3, 4, 5, 6], device="cuda")
    plan = BatchPlan(input_ids=None, seq_starts=tuple(starts), num_computed=(0,) * 6, kv=None, kda_slots=slots,
                     sample_rows=None, verify=verify)
    ref_pool = clone_pool(pool)
    with torch.no_grad():
        expect = TorchMixerOps().kda(attn, 0, x, plan, ref_pool)
        y = GpuMixerOps().kda(attn, 0, x, plan, pool)  # a 100-row prompt: the ragged fla path
    assert torch.isfinite(y).all()
    err = float((y.float() - expect.float()).norm() / expect.float().norm())
    assert err < tol, err
    for name in ("state", "conv"):
        a, b = getattr(pool, name)[0, 1:7].float(), getattr(ref_pool, name)[0, 1:7].float()
        assert float((a - b).norm() / b.norm()) < tol, name
    for slot, n in ((5, 1), (6, 8)):
        torch.testing.assert_close(pool.prefix_x[0, slot, :n], ref_pool.prefix_x[0, slot, :n])


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("shape", [(4, 32, 128), (12, 128, 1024)])
@pytest.mark.parametrize("stacked", [False, True])
@pytest.mark.parametrize("max_rows", [kda_decode.DECODE_STEP_MAX_ROWS, 0])
def test_kda_decode_updates_the_pool_in_place_like_torch(dtype, tol, shape, stacked, max_rows, monkeypatch):
    """One row per sequence, slots out of order: state and conv windows written in place by slot
    (kda_decode.decode_step, or past its row bound, forced by a bound of 0, fla's recurrent kernel); the other
    slots are untouched. With `stacked`, x's projections run as one GEMM (the torch reference reads the same
    weights, now views)."""
    monkeypatch.setattr(kda_decode, "DECODE_STEP_MAX_ROWS", max_rows)
    heads, head_dim, hidden = shape
    attn, pool = layer_and_pool(heads, head_dim, hidden, dtype)
    slots = torch.tensor([7, 2, 5, 1], device="cuda")
    x = torch.randn(4, hidden, device="cuda", dtype=dtype)
    plan = BatchPlan(input_ids=None, seq_starts=(0, 1, 2, 3, 4), num_computed=(9,) * 4, kv=None, kda_slots=slots,
                     sample_rows=None, kind=StepKind.DECODE)
    ref_pool = clone_pool(pool)
    untouched = [s for s in range(pool.max_slots) if s not in slots.tolist()]
    before = pool.state[0, untouched].clone(), pool.conv[0, untouched].clone()
    with torch.no_grad():
        expect = TorchMixerOps().kda(attn, 0, x, plan, ref_pool)
        y = GpuMixerOps(fused=stacked).kda(attn, 0, x, plan, pool)
    assert torch.isfinite(y).all()
    err = float((y.float() - expect.float()).norm() / expect.float().norm())
    assert err < tol, err
    for name in ("state", "conv"):
        a, b = getattr(pool, name)[0, slots].float(), getattr(ref_pool, name)[0, slots].float()
        assert float((a - b).norm() / b.norm()) < tol, name
    assert torch.equal(pool.state[0, untouched], before[0]) and torch.equal(pool.conv[0, untouched], before[1])


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("capacity", [None, 16])
def test_short_blocks_with_pending_prefixes_match_torch(dtype, tol, capacity):
    """The short-block path compiled for this GPU (kernels/kda_blocks.py: block conv, window fold, the recurrent
    fold): verify blocks after accepted pending prefixes, a verify block without one, a decode row after a
    prefix and a short prompt, at one TP8 rank's head shape; compact and fixed-capacity (captured verify
    step) layouts. Output, states, windows and the next pending prefixes end as the torch mixer leaves them."""
    heads, head_dim, hidden = 12, 128, 1024
    attn, pool = layer_and_pool(heads, head_dim, hidden, dtype)
    pool.prefix_x.normal_()
    lengths, verify, slots = [4, 4, 1, 7, 4], (True, True, False, False, True), (5, 2, 6, 8, 4)
    for slot, n in ((5, 2), (6, 3), (4, 3)):
        pool.prefix_len[slot] = n
    starts = [0]
    for n in lengths:
        starts.append(starts[-1] + n)
    plan = BatchPlan(input_ids=None, seq_starts=tuple(starts), num_computed=(0,) * 5, kv=None,
                     kda_slots=torch.tensor(slots, device="cuda"), sample_rows=None, verify=verify, slot_ids=slots)
    x = torch.randn(starts[-1], hidden, device="cuda", dtype=dtype)
    ref_pool = clone_pool(pool)
    layout = kda_fla.BlockLayout.build(plan.seq_starts, slots, [pool.prefix_len[s] for s in slots], verify,
                                       pool.prefix_x.shape[2], x.device, capacity=capacity)
    with torch.no_grad():
        expect = TorchMixerOps().kda(attn, 0, x, plan, ref_pool)
        blocks = replace(plan, kind=StepKind.STAGED_BLOCKS, staged=StagedLayout(torch.tensor(plan.seq_starts), layout))
        y = GpuMixerOps(fused=True).kda(attn, 0, x, blocks, pool)
    assert torch.isfinite(y).all()
    err = float((y.float() - expect.float()).norm() / expect.float().norm())
    assert err < tol, err
    live = list(slots)
    for name in ("state", "conv"):
        a, b = getattr(pool, name)[0, live].float(), getattr(ref_pool, name)[0, live].float()
        assert float((a - b).norm() / b.norm()) < tol, name
    for slot, n in ((5, 4), (2, 4), (4, 4)):  # the verify blocks' inputs wait as the next pending prefixes
        torch.testing.assert_close(pool.prefix_x[0, slot, :n], ref_pool.prefix_x[0, slot, :n])


@pytest.mark.parametrize(("lengths", "num_rows"), [([700, 3, 129], 1024), ([64], 64), ([5, 1], 96)])
def test_the_staged_chunk_table_gives_chunk_kda_bit_for_bit(lengths, num_rows):
    """The captured prefill's chunked KDA over the chunk table its layout staged once for the step equals fla's
    chunk_kda(use_graph=True), which builds that table itself in every call, bit for bit (bf16, a TP8 rank's 12
    heads of 128)."""
    from kda_chunk_table import chunk_kda_both_ways

    _, theirs, ours = chunk_kda_both_ways("cuda", torch.bfloat16, lengths, num_rows, heads=12, head_dim=128)
    assert torch.equal(ours[0], theirs[0]) and torch.equal(ours[1], theirs[1])
