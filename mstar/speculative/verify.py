"""Batched verification of draft blocks against the target's logits: greedy, chain and block rules.

Shapes and indexing (all rules):

    target_logits  [B, L+1, V]  raw target logits; row j is the target's distribution for the token that
                                follows the anchor and the first j drafts (row 0: the token after the anchor)
    draft_tokens   [B, L]       d_1..d_L; column j holds d_{j+1}, drafted from draft_probs[:, j]
    draft_probs    [B, L, V]    q: the exact distribution each draft token was drawn from (one-hot for a
                                greedy draft); column j is the draft's distribution for the same token as
                                target row j
    num_drafts     [B]          optional, 0..L: row b verifies only its first num_drafts[b] drafts

So draft d_{j+1} is judged by target row j and draft column j, and the token after a committed prefix
of n drafts (the correction or the bonus) comes from target row n. The papers' 1-based notation, where
P_i and q_i are the distributions of d_i, maps to row/column i-1 here.

Target probabilities P are the *processed* distribution of each request: the sampler's own
`filter_logits` (temperature, top-k, top-p, min-p, in that order) followed by softmax, so a sampled
request's output is distributed exactly as the plain sampler would sample it, with or without drafts.

Every rule returns `VerifyResult`: tokens [B, L+1] (the accepted drafts, then one corrected or bonus
token, then -1 padding), num_accepted [B] (0..num_drafts) and num_emitted = num_accepted + 1.

Greedy requests (temperature 0) always use the greedy rule on the raw logits, whatever rule the other
rows of the batch use (`verify_chain` and `verify_block` apply it to them too; `verify` dispatches).

Randomness. Sampled rows draw, per call, L uniforms (one per draft position, used or not) and then V
Exp(1) variates for the exponential race (argmax p / E) that samples the corrected or bonus token. Unseeded
rows take them from the shared `generator`, drawn for the whole batch at once; a seeded row (its generator
in `SamplingBatch.generators`) overwrites its own row from its own generator, in that order. A seeded
request's result therefore depends only on its generator, its own inputs and L, not on its neighbours or
its position in the batch. Greedy rows draw nothing.

Everything stays on the device; `num_drafts` given as a host sequence is checked, given as a tensor it is
trusted (checking it would need a sync). The only Python loops are over the <= L positions and over the
seeded rows when drawing their random numbers.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from mstar.engine.sampler import SamplingBatch, filter_logits

Method = Literal["chain", "block"]
METHODS: tuple[str, ...] = ("chain", "block")

_TINY = torch.finfo(torch.float32).tiny  # floor for divisors and noise: keeps ratios and logs finite


@dataclass
class VerifyResult:
    tokens: torch.Tensor  # [B, L+1] long: accepted drafts, then the corrected/bonus token, then -1
    num_accepted: torch.Tensor  # [B] long: drafts accepted, 0..num_drafts
    finite: torch.Tensor | None = None  # [B, L+1] bool: each row's logits finite, where the rule checked it anyway

    @property
    def num_emitted(self) -> torch.Tensor:
        """[B] long: num_accepted + 1 (computed when read: the engine never reads it, and each launch costs it)."""
        return self.num_accepted + 1

    def token_lists(self) -> list[list[int]]:
        """Host-side emitted tokens per row (one sync)."""
        rows, counts = self.tokens.tolist(), self.num_emitted.tolist()
        return [row[:n] for row, n in zip(rows, counts, strict=True)]


# ----------------------------------------------------------------------------------------------------
# Inputs


def _num_drafts_tensor(num_drafts: torch.Tensor | Sequence[int] | None, rows: int, max_drafts: int,
                       device: torch.device) -> torch.Tensor:
    if num_drafts is None:
        return torch.full((rows,), max_drafts, dtype=torch.long, device=device)
    if isinstance(num_drafts, torch.Tensor):
        if num_drafts.shape != (rows,):
            raise ValueError(f"num_drafts must be [B] = [{rows}], got shape {tuple(num_drafts.shape)}")
        return num_drafts.to(device=device, dtype=torch.long)
    values = list(num_drafts)
    if len(values) != rows or any(not 0 <= n <= max_drafts for n in values):
        raise ValueError(f"num_drafts must hold {rows} values in 0..{max_drafts} (the drafts per row, at most "
                         f"draft_tokens.shape[1]), got {values}")
    return torch.tensor(values, dtype=torch.long, device=device)


def _check_shapes(target_logits: torch.Tensor, draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None,
                  batch: SamplingBatch | None) -> None:
    if target_logits.dim() != 3 or draft_tokens.dim() != 2:
        raise ValueError(f"target_logits must be [B, L+1, V] and draft_tokens [B, L], got shapes "
                         f"{tuple(target_logits.shape)} and {tuple(draft_tokens.shape)}")
    rows, width, vocab = target_logits.shape
    if draft_tokens.shape != (rows, width - 1):
        raise ValueError(f"draft_tokens must be [B, L] = [{rows}, {width - 1}] to match target_logits "
                         f"{tuple(target_logits.shape)}, got {tuple(draft_tokens.shape)}")
    if draft_probs is not None and draft_probs.shape != (rows, width - 1, vocab):
        raise ValueError(f"draft_probs must be [B, L, V] = [{rows}, {width - 1}, {vocab}], "
                         f"got {tuple(draft_probs.shape)}")
    if batch is not None and batch.size != rows:
        raise ValueError(f"the SamplingBatch has {batch.size} rows but target_logits has B = {rows}")
    if batch is not None and batch.temperature.device != target_logits.device:
        raise ValueError(f"target_logits are on {target_logits.device} but the SamplingBatch on "
                         f"{batch.temperature.device}; build the batch on the logits' device")


def target_probs(target_logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """[B, L+1, V] fp32 processed target probabilities: `filter_logits` of every row, then softmax."""
    rows, width, vocab = target_logits.shape
    per_position = dataclasses.replace(
        batch,
        temperature=batch.temperature.repeat_interleave(width),
        top_k=batch.top_k.repeat_interleave(width),
        top_p=batch.top_p.repeat_interleave(width),
        min_p=batch.min_p.repeat_interleave(width),
        generators=tuple(g for g in batch.generators for _ in range(width)),
        greedy=tuple(greedy for greedy in batch.greedy for _ in range(width)),
    )
    filtered = filter_logits(target_logits.float().reshape(rows * width, vocab), per_position)
    return filtered.softmax(dim=-1).reshape(rows, width, vocab)


def _draw_randomness(batch: SamplingBatch, positions: int, vocab: int, device: torch.device,
                     generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(uniforms [B, L] in [0, 1), Exp(1) noise [B, V]); see the module docstring for who draws what."""
    uniforms = torch.empty(batch.size, positions, dtype=torch.float32, device=device)
    noise = torch.empty(batch.size, vocab, dtype=torch.float32, device=device)
    seeded = [(row, g) for row, g in enumerate(batch.generators) if g is not None and not batch.greedy[row]]
    shared_rows = sum(not greedy for greedy in batch.greedy) - len(seeded)
    if shared_rows:
        uniforms.uniform_(generator=generator)
        noise.exponential_(generator=generator)
    else:
        uniforms.fill_(0.5)
        noise.fill_(1.0)
    for row, row_generator in seeded:
        uniforms[row].uniform_(generator=row_generator)
        noise[row].exponential_(generator=row_generator)
    return uniforms, noise.clamp_min_(_TINY)


