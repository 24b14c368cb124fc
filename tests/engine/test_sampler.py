"""The batched sampler against per-row reference implementations; fresh random logits each run."""

from __future__ import annotations

import random

import pytest
import torch

from mstar.engine.params import SamplingParams
from mstar.engine.sampler import (
    Sampler,
    SamplingBatch,
    filter_logits,
    request_generator,
    scale_by_temperature,
)
from mstar.kernels.sampling_masks import min_p_mask, top_k_mask, top_p_mask

CPU = torch.device("cpu")


def _batch(params, generators=None):
    return SamplingBatch.build(params, generators or [None] * len(params), CPU)


def _fresh_seed() -> int:
    return random.getrandbits(63)


def _logits_with_ties(rows: int, vocab: int) -> torch.Tensor:
    return torch.randint(-3, 3, (rows, vocab)).float()


# ---- straightforward per-row references (fp64, loops over the sorted vocabulary) --------------------


def ref_top_k_keep(row: torch.Tensor, k: int) -> torch.Tensor:
    if k == 0 or k >= row.numel():
        return torch.ones_like(row, dtype=torch.bool)
    kth = sorted(row.tolist(), reverse=True)[k - 1]
    return row >= kth  # ties with the k-th are kept


def ref_top_p_keep(row: torch.Tensor, p: float) -> torch.Tensor:
    if p >= 1:
        return torch.ones_like(row, dtype=torch.bool)
    probs = row.double().softmax(-1).tolist()
    values = row.double().tolist()
    mass, last = 0.0, None
    for i in sorted(range(len(values)), key=lambda i: -values[i]):
        mass += probs[i]
        last = values[i]
        if mass >= p:
            break
    return row.double() >= last  # ties with the last kept token are kept


def ref_min_p_keep(row: torch.Tensor, m: float) -> torch.Tensor:
    probs = row.double().softmax(-1)
    return probs >= m * probs.max()


