"""moe_mxfp4 (Triton W4A16 routed experts) against its torch reference, moe_mxfp4_reference.

Without CUDA, Triton's interpreter (TRITON_INTERPRET=1, set by conftest.py or below, before triton
is imported) runs the tiny-shape tests on the CPU. If triton was imported in this process without
it, the interpreter cannot work here, so one test reruns this file in a fresh process with
TRITON_INTERPRET=1. With CUDA the tiny tests run
compiled on the GPU, and so do the tests at the real per-rank shapes of pruned75 at TP8 (E=224,
top-16, H_lat=3584, I=384), which skip elsewhere. Every run draws fresh weights, activations and
routing (the seed is printed); outputs and buffers are poisoned before each call; errors are
||out - ref|| / ||ref|| against the fp32 reference, with a bf16 bound (the kernel rounds the SiTU
output, and with combine="reduce" each expert's output, to bf16).
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import replace

import pytest
import torch

if not torch.cuda.is_available() and "triton" not in sys.modules:
    # Before triton is imported: its own helpers, moe_mxfp4's kernels and the probe below must all be
    # interpreted (the interpreter keeps consulting the variable, so it stays set). Once triton is
    # imported, setting it would not help here and would only change modules imported later.
    os.environ.setdefault("TRITON_INTERPRET", "1")
triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

from mstar.kernels import moe_mxfp4 as moe  # noqa: E402
from mstar.kernels.moe_mxfp4 import _dequant_words, _k_order, _k_position  # noqa: E402
from mstar.quant.mxfp4 import dequantize_mxfp4, random_mxfp4  # noqa: E402
from mstar.quant.mxfp4_words import from_word_layout  # noqa: E402

# Interpreted only if triton's own helpers (tl.sum & co.) were defined under the interpreter too.
INTERPRET = moe._interpreted() and type(tl.standard.sum).__name__ == "InterpretedFunction"
# The kernels can run in this process: compiled on a GPU, or interpreted on the CPU.
IN_PROCESS = INTERPRET or (torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") != "1")
TINY_DEVICE = "cpu" if INTERPRET else "cuda"
BF16_BOUND = 1e-2
COMBINES = ("atomic", "reduce")
DECODES = ("subnormal", "select")

needs_kernel_device = pytest.mark.skipif(
    not IN_PROCESS, reason="triton was imported without TRITON_INTERPRET=1 and there is no GPU: "
    "test_kernels_in_fresh_interpreter_process runs these")
gpu = pytest.mark.skipif(not torch.cuda.is_available() or INTERPRET,
                         reason="needs CUDA, without TRITON_INTERPRET (real shapes are too slow for the interpreter)")

# One TP8 rank of pruned75.
RANK_E, RANK_K, RANK_H, RANK_I = 224, 16, 3584, 384
# Tiny shapes for the interpreter (H and I must be multiples of 128).
TINY_E, TINY_K, TINY_H, TINY_I = 4, 2, 128, 128
# The decode path (no alignment) at K3's top-16, over few enough experts that tokens share them.
DIRECT_E, DIRECT_K = 24, 16


# ----------------------------------------------------------------------------------------------
# Helpers
# ----------------------------------------------------------------------------------------------


def new_generator(device) -> torch.Generator:
    generator = torch.Generator(device=device)
    print(f"seed = {generator.seed()}")
    return generator


def tiny_experts(gen: torch.Generator, num_experts: int = TINY_E, hidden: int = TINY_H,
                 inter: int = TINY_I) -> moe.StackedExperts:
    """Per-expert checkpoint-style tensors, stacked by stack_experts."""
    w1 = [random_mxfp4(inter, hidden, gen) for _ in range(num_experts)]
    w3 = [random_mxfp4(inter, hidden, gen) for _ in range(num_experts)]
    w2 = [random_mxfp4(hidden, inter, gen) for _ in range(num_experts)]
    return moe.stack_experts(w1, w3, w2)


def rank_experts(gen: torch.Generator) -> moe.StackedExperts:
    """Real per-rank shapes, drawn as one matrix per stacked tensor (rows are independent anyway)."""
    w13_packed, w13_scale = random_mxfp4(RANK_E * 2 * RANK_I, RANK_H, gen)
    w2_packed, w2_scale = random_mxfp4(RANK_E * RANK_H, RANK_I, gen)
    return moe.StackedExperts(
        w13_packed.view(RANK_E, 2 * RANK_I, -1), w13_scale.view(RANK_E, 2 * RANK_I, -1),
        w2_packed.view(RANK_E, RANK_H, -1), w2_scale.view(RANK_E, RANK_H, -1),
    )


def routing(num_tokens: int, num_experts: int, top_k: int, gen: torch.Generator, pattern: str = "random"):
    """(ids int64 [T, k], weights fp32 [T, k]) with positive weights summing to one per token.

    random: distinct experts per token, as the router picks them. hot: every token uses the same k
    experts (repeated experts, several row blocks per expert, most experts unused). skewed: half of
    each token's slots from a small hot set. repeat_in_token: one expert twice in a token's row.
    """
    device = gen.device
    scores = torch.rand(num_tokens, num_experts, generator=gen, device=device)
    if pattern == "hot":
        chosen = torch.randperm(num_experts, generator=gen, device=device)[:top_k]
        order = torch.rand(num_tokens, top_k, generator=gen, device=device).argsort(dim=1)
        ids = chosen[order]
    elif pattern == "skewed":
        hot = torch.randperm(num_experts, generator=gen, device=device)[: max(1, top_k // 2) + 1]
        scores[:, hot] += 1.0
        ids = scores.topk(top_k, dim=1).indices
    elif pattern == "repeat_in_token":
        ids = scores.topk(top_k, dim=1).indices
        ids[:, -1] = ids[:, 0]
    else:
        ids = scores.topk(top_k, dim=1).indices
    weights = torch.rand(num_tokens, top_k, generator=gen, device=device) + 0.1
    return ids, weights / weights.sum(dim=1, keepdim=True)


def drop_some(ids: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """ids with about a quarter of the pairs DROPPED (experts other ranks hold): always the second pair
    and, with several tokens, all of the last token's pairs; never token 0's first and last slot (the
    pair that "repeat_in_token" repeats stays repeated)."""
    dropped = torch.rand(ids.shape, generator=gen, device=ids.device) < 0.25
    if ids.shape[0] > 1:
        dropped[-1] = True
    dropped[0, 1] = True
    dropped[0, 0] = dropped[0, -1] = False
    return ids.masked_fill(dropped, moe.DROPPED)


def poisoned_workspace(num_tokens, top_k, stacked, config) -> moe.MoEWorkspace:
    """A workspace whose every entry is wrong until the kernels write it (NaN, or a wrong index)."""
    e, h, i = moe.check_weights(*stacked)
    config = moe.fit_config(config, h, i)
    ws = moe.MoEWorkspace.allocate(num_tokens, top_k, e, h, i, config, stacked.w13_packed.device)
    pairs = num_tokens * top_k
    ws.sorted_pair.fill_(pairs - 1)  # in range, so that a missed entry computes the wrong pair
    ws.block_expert.fill_(e - 1)
    ws.block_rows.fill_(config.block_m)
    ws.hidden_act.fill_(float("nan"))
    if ws.expert_out is not None:
        ws.expert_out.fill_(float("nan"))
    return ws


def run_kernel(z, ids, weights, stacked, config: moe.MoEConfig | None = None):
    """(out, workspace, config) of one moe_mxfp4 call on poisoned buffers."""
    e, h, i = moe.check_weights(*stacked)
    config = moe.fit_config(config or moe.default_config(z.shape[0], ids.shape[1], e), h, i)
    ws = poisoned_workspace(z.shape[0], ids.shape[1], stacked, config)
    out = torch.full((z.shape[0], h), float("nan"), dtype=torch.float32, device=z.device)
    result = moe.moe_mxfp4(z, ids, weights, *stacked, config=config, out=out, workspace=ws)
    assert result.data_ptr() == out.data_ptr()
    return out, ws, config


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert torch.isfinite(out).all(), "output has NaN/inf: an element was not written or a NaN was read"
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def check_alignment(ws: moe.MoEWorkspace, ids: torch.Tensor) -> None:
    """Experts in order, each with whole blocks but its last, holding exactly its pairs in pair order;
    unused blocks (expert -1, no rows) only at the end; DROPPED pairs nowhere. Without alignment: no
    blocks at all."""
    if ws.num_blocks == 0:
        assert ws.sorted_pair.numel() == 0 and ws.block_rows.numel() == 0
        return
    flat = ids.reshape(-1).cpu()
    block_expert, block_rows = ws.block_expert.cpu().tolist(), ws.block_rows.cpu().tolist()
    sorted_pair = ws.sorted_pair.cpu().view(-1, ws.block_m)
    placed: dict[int, list[int]] = {}
    live = [b for b, e in enumerate(block_expert) if e >= 0]
    assert live == list(range(len(live))), f"unused blocks before used ones: {block_expert}"
    assert all(block_rows[b] == 0 for b in range(len(live), ws.num_blocks)), "unused blocks with rows"
    for b in live:
        expert, rows = block_expert[b], block_rows[b]
        assert 1 <= rows <= ws.block_m, f"block {b} has {rows} rows"
        if b > 0 and block_expert[b - 1] == expert:
            assert block_rows[b - 1] == ws.block_m, f"block {b - 1} is partial but expert {expert} continues"
        else:
            assert expert not in placed and (b == 0 or block_expert[b - 1] < expert), f"expert {expert} out of order"
        placed.setdefault(expert, []).extend(sorted_pair[b, :rows].tolist())
    for expert in flat.unique().tolist():
        if expert == moe.DROPPED:
            continue
        expected = (flat == expert).nonzero().flatten().tolist()
        assert placed.pop(expert, None) == expected, f"expert {expert}: wrong pairs or order"
    assert not placed, f"blocks for unused experts {sorted(placed)}"


# ----------------------------------------------------------------------------------------------
# Tiny shapes: interpreter on the CPU, compiled on a GPU
# ----------------------------------------------------------------------------------------------


@pytest.mark.skipif(IN_PROCESS, reason="the kernel tests run in this process")
def test_kernels_in_fresh_interpreter_process():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]


@needs_kernel_device
@pytest.mark.parametrize("swap_ab", [True, False])
@pytest.mark.parametrize("decode", DECODES)
@pytest.mark.parametrize("combine", COMBINES)
@pytest.mark.parametrize("num_tokens", [1, 5])
def test_tiny_matches_reference(num_tokens, combine, decode, swap_ab):
    gen = new_generator(TINY_DEVICE)
    stacked = tiny_experts(gen)
    z = torch.randn(num_tokens, TINY_H, generator=gen, device=TINY_DEVICE).to(torch.bfloat16)
    ids, weights = routing(num_tokens, TINY_E, TINY_K, gen)
    base = moe.default_config(num_tokens, TINY_K, TINY_E)
    config = moe.MoEConfig(base.block_m, base.gate_up, base.down, combine=combine, decode=decode, swap_ab=swap_ab)
    out, ws, _ = run_kernel(z, ids, weights, stacked, config)
    assert relative_error(out, moe.moe_mxfp4_reference(z, ids, weights, *stacked)) < BF16_BOUND
    check_alignment(ws, ids)


@needs_kernel_device
@pytest.mark.parametrize("pattern", ["hot", "repeat_in_token", "skewed"])
def test_tiny_repeated_and_unused_experts(pattern):
    """20 tokens in 16-row blocks: "hot" puts all 40 pairs on 2 of the 4 experts (several blocks each,
    two experts unused); "repeat_in_token" routes a token to one expert twice."""
    gen = new_generator(TINY_DEVICE)
    stacked = tiny_experts(gen)
    num_tokens = 20
    z = torch.randn(num_tokens, TINY_H, generator=gen, device=TINY_DEVICE).to(torch.bfloat16)
    ids, weights = routing(num_tokens, TINY_E, TINY_K, gen, pattern)
    config = moe.MoEConfig(16, moe.GemmTile(32, 128), moe.GemmTile(64, 128), combine="reduce")
    out, ws, _ = run_kernel(z, ids, weights, stacked, config)
    assert relative_error(out, moe.moe_mxfp4_reference(z, ids, weights, *stacked)) < BF16_BOUND
    check_alignment(ws, ids)


def direct_config(num_tokens: int, **changes) -> moe.MoEConfig:
    """The direct path's default config at DIRECT_E/DIRECT_K, on the interpreter with wide N tiles:
    2 gate/up and 1 down program per expert instead of 8 and 2 keep the CPU run short."""
    config = moe.default_config(num_tokens, DIRECT_K, DIRECT_E, align=False)
    if INTERPRET:
        changes = {"gate_up": moe.GemmTile(64, 128), "down": moe.GemmTile(128, 128), **changes}
    return replace(config, **changes)


@needs_kernel_device
@pytest.mark.parametrize(("num_tokens", "pattern"), [(1, "random"), (2, "repeat_in_token"), (5, "random"),
                                                     (8, "random"), (8, "repeat_in_token")])
def test_direct_matches_reference(num_tokens, pattern):
    """The decode path (no alignment) at top-16 over 24 experts: tokens share experts (each expert's
    program computes all its tokens), some pairs are DROPPED, and "repeat_in_token" routes a token to
    one expert twice (one row, the two combine weights summed)."""
    gen = new_generator(TINY_DEVICE)
    stacked = tiny_experts(gen, DIRECT_E)
    z = torch.randn(num_tokens, TINY_H, generator=gen, device=TINY_DEVICE).to(torch.bfloat16)
    ids, weights = routing(num_tokens, DIRECT_E, DIRECT_K, gen, pattern)
    ids = drop_some(ids, gen)
    out, ws, _ = run_kernel(z, ids, weights, stacked, direct_config(num_tokens))
    assert ws.num_blocks == 0
    assert relative_error(out, moe.moe_mxfp4_reference(z, ids, weights, *stacked)) < BF16_BOUND


@needs_kernel_device
@pytest.mark.parametrize(("decode", "swap_ab"), [("select", True), ("subnormal", False)])
def test_direct_variants(decode, swap_ab):
    """The decode path with the other decode and with the activations as the dot's A operand."""
    gen = new_generator(TINY_DEVICE)
    stacked = tiny_experts(gen, DIRECT_E)
    z = torch.randn(3, TINY_H, generator=gen, device=TINY_DEVICE).to(torch.bfloat16)
    ids, weights = routing(3, DIRECT_E, DIRECT_K, gen)
    ids = drop_some(ids, gen)
    out, _, _ = run_kernel(z, ids, weights, stacked, direct_config(3, decode=decode, swap_ab=swap_ab))
    assert relative_error(out, moe.moe_mxfp4_reference(z, ids, weights, *stacked)) < BF16_BOUND


