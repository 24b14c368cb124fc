"""The router's selection kernel (mstar/kernels/router_topk.py) against the torch `Router`: the same
experts and weights. Without CUDA through Triton's interpreter; on the GPU with the bf16 GEMM."""

from __future__ import annotations

import json
import os
from importlib import resources

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from mstar.kernels import router_topk  # noqa: E402
from mstar.models.kimi_k3.config import parse_config  # noqa: E402
from mstar.models.kimi_k3.moe import Router  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def router_config(experts, top_k, renormalize, scale):
    raw = json.loads(resources.files("mstar.models.kimi_k3").joinpath("fixtures", "kimi_k3_config.json").read_text())
    raw["text_config"].update(hidden_size=256, num_experts=experts, num_experts_per_token=top_k,
                              moe_renormalize=renormalize, routed_scaling_factor=scale, num_expert_group=1,
                              topk_group=1)
    return parse_config(raw)


@pytest.mark.parametrize("experts, top_k, renormalize, scale", [(224, 16, True, 1.0), (20, 3, False, 2.5),
                                                                 (16, 1, True, 1.0)])
@pytest.mark.parametrize("dtype", [torch.float32] + ([torch.bfloat16] if DEVICE == "cuda" else []))
def test_selection_equals_the_torch_router(experts, top_k, renormalize, scale, dtype):
    router = Router(router_config(experts, top_k, renormalize, scale)).to(DEVICE)
    with torch.no_grad():
        router.e_score_correction_bias.normal_(0, 0.05)
    router = router.to(dtype)
    x = torch.randn(9, 256, device=DEVICE).to(dtype)
    expect = router(x)
    ids, weights = router_topk.route(x, router.weight, router.e_score_correction_bias, top_k, renormalize, scale)
    # the same set of experts per token (order is free), with the same weights
    order, expect_order = ids.sort(-1), expect.experts.sort(-1)
    assert torch.equal(order.values, expect_order.values)
    got_w = weights.gather(1, order.indices)
    want_w = expect.weights.gather(1, expect_order.indices)
    torch.testing.assert_close(got_w, want_w.float(), rtol=1e-5, atol=1e-6)


def test_a_nan_row_still_picks_experts_in_range():
    """A NaN logits row (a poisoned request) picks ids the expert kernels can index and gets NaN weights;
    a single NaN logit is never picked; the other rows are routed as without them."""
    logits = torch.randn(3, 40, device=DEVICE)
    bias = torch.randn(40, device=DEVICE) * 0.1
    clean_ids, clean_w = router_topk.select(logits, bias, 6, True, 2.5)
    logits[1] = float("nan")
    logits[2, 5] = float("nan")
    ids, w = router_topk.select(logits, bias, 6, True, 2.5)
    assert ((ids >= 0) & (ids < 40)).all()
    assert torch.isnan(w[1]).all()
    assert torch.equal(ids[0], clean_ids[0]) and torch.equal(w[0], clean_w[0])
    assert 5 not in ids[2].tolist() and torch.isfinite(w[2]).all()


def test_ties_pick_the_lowest_ids_and_negative_choices_rank_below_positive_ones():
    """Choices (sigmoid + bias) that tie exactly, and biases that push some below zero: the picks are the k
    largest choices, the lowest id first among equal ones (a stable sort of -choice is the reference)."""
    E, k = 224, 16
    logits = torch.randn(5, E, device=DEVICE).round(decimals=1)  # many exactly equal logits per row
    bias = (torch.randn(E, device=DEVICE) * 0.6).round(decimals=1)
    logits[3] = 0.0
    bias[::3] = -1.0  # with s <= 1, these choices are <= 0
    ids, _ = router_topk.select(logits, bias, k, False, 1.0)
    choice = torch.sigmoid(logits) + bias
    want = torch.sort(-choice, dim=-1, stable=True).indices[:, :k]
    assert torch.equal(ids, want)


@pytest.mark.parametrize("rows, inter", [(1, 768), (7, 96), (3, 1030)])
@pytest.mark.parametrize("dtype", [torch.float32] + ([torch.bfloat16] if DEVICE == "cuda" else []))
def test_selection_with_situ_is_the_two_launches(rows, inter, dtype):
    """select_with_situ (one launch) = select + gated_mlp.situ_and_mul, bit for bit: fresh inputs, gate/up a
    strided view of a wider GEMM output as the MoE inputs give it, SiTU widths over one and several blocks."""
    from mstar.kernels import gated_mlp

    E, k = 224, 16
    logits = torch.randn(rows, E, device=DEVICE)
    bias = torch.randn(E, device=DEVICE) * 0.05
    wide = (torch.randn(rows, 40 + 2 * inter, device=DEVICE) * 8).to(dtype)  # far into both tanh clips
    gate_up = wide[:, 40:]
    ids, weights, hidden = router_topk.select_with_situ(logits, bias, k, True, 2.5, gate_up, 4.0, 25.0)
    want_ids, want_weights = router_topk.select(logits, bias, k, True, 2.5)
    assert torch.equal(ids, want_ids) and torch.equal(weights, want_weights)
    assert hidden.dtype == dtype and torch.equal(hidden, gated_mlp.situ_and_mul(gate_up, 4.0, 25.0))
    with pytest.raises(ValueError, match="gate_up must be"):
        router_topk.select_with_situ(logits, bias, k, True, 2.5, gate_up[:, 1:], 4.0, 25.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_selection_with_situ_writes_into_a_column_slice_of_a_wider_buffer(dtype):
    """With `out`, the SiTU lands in the last columns of a wider buffer (the MoE output GEMM's input, poisoned:
    its first columns stay untouched), the same bits as its own tensor."""
    rows, inter, E, k = 3, 600, 40, 4
    logits = torch.randn(rows, E, device=DEVICE)
    bias = torch.randn(E, device=DEVICE) * 0.05
    gate_up = (torch.randn(rows, 2 * inter, device=DEVICE) * 8).to(dtype)
    buffer = torch.full((rows, 24 + inter), float("nan"), device=DEVICE, dtype=dtype)
    ids, weights, hidden = router_topk.select_with_situ(logits, bias, k, True, 2.5, gate_up, 4.0, 25.0,
                                                        out=buffer[:, 24:])
    assert hidden.data_ptr() == buffer[:, 24:].data_ptr() and buffer[:, :24].isnan().all()
    want_ids, want_weights, want_hidden = router_topk.select_with_situ(logits, bias, k, True, 2.5, gate_up, 4.0, 25.0)
    assert torch.equal(ids, want_ids) and torch.equal(weights, want_weights) and torch.equal(hidden, want_hidden)
    with pytest.raises(ValueError, match="out must be"):
        router_topk.select_with_situ(logits, bias, k, True, 2.5, gate_up, 4.0, 25.0, out=buffer[:, 23:])