def ref_filter(row: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Temperature, top-k, top-p, min-p one after another on one row (fp64); dropped = -inf."""
    x = row.double() / p.temperature
    for keep in (lambda x: ref_top_k_keep(x, p.top_k), lambda x: ref_top_p_keep(x, p.top_p),
                 lambda x: ref_min_p_keep(x, p.min_p)):
        x = x.masked_fill(~keep(x), float("-inf"))
    return x


def _random_row_params(rows: int, vocab: int):
    top_k = [random.choice([0, 1, 2, 5, vocab, vocab + 7, random.randint(1, vocab)]) for _ in range(rows)]
    top_p = [random.choice([1.0, random.uniform(0.05, 0.999)]) for _ in range(rows)]
    min_p = [random.choice([0.0, 1.0, random.uniform(0.001, 0.5)]) for _ in range(rows)]
    return top_k, top_p, min_p


# ---- greedy ------------------------------------------------------------------------------------------


def test_greedy_is_raw_argmax_whatever_the_filters():
    rows, vocab = 16, 64
    logits = torch.randn(rows, vocab) * 4
    params = [SamplingParams(temperature=0, top_k=random.choice([0, 1, 3]), top_p=random.uniform(0.01, 1),
                             min_p=random.uniform(0, 1)) for _ in range(rows)]
    result = Sampler().sample(logits, _batch(params))
    assert torch.equal(result.token_ids, logits.argmax(-1))


def test_greedy_rows_in_a_mixed_batch_and_ties_take_lowest_id():
    rows, vocab = 12, 20
    logits = _logits_with_ties(rows, vocab)  # the maximum is tied in almost every row
    params = [SamplingParams(temperature=0.0 if i % 2 else 1.5, top_k=2, top_p=0.3) for i in range(rows)]
    result = Sampler().sample(logits, _batch(params))
    for i in range(1, rows, 2):
        best = logits[i].max()
        assert result.token_ids[i] == (logits[i] == best).nonzero()[0, 0]


def test_greedy_accepts_half_precision_logits():
    logits = torch.randn(4, 33).to(torch.bfloat16)
    result = Sampler().sample(logits, _batch([SamplingParams(temperature=0)] * 4))
    assert torch.equal(result.token_ids, logits.float().argmax(-1))


# ---- stages against references -----------------------------------------------------------------------


def test_temperature_scales_sampled_rows_and_leaves_greedy_rows():
    logits = torch.randn(3, 10)
    temperature = torch.tensor([0.5, 0.0, 2.0])
    scaled = scale_by_temperature(logits, temperature)
    best = logits.amax(-1, keepdim=True)  # sampled rows are shifted so that their best logit is 0
    torch.testing.assert_close(scaled[0], (logits[0] - best[0]) / 0.5)
    torch.testing.assert_close(scaled[1], logits[1] - best[1])
    torch.testing.assert_close(scaled[2], (logits[2] - best[2]) / 2.0)


@pytest.mark.parametrize("ties", [False, True])
def test_top_k_mask_matches_reference(ties):
    rows, vocab = 48, 40
    logits = _logits_with_ties(rows, vocab) if ties else torch.randn(rows, vocab) * 3
    top_k, _, _ = _random_row_params(rows, vocab)
    k = torch.tensor(top_k)
    expected = torch.stack([~ref_top_k_keep(logits[i], top_k[i]) for i in range(rows)])
    assert torch.equal(top_k_mask(logits, k), expected)  # full-sort path
    bound = max(x for x in top_k if x > 0)
    assert torch.equal(top_k_mask(logits, k, max_top_k=bound), expected)  # topk path (when bound < V)
    if ties:  # top_k == 1 with a tied maximum keeps every tied token
        one = top_k_mask(logits, torch.ones(rows, dtype=torch.long))
        assert torch.equal(~one, logits == logits.amax(-1, keepdim=True))


@pytest.mark.parametrize("ties", [False, True])
def test_top_p_mask_matches_reference(ties):
    rows, vocab = 48, 40
    logits = _logits_with_ties(rows, vocab) if ties else torch.randn(rows, vocab) * 3
    _, top_p, _ = _random_row_params(rows, vocab)
    mask = top_p_mask(logits, torch.tensor(top_p))
    for i in range(rows):
        assert torch.equal(~mask[i], ref_top_p_keep(logits[i], top_p[i])), f"row {i}, top_p={top_p[i]}"
    assert not mask.gather(-1, logits.argmax(-1, keepdim=True)).any()  # the best token always stays


def test_top_p_one_keeps_even_underflowing_tokens_and_tiny_top_p_keeps_the_best():
    logits = torch.randn(4, 30)
    logits[:, :5] = -1e4  # probabilities that underflow to 0 in fp32
    assert not top_p_mask(logits, torch.ones(4)).any()
    tiny = top_p_mask(logits, torch.full((4,), 1e-6))
    assert torch.equal(~tiny, logits == logits.amax(-1, keepdim=True))


@pytest.mark.parametrize("ties", [False, True])
def test_min_p_mask_matches_reference(ties):
    rows, vocab = 48, 40
    logits = _logits_with_ties(rows, vocab) if ties else torch.randn(rows, vocab) * 3
    _, _, min_p = _random_row_params(rows, vocab)
    mask = min_p_mask(logits, torch.tensor(min_p))
    expected = torch.stack([~ref_min_p_keep(logits[i], min_p[i]) for i in range(rows)])
    assert torch.equal(mask, expected)
    assert not min_p_mask(logits, torch.zeros(rows)).any()


@pytest.mark.parametrize("ties", [False, True])
def test_filter_pipeline_matches_reference_order(ties):
    rows, vocab = 40, 32
    logits = _logits_with_ties(rows, vocab) if ties else torch.randn(rows, vocab) * 3
    top_k, top_p, min_p = _random_row_params(rows, vocab)
    params = [SamplingParams(temperature=random.uniform(0.2, 2.0), top_k=k, top_p=p, min_p=m)
              for k, p, m in zip(top_k, top_p, min_p, strict=True)]
    filtered = filter_logits(logits, _batch(params))
    for i, p in enumerate(params):
        expected = ref_filter(logits[i], p)
        assert torch.equal(filtered[i].isfinite(), expected.isfinite()), f"row {i}: {p}"
        kept = expected.isfinite()
        # equal up to the per-row shift that puts the best logit at 0 (it changes no probability); the shift is
        # taken before the division by T, the reference's after it: fp32 rounding apart
        torch.testing.assert_close(filtered[i][kept].double(), (expected[kept] - expected[kept].max()).double(),
                                   rtol=1e-6, atol=1e-5)


# ---- sampling distribution -----------------------------------------------------------------------


def test_empirical_frequencies_match_filtered_softmax():
    """Three request specs interleaved in one batch of 60k rows; each frequency within 0.02 (> 5 sigma)."""
    vocab, per_spec = 8, 20_000
    logits = torch.randn(vocab) * 1.5
    specs = [
        SamplingParams(temperature=0.7, top_k=5, top_p=0.9, min_p=0.05, seed=1),  # seeded rows
        SamplingParams(temperature=1.3, top_p=0.8, min_p=0.1),  # shared generator
        SamplingParams(temperature=1.0),  # plain softmax, shared generator
    ]
    base = _fresh_seed()
    params, generators = [], []
    for i in range(per_spec):
        for spec in specs:
            params.append(spec)
            generators.append(request_generator(base + i, CPU) if spec.seed is not None else None)
    sampler = Sampler(torch.Generator().manual_seed(_fresh_seed()))
    tokens = sampler.sample(logits.expand(len(params), vocab), _batch(params, generators)).token_ids
    for s, spec in enumerate(specs):
        expected = ref_filter(logits, spec).softmax(-1)
        counts = torch.bincount(tokens[s :: len(specs)], minlength=vocab).double()
        assert (counts[expected == 0] == 0).all(), f"spec {s} sampled a filtered token"
        freq = counts / per_spec
        assert (freq - expected).abs().max() < 0.02, f"spec {s}: {freq.tolist()} vs {expected.tolist()}"


# ---- seeded determinism --------------------------------------------------------------------------


def _run_seeded(seed: int, steps: list[torch.Tensor], position: int, rows: int, spec: SamplingParams) -> list[int]:
    """Sample the seeded request at `position` in a batch of random neighbours, fresh each step."""
    gen = request_generator(seed, CPU)
    neighbour_gens = {r: request_generator(_fresh_seed(), CPU) for r in range(rows) if r % 2}
    sampler = Sampler(torch.Generator().manual_seed(_fresh_seed()))
    tokens = []
    for target_logits in steps:
        logits = torch.randn(rows, target_logits.numel()) * 2
        logits[position] = target_logits
        params = [SamplingParams(temperature=random.choice([0.0, 0.8, 1.2]), top_p=random.uniform(0.5, 1))
                  for _ in range(rows)]
        generators = [neighbour_gens.get(r) for r in range(rows)]
        params[position], generators[position] = spec, gen
        tokens.append(int(sampler.sample(logits, _batch(params, generators)).token_ids[position]))
    return tokens


def test_seeded_tokens_depend_only_on_seed_and_own_logits():
    vocab = 1000
    steps = [torch.randn(vocab) for _ in range(8)]
    seed = _fresh_seed()
    spec = SamplingParams(temperature=1.0, top_p=0.95, seed=seed)
    alone = _run_seeded(seed, steps, position=0, rows=1, spec=spec)
    assert _run_seeded(seed, steps, position=0, rows=1, spec=spec) == alone  # same seed, same sequence
    assert _run_seeded(seed, steps, position=3, rows=6, spec=spec) == alone  # other slot, other neighbours
    assert _run_seeded(seed, steps, position=0, rows=4, spec=spec) == alone
    other = SamplingParams(temperature=1.0, top_p=0.95, seed=seed + 1)
    assert _run_seeded(seed + 1, steps, position=0, rows=1, spec=other) != alone


# ---- logprobs ------------------------------------------------------------------------------------


def test_logprobs_are_raw_log_softmax_best_first():
    rows, vocab = 6, 100
    logits = (torch.randn(rows, vocab) * 3).to(torch.bfloat16)
    requested = [None, 0, 3, 5, None, 20]
    params = [SamplingParams(temperature=0.0 if i % 3 == 0 else 0.6, top_k=4, logprobs=k)
              for i, k in enumerate(requested)]
    result = Sampler().sample(logits, _batch(params))
    reference = logits.float().log_softmax(-1)
    torch.testing.assert_close(result.logprobs, reference.gather(-1, result.token_ids[:, None]).squeeze(-1))
    assert result.top_ids.shape == result.top_logprobs.shape == (rows, 20)
    torch.testing.assert_close(result.top_logprobs, reference.gather(-1, result.top_ids))
    torch.testing.assert_close(result.top_logprobs, reference.sort(-1, descending=True).values[:, :20])
    assert (result.top_logprobs[:, :-1] >= result.top_logprobs[:, 1:]).all()
    assert all(len(set(r)) == 20 for r in result.top_ids.tolist())

    records = result.token_logprobs(requested)
    for i, (record, k) in enumerate(zip(records, requested, strict=True)):
        if k is None:
            assert record is None
            continue
        assert record.token_id == int(result.token_ids[i])
        assert record.logprob == pytest.approx(float(result.logprobs[i]))
        assert [t for t, _ in record.top] == result.top_ids[i, :k].tolist()


def test_no_logprobs_requested_means_no_alternatives():
    logits = torch.randn(3, 16)
    result = Sampler().sample(logits, _batch([SamplingParams()] * 3))
    assert result.top_ids is None and result.top_logprobs is None
    only_chosen = Sampler().sample(logits, _batch([SamplingParams(logprobs=0)] * 3))
    assert only_chosen.top_ids.shape == (3, 0)
    torch.testing.assert_close(only_chosen.logprobs, logits.log_softmax(-1).gather(
        -1, only_chosen.token_ids[:, None]).squeeze(-1))


# ---- building batches ----------------------------------------------------------------------------


def test_build_mixed_greedy_seeded_unseeded_rows():
    seed = _fresh_seed()
    params = [
        SamplingParams(temperature=0, top_k=50, logprobs=2),  # greedy: its top-k does not count
        SamplingParams(temperature=0.8, top_k=-1, top_p=0.9, seed=seed),  # seeded
        SamplingParams(temperature=1.1, top_k=7, min_p=0.2),  # unseeded
        SamplingParams(temperature=0, seed=seed + 1, logprobs=4),  # greedy with a seed
    ]
    generators = [None, request_generator(seed, CPU), None, request_generator(seed + 1, CPU)]
    batch = SamplingBatch.build(params, generators, CPU)
    assert batch.size == 4 and not batch.all_greedy
    assert batch.temperature.tolist() == pytest.approx([0, 0.8, 1.1, 0])
    assert batch.top_k.tolist() == [50, 0, 7, 0] and batch.top_k.dtype == torch.long
    assert batch.top_p.tolist() == pytest.approx([1, 0.9, 1, 1])
    assert batch.min_p.tolist() == pytest.approx([0, 0, 0.2, 0])
    assert batch.greedy == (True, False, False, True)
    assert batch.generators[1] is generators[1] and batch.generators[2] is None
    assert (batch.max_logprobs, batch.max_top_k, batch.use_top_p, batch.use_min_p) == (4, 7, True, True)

    logits = torch.randn(4, 64)
    result = Sampler().sample(logits, batch)
    assert result.token_ids[[0, 3]].tolist() == logits[[0, 3]].argmax(-1).tolist()
    assert result.top_ids.shape == (4, 4)


def test_build_and_sample_reject_bad_input():
    with pytest.raises(ValueError, match="generators"):
        SamplingBatch.build([SamplingParams()], [], CPU)
    with pytest.raises(ValueError, match="request_generator"):
        SamplingBatch.build([SamplingParams(seed=3)], [None], CPU)
    with pytest.raises(ValueError, match=r"\[B, V\]"):
        Sampler().sample(torch.randn(3, 8), _batch([SamplingParams()] * 2))


# ---- extreme but valid temperatures -----------------------------------------------------------------


@pytest.mark.parametrize("temperature", [1e-45, 3e-39, 1e-38, 1e-6, 9.99e-6])
def test_temperatures_below_the_greedy_epsilon_are_greedy(temperature):
    logits = torch.randn(6, 40) * 30
    params = [SamplingParams(temperature=temperature, seed=_fresh_seed(), top_p=0.5, top_k=3)] * 6
    batch = _batch(params, [request_generator(p.seed, CPU) for p in params])
    assert batch.all_greedy and torch.equal(batch.temperature, torch.zeros(6))
    result = Sampler().sample(logits, batch)
    assert torch.equal(result.token_ids, logits.argmax(-1))


def test_a_small_sampled_temperature_never_makes_finite_logits_non_finite():
    rows, vocab = 6, 40
    logits = torch.randn(rows, vocab) * 1e34  # logits / 1e-5 overflows fp32
    params = [SamplingParams(temperature=1e-5, top_p=0.9, min_p=0.1, top_k=20)] * rows
    batch = _batch(params)
    filtered = filter_logits(logits, batch)
    assert not filtered.isnan().any() and not (filtered == float("inf")).any()
    assert filtered.isfinite().any(dim=-1).all()  # every row keeps a token
    result = Sampler(torch.Generator().manual_seed(_fresh_seed())).sample(logits, batch)
    # At such a temperature the best token holds all the mass (the plain quotient made +inf ties instead).
    assert torch.equal(result.token_ids, logits.argmax(-1))