@needs_kernel_device
@pytest.mark.parametrize("align", [False, True])
def test_split_k(align):
    """Both GEMMs split in two along K (H = I = 256): the gate/up part that completes a tile adds up the
    others' and applies SiTU, the down parts add into the output. The split buffers are left zero, so a
    second call on the same workspace (new inputs) is right too."""
    gen = new_generator(TINY_DEVICE)
    stacked = tiny_experts(gen, DIRECT_E, hidden=256, inter=256)
    split = {"gate_up": moe.GemmTile(128, 128, split_k=2), "down": moe.GemmTile(128, 128, split_k=2)}
    config = moe.fit_config(replace(moe.default_config(3, DIRECT_K, DIRECT_E, align=align), **split), 256, 256)
    assert (config.gate_up.split_k, config.down.split_k) == (2, 2)
    ws = poisoned_workspace(3, DIRECT_K, stacked, config)
    for _ in range(2):
        z = torch.randn(3, 256, generator=gen, device=TINY_DEVICE).to(torch.bfloat16)
        ids, weights = routing(3, DIRECT_E, DIRECT_K, gen)
        ids = drop_some(ids, gen)
        out = torch.full((3, 256), float("nan"), device=TINY_DEVICE)
        ws.hidden_act.fill_(float("nan"))
        moe.moe_mxfp4(z, ids, weights, *stacked, config=config, out=out, workspace=ws)
        assert relative_error(out, moe.moe_mxfp4_reference(z, ids, weights, *stacked)) < BF16_BOUND
        assert not ws.split_sum.any() and not ws.split_count.any(), "the split buffers must be left zero"


