"""Draft verification (greedy, chain, block) and the draft-length schedule; fresh randomness each run.

Losslessness is checked by Monte Carlo on a tiny vocabulary: the target is a Markov "model", a table
P(x_{t+1} | x_t) after the sampler's processing, so target row j of a verify is P(. | d_j) (row 0:
P(. | anchor)), and the draft is another table Q(x_{t+1} | x_t) the drafts are really drawn from.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from mstar.engine.params import SamplingParams
from mstar.engine.sampler import SamplingBatch, filter_logits, request_generator
from mstar.speculative.schedule import DraftSchedule
from mstar.speculative.verify import verify, verify_block, verify_chain, verify_greedy

CPU = torch.device("cpu")
ROWS = 100_000  # Monte Carlo rows: the standard error of a probability is at most sqrt(0.25 / ROWS)
TOLERANCE = 0.01  # absolute, per probability


def _batch(params: list[SamplingParams], generators=None) -> SamplingBatch:
    return SamplingBatch.build(params, generators or [None] * len(params), CPU)


def _uniform_batch(rows: int, **params) -> SamplingBatch:
    return _batch([SamplingParams(**params)] * rows)


def _fresh_seed() -> int:
    return random.getrandbits(63)


# ---- greedy --------------------------------------------------------------------------------------------


def _logits_with_argmax(best: list[list[int]], vocab: int) -> torch.Tensor:
    """[B, len(row), V] random logits whose row-wise argmax is `best` (by a clear margin)."""
    logits = torch.randn(len(best), len(best[0]), vocab)
    for b, row in enumerate(best):
        for j, token in enumerate(row):
            logits[b, j, token] = logits[b, j].max() + 1.0
    return logits


def test_greedy_hand_built_cases():
    vocab = 6
    best = [[1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 4]]
    drafts = torch.tensor([[1, 2, 3], [5, 2, 3], [1, 2, 0]])  # all accepted / first rejected / third rejected
    result = verify_greedy(_logits_with_argmax(best, vocab), drafts)
    assert result.tokens.tolist() == [[1, 2, 3, 4], [1, -1, -1, -1], [1, 2, 3, -1]]
    assert result.num_accepted.tolist() == [3, 0, 2]
    assert result.num_emitted.tolist() == [4, 1, 3]
    assert result.token_lists() == [[1, 2, 3, 4], [1], [1, 2, 3]]

    middle = verify_greedy(_logits_with_argmax([[1, 2, 3, 4]], vocab), torch.tensor([[1, 0, 3]]))
    assert middle.tokens.tolist() == [[1, 2, -1, -1]]
    assert middle.num_accepted.tolist() == [1]


def test_greedy_rows_with_different_num_drafts():
    vocab = 7
    best = [[3, 1, 4, 1], [5, 2, 6, 5], [2, 0, 0, 6], [1, 1, 1, 1]]
    logits = _logits_with_argmax(best, vocab)
    # Padding positions hold -1 (or anything): they are never compared.
    drafts = torch.tensor([[3, 1, -1], [5, 2, 6], [-1, -1, -1], [1, 4, -1]])
    for num_drafts in ([2, 3, 0, 2], torch.tensor([2, 3, 0, 2])):
        result = verify_greedy(logits, drafts, num_drafts)
        assert result.tokens.tolist() == [[3, 1, 4, -1], [5, 2, 6, 5], [2, -1, -1, -1], [1, 1, -1, -1]]
        assert result.num_accepted.tolist() == [2, 3, 0, 1]
        assert result.num_emitted.tolist() == [3, 4, 1, 2]


def test_greedy_rows_use_the_greedy_rule_in_a_sampled_batch():
    vocab, drafts = 9, 3
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, top_p=0.9),
              SamplingParams(temperature=0.0, top_k=2), SamplingParams(temperature=1.2)]
    batch = _batch(params)
    logits = torch.randn(len(params), drafts + 1, vocab)
    best = logits.argmax(-1)
    draft_tokens = best[:, :drafts].clone()
    draft_tokens[2, 1] = (best[2, 1] + 1) % vocab  # greedy row 2 is rejected at its second draft
    draft_probs = torch.softmax(torch.randn(len(params), drafts, vocab), -1)
    draft_probs[0] = 0.0  # greedy rows may pass anything as their draft distribution
    greedy = verify_greedy(logits, draft_tokens)
    for method in ("chain", "block"):
        result = verify(logits, draft_tokens, draft_probs, batch, method=method)
        for row in (0, 2):
            assert result.tokens[row].tolist() == greedy.tokens[row].tolist()
            assert result.num_accepted[row] == greedy.num_accepted[row]
        assert result.num_accepted[0] == drafts and result.num_accepted[2] == 1


# ---- losslessness (Monte Carlo) --------------------------------------------------------------------------


class MarkovPair:
    """A target table (raw logits, processed probabilities) and a different draft table, over `vocab`."""

    def __init__(self, vocab: int, params: SamplingParams):
        self.vocab, self.params = vocab, params
        self.target_logits = torch.randn(vocab, vocab) * 0.8
        self.target = filter_logits(self.target_logits, _uniform_batch(vocab, **_fields(params))).softmax(-1)
        # Correlated with the target (as a trained draft is) but different, with tokens it never proposes.
        draft = torch.softmax(self.target_logits + torch.randn(vocab, vocab) * 1.2, -1)
        draft[torch.arange(vocab), torch.randint(vocab, (vocab,))] = 0.0
        self.draft = draft / draft.sum(-1, keepdim=True)

    def speculate(self, method: str, anchors: torch.Tensor, drafts: int, num_drafts: torch.Tensor,
                  one_hot_draft: bool, generator: torch.Generator):
        """Draft `drafts` tokens per row from the draft table, then verify them."""
        previous, tokens, probs = anchors, [], []
        for _ in range(drafts):
            q = self.draft[previous]
            if one_hot_draft:
                token = q.argmax(-1)
                q = torch.nn.functional.one_hot(token, self.vocab).float()
            else:
                token = torch.multinomial(q, 1, generator=generator).squeeze(-1)
            tokens.append(token)
            probs.append(q)
            previous = token
        rows = len(anchors)
        draft_tokens = torch.stack(tokens, dim=1) if drafts else torch.empty(rows, 0, dtype=torch.long)
        draft_probs = torch.stack(probs, dim=1) if drafts else torch.empty(rows, 0, self.vocab)
        target_logits = self.target_logits[torch.cat([anchors.unsqueeze(1), draft_tokens], dim=1)]
        batch = _uniform_batch(rows, **_fields(self.params))
        return verify(target_logits, draft_tokens, draft_probs, batch, method=method,
                      num_drafts=num_drafts, generator=generator)


def _fields(params: SamplingParams) -> dict:
    return {"temperature": params.temperature, "top_p": params.top_p, "top_k": params.top_k, "min_p": params.min_p}


def _decode_streams(pair: MarkovPair, method: str, anchor: int, drafts: int, one_hot_draft: bool,
                    length: int) -> tuple[torch.Tensor, list]:
    """The first `length` tokens of ROWS independent speculative decodes from `anchor`, and the verifies.

    Every round drafts from each row's last token and verifies with random per-row draft counts (so
    padding is exercised); rows keep what they emit until they have `length` tokens, as the engine would.
    """
    generator = torch.Generator().manual_seed(_fresh_seed())
    streams = torch.full((ROWS, length), -1, dtype=torch.long)
    filled = torch.zeros(ROWS, dtype=torch.long)
    last = torch.full((ROWS,), anchor, dtype=torch.long)
    rows, rounds = torch.arange(ROWS), []
    while int(filled.min()) < length:
        num_drafts = torch.randint(0, drafts + 1, (ROWS,), generator=generator)
        result = pair.speculate(method, last, drafts, num_drafts, one_hot_draft, generator)
        for k in range(drafts + 1):
            slot = filled + k
            take = (k < result.num_emitted) & (slot < length)
            streams[rows[take], slot[take]] = result.tokens[take, k]
        filled = (filled + result.num_emitted).clamp(max=length)
        last = streams[rows, filled - 1]
        rounds.append(result)
    return streams, rounds


def _chi_square_bound(dof: int, z: float = 4.75) -> float:
    """Wilson-Hilferty upper quantile of chi-square(dof) at a normal z (4.75: p ~ 1e-6)."""
    c = 2 / (9 * dof)
    return dof * (1 - c + z * math.sqrt(c)) ** 3


def _chi_square(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, float]:
    """(statistic, 1e-6 bound) of observed counts against expected probabilities (cells < 5 pooled)."""
    expected = probs.double().flatten() * counts.sum()
    counts = counts.double().flatten()
    small = expected < 5
    observed = torch.cat([counts[~small], counts[small].sum().view(1)])
    expected = torch.cat([expected[~small], expected[small].sum().view(1)])
    keep = expected > 0
    statistic = ((observed[keep] - expected[keep]) ** 2 / expected[keep]).sum().item()
    return statistic, _chi_square_bound(int(keep.sum()) - 1)


@pytest.mark.parametrize("one_hot_draft", [False, True], ids=["sampled-draft", "greedy-draft"])
@pytest.mark.parametrize("method", ["chain", "block"])
def test_emitted_tokens_follow_the_target(method, one_hot_draft):
    assert 4 * math.sqrt(0.25 / ROWS) < TOLERANCE  # the tolerance is beyond 4 sigma of any cell
    vocab, drafts = 5, 3
    pair = MarkovPair(vocab, SamplingParams(temperature=0.7, top_p=0.9))
    anchor = random.randrange(vocab)
    length = drafts + 1
    streams, rounds = _decode_streams(pair, method, anchor, drafts, one_hot_draft, length)

    # The first token and the first two, per probability (what a bug in the first positions would move).
    expected_first = pair.target[anchor]
    expected_joint = expected_first.unsqueeze(1) * pair.target  # P(x | anchor) P(y | x)
    first, second = streams[:, 0], streams[:, 1]
    observed_first = torch.bincount(first, minlength=vocab).double() / ROWS
    observed_joint = torch.bincount(first * vocab + second, minlength=vocab * vocab).double().view(vocab, vocab) / ROWS
    first_error = (observed_first - expected_first.double()).abs().max().item()
    joint_error = (observed_joint - expected_joint.double()).abs().max().item()

    # The whole first block's worth of tokens (a bug at a late position shows only here): chi-square, and
    # exactly zero counts where the processed target has no mass (e.g. tokens top-p drops).
    expected_stream = expected_first
    for _ in range(length - 1):
        expected_stream = expected_stream.unsqueeze(-1) * pair.target[(None,) * (expected_stream.dim() - 1)]
    codes = (streams * vocab ** torch.arange(length - 1, -1, -1)).sum(-1)
    counts = torch.bincount(codes, minlength=vocab**length)
    statistic, bound = _chi_square(counts, expected_stream)
    print(f"{method} one_hot={one_hot_draft}: max |error| first {first_error:.4f}, joint {joint_error:.4f}; "
          f"{length}-token chi-square {statistic:.0f} (bound {bound:.0f})")
    assert first_error < TOLERANCE, (observed_first, expected_first)
    assert joint_error < TOLERANCE, (observed_joint, expected_joint)
    assert int(counts[expected_stream.flatten() == 0].sum()) == 0
    assert statistic < bound

    # The verifier really speculated (drafts accepted; sampled drafts also rejected), and the padding is -1.
    accepted = torch.cat([result.num_accepted for result in rounds])
    assert accepted.float().mean().item() > 0
    if not one_hot_draft:
        assert bool((accepted < drafts).any())
    positions = torch.arange(drafts + 1).expand(ROWS, -1)
    for result in rounds:
        emitted = result.num_emitted.unsqueeze(1)
        assert bool((result.tokens[positions >= emitted] == -1).all())
        assert bool((result.tokens[positions < emitted] >= 0).all())


def test_no_drafts_samples_from_the_target_row():
    vocab = 6
    pair = MarkovPair(vocab, SamplingParams(temperature=0.9, top_k=4))
    anchor = random.randrange(vocab)
    generator = torch.Generator().manual_seed(_fresh_seed())
    anchors = torch.full((ROWS,), anchor, dtype=torch.long)
    for method in ("chain", "block"):
        result = pair.speculate(method, anchors, 0, torch.zeros(ROWS, dtype=torch.long), False, generator)
        assert result.tokens.shape == (ROWS, 1) and bool((result.num_accepted == 0).all())
        observed = torch.bincount(result.tokens[:, 0], minlength=vocab).double() / ROWS
        assert (observed - pair.target[anchor].double()).abs().max().item() < TOLERANCE


# ---- block accepts at least as much as chain -----------------------------------------------------------


def _mean_accepted(method: str, logits, draft_tokens, draft_probs, batch) -> tuple[float, float]:
    """(mean, standard error) of the accepted drafts over the rows."""
    generator = torch.Generator().manual_seed(_fresh_seed())
    accepted = verify(logits, draft_tokens, draft_probs, batch, method=method, generator=generator).num_accepted
    accepted = accepted.double()
    return accepted.mean().item(), accepted.std().item() / math.sqrt(len(accepted))


def test_block_matches_the_papers_example():
    """Sun et al. §1: draft (2/3, 1/3), target (1/3, 2/3), two drafts: chain accepts 10/9, block 11/9."""
    draft = torch.tensor([2 / 3, 1 / 3])
    target = torch.tensor([1 / 3, 2 / 3])
    generator = torch.Generator().manual_seed(_fresh_seed())
    draft_tokens = torch.multinomial(draft.expand(ROWS, -1), 2, replacement=True, generator=generator)
    draft_probs = draft.expand(ROWS, 2, -1)
    logits = target.log().expand(ROWS, 3, -1)
    batch = _uniform_batch(ROWS, temperature=1.0)
    chain, chain_se = _mean_accepted("chain", logits, draft_tokens, draft_probs, batch)
    block, block_se = _mean_accepted("block", logits, draft_tokens, draft_probs, batch)
    print(f"paper example: chain {chain:.4f} (10/9 = {10 / 9:.4f}), block {block:.4f} (11/9 = {11 / 9:.4f})")
    assert abs(chain - 10 / 9) < 6 * chain_se
    assert abs(block - 11 / 9) < 6 * block_se


def test_block_accepts_at_least_as_many_as_chain():
    vocab, drafts = 6, 3
    pair = MarkovPair(vocab, SamplingParams(temperature=0.7, top_p=0.9))
    generator = torch.Generator().manual_seed(_fresh_seed())
    anchors = torch.randint(vocab, (ROWS,), generator=generator)
    previous, tokens, probs = anchors, [], []
    for _ in range(drafts):
        q = pair.draft[previous]
        previous = torch.multinomial(q, 1, generator=generator).squeeze(-1)
        tokens.append(previous)
        probs.append(q)
    draft_tokens = torch.stack(tokens, dim=1)
    logits = pair.target_logits[torch.cat([anchors.unsqueeze(1), draft_tokens], dim=1)]
    batch = _uniform_batch(ROWS, temperature=0.7, top_p=0.9)
    inputs = (logits, draft_tokens, torch.stack(probs, dim=1), batch)
    chain, chain_se = _mean_accepted("chain", *inputs)
    block, block_se = _mean_accepted("block", *inputs)
    print(f"random tables: chain {chain:.4f} ± {chain_se:.4f}, block {block:.4f} ± {block_se:.4f}")
    assert block > chain - 4 * math.hypot(chain_se, block_se)


# ---- seeded rows ---------------------------------------------------------------------------------------


def _random_row(vocab: int, drafts: int):
    logits = torch.randn(drafts + 1, vocab) * 2
    q = torch.softmax(torch.randn(drafts, vocab) * 2, -1)
    tokens = torch.multinomial(q, 1).squeeze(-1)
    return logits, tokens, q


@pytest.mark.parametrize("method", ["chain", "block"])
def test_seeded_rows_ignore_their_neighbours(method):
    vocab, drafts = 8, 4
    seed = _fresh_seed()
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=seed)
    rows = [_random_row(vocab, drafts) for _ in range(20)]  # the seeded request's inputs for 20 steps

    def run(position: int, neighbours: int) -> list[list[int]]:
        generator = request_generator(seed, CPU)  # a fresh request with the same seed
        shared = torch.Generator().manual_seed(_fresh_seed())
        out = []
        for logits, tokens, q in rows:
            others = [_random_row(vocab, drafts) for _ in range(neighbours)]
            inputs = others[:position] + [(logits, tokens, q)] + others[position:]
            other_params = [SamplingParams(temperature=random.choice([0.0, 0.5, 1.3]),
                                           seed=random.choice([None, _fresh_seed()])) for _ in others]
            all_params = other_params[:position] + [params] + other_params[position:]
            generators = [request_generator(p.seed, CPU) if p.seed is not None else None for p in all_params]
            generators[position] = generator
            num_drafts = [random.randint(0, drafts) for _ in inputs]
            num_drafts[position] = drafts
            result = verify(torch.stack([x[0] for x in inputs]), torch.stack([x[1] for x in inputs]),
                            torch.stack([x[2] for x in inputs]), _batch(all_params, generators), method=method,
                            num_drafts=num_drafts, generator=shared)
            out.append(result.token_lists()[position])
        return out

    alone = run(0, 0)
    assert run(2, 3) == alone
    assert run(5, 5) == alone
    assert any(len(tokens) <= drafts for tokens in alone)  # some drafts were rejected, so draws mattered


# ---- input errors --------------------------------------------------------------------------------------


def test_input_errors_name_the_argument():
    logits, tokens, q = torch.randn(2, 4, 5), torch.randint(5, (2, 3)), torch.softmax(torch.randn(2, 3, 5), -1)
    batch = _uniform_batch(2, temperature=0.8)
    with pytest.raises(ValueError, match="method"):
        verify(logits, tokens, q, batch, method="greedy")
    with pytest.raises(ValueError, match="draft_tokens"):
        verify_chain(logits, tokens[:, :2], q, batch)
    with pytest.raises(ValueError, match="draft_probs"):
        verify_block(logits, tokens, q[:, :2], batch)
    with pytest.raises(ValueError, match="draft_probs"):
        verify_block(logits, tokens, None, batch)
    with pytest.raises(ValueError, match="num_drafts"):
        verify_chain(logits, tokens, q, batch, num_drafts=[1, 4])
    with pytest.raises(ValueError, match="SamplingBatch"):
        verify_chain(logits, tokens, q, _uniform_batch(3, temperature=0.8))


# ---- schedule ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("form", ["mapping", "pairs", "json"])
def test_schedule_semantics(form):
    seed = {16: 7, 32: 4, 64: 0}
    config = {"mapping": seed, "pairs": list(seed.items())[::-1], "json": {str(k): v for k, v in seed.items()}}
    schedule = DraftSchedule.from_config(7, config[form])
    expected = {**dict.fromkeys(range(1, 17), 7), **dict.fromkeys(range(17, 33), 4),
                **dict.fromkeys(range(33, 65), 0), 65: 0, 1000: 0}
    assert {size: schedule.drafts_for(size) for size in expected} == expected
    assert schedule.capture_buckets() == (0, 4, 7)
    assert schedule.max_drafts == 7


def test_schedule_edges():
    k = random.randint(1, 8)
    empty = DraftSchedule.from_config(k, {})
    assert [empty.drafts_for(size) for size in (1, 17, 4096)] == [k] * 3
    assert empty.capture_buckets() == (k,)
    assert DraftSchedule.from_config(k, None).drafts_for(3) == k
    one = DraftSchedule.from_config(5, {8: 5})
    assert [one.drafts_for(size) for size in (1, 8, 9)] == [5, 5, 0]
    assert one.capture_buckets() == (0, 5)


@pytest.mark.parametrize(("speculative_tokens", "schedule", "message"), [
    (7, {16: 8}, "0..7"),
    (7, {16: -1}, "0..7"),
    (7, {0: 3}, "key 0 must be >= 1"),
    (7, [(16, 7), (16, 4)], "appears twice"),
    (7, [(16, 7, 1)], "pair"),
    (7, {"sixteen": 7}, "integer"),
    (7, {16: 2.5}, "integer"),
    (-1, {}, "speculative_tokens"),
])
def test_schedule_validation(speculative_tokens, schedule, message):
    with pytest.raises(ValueError, match=message):
        DraftSchedule.from_config(speculative_tokens, schedule)


def test_drafts_for_rejects_bad_batch_sizes():
    schedule = DraftSchedule.from_config(7, {16: 7})
    for bad in (0, -3, 2.0, True):
        with pytest.raises(ValueError, match="batch_size"):
            schedule.drafts_for(bad)
