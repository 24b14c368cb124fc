"""The DSpark draft reference (K3DSparkModel): loading, yarn RoPE, the block forward, the Markov head, the
context cache and the wiring to the target's taps.

The block forward and RoPE are checked against independent float64 formulations written here: complex-number
rotation from per-index YaRN formulas, and expanded per-head attention over every context row and block slot
with an explicit visibility mask.
"""

from __future__ import annotations

import math
import random

import pytest
import torch
import torch.nn.functional as F

from mstar.engine.params import SamplingParams
from mstar.engine.sampler import SamplingBatch, filter_logits
from mstar.models.dspark import FIXTURE_PATH, expected_dspark_tensors, load_dspark_checkpoint, load_dspark_config
from mstar.models.dspark.config import YarnRopeConfig
from mstar.models.dspark.model import DraftCache, K3DSparkModel, draft_distribution
from mstar.models.dspark.rope import YarnRotaryEmbedding, yarn_correction_range

F64 = torch.float64


# --- fixtures ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def draft(tiny_dirs) -> K3DSparkModel:
    """The tiny draft in float64, with norm weights and the confidence bias moved off their init values (1, 0)
    so that every norm (and the context path skipping input_layernorm) is visible in the comparisons."""
    model = K3DSparkModel.from_checkpoint(tiny_dirs[1], dtype=F64)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn_like(p))
        model.confidence_head.proj.bias.fill_(0.3 * torch.randn(()).item())
    return model


@pytest.fixture(scope="module")
def target_io(draft):
    """A fresh random stand-in for the target's embed_tokens and lm_head (float64)."""
    cfg = draft.config
    embed = torch.nn.Embedding(cfg.vocab_size, cfg.hidden_size).to(F64)
    lm_head = torch.nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False).to(F64)
    with torch.no_grad():
        embed.weight.normal_()
        lm_head.weight.normal_(std=cfg.hidden_size**-0.5)
    return embed, lm_head


def _taps(cfg, t: int) -> torch.Tensor:
    return torch.randn(t, cfg.context_input_size, dtype=F64)


def _cache(model: K3DSparkModel, taps: torch.Tensor) -> DraftCache:
    cache = model.new_cache()
    model.extend_context(cache, taps)
    return cache


# --- building and loading ------------------------------------------------------------------------------


def test_tiny_draft_loads_strictly(tiny_dirs):
    cfg, tensors = load_dspark_checkpoint(tiny_dirs[1], dtype=F64)
    model = K3DSparkModel(cfg).to(F64)
    model.load_state_dict(tensors, strict=True)
    assert set(model.state_dict()) == set(tensors)
    for name, t in model.state_dict().items():
        assert torch.equal(t, tensors[name]), name
    loaded = K3DSparkModel.from_checkpoint(tiny_dirs[1], dtype=F64)
    assert loaded.dtype == F64 and not any(p.is_meta for p in loaded.parameters())


def test_real_size_shapes_on_meta():
    cfg = load_dspark_config(FIXTURE_PATH)
    with torch.device("meta"):
        model = K3DSparkModel(cfg)
    expected = {n: shape for n, (shape, _) in expected_dspark_tensors(cfg).items() if n != "embed_tokens.weight"}
    assert {n: tuple(t.shape) for n, t in model.state_dict().items()} == expected
    assert cfg.kv_cache_width == 576 and cfg.confidence_input_size == 7424
    assert sum(t.numel() for t in model.state_dict().values()) + cfg.vocab_size * cfg.hidden_size == 3_562_312_961
    assert cfg.softmax_scale == pytest.approx(192**-0.5 * (0.1 * math.log(32) + 1) ** 2)
    assert yarn_correction_range(cfg.rope, cfg.qk_rope_head_dim) == (15, 26)  # the ramp sits inside the 32 freqs
    # Every norm of the draft, q_a/kv_a included, uses rms_norm_eps (see the model's docstring).
    assert {m.eps for n, m in model.named_modules() if n.endswith("norm")} == {cfg.rms_norm_eps}


# --- RoPE ------------------------------------------------------------------------------------------------