@needs_kernel_device
@pytest.mark.parametrize(("align", "combine", "split_k"),
                         [(True, "atomic", 1), (True, "reduce", 1), (False, "atomic", 1), (True, "atomic", 2)])
def test_down_tiles(align, combine, split_k):
    """The down GEMM with several output tiles per program (H = 256 in 4 tiles of 64, I = 256 in 2 K steps),
    each tile's epilogue inside the one pipelined loop: every tile of every row block is added (or stored)
    once, with its own columns, and the accumulator starts from zero for each."""
    gen = new_generator(TINY_DEVICE)
    stacked = tiny_experts(gen, DIRECT_E, hidden=256, inter=256)
    base = moe.default_config(3, DIRECT_K, DIRECT_E, align=align)
    config = moe.fit_config(replace(base, combine=combine, down=moe.GemmTile(64, 128, split_k=split_k, tiles=4)),
                            256, 256)
    assert (config.down.tiles, config.down.split_k) == (4, split_k)
    ws = poisoned_workspace(3, DIRECT_K, stacked, config)
    z = torch.randn(3, 256, generator=gen, device=TINY_DEVICE).to(torch.bfloat16)
    ids, weights = routing(3, DIRECT_E, DIRECT_K, gen)
    ids = drop_some(ids, gen)
    out = torch.full((3, 256), float("nan"), device=TINY_DEVICE)
    moe.moe_mxfp4(z, ids, weights, *stacked, config=config, out=out, workspace=ws)
    assert relative_error(out, moe.moe_mxfp4_reference(z, ids, weights, *stacked)) < BF16_BOUND


