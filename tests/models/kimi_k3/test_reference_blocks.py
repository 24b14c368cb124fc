"""AttnRes, SiTU, the router and the latent MoE against float64 formulations written from the formulas."""

import json
import math
from importlib import resources

import pytest
import torch

from mstar.models.kimi_k3.attn_res import ResidualStream, attn_res_mix
from mstar.models.kimi_k3.config import parse_config
from mstar.models.kimi_k3.mlp import situ
from mstar.models.kimi_k3.moe import LatentMoE, select_experts

F64 = torch.float64


def tiny_config(**text_overrides):
    raw = json.loads(resources.files("mstar.models.kimi_k3").joinpath("fixtures", "kimi_k3_config.json").read_text())
    t = raw["text_config"]
    t.update(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32,
             kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, intermediate_size=96,
             moe_intermediate_size=32, num_experts=8, num_experts_per_token=3, num_shared_experts=1,
             routed_expert_hidden_size=32, attn_res_block_size=2, vocab_size=100)
    t["linear_attn_config"].update(head_dim=16, num_heads=4, full_attn_layers=[2, 4], kda_layers=[1, 3])
    t.update(text_overrides)
    return parse_config(raw)


def test_attn_res_against_formula():
    n, t, d, eps = 4, 5, 24, 1e-5
    sources = [torch.randn(t, d, dtype=F64) * (i + 1) for i in range(n)]
    proj, norm = torch.randn(1, d, dtype=F64), 1 + 0.1 * torch.randn(d, dtype=F64)
    out = attn_res_mix(sources, proj, norm, eps)
    for row in range(t):
        scores = []
        for v in sources:
            x = v[row]
            rms = math.sqrt(sum(float(e) ** 2 for e in x) / d + eps)
            scores.append(sum(float(x[j]) / rms * float(norm[j]) * float(proj[0, j]) for j in range(d)))
        m = max(scores)
        alpha = [math.exp(s - m) for s in scores]
        z = sum(alpha)
        expect = sum(a / z * v[row] for a, v in zip(alpha, sources, strict=True))
        torch.testing.assert_close(out[row], expect, rtol=1e-12, atol=1e-12)


def test_attn_res_block_schedule_matches_k3():
    """Attention at layer l sees ceil(l/B) stored blocks; the FFN one more at l % B == 0; output ceil(N/B)."""
    block, layers = 12, 93
    stream = ResidualStream(torch.zeros(1, 2), block, layers)
    for l in range(layers):
        assert len(stream.blocks) == math.ceil(l / block)
        stream.maybe_close_block(l)
        assert len(stream.blocks) == math.ceil(l / block) + (l % block == 0)
        stream.add(torch.ones(1, 2))
        stream.add(torch.ones(1, 2))
    assert stream.stacked().shape[0] == 9  # 8 stored blocks + the live partial sum
    assert float(stream.raw_sum()[0, 0]) == 2 * layers


def test_situ_against_formula():
    a = torch.randn(1000, dtype=F64) * 20
    b = torch.randn(1000, dtype=F64) * 60
    got = situ(a, b, 4.0, 25.0)
    expect = torch.tensor([4 * math.tanh(x / 4) / (1 + math.exp(-x)) * 25 * math.tanh(y / 25)
                           for x, y in zip(a.tolist(), b.tolist(), strict=True)], dtype=F64)
    torch.testing.assert_close(got, expect, rtol=1e-12, atol=1e-12)
    assert float(got.abs().max()) < 4 * 25  # both branches saturate


def test_select_experts_group_limited():
    scores = torch.rand(6, 16, dtype=F64)
    bias = torch.randn(16, dtype=F64) * 0.1
    ids = select_experts(scores, bias, top_k=3, num_groups=4, top_groups=2)
    choice = scores + bias
    for row in range(6):
        groups = choice[row].view(4, 4)
        merit = groups.topk(2, dim=-1).values.sum(-1)
        kept = set(merit.topk(2).indices.tolist())
        allowed = [e for e in range(16) if e // 4 in kept]
        best = sorted(allowed, key=lambda e: -float(choice[row, e]))[:3]
        assert sorted(ids[row].tolist()) == sorted(best)


@pytest.mark.parametrize("latent", [True, False])
def test_latent_moe_against_dense_formula(latent):
    cfg = tiny_config()
    if not latent:
        cfg = cfg.with_overrides(routed_expert_hidden_size=None, latent_moe_use_norm=False)
    moe = LatentMoE(cfg).to(F64)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.3)
    x = torch.randn(7, cfg.hidden_size, dtype=F64)
    got = moe(x)

    def gated(w1, w3, w2, z):
        a, b = z @ w1.T, z @ w3.T
        return (4 * torch.tanh(a / 4) * torch.sigmoid(a) * 25 * torch.tanh(b / 25)) @ w2.T

    def rms(v, w):
        return w * v / torch.sqrt(v.pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps)

    for t in range(7):
        scores = torch.sigmoid(x[t] @ moe.gate.weight.T)
        chosen = (scores + moe.gate.e_score_correction_bias).topk(3).indices
        w = scores[chosen] / scores[chosen].sum()
        z = x[t] @ moe.routed_expert_down_proj.weight.T if latent else x[t]
        r = sum(w[i] * gated(moe.experts[e].w1.weight, moe.experts[e].w3.weight, moe.experts[e].w2.weight, z)
                for i, e in enumerate(chosen.tolist()))
        if latent:
            r = rms(r, moe.routed_expert_norm.weight) @ moe.routed_expert_up_proj.weight.T
        sh = moe.shared_experts
        r = r + gated(sh.gate_proj.weight, sh.up_proj.weight, sh.down_proj.weight, x[t])
        torch.testing.assert_close(got[t], r, rtol=1e-10, atol=1e-10)


def test_router_weights_ignore_the_bias():
    cfg = tiny_config()
    moe = LatentMoE(cfg).to(F64)
    with torch.no_grad():
        moe.gate.e_score_correction_bias.copy_(torch.arange(8, dtype=F64) * 10)  # forces experts 5, 6, 7
    x = torch.randn(4, cfg.hidden_size, dtype=F64)
    routing = moe.gate(x)
    assert all(sorted(r) == [5, 6, 7] for r in routing.experts.tolist())
    scores = torch.sigmoid(x @ moe.gate.weight.T)[:, 5:8]
    torch.testing.assert_close(routing.weights.sort(-1).values, (scores / scores.sum(-1, keepdim=True)).sort(-1).values)