# ----------------------------------------------------------------------------------------------------
# Shared pieces


def _at_position(x: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
    """x[b, position[b]] for x [B, R, V] -> [B, V]."""
    index = position.view(-1, 1, 1).expand(-1, 1, x.shape[-1])
    return x.gather(1, index).squeeze(1)


def _assemble(draft_tokens: torch.Tensor, num_accepted: torch.Tensor, final: torch.Tensor) -> VerifyResult:
    rows, drafts = draft_tokens.shape
    positions = torch.arange(drafts + 1, device=draft_tokens.device)
    padded = torch.cat([draft_tokens.long(), draft_tokens.new_full((rows, 1), -1).long()], dim=1)
    accepted = num_accepted.unsqueeze(-1)
    tokens = torch.where(positions < accepted, padded, torch.full_like(padded, -1))
    tokens = torch.where(positions == accepted, final.unsqueeze(-1), tokens)
    return VerifyResult(tokens=tokens, num_accepted=num_accepted)


def _race(weights: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """Sample one token per row from unnormalised weights [B, V] >= 0 (exponential race, as the sampler)."""
    return (weights.log() - noise.log()).argmax(dim=-1)


def _final_token(probs: torch.Tensor, draft_probs: torch.Tensor, stop: torch.Tensor, num_drafts: torch.Tensor,
                 weight: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """The token after the committed prefix of `stop` drafts.

    stop == num_drafts: the bonus, sampled from target row `stop`.
    stop <  num_drafts: sampled from the residual norm(max(weight * P - q, 0)) of target row `stop` and
                        draft column `stop` (both: the distribution of the token right after the prefix).
                        Chain uses weight 1, block uses p_stop. If the residual is all zero (only possible
                        when no mass is missing, e.g. P == q exactly, which the rules make a probability-0
                        event or an event with no prescribed outcome), fall back to the target row itself.
    """
    target_row = _at_position(probs, stop)
    if draft_probs.shape[1] == 0:
        return _race(target_row, noise)
    draft_row = _at_position(draft_probs, stop.clamp(max=draft_probs.shape[1] - 1))
    residual = (weight.unsqueeze(-1) * target_row - draft_row).clamp_min(0)
    use_residual = (stop < num_drafts) & (residual.sum(dim=-1) > 0)
    return _race(torch.where(use_residual.unsqueeze(-1), residual, target_row), noise)


def _draft_token_probs(probs: torch.Tensor, draft_probs: torch.Tensor,
                       draft_tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(P_j(d_{j+1}), q_j(d_{j+1})) [B, L] each; padding ids (-1) read token 0, masked by the callers."""
    index = draft_tokens.long().clamp_min(0).unsqueeze(-1)
    drafts = draft_tokens.shape[1]
    return probs[:, :drafts].gather(-1, index).squeeze(-1), draft_probs.gather(-1, index).squeeze(-1)


def _valid_positions(num_drafts: torch.Tensor, drafts: int) -> torch.Tensor:
    """[B, L] True where column j holds a draft the row verifies (j < num_drafts)."""
    return torch.arange(drafts, device=num_drafts.device) < num_drafts.unsqueeze(-1)


# ----------------------------------------------------------------------------------------------------
# Greedy


def verify_greedy(target_logits: torch.Tensor, draft_tokens: torch.Tensor,
                  num_drafts: torch.Tensor | Sequence[int] | None = None) -> VerifyResult:
    """Accept d_{j+1} while it equals the argmax of raw target row j, then emit the next row's argmax.

    At the first mismatch (column j) the emitted token is argmax of row j; with all n drafts accepted it
    is the bonus argmax of row n. Ties go to the lowest id, as in the sampler. On a GPU through two Triton
    launches (kernels/greedy_verify.py), elsewhere `reference_verify_greedy`.
    """
    if not target_logits.is_cuda or target_logits.stride(-1) != 1:
        return reference_verify_greedy(target_logits, draft_tokens, num_drafts)
    from mstar.kernels.greedy_verify import greedy_verify

    _check_shapes(target_logits, draft_tokens, None, None)
    rows, width, _ = target_logits.shape
    num_drafts = _num_drafts_tensor(num_drafts, rows, width - 1, target_logits.device)
    tokens, num_accepted, finite = greedy_verify(target_logits, draft_tokens, num_drafts)
    return VerifyResult(tokens=tokens, num_accepted=num_accepted, finite=finite)


def reference_verify_greedy(target_logits: torch.Tensor, draft_tokens: torch.Tensor,
                            num_drafts: torch.Tensor | Sequence[int] | None = None) -> VerifyResult:
    """`verify_greedy` in torch: the rule as written, and what the kernels are tested against."""
    _check_shapes(target_logits, draft_tokens, None, None)
    rows, width, _ = target_logits.shape
    drafts = width - 1
    num_drafts = _num_drafts_tensor(num_drafts, rows, drafts, target_logits.device)
    best = target_logits.float().argmax(dim=-1)  # [B, L+1]
    match = (draft_tokens.long() == best[:, :drafts]) & _valid_positions(num_drafts, drafts)
    num_accepted = match.long().cumprod(dim=-1).sum(dim=-1)
    final = best.gather(1, num_accepted.unsqueeze(-1)).squeeze(-1)
    return _assemble(draft_tokens, num_accepted, final)


def _with_greedy_rows(result: VerifyResult, target_logits: torch.Tensor, draft_tokens: torch.Tensor,
                      num_drafts: torch.Tensor, batch: SamplingBatch) -> VerifyResult:
    if not any(batch.greedy):
        return result
    greedy = verify_greedy(target_logits, draft_tokens, num_drafts)
    is_greedy = batch.temperature == 0
    return VerifyResult(
        tokens=torch.where(is_greedy.unsqueeze(-1), greedy.tokens, result.tokens),
        num_accepted=torch.where(is_greedy, greedy.num_accepted, result.num_accepted),
    )


# ----------------------------------------------------------------------------------------------------
# Chain (Leviathan et al. 2023, Chen et al. 2023)



def _prepare(rule: str, target_logits: torch.Tensor, draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None,
             batch: SamplingBatch, num_drafts, generator: torch.Generator | None):
    """What both sampled rules start from: the greedy result when every row is greedy, else
    (rows, L, device, num_drafts [B], target probs P, draft probs q, uniforms, Exp(1) noise)."""
    _check_shapes(target_logits, draft_tokens, draft_probs, batch)
    rows, width, vocab = target_logits.shape
    drafts = width - 1
    device = target_logits.device
    num_drafts = _num_drafts_tensor(num_drafts, rows, drafts, device)
    if batch.all_greedy:
        return verify_greedy(target_logits, draft_tokens, num_drafts)
    if draft_probs is None:
        raise ValueError(f"{rule}: the batch has sampled rows, so pass draft_probs [B, L, V] "
                         "(the distributions the drafts were drawn from)")
    probs = target_probs(target_logits, batch)
    uniforms, noise = _draw_randomness(batch, drafts, vocab, device, generator)
    return rows, drafts, device, num_drafts, probs, draft_probs.float(), uniforms, noise

def verify_chain(target_logits: torch.Tensor, draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None,
                 batch: SamplingBatch, num_drafts: torch.Tensor | Sequence[int] | None = None,
                 generator: torch.Generator | None = None) -> VerifyResult:
    """Token-by-token rejection: accept d_i if u_i * q_i(d_i) < P_i(d_i), stop at the first rejection.

    1-based as in the papers (P_i, q_i: the distributions of d_i = target row / draft column i-1):
      - rejection at i: the token is sampled from norm(max(P_i - q_i, 0));
      - all n drafts accepted: the bonus is sampled from P_{n+1} (target row n).
    Each emitted token is then distributed as P given the prefix: P(accept x) = min(P(x), q(x)) and the
    residual supplies the remaining max(P(x) - q(x), 0).

    Edge cases, explicitly:
      - q_i(d_i) == 0 (the draft produced a token it gave no mass, i.e. rounding): the test reads
        0 < P_i(d_i), so the draft is accepted iff the target allows it (ratio +inf, or 0/0 -> reject);
      - all-zero residual (max(P_i - q_i, 0) == 0 everywhere, i.e. P_i == q_i): a rejection then has
        probability 0 except through the q_i(d_i) == P_i(d_i) == 0 case above, which no draw from q can
        reach; the token is sampled from P_i so the output is always a valid target token.
    Greedy rows use `verify_greedy` on their raw logits; they may pass anything as their draft_probs.
    """
    prep = _prepare("verify_chain", target_logits, draft_tokens, draft_probs, batch, num_drafts, generator)
    if isinstance(prep, VerifyResult):
        return prep
    rows, drafts, device, num_drafts, probs, draft_probs, uniforms, noise = prep
    target_at_draft, draft_at_draft = _draft_token_probs(probs, draft_probs, draft_tokens)
    accept = (uniforms * draft_at_draft < target_at_draft) & _valid_positions(num_drafts, drafts)
    num_accepted = accept.long().cumprod(dim=-1).sum(dim=-1)
    weight = torch.ones(rows, dtype=torch.float32, device=device)
    final = _final_token(probs, draft_probs, num_accepted, num_drafts, weight, noise)
    result = _assemble(draft_tokens, num_accepted, final)
    return _with_greedy_rows(result, target_logits, draft_tokens, num_drafts, batch)


# ----------------------------------------------------------------------------------------------------
# Block (Sun et al. 2024, "Block Verification Accelerates Speculative Decoding", arXiv 2403.10444)


def _block_weights(target_at_draft: torch.Tensor, draft_at_draft: torch.Tensor) -> torch.Tensor:
    """[B, L+1] p_0..p_L: p_0 = 1, p_i = min(1, p_{i-1} P_i(d_i) / q_i(d_i)).

    q_i(d_i) == 0 reads as ratio +inf: p_i = 1 if p_{i-1} P_i(d_i) > 0, else 0 (the divisor is floored at
    the smallest normal float, and the clamp at 1 does the rest).
    """
    weights = [torch.ones(target_at_draft.shape[0], dtype=torch.float32, device=target_at_draft.device)]
    for j in range(target_at_draft.shape[1]):
        ratio = weights[-1] * target_at_draft[:, j] / draft_at_draft[:, j].clamp_min(_TINY)
        weights.append(ratio.clamp(max=1.0))
    return torch.stack(weights, dim=1)


def _block_stop_probs(probs: torch.Tensor, draft_probs: torch.Tensor, weights: torch.Tensor,
                      num_drafts: torch.Tensor) -> torch.Tensor:
    """[B, L] h_1..h_L (column i-1 holds h_i) for each row's own n = num_drafts.

    i < n: h_i = r_{i+1} / (r_{i+1} + 1 - p_i), r_{i+1} = sum_x max(p_i P_{i+1}(x) - q_{i+1}(x), 0)
           (P_{i+1}, q_{i+1}: target row i, draft column i); 0 when r_{i+1} == 0, including the 0/0 case
           p_i == 1, P_{i+1} == q_{i+1}: stopping at i would need a token from an empty residual.
    i == n: h_n = p_n.
    i > n: 0 (padding: never selected).
    """
    rows, drafts = draft_probs.shape[:2]
    columns = []
    for i in range(1, drafts + 1):
        p_i = weights[:, i]
        if i < drafts:
            missing = (p_i.unsqueeze(-1) * probs[:, i] - draft_probs[:, i]).clamp_min(0).sum(dim=-1)
            stop = torch.where(missing > 0, missing / (missing + 1 - p_i).clamp_min(_TINY),
                               torch.zeros_like(missing))
        else:
            stop = torch.zeros_like(p_i)
        stop = torch.where(num_drafts == i, p_i, torch.where(num_drafts > i, stop, torch.zeros_like(stop)))
        columns.append(stop)
    if not columns:
        return weights.new_zeros(rows, 0)
    return torch.stack(columns, dim=1)


def verify_block(target_logits: torch.Tensor, draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None,
                 batch: SamplingBatch, num_drafts: torch.Tensor | Sequence[int] | None = None,
                 generator: torch.Generator | None = None) -> VerifyResult:
    """Block verification (Sun et al. 2024, Algorithm 2), 1-based as in the paper for n drafts:

        p_0 = 1,  p_i = min(1, p_{i-1} P_i(d_i) / q_i(d_i))
        h_i = r_{i+1} / (r_{i+1} + 1 - p_i),  r_{i+1} = sum_x max(p_i P_{i+1}(x) - q_{i+1}(x), 0)   (i < n)
        h_n = p_n
        tau = the LAST i with u_i < h_i (0 if none); u_1..u_n iid U(0, 1); not a prefix stop
        commit d_1..d_tau, then
            tau <  n: sample from p_res(x) = norm(max(p_tau P_{tau+1}(x) - q_{tau+1}(x), 0))   (paper eq. 4)
            tau == n: sample the bonus from P_{n+1}

    Which residual: in the paper p_res(x | X^tau) is built from M_b(x | X^tau) and M_s(x | X^tau), the
    target's and the draft's distributions of the token *after* the committed prefix X^tau, i.e.
    P_{tau+1}, q_{tau+1} in 1-based notation = target row tau and draft column tau here (for tau = 0:
    max(P_1 - q_1, 0), the chain residual of the first token; dspark.md's "p_tau P_tau - q_tau" is the
    same rule written with 0-based rows). It cannot be P_tau: d_tau is already committed, so the token to
    sample now is the next one, and its only honest distributions are those conditioned on X^tau.

    Why the output is the target's: by induction p_i Q(d^i) <= P(d^i) (Q, P the joint probabilities of the
    prefix), so p_i is the fraction of the draft's mass on d^i that can still be kept as a target sample.
    Stopping at i keeps d^i and must fill the target mass on the next token that the kept draft mass does
    not cover, which is max(p_i P_{i+1}(x) - q_{i+1}(x), 0) summed, r_{i+1}; h_i splits the event "not
    continued past i" between "stop at i and fill from that residual" and "fall back to an earlier
    prefix" in the ratio r_{i+1} : (1 - p_i) that makes every prefix's total probability equal the target's
    (paper Thm. 1). For n = 1 this is exactly the chain rule. Taking the last passing index matters:
    h_i is the stop probability conditioned on not having continued further.

    Edge cases: q_i(d_i) == 0 -> ratio +inf (p_i = 1 unless p_{i-1} P_i(d_i) == 0); r_{i+1} == 0 -> h_i = 0
    (an empty residual is never selected); u < h is strict so h = 0 never passes and h = 1 always does;
    tau = 0 with an all-zero residual (P_1 == q_1, which makes tau = 0 a probability-0 event) samples from
    P_1. Greedy rows use `verify_greedy` on their raw logits.
    """
    prep = _prepare("verify_block", target_logits, draft_tokens, draft_probs, batch, num_drafts, generator)
    if isinstance(prep, VerifyResult):
        return prep
    rows, drafts, device, num_drafts, probs, draft_probs, uniforms, noise = prep
    weights = _block_weights(*_draft_token_probs(probs, draft_probs, draft_tokens))
    stop_probs = _block_stop_probs(probs, draft_probs, weights, num_drafts)
    passing = torch.where(uniforms < stop_probs, torch.arange(1, drafts + 1, device=device), 0)
    num_accepted = passing.amax(dim=-1) if drafts else torch.zeros(rows, dtype=torch.long, device=device)
    weight = weights.gather(1, num_accepted.unsqueeze(-1)).squeeze(-1)
    final = _final_token(probs, draft_probs, num_accepted, num_drafts, weight, noise)
    result = _assemble(draft_tokens, num_accepted, final)
    return _with_greedy_rows(result, target_logits, draft_tokens, num_drafts, batch)


# ----------------------------------------------------------------------------------------------------


def verify(target_logits: torch.Tensor, draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None,
           batch: SamplingBatch, method: Method = "block", num_drafts: torch.Tensor | Sequence[int] | None = None,
           generator: torch.Generator | None = None) -> VerifyResult:
    """Verify a batch: greedy rows by the greedy rule, sampled rows by `method` ("chain" or "block")."""
    rules = {"chain": verify_chain, "block": verify_block}
    if method not in rules:
        raise ValueError(f"verify: method must be one of {METHODS}, got {method!r} (greedy requests use the "
                         "greedy rule automatically)")
    return rules[method](target_logits, draft_tokens, draft_probs, batch, num_drafts, generator)