@needs_kernel_device
def test_direct_all_dropped():
    """Every pair dropped: nothing computed, the output is zero (the gate/up launch still zeroes it)."""
    gen = new_generator(TINY_DEVICE)
    stacked = tiny_experts(gen, DIRECT_E)
    z = torch.randn(2, TINY_H, generator=gen, device=TINY_DEVICE).to(torch.bfloat16)
    ids, weights = routing(2, DIRECT_E, DIRECT_K, gen)
    out, _, _ = run_kernel(z, torch.full_like(ids, moe.DROPPED), weights, stacked, direct_config(2))
    assert torch.equal(out, torch.zeros_like(out))


@needs_kernel_device
@pytest.mark.parametrize(("num_tokens", "block_m", "drop"), [(1, 16, False), (64, 16, True), (300, 32, False),
                                                           (1100, 128, True)])
def test_alignment_at_rank_routing(num_tokens, block_m, drop):
    """The alignment alone, on real per-rank routing (E=224, top-16): one chunk of pairs (exactly full at 64
    tokens), several (300, 1100 tokens: 5 and 18 chunks of 1,024; the interpreter sorts each in ~1.5 s),
    repeated and unused experts, DROPPED pairs."""
    gen = new_generator(TINY_DEVICE)
    ids, _ = routing(num_tokens, RANK_E, RANK_K, gen, "skewed")
    if drop:
        ids = drop_some(ids, gen)
    config = moe.MoEConfig(block_m, moe.GemmTile(16, 128), moe.GemmTile(16, 128))
    ws = moe.MoEWorkspace.allocate(num_tokens, RANK_K, RANK_E, 128, 128, config, TINY_DEVICE)
    ws.sorted_pair.fill_(-1)
    ws.block_expert.fill_(RANK_E + 1)
    ws.block_rows.fill_(block_m + 1)
    moe._align(ids, RANK_E, ws.sorted_pair, ws.block_m, blocks=(ws.block_expert, ws.block_rows))
    check_alignment(ws, ids)