def _reference_rope(x: torch.Tensor, positions: torch.Tensor, rope: YarnRopeConfig) -> torch.Tensor:
    """Interleaved pairs as complex numbers times e^{i p f_i}, f_i from DeepSeek's yarn formulas, in float64."""
    d = x.shape[-1]

    def corr(n: float) -> float:
        return d * math.log(rope.original_max_position_embeddings / (n * 2 * math.pi)) / (2 * math.log(rope.rope_theta))

    low = max(math.floor(corr(rope.beta_fast)), 0)
    high = min(math.ceil(corr(rope.beta_slow)), d - 1)
    if high == low:
        high += 0.001
    freqs = []
    for i in range(d // 2):
        freq = 1.0 / rope.rope_theta ** (2 * i / d)
        smooth = 1 - min(max((i - low) / (high - low), 0.0), 1.0)
        freqs.append(freq / rope.factor * (1 - smooth) + freq * smooth)

    def mscale(m: float) -> float:
        return 1.0 if rope.factor <= 1 else 0.1 * m * math.log(rope.factor) + 1.0

    magnitude = mscale(rope.mscale) / mscale(rope.mscale_all_dim)
    angle = positions.to(F64)[:, None] * torch.tensor(freqs, dtype=F64)[None, :]
    turn = torch.polar(torch.full_like(angle, magnitude), angle)  # [T, d/2]
    z = torch.view_as_complex(x.to(F64).reshape(*x.shape[:-1], d // 2, 2).contiguous())
    turn = turn.view(x.shape[0], *([1] * (x.dim() - 2)), d // 2)
    return torch.view_as_real(z * turn).reshape(x.shape)


@pytest.mark.parametrize(
    "rope, dim",
    [
        (load_dspark_config(FIXTURE_PATH).rope, 64),  # the real draft: theta 5e4, factor 32, L0 32768
        (load_dspark_config(FIXTURE_PATH).rope, 16),  # the tiny draft's width
        # DeepSeek-V3-like settings with mscale != mscale_all_dim, so cos/sin carry a magnitude factor
        (YarnRopeConfig(factor=40.0, original_max_position_embeddings=4096, rope_theta=10000.0, beta_fast=32.0,
                        beta_slow=1.0, mscale=0.8, mscale_all_dim=1.0), 64),
    ],
)
def test_rope_matches_yarn_formulas(rope, dim):
    rotary = YarnRotaryEmbedding(rope, dim)
    positions = torch.cat([torch.randint(0, 100, (6,)), torch.randint(0, 1_048_576, (6,))])
    x = torch.randn(12, 3, dim, dtype=F64)
    got, want = rotary(x, positions), _reference_rope(x, positions, rope)
    assert (got - want).abs().max() < 1e-9
    # fp32 (as served): same result within fp32 angle rounding at small positions
    small = torch.randint(0, 2048, (12,))
    got32 = rotary(x.float(), small)
    assert got32.dtype == torch.float32
    assert (got32.double() - _reference_rope(x, small, rope)).abs().max() < 5e-3


# --- the block forward -----------------------------------------------------------------------------------


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)


def _reference_block(model: K3DSparkModel, taps, anchor_token, anchor_pos, k, embed_w, head_w):
    """Expanded MLA in float64: keys/values of every context token (positions 0..T-1) and every block slot,
    context visible only below anchor_pos, the block fully visible. Returns (h [k, D], U [k, V])."""
    cfg = model.config
    sd = {n: t.detach() for n, t in model.state_dict().items()}
    eps, heads = cfg.rms_norm_eps, cfg.num_attention_heads
    nope, rope_d, v_d, r = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    scale = (nope + rope_d) ** -0.5 * (0.1 * cfg.rope.mscale_all_dim * math.log(cfg.rope.factor) + 1) ** 2
    t = taps.shape[0]
    h_ctx = _rms(taps @ sd["context_proj.weight"].T, sd["context_norm.weight"], eps)
    ids = torch.tensor([anchor_token] + [cfg.mask_token_id] * (k - 1))
    x = embed_w[ids]
    q_pos = anchor_pos + torch.arange(k)
    key_pos = torch.cat([torch.arange(t), q_pos])
    visible = torch.cat([torch.arange(t) < anchor_pos, torch.ones(k, dtype=torch.bool)])
    for i in range(cfg.num_hidden_layers):
        w = {n.removeprefix(f"layers.{i}."): v for n, v in sd.items() if n.startswith(f"layers.{i}.")}
        xn = _rms(x, w["input_layernorm.weight"], eps)
        src = torch.cat([h_ctx, xn])  # the context path skips input_layernorm
        c, k_pe = (src @ w["self_attn.kv_a_proj_with_mqa.weight"].T).split([r, rope_d], dim=-1)
        c = _rms(c, w["self_attn.kv_a_layernorm.weight"], eps)
        k_pe = _reference_rope(k_pe, key_pos, cfg.rope)
        kv = (c @ w["self_attn.kv_b_proj.weight"].T).view(-1, heads, nope + v_d)
        keys = torch.cat([kv[..., :nope], k_pe[:, None, :].expand(-1, heads, -1)], dim=-1)
        values = kv[..., nope:]
        q_lat = _rms(xn @ w["self_attn.q_a_proj.weight"].T, w["self_attn.q_a_layernorm.weight"], eps)
        q = (q_lat @ w["self_attn.q_b_proj.weight"].T).view(k, heads, nope + rope_d)
        q = torch.cat([q[..., :nope], _reference_rope(q[..., nope:], q_pos, cfg.rope)], dim=-1)
        scores = torch.einsum("qhd,khd->hqk", q, keys) * scale
        scores = scores.masked_fill(~visible[None, None, :], float("-inf"))
        o = torch.einsum("hqk,khd->qhd", scores.softmax(-1), values).reshape(k, heads * v_d)
        x = x + o @ w["self_attn.o_proj.weight"].T
        xn = _rms(x, w["post_attention_layernorm.weight"], eps)
        gate, up = xn @ w["mlp.gate_proj.weight"].T, xn @ w["mlp.up_proj.weight"].T
        x = x + (F.silu(gate) * up) @ w["mlp.down_proj.weight"].T
    h = _rms(x, sd["final_norm.weight"], eps)
    return h, h @ head_w.T


@pytest.mark.parametrize("anchor_pos", [1, 5, 70])
@pytest.mark.parametrize("stale_rows", [0, 3])  # context rows at positions >= anchor_pos must stay hidden
def test_block_forward_matches_expanded_reference(draft, target_io, anchor_pos, stale_rows):
    cfg = draft.config
    embed, lm_head = target_io
    taps = _taps(cfg, anchor_pos + stale_rows)
    anchor = int(torch.randint(0, cfg.vocab_size, ()))
    k = 7
    cache = _cache(draft, taps)
    proposal = draft.propose(cache, anchor, anchor_pos, k, embed, lm_head)
    h, base = _reference_block(draft, taps, anchor, anchor_pos, k, embed.weight.detach(), lm_head.weight.detach())
    hidden = draft.block_hidden(cache, anchor, anchor_pos, k, embed)
    assert (hidden - h).abs().max() < 1e-10
    assert (lm_head(hidden) - base).abs().max() < 1e-10
    assert torch.equal(proposal.tokens, draft.markov_sample(base, anchor)[0])  # the greedy chain over U_j
    # confidence c_j = sigmoid(w . [h_j ; W1[x_{j-1}]] + b), x_0 = the anchor
    sd = draft.state_dict()
    prev = torch.cat([torch.tensor([anchor]), proposal.tokens[:-1]])
    features = torch.cat([h, sd["markov_head.markov_w1.weight"][prev]], dim=-1)
    conf = torch.sigmoid(features @ sd["confidence_head.proj.weight"][0] + sd["confidence_head.proj.bias"])
    assert (draft.confidence(hidden, prev) - conf).abs().max() < 1e-12


def test_single_draft_block(draft, target_io):
    cfg = draft.config
    taps = _taps(cfg, 4)
    embed, lm_head = target_io
    cache = _cache(draft, taps)
    proposal = draft.propose(cache, 3, 4, 1, embed, lm_head)
    h, base = _reference_block(draft, taps, 3, 4, 1, embed.weight.detach(), lm_head.weight.detach())
    assert (lm_head(draft.block_hidden(cache, 3, 4, 1, embed)) - base).abs().max() < 1e-10
    assert torch.equal(proposal.tokens, draft.markov_sample(base, 3)[0])


# --- the Markov head -------------------------------------------------------------------------------------


def test_markov_bias_conditions_each_slot_on_its_predecessor_only(draft):
    cfg = draft.config
    k = 6
    base = torch.randn(k, cfg.vocab_size, dtype=F64)
    prev = torch.randint(0, cfg.vocab_size, (k,))
    logits = draft.markov_logits(base, prev)
    for j in range(k):
        changed = prev.clone()
        changed[j] = (prev[j] + 1 + torch.randint(0, cfg.vocab_size - 1, ())) % cfg.vocab_size
        diff = (draft.markov_logits(base, changed) - logits).abs().amax(-1)
        assert diff[j] > 1e-3 and torch.all(diff[torch.arange(k) != j] == 0)


def test_greedy_follows_corrected_argmax_and_slot0_uses_anchor(draft, target_io):
    cfg = draft.config
    embed, lm_head = target_io
    anchor = int(torch.randint(0, cfg.vocab_size, ()))
    cache = _cache(draft, _taps(cfg, 9))
    p = draft.propose(cache, anchor, 9, 7, embed, lm_head)
    base = lm_head(draft.block_hidden(cache, anchor, 9, 7, embed))
    sd = draft.state_dict()
    w1, w2 = sd["markov_head.markov_w1.weight"], sd["markov_head.markov_w2.weight"]
    _, logits, _ = draft.markov_sample(base, anchor)
    assert torch.allclose(logits[0], base[0] + w2 @ w1[anchor], rtol=0, atol=1e-12)
    prev = torch.cat([torch.tensor([anchor]), p.tokens[:-1]])
    corrected = base + w1[prev] @ w2.T
    assert torch.allclose(logits, corrected, rtol=0, atol=1e-12)
    assert torch.equal(p.tokens, corrected.argmax(-1))
    assert torch.equal(p.probs, F.one_hot(p.tokens, cfg.vocab_size).to(p.probs.dtype))


def test_nan_row_cannot_push_an_id_out_of_range(draft):
    cfg = draft.config
    base = torch.randn(3, cfg.vocab_size, dtype=F64)
    base[1] = float("nan")
    tokens, _, _ = draft.markov_sample(base, 5)
    assert tokens.min() >= 0 and tokens.max() < cfg.vocab_size


@pytest.mark.parametrize("temperature", [1e-45, 1e-38, 1e-5, 1.0])
def test_a_sampled_draft_with_bad_numbers_proposes_without_failing(draft, temperature):
    """NaN rows (a bad context) or a tiny temperature over large logits: the block still proposes in-range
    tokens with a proper q (one-hot where its numbers went bad), instead of failing the whole step."""
    cfg = draft.config
    base = torch.randn(4, cfg.vocab_size, dtype=F64) * 1e300  # / T overflows fp64
    base[2] = float("nan")
    gen = torch.Generator().manual_seed(random.getrandbits(63))
    tokens, logits, probs = draft.markov_sample(base, 5, temperature=temperature, top_p=0.9, generator=gen)
    assert tokens.min() >= 0 and tokens.max() < cfg.vocab_size
    assert torch.isfinite(probs).all()
    torch.testing.assert_close(probs.sum(-1), torch.ones(4, dtype=probs.dtype))
    assert probs[2].max() == 1  # the NaN slot proposes its argmax with a point mass
    assert (probs.gather(-1, tokens[:, None]) > 0).all()  # every draft was drawn from its own q


def test_sampled_drafts_are_reproducible_and_follow_q(draft, target_io):
    cfg = draft.config
    embed, lm_head = target_io
    cache, anchor, temp = _cache(draft, _taps(cfg, 11)), 17, 0.7
    def run(seed: int):
        gen = torch.Generator().manual_seed(seed)
        return draft.propose(cache, anchor, 11, 7, embed, lm_head, temperature=temp, generator=gen)

    runs = [run(5), run(5), run(6)]
    assert torch.equal(runs[0].tokens, runs[1].tokens) and torch.equal(runs[0].probs, runs[1].probs)
    base = lm_head(draft.block_hidden(cache, anchor, 11, 7, embed))
    for p in runs:
        prev = torch.cat([torch.tensor([anchor]), p.tokens[:-1]])
        q = (draft.markov_logits(base, prev) / temp).softmax(-1)
        assert (p.probs - q).abs().max() < 1e-12
        assert torch.allclose(p.probs.sum(-1), torch.ones(7, dtype=F64))
        assert torch.all(p.probs[torch.arange(7), p.tokens] > 0)
    # top-k then top-p keep exactly the documented support
    p = draft.propose(cache, anchor, 11, 7, embed, lm_head, temperature=temp, top_k=20, top_p=0.6,
                      generator=torch.Generator().manual_seed(1))
    prev = torch.cat([torch.tensor([anchor]), p.tokens[:-1]])
    full = (draft.markov_logits(base, prev) / temp).softmax(-1)
    for j in range(7):
        kept = (p.probs[j] > 0).nonzero().flatten()
        ranked = full[j].argsort(descending=True)
        top20 = full[j][ranked[:20]] / full[j][ranked[:20]].sum()
        n = int((top20.cumsum(0) - top20 < 0.6).sum())  # the smallest prefix reaching 0.6 of the top-20 mass
        assert set(kept.tolist()) == set(ranked[:n].tolist()) and p.tokens[j].item() in kept.tolist()
        assert torch.allclose(p.probs[j, kept], full[j, kept] / full[j, kept].sum(), rtol=1e-12, atol=0)


def test_sequential_sampling_matches_the_chain_distribution(draft):
    """Empirical joint law of (x_1, x_2) against q_1(x_1) q_2(x_2 | x_1), on four live tokens."""
    cfg = draft.config
    live = torch.randperm(cfg.vocab_size)[:4]
    base = torch.full((2, cfg.vocab_size), -60.0, dtype=F64)
    base[:, live] = torch.randn(2, 4, dtype=F64)
    anchor, temp, n = int(live[0]), 0.9, 4000
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    counts = torch.zeros(4, 4)
    index = {int(t): i for i, t in enumerate(live)}
    for _ in range(n):
        tokens, _, _ = draft.markov_sample(base, anchor, temperature=temp, generator=gen)
        counts[index[int(tokens[0])], index[int(tokens[1])]] += 1
    q1 = draft_distribution(draft.markov_logits(base[0], torch.tensor(anchor)), temp)[1][live]
    expected = torch.stack(
        [q1[a] * draft_distribution(draft.markov_logits(base[1], live[a]), temp)[1][live] for a in range(4)]
    ).float()
    sigma = (n * expected * (1 - expected)).sqrt()
    assert torch.all((counts - n * expected).abs() <= 5 * sigma + 2)


@pytest.mark.parametrize("ties", [False, True])
def test_draft_distribution_filters_as_the_target_sampler(ties):
    """q_j is the target sampler's distribution for the same parameters (one set of masks): random logits,
    with ties at the boundaries or not, and random temperature, top-k, top-p and min-p per row."""
    rows, vocab = 24, 40
    logits = torch.randint(-3, 3, (rows, vocab)).float() if ties else torch.randn(rows, vocab) * 3
    for i in range(rows):
        params = SamplingParams(temperature=random.uniform(0.2, 2.0), top_k=random.choice([0, 1, 5, vocab]),
                                top_p=random.choice([1.0, 0.9, 0.3]), min_p=random.choice([0.0, 0.1, 0.5]))
        batch = SamplingBatch.build([params], [None], "cpu")
        expected = filter_logits(logits[i : i + 1], batch)[0]
        z, q = draft_distribution(logits[i], params.temperature, params.top_k or None,
                                  params.top_p if params.top_p < 1 else None, params.min_p or None)
        assert torch.equal(z == float("-inf"), expected == float("-inf")), f"row {i}: {params}"
        torch.testing.assert_close(q, expected.softmax(-1))


def test_draft_distribution_rejects_bad_arguments():
    z = torch.randn(5)
    for kwargs in ({"temperature": 0.0}, {"temperature": 1.0, "top_k": 0}, {"temperature": 1.0, "top_p": 0.0},
                   {"temperature": 1.0, "min_p": 1.5}):
        with pytest.raises(ValueError):
            draft_distribution(z, **kwargs)


# --- the context cache -----------------------------------------------------------------------------------


def test_every_norm_of_the_context_and_query_paths_goes_through_the_given_norm(draft):
    """The GPU path passes a one-launch RMSNorm kernel (models/dspark/paged.py, kernel_norm): each norm of the
    context rows (context_norm, every layer's kv_a_layernorm) and of a layer's queries (q_a_layernorm) must reach
    it, and a norm that computes the same function must give the same rows."""
    cfg = draft.config
    taps, positions = _taps(cfg, 5), torch.arange(5)
    seen = []

    def recording(norm, x):
        seen.append(norm)
        return norm(x)

    rows = draft.context_kv(taps, positions, recording)
    attn = [layer.self_attn for layer in draft.layers]
    assert seen == [draft.context_norm] + [a.kv_a_layernorm for a in attn]
    for got, expect in zip(rows, draft.context_kv(taps, positions), strict=True):
        assert torch.equal(got, expect)
    seen.clear()
    x = torch.randn(3, cfg.hidden_size, dtype=F64)
    q_nope, q_pe = attn[0].queries(x, torch.arange(3), recording)
    assert seen == ([attn[0].q_a_layernorm] if cfg.q_lora_rank is not None else [])
    expect_nope, expect_pe = attn[0].queries(x, torch.arange(3))
    assert torch.equal(q_nope, expect_nope) and torch.equal(q_pe, expect_pe)


def test_context_rows_are_incremental(draft):
    cfg = draft.config
    t, a = 13, int(torch.randint(1, 12, ()))
    taps = _taps(cfg, t)
    whole = draft.context_kv(taps, torch.arange(t))
    first, second = draft.context_kv(taps[:a], torch.arange(a)), draft.context_kv(taps[a:], torch.arange(a, t))
    assert len(whole) == cfg.num_hidden_layers and whole[0].shape == (t, cfg.kv_cache_width)
    for w, x, y in zip(whole, first, second, strict=True):
        assert (torch.cat([x, y]) - w).abs().max() < 1e-12
    cache = draft.new_cache()
    draft.extend_context(cache, taps[:a])
    draft.extend_context(cache, taps[a:])
    assert cache.num_tokens == t
    for w, c in zip(whole, cache.rows, strict=True):
        assert (c - w).abs().max() < 1e-12


def test_trimmed_cache_equals_a_cache_of_the_prefix(draft, target_io):
    cfg = draft.config
    embed, lm_head = target_io
    t, n = 15, int(torch.randint(1, 14, ()))
    taps = _taps(cfg, t)
    trimmed = _cache(draft, taps)
    trimmed.trim(n)
    fresh = _cache(draft, taps[:n])
    anchor = int(torch.randint(0, cfg.vocab_size, ()))
    a = draft.propose(trimmed, anchor, n, 7, embed, lm_head)
    b = draft.propose(fresh, anchor, n, 7, embed, lm_head)
    assert torch.equal(a.tokens, b.tokens)
    hidden_a, hidden_b = (draft.block_hidden(c, anchor, n, 7, embed) for c in (trimmed, fresh))
    assert (hidden_a - hidden_b).abs().max() < 1e-12
    # continuing after the trim equals a cache built in one go
    more = _taps(cfg, 4)
    draft.extend_context(trimmed, more)
    once = _cache(draft, torch.cat([taps[:n], more]))
    for x, y in zip(trimmed.rows, once.rows, strict=True):
        assert (x - y).abs().max() < 1e-12


def test_propose_never_writes_the_cache(draft, target_io):
    cfg = draft.config
    embed, lm_head = target_io
    cache = _cache(draft, _taps(cfg, 8))
    before = cache.clone()
    draft.propose(cache, 1, 8, 7, embed, lm_head, temperature=1.0, generator=torch.Generator().manual_seed(0))
    assert cache.num_tokens == 8 and all(torch.equal(x, y) for x, y in zip(cache.rows, before.rows, strict=True))


def test_cache_and_propose_errors(draft, target_io):
    cfg = draft.config
    embed, lm_head = target_io
    cache = _cache(draft, _taps(cfg, 4))
    with pytest.raises(ValueError, match="trim"):
        cache.trim(5)
    with pytest.raises(ValueError, match="append"):
        cache.append([torch.zeros(2, cfg.kv_cache_width + 1, dtype=F64)] * cfg.num_hidden_layers)
    with pytest.raises(ValueError, match="anchor_pos"):
        draft.propose(cache, 1, 5, 7, embed, lm_head)
    with pytest.raises(ValueError, match="taps"):
        draft.context_kv(torch.zeros(2, cfg.context_input_size + 1, dtype=F64), torch.arange(2))


# --- wiring to the target ------------------------------------------------------------------------------


def test_taps_from_tiny_target_drive_a_proposal(tiny_model_fp64, draft):
    cfg, target = draft.config, tiny_model_fp64
    cfg.check_matches_target(target.config.hidden_size, target.config.num_hidden_layers, target.config.vocab_size)
    t = 10
    ids = torch.randint(0, 1024, (t,))
    out = target(ids, tap_layers=cfg.target_layer_ids)
    assert out.taps.shape == (t, cfg.context_input_size)
    cache = _cache(draft, out.taps)
    anchor = int(out.logits[-1].argmax())
    embed, lm_head = target.model.embed_tokens, target.lm_head
    for kwargs in ({}, {"temperature": 0.8, "top_p": 0.95, "generator": torch.Generator().manual_seed(3)}):
        p = draft.propose(cache, anchor, t, 7, embed, lm_head, **kwargs)
        assert p.tokens.shape == (7,) and p.probs.shape == (7, cfg.vocab_size) and torch.isfinite(p.probs).all()
        hidden = draft.block_hidden(cache, anchor, t, 7, embed)
        confidence = draft.confidence(hidden, torch.cat([torch.tensor([anchor]), p.tokens[:-1]]))
        assert hidden.shape == (7, cfg.hidden_size) and confidence.shape == (7,)
        assert torch.all((confidence > 0) & (confidence < 1))
