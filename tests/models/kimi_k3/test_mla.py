"""Gated NoPE MLA: the layer against a float64 formulation written here from the formulas, and the
expanded / absorbed forms, cache hand-over and decode loop against one another."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch
from paths import ROOT

from mstar.models.kimi_k3.config import KimiK3Config, parse_config
from mstar.models.kimi_k3.mla import LATENT_NORM_EPS, GatedMLA, MLACache, absorbed_attention

FIXTURE = ROOT / "mstar/models/kimi_k3/fixtures/kimi_k3_config.json"
MLA_LAYER = 3  # 0-based; 1-based layer 4 is a full-attention layer in the fixture
F64 = dict(rtol=1e-10, atol=1e-10)


def small_config(q_lora_rank: int | None = 48, gate: bool = True) -> KimiK3Config:
    """The real K3 config with the attention shrunk: hidden 64, 4 heads, latent 32, nope 16, rope 8, v 16."""
    raw = copy.deepcopy(json.loads(FIXTURE.read_text()))
    raw["text_config"].update(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=4,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        q_lora_rank=q_lora_rank,
        mla_use_output_gate=gate,
    )
    return parse_config(raw)


def make_layer(cfg: KimiK3Config, dtype=torch.float64) -> GatedMLA:
    """A layer with weights that give O(1) attention logits, so the softmax is far from uniform."""
    layer = GatedMLA(cfg, MLA_LAYER).to(dtype)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if name.endswith("layernorm.weight"):
                p.copy_(1 + 0.2 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) / math.sqrt(p.shape[1]))
    return layer


# --- independent float64 formulation (reads the weights by their checkpoint names) ---------------------


def ref_rms(x, w, eps):
    return w * x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)


def reference_mla(w: dict, x: torch.Tensor, cfg: KimiK3Config, *, eps=1e-6, scale=None) -> torch.Tensor:
    """Causal gated NoPE MLA over the whole sequence x [T, D], one head at a time, in float64."""
    w = {k: v.double() for k, v in w.items()}
    x = x.double()
    n_heads, nope, rope, dv, r = (cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim,
                                  cfg.v_head_dim, cfg.kv_lora_rank)
    scale = (nope + rope) ** -0.5 if scale is None else scale
    t = x.shape[0]
    if "q_proj.weight" in w:
        q = x @ w["q_proj.weight"].T
    else:
        q = ref_rms(x @ w["q_a_proj.weight"].T, w["q_a_layernorm.weight"], eps) @ w["q_b_proj.weight"].T
    kv = x @ w["kv_a_proj_with_mqa.weight"].T
    c_kv = ref_rms(kv[:, :r], w["kv_a_layernorm.weight"], eps)
    k_pe = kv[:, r:]
    future = torch.ones(t, t, dtype=torch.bool).triu(1)
    heads = []
    for h in range(n_heads):
        q_h = q[:, h * (nope + rope):(h + 1) * (nope + rope)]
        w_kv = w["kv_b_proj.weight"][h * (nope + dv):(h + 1) * (nope + dv)]
        k_h = torch.cat([c_kv @ w_kv[:nope].T, k_pe], dim=1)
        v_h = c_kv @ w_kv[nope:].T
        s = (q_h @ k_h.T * scale).masked_fill(future, -math.inf)
        heads.append(torch.softmax(s, dim=1) @ v_h)
    o = torch.cat(heads, dim=1)
    if "g_proj.weight" in w:
        o = o * torch.sigmoid(x @ w["g_proj.weight"].T)
    return o @ w["o_proj.weight"].T


def max_err(a, b) -> float:
    return (a.double() - b.double()).abs().max().item()


# --- the layer against the formulas --------------------------------------------------------------------


@pytest.mark.parametrize("absorbed", [False, True], ids=["expanded", "absorbed"])
@pytest.mark.parametrize("gate", [True, False], ids=["gate", "nogate"])
@pytest.mark.parametrize("q_lora_rank", [48, None], ids=["q_lora", "q_proj"])
def test_layer_matches_reference(absorbed, gate, q_lora_rank):
    cfg = small_config(q_lora_rank=q_lora_rank, gate=gate)
    layer = make_layer(cfg)
    names = set(layer.state_dict())
    assert ("g_proj.weight" in names) == gate
    assert ("q_proj.weight" in names) == (q_lora_rank is None)
    assert ("q_a_proj.weight" in names) == (q_lora_rank is not None)
    x = torch.randn(19, 64, dtype=torch.float64)
    y, cache = layer(x, absorbed=absorbed)
    torch.testing.assert_close(y, reference_mla(layer.state_dict(), x, cfg), **F64)
    assert len(cache) == 19


def test_checkpoint_shapes():
    cfg = small_config()
    shapes = {k: tuple(v.shape) for k, v in GatedMLA(cfg, MLA_LAYER).state_dict().items()}
    assert shapes == {
        "q_a_proj.weight": (48, 64),
        "q_a_layernorm.weight": (48,),
        "q_b_proj.weight": (4 * 24, 48),
        "kv_a_proj_with_mqa.weight": (32 + 8, 64),
        "kv_a_layernorm.weight": (32,),
        "kv_b_proj.weight": (4 * 32, 32),
        "g_proj.weight": (4 * 16, 64),
        "o_proj.weight": (64, 4 * 16),
    }


def test_float32_and_bfloat16_follow_float64():
    cfg = small_config()
    layer64 = make_layer(cfg)
    x = torch.randn(11, 64, dtype=torch.float64)
    ref = reference_mla(layer64.state_dict(), x, cfg)
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 0.05)):
        layer = copy.deepcopy(layer64).to(dtype)
        for absorbed in (False, True):
            y, cache = layer(x.to(dtype), absorbed=absorbed)
            assert y.dtype == dtype and cache.latent.dtype == dtype
            assert max_err(y, ref) < tol * ref.abs().max().item(), (dtype, absorbed)


# --- the two forms agree --------------------------------------------------------------------------------


def test_absorbed_equals_expanded_prefill():
    layer = make_layer(small_config())
    x = torch.randn(33, 64, dtype=torch.float64)
    y_exp, c_exp = layer(x)
    y_abs, c_abs = layer(x, absorbed=True)
    torch.testing.assert_close(y_abs, y_exp, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(c_abs.rows(), c_exp.rows(), rtol=0, atol=0)


def test_absorbed_equals_expanded_decode_over_long_cache():
    layer = make_layer(small_config())
    _, cache = layer(torch.randn(700, 64, dtype=torch.float64))
    x = torch.randn(1, 64, dtype=torch.float64)
    y_exp, _ = layer(x, cache)
    y_abs, new_cache = layer(x, cache, absorbed=True)
    torch.testing.assert_close(y_abs, y_exp, rtol=1e-12, atol=1e-12)
    assert len(new_cache) == 701 and len(cache) == 700  # the handed-in cache is not modified


# --- cache hand-over -------------------------------------------------------------------------------------


@pytest.mark.parametrize("first,then", [(False, False), (True, True), (False, True)],
                         ids=["expanded", "absorbed", "expanded-then-absorbed"])
def test_prefix_then_continue_equals_one_pass(first, then):
    layer = make_layer(small_config())
    x = torch.randn(29, 64, dtype=torch.float64)
    a = int(torch.randint(1, 28, ()).item())
    y_full, c_full = layer(x)
    y_head, cache = layer(x[:a], absorbed=first)
    y_tail, cache = layer(x[a:], cache, absorbed=then)
    torch.testing.assert_close(torch.cat([y_head, y_tail]), y_full, **F64)
    torch.testing.assert_close(cache.rows(), c_full.rows(), **F64)


@pytest.mark.parametrize("absorbed", [False, True], ids=["expanded", "absorbed"])
def test_token_by_token_decode_equals_one_pass(absorbed):
    layer = make_layer(small_config())
    x = torch.randn(24, 64, dtype=torch.float64)
    y_full, _ = layer(x)
    cache, ys = None, []
    for t in range(x.shape[0]):
        y_t, cache = layer(x[t:t + 1], cache, absorbed=absorbed)
        ys.append(y_t)
    torch.testing.assert_close(torch.cat(ys), y_full, **F64)


def test_cache_helpers_round_trip():
    latent, k_pe = torch.randn(5, 32), torch.randn(5, 8)
    cache = MLACache.empty(32, 8, dtype=torch.float32).append(latent[:2], k_pe[:2]).append(latent[2:], k_pe[2:])
    assert len(cache) == 5 and cache.rows().shape == (5, 40)
    torch.testing.assert_close(cache.rows(), torch.cat([latent, k_pe], dim=1), rtol=0, atol=0)
    back = MLACache.from_rows(cache.rows(), 32)
    torch.testing.assert_close(back.latent, latent, rtol=0, atol=0)
    torch.testing.assert_close(back.k_pe, k_pe, rtol=0, atol=0)


def test_wrong_cache_width_is_rejected():
    layer = make_layer(small_config())
    with pytest.raises(ValueError, match="kv_lora_rank"):
        layer(torch.randn(2, 64, dtype=torch.float64), MLACache.empty(16, 8, dtype=torch.float64))


# --- eps and scale ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("absorbed", [False, True], ids=["expanded", "absorbed"])
def test_latent_norm_eps_is_1e6(absorbed):
    assert LATENT_NORM_EPS == 1e-6
    cfg = small_config()
    layer = make_layer(cfg)
    # Inputs small enough that mean(c^2) of the q_a/kv_a outputs is ~1e-6, comparable to eps.
    x = 1e-3 * torch.randn(13, 64, dtype=torch.float64)
    y, _ = layer(x, absorbed=absorbed)
    w = layer.state_dict()
    ref6, ref5 = reference_mla(w, x, cfg, eps=1e-6), reference_mla(w, x, cfg, eps=1e-5)
    torch.testing.assert_close(y, ref6, **F64)
    assert max_err(y, ref5) > 1e-2 * ref6.abs().max().item()


@pytest.mark.parametrize("absorbed", [False, True], ids=["expanded", "absorbed"])
def test_scale_is_qk_head_dim(absorbed):
    cfg = small_config()
    assert cfg.mla_softmax_scale == (16 + 8) ** -0.5
    layer = make_layer(cfg)
    x = torch.randn(17, 64, dtype=torch.float64)
    y, _ = layer(x, absorbed=absorbed)
    w = layer.state_dict()
    torch.testing.assert_close(y, reference_mla(w, x, cfg, scale=(16 + 8) ** -0.5), **F64)
    wrong = reference_mla(w, x, cfg, scale=(32 + 8) ** -0.5)  # the absorbed row width: not the scale
    assert max_err(y, wrong) > 1e-2 * wrong.abs().max().item()


def test_absorbed_core_against_explicit_softmax():
    """The standalone core: o_lat[t, h] = sum_{s <= offset+t} softmax(q_abs . row * scale) latent_s."""
    t, h, r, rope, offset = 5, 3, 32, 8, 11
    q_abs = torch.randn(t, h, r + rope, dtype=torch.float64)
    rows = torch.randn(offset + t, r + rope, dtype=torch.float64)
    scale = 0.3
    o_lat = absorbed_attention(q_abs, rows, offset, scale, kv_lora_rank=r)
    assert o_lat.shape == (t, h, r)
    for i in range(t):
        visible = rows[: offset + i + 1]
        for j in range(h):
            p = torch.softmax(visible @ q_abs[i, j] * scale, dim=0)
            torch.testing.assert_close(o_lat[i, j], p @ visible[:, :r], **F64)