@triton.jit
def _dequant_probe(packed_ptr, words_ptr, out_ptr, column_ptr, N: tl.constexpr, KB: tl.constexpr,
                   SUBNORMAL_DECODE: tl.constexpr, COMPUTE: tl.constexpr, K_ORDER: tl.constexpr):
    """The decoded tile of N rows x 2 KB columns, and the source column of each of its columns."""
    rows = tl.arange(0, N)[:, None]
    cols = tl.arange(0, 2 * KB)[None, :]
    words = tl.load(words_ptr + rows * (KB // 64) + tl.arange(0, KB // 64)[None, :])
    packed = tl.load(packed_ptr.to(tl.pointer_type(tl.int32)) + rows * (KB // 4) + tl.arange(0, KB // 4)[None, :])
    w = _dequant_words(packed, words, N, KB // 4, SUBNORMAL_DECODE, COMPUTE, K_ORDER)
    tl.store(column_ptr + rows * (2 * KB) + cols, _k_order(rows * 0 + cols, N, 2 * KB) if K_ORDER else rows * 0 + cols)
    tl.store(out_ptr + rows * (2 * KB) + cols, w.to(tl.float32))


@needs_kernel_device
@pytest.mark.parametrize("k_order", [False, True])
@pytest.mark.parametrize("decode", DECODES)
def test_dequant_is_exact(decode, k_order):
    """Every code (every column of a word, both signs) and a wide range of scale bytes decode bit for bit from
    the word layout, in the natural column order and in that of _k_order (the one the activations take)."""
    gen = new_generator(TINY_DEVICE)
    rows, kb = 16, 128
    packed = torch.randint(0, 256, (rows, kb), generator=gen, device=TINY_DEVICE, dtype=torch.int32).to(torch.uint8)
    top = moe.MAX_SUBNORMAL_DECODE_SCALE if decode == "subnormal" else 192
    scale = torch.randint(64, top + 1, (rows, kb // 16), generator=gen, device=TINY_DEVICE, dtype=torch.int32)
    scale = scale.to(torch.uint8)
    out = torch.full((rows, 2 * kb), float("nan"), device=TINY_DEVICE)
    column = torch.full((rows, 2 * kb), -1, dtype=torch.int32, device=TINY_DEVICE)
    _dequant_probe[(1,)](packed, scale.view(torch.int32), out, column, N=rows, KB=kb,
                         SUBNORMAL_DECODE=decode == "subnormal", COMPUTE=moe._compute_dtype(), K_ORDER=k_order)
    expected = dequantize_mxfp4(from_word_layout(packed), scale)
    assert torch.equal(column.sort(dim=1).values, torch.arange(2 * kb, device=TINY_DEVICE).expand(rows, -1).int())
    expected = expected.gather(1, column.long())
    assert torch.equal(out, expected), "dequantized weights differ from dequantize_mxfp4"


@triton.jit
def _order_probe(order_ptr, position_ptr, COLS: tl.constexpr):
    cols = tl.arange(0, COLS)
    tl.store(order_ptr + cols, tl.reshape(_k_order(cols[None, :], 1, COLS), (COLS,)))
    tl.store(position_ptr + cols, _k_position(cols, COLS))


@needs_kernel_device
@pytest.mark.parametrize("cols", [128, 256])
def test_k_position_inverts_k_order(cols):
    """The order kernel and the gate/up epilogue store natural column c at `_k_position(c)`; the GEMMs then read
    the layout `_k_order` gives: the two must be inverse permutations."""
    order = torch.full((cols,), -1, dtype=torch.int32, device=TINY_DEVICE)
    position = torch.full((cols,), -1, dtype=torch.int32, device=TINY_DEVICE)
    _order_probe[(1,)](order, position, COLS=cols)
    natural = torch.arange(cols, dtype=torch.int32, device=TINY_DEVICE)
    assert torch.equal(order.sort().values, natural), "_k_order is not a permutation"
    assert torch.equal(order[position.long()], natural), "_k_position is not the inverse of _k_order"


@needs_kernel_device
@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")  # sigmoid of large gates
def test_select_decode_takes_large_scales():
    """Scale bytes above 128: stack_experts refuses them for the default decode; decode='select' is exact."""
    gen = new_generator(TINY_DEVICE)
    w1 = [random_mxfp4(TINY_I, TINY_H, gen) for _ in range(TINY_E)]
    w1[0] = (w1[0][0], torch.full_like(w1[0][1], 131))  # weights up to 6 * 2^4
    w3 = [random_mxfp4(TINY_I, TINY_H, gen) for _ in range(TINY_E)]
    w2 = [random_mxfp4(TINY_H, TINY_I, gen) for _ in range(TINY_E)]
    with pytest.raises(ValueError, match="scale byte 131"):
        moe.stack_experts(w1, w3, w2)
    stacked = moe.stack_experts(w1, w3, w2, check_scales=False)
    z = torch.randn(3, TINY_H, generator=gen, device=TINY_DEVICE).to(torch.bfloat16)
    ids, weights = routing(3, TINY_E, TINY_K, gen)
    ids[:, 0] = 0
    config = moe.MoEConfig(16, moe.GemmTile(16, 128), moe.GemmTile(64, 128), decode="select")
    out, _, _ = run_kernel(z, ids, weights, stacked, config)
    assert relative_error(out, moe.moe_mxfp4_reference(z, ids, weights, *stacked)) < BF16_BOUND


# ----------------------------------------------------------------------------------------------
# Host-side checks (no kernel)
# ----------------------------------------------------------------------------------------------


def test_inputs_are_checked():
    gen = new_generator("cpu")
    w = [random_mxfp4(TINY_I, TINY_H, gen) for _ in range(2)]
    w2 = [random_mxfp4(TINY_H, TINY_I, gen) for _ in range(2)]
    with pytest.raises(ValueError, match="w1 2, w3 1"):
        moe.stack_experts(w, w[:1], w2)
    with pytest.raises(ValueError, match="w2 tensors differ"):
        moe.stack_experts(w, w, [w2[0], random_mxfp4(TINY_H, 2 * TINY_I, gen)])
    stacked = moe.stack_experts(w, w, w2)
    z = torch.randn(2, TINY_H).to(torch.bfloat16)
    ids, weights = torch.zeros(2, 1, dtype=torch.int64), torch.ones(2, 1)
    with pytest.raises(ValueError, match="z must be bf16"):
        moe.moe_mxfp4(z.float(), ids, weights, *stacked)
    with pytest.raises(ValueError, match="expert_weights must be fp32"):
        moe.moe_mxfp4(z, ids, weights.double(), *stacked)
    with pytest.raises(ValueError, match="w2_scale has shape"):
        moe.moe_mxfp4(z, ids, weights, stacked.w13_packed, stacked.w13_scale, stacked.w2_packed,
                      stacked.w2_scale[:, :, :2].contiguous())
    with pytest.raises(ValueError, match="multiples of 128"):
        moe.check_weights(*moe.stack_experts(*(3 * [[random_mxfp4(64, 64, gen)]])))
    with pytest.raises(ValueError, match="block_m"):
        moe.fit_config(moe.MoEConfig(24, moe.GemmTile(16, 128), moe.GemmTile(16, 128)), TINY_H, TINY_I)
    with pytest.raises(ValueError, match="combine must be 'atomic'"):
        moe.fit_config(replace(moe.default_config(1, 2, 2), combine="reduce"), TINY_H, TINY_I)
    with pytest.raises(ValueError, match="split_k must be >= 1"):
        moe.fit_config(replace(moe.default_config(1, 2, 2), gate_up=moe.GemmTile(16, 128, split_k=0)), TINY_H, TINY_I)
    with pytest.raises(ValueError, match="split down GEMM"):
        moe.fit_config(moe.MoEConfig(16, moe.GemmTile(16, 128), moe.GemmTile(16, 128, split_k=2), "reduce"), 128, 256)
    too_short = replace(moe.default_config(17, 1, 2, align=False), block_m=16)
    with pytest.raises(ValueError, match="block_m >= T"):
        moe.moe_mxfp4(torch.zeros(17, TINY_H, dtype=torch.bfloat16), torch.zeros(17, 1, dtype=torch.int64),
                      torch.ones(17, 1), *stacked, config=too_short)
    assert not moe.supported("cpu")


def test_stack_from_checkpoint_names():
    gen = new_generator("cpu")
    prefix = "language_model.model.layers.3.block_sparse_moe.experts"
    tensors, pairs = {}, {"w1": [], "w3": [], "w2": []}
    for e in range(TINY_E):
        for w, shape in (("w1", (TINY_I, TINY_H)), ("w3", (TINY_I, TINY_H)), ("w2", (TINY_H, TINY_I))):
            packed, scale = random_mxfp4(*shape, gen)
            tensors[f"{prefix}.{e}.{w}.weight_packed"], tensors[f"{prefix}.{e}.{w}.weight_scale"] = packed, scale
            pairs[w].append((packed, scale))
    stacked = moe.stack_experts_from_state(tensors, prefix, TINY_E)
    for got, want in zip(stacked, moe.stack_experts(pairs["w1"], pairs["w3"], pairs["w2"]), strict=True):
        assert torch.equal(got, want)
    assert torch.equal(from_word_layout(stacked.w13_packed[1, TINY_I:]), pairs["w3"][1][0])  # w3 rows follow w1
    assert torch.equal(stacked.w2_scale[2], pairs["w2"][2][1])  # the scales as the checkpoint has them
    del tensors[f"{prefix}.2.w2.weight_scale"]
    with pytest.raises(KeyError, match="experts.2.w2.weight_scale"):
        moe.stack_experts_from_state(tensors, prefix, TINY_E)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
def test_situ_reference_is_the_models(dtype):
    """The kernels' SiTU reference equals the model's, bit for bit, in each dtype (fp32 arithmetic for
    bf16, fp64 kept), over soft-clip and saturated ranges of both branches."""
    from mstar.models.kimi_k3.mlp import situ

    gen = new_generator("cpu")
    gate, up = ((torch.randn(64, 96, generator=gen, dtype=torch.float64) * 30).to(dtype) for _ in range(2))
    got = moe.situ_reference(gate, up, moe.SITU_BETA, moe.SITU_LINEAR_BETA)
    want = situ(gate, up, moe.SITU_BETA, moe.SITU_LINEAR_BETA)
    assert got.dtype == want.dtype == dtype
    assert torch.equal(got, want)


def test_config_table_and_block_bound():
    for tokens in (1, 8, 16, 64, 256, 1024, 8192):
        for align in (None, True):
            config = moe.fit_config(moe.default_config(tokens, RANK_K, RANK_E, align=align), RANK_H, RANK_I)
            assert RANK_I % config.gate_up.block_n == 0 and RANK_H % config.gate_up.block_k == 0
            assert RANK_H % config.down.block_n == 0 and RANK_I % config.down.block_k == 0
        # The decode path up to DIRECT_MAX_PAIRS pairs (T <= 8 at top-16), the alignment above.
        assert moe.default_config(tokens, RANK_K, RANK_E).align == (tokens * RANK_K > moe.DIRECT_MAX_PAIRS)
    direct = moe.default_config(40, RANK_K, RANK_E, align=False)
    assert not direct.align and direct.block_m == 64 and direct.combine == "atomic"
    shrunk = moe.fit_config(moe.MoEConfig(16, moe.GemmTile(256, 1024), moe.GemmTile(512, 512)), TINY_H, TINY_I)
    assert (shrunk.gate_up.block_n, shrunk.gate_up.block_k, shrunk.down.block_n, shrunk.down.block_k) == (
        128, 128, 128, 128)
    # split_k shrinks to whole scale words per part: 3584 = 28 x 128 splits in 7 (not 8) parts, 384 in 3 (not 4).
    split = moe.fit_config(moe.MoEConfig(16, moe.GemmTile(32, 256, split_k=8), moe.GemmTile(64, 128, split_k=4)),
                           RANK_H, RANK_I)
    assert (split.gate_up.split_k, split.gate_up.block_k, split.down.split_k) == (7, 256, 3)
    # tiles shrinks to divide the down GEMM's N tiles (3584 / 128 = 28: 8 -> 7), and only the down tile takes it.
    tiled = moe.fit_config(moe.MoEConfig(16, moe.GemmTile(64, 128), moe.GemmTile(128, 128, tiles=8)), RANK_H, RANK_I)
    assert tiled.down.tiles == 7
    with pytest.raises(ValueError, match="tiles"):
        moe.fit_config(moe.MoEConfig(16, moe.GemmTile(64, 128, tiles=2), moe.GemmTile(128, 128)), RANK_H, RANK_I)
    # Worst cases: every pair its own expert, and every expert with one pair more than a block.
    assert moe.max_row_blocks(16, 224, 16) == 16
    assert moe.max_row_blocks(224 * 17, 224, 16) >= 224 * 2
    assert moe.max_row_blocks(224 * 17, 224, 16) <= (224 * 17 + 224 * 15) // 16


# ----------------------------------------------------------------------------------------------
# GPU: real per-rank shapes
# ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def rank_weights():
    return rank_experts(new_generator("cuda"))


def rank_inputs(num_tokens: int, pattern: str = "random", drop: bool = False):
    gen = new_generator("cuda")
    z = torch.randn(num_tokens, RANK_H, generator=gen, device="cuda").to(torch.bfloat16)
    ids, weights = routing(num_tokens, RANK_E, RANK_K, gen, pattern)
    return z, drop_some(ids, gen) if drop else ids, weights


@gpu
@pytest.mark.parametrize("num_tokens", [1, 8, 64, 300])
def test_gpu_matches_reference(rank_weights, num_tokens):
    z, ids, weights = rank_inputs(num_tokens)
    out, ws, config = run_kernel(z, ids, weights, rank_weights)
    err = relative_error(out, moe.moe_mxfp4_reference(z, ids, weights, *rank_weights))
    print(f"T={num_tokens} {config}: relative error {err:.2e}")
    assert err < BF16_BOUND
    check_alignment(ws, ids)


@gpu
@pytest.mark.parametrize("align", [False, True])
@pytest.mark.parametrize(("num_tokens", "pattern"), [(1, "random"), (2, "repeat_in_token"), (5, "skewed"),
                                                     (8, "random"), (8, "hot"), (16, "skewed")])
def test_gpu_direct_and_aligned(rank_weights, num_tokens, pattern, align):
    """Both pipelines at decode sizes on real shapes, with DROPPED pairs and shared experts."""
    z, ids, weights = rank_inputs(num_tokens, pattern, drop=True)
    out, ws, config = run_kernel(z, ids, weights, rank_weights, moe.default_config(num_tokens, RANK_K, RANK_E,
                                                                                    align=align))
    err = relative_error(out, moe.moe_mxfp4_reference(z, ids, weights, *rank_weights))
    print(f"T={num_tokens} {pattern} align={align}: relative error {err:.2e}")
    assert err < BF16_BOUND
    check_alignment(ws, ids)


@gpu
@pytest.mark.parametrize("align", [False, True])
@pytest.mark.parametrize("gate_up", [moe.GemmTile(32, 256, split_k=2), moe.GemmTile(64, 128, split_k=4)])
def test_gpu_split_k(rank_weights, gate_up, align):
    """Split gate/up at real shapes, twice on one workspace. (64, 128, split 4) once lost sums: its
    loads and stores of the sums went to different threads (now one exchange per element)."""
    config = moe.fit_config(replace(moe.default_config(8, RANK_K, RANK_E, align=align), gate_up=gate_up,
                                    down=moe.GemmTile(128, 128, split_k=3)), RANK_H, RANK_I)
    ws = poisoned_workspace(8, RANK_K, rank_weights, config)
    for pattern in ("random", "hot"):
        z, ids, weights = rank_inputs(8, pattern, drop=True)
        out = torch.full((8, RANK_H), float("nan"), device="cuda")
        ws.hidden_act.fill_(float("nan"))
        moe.moe_mxfp4(z, ids, weights, *rank_weights, config=config, out=out, workspace=ws)
        assert relative_error(out, moe.moe_mxfp4_reference(z, ids, weights, *rank_weights)) < BF16_BOUND
        assert not ws.split_sum.any() and not ws.split_count.any()


@gpu
@pytest.mark.parametrize("align", [False, True])
@pytest.mark.parametrize("tiles", [2, 7, 28])
def test_gpu_down_tiles(rank_weights, tiles, align):
    """Several down tiles per program at real shapes, on fresh routing with dropped pairs."""
    num_tokens = 8 if not align else 64
    config = moe.fit_config(replace(moe.default_config(num_tokens, RANK_K, RANK_E, align=align),
                                    down=moe.GemmTile(128, 128, tiles=tiles)), RANK_H, RANK_I)
    z, ids, weights = rank_inputs(num_tokens, "random", drop=True)
    out, ws, config = run_kernel(z, ids, weights, rank_weights, config)
    assert relative_error(out, moe.moe_mxfp4_reference(z, ids, weights, *rank_weights)) < BF16_BOUND


@gpu
@pytest.mark.parametrize("pattern", ["hot", "skewed"])
@pytest.mark.parametrize("num_tokens", [64, 300])
def test_gpu_repeated_and_unused_experts(rank_weights, num_tokens, pattern):
    z, ids, weights = rank_inputs(num_tokens, pattern)
    out, ws, _ = run_kernel(z, ids, weights, rank_weights)
    assert relative_error(out, moe.moe_mxfp4_reference(z, ids, weights, *rank_weights)) < BF16_BOUND
    check_alignment(ws, ids)


@gpu
@pytest.mark.parametrize("decode", DECODES)
@pytest.mark.parametrize("combine", COMBINES)
@pytest.mark.parametrize("block_m", [16, 64])
def test_gpu_variants(rank_weights, block_m, combine, decode):
    z, ids, weights = rank_inputs(64)
    base = moe.default_config(64 if block_m == 16 else 512, RANK_K, RANK_E)  # swap_ab at 16, not at 64
    config = moe.MoEConfig(block_m, base.gate_up, base.down, combine=combine, decode=decode, swap_ab=base.swap_ab)
    out, _, _ = run_kernel(z, ids, weights, rank_weights, config)
    assert relative_error(out, moe.moe_mxfp4_reference(z, ids, weights, *rank_weights)) < BF16_BOUND


@gpu
def test_gpu_reduce_is_deterministic(rank_weights):
    z, ids, weights = rank_inputs(64)
    config = moe.default_config(64, RANK_K, RANK_E)
    config = moe.MoEConfig(config.block_m, config.gate_up, config.down, combine="reduce")
    first, _, _ = run_kernel(z, ids, weights, rank_weights, config)
    second, _, _ = run_kernel(z, ids, weights, rank_weights, config)
    assert torch.equal(first, second)


@gpu
@pytest.mark.parametrize("num_tokens", [1, 8, 64])
def test_gpu_cuda_graph_replay(rank_weights, num_tokens):
    """Captured once, replayed on new inputs copied into the static buffers (new routing, DROPPED pairs
    included: the decode path finds each program's expert and tokens on the device)."""
    e, h, i = moe.check_weights(*rank_weights)
    config = moe.fit_config(moe.default_config(num_tokens, RANK_K, e), h, i)
    ws = moe.MoEWorkspace.allocate(num_tokens, RANK_K, e, h, i, config, "cuda")
    z, ids, weights = rank_inputs(num_tokens, drop=True)
    out = torch.empty(num_tokens, h, device="cuda")
    moe.moe_mxfp4(z, ids, weights, *rank_weights, config=config, out=out, workspace=ws)  # compile outside
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        moe.moe_mxfp4(z, ids, weights, *rank_weights, config=config, out=out, workspace=ws)
    for pattern in ("random", "hot"):
        new_z, new_ids, new_weights = rank_inputs(num_tokens, pattern, drop=True)
        z.copy_(new_z)
        ids.copy_(new_ids)
        weights.copy_(new_weights)
        out.fill_(float("nan"))
        ws.hidden_act.fill_(float("nan"))
        graph.replay()
        ref = moe.moe_mxfp4_reference(new_z, new_ids, new_weights, *rank_weights)
        assert relative_error(out, ref) < BF16_BOUND
