"""Greedy identity between a served path and the fp32 reference, honest about near ties.

Two fp32 computations that sum in different orders (a batched step against one sequence alone) agree
to ~1e-6, not bitwise. A greedy token or a router's top-k choice whose margin is below that noise may
flip, and after a flip the continuations legitimately differ. So a mismatch passes only when the
reference itself shows a near tie at or before the first differing token: the top-2 logit gap at that
step, or the k-th vs (k+1)-th biased router score of any token the reference routed on the way there.
Any other mismatch is a bug and fails with the margins that ruled a tie out.
"""

from __future__ import annotations

import random

import torch

from mstar.models.kimi_k3.generate import greedy_generate
from mstar.models.kimi_k3.model import KimiK3ForCausalLM
from mstar.models.kimi_k3.moe import Router

# fp32 noise after a dozen layers is ~1e-6 relative in the logits and ~3e-7 in a router's sigmoid
# scores; ties are declared a few tens of times above it. The router bound is kept tight because it is
# checked over every routed token of the context: a loose one would excuse real bugs on long prompts.
LOGIT_TIE = 1e-4  # relative to the largest logit
ROUTER_TIE = 1e-5  # absolute, on scores in (0, 1)


Job = tuple[list[int], int, list[int]]  # (prompt, max_tokens, reference greedy tokens)


def random_jobs(model: KimiK3ForCausalLM, lengths, max_tokens: tuple[int, int]) -> list[Job]:
    """(prompt, max_tokens, reference greedy tokens) for fresh random prompts of `lengths` (ordinary ids
    only, below the 256 special slots) and output lengths drawn from the inclusive range `max_tokens`."""
    rng = random.Random()
    jobs = []
    for n in lengths:
        prompt = [rng.randrange(model.config.vocab_size - 256) for _ in range(n)]
        count = rng.randint(*max_tokens)
        jobs.append((prompt, count, greedy_generate(model, prompt, count)))
    return jobs


def router_margins(model: KimiK3ForCausalLM, ids: list[int]) -> torch.Tensor:
    """[len(ids)] float64: per token, the smallest gap between the k-th and (k+1)-th biased router score
    over every layer (inf where no router chooses among more than k experts)."""
    gaps = torch.full((len(ids),), float("inf"), dtype=torch.float64)

    def record(router: Router, args, _out):
        x = args[0].to(torch.float64)
        scores = torch.sigmoid(x @ router.weight.to(torch.float64).T) + router.e_score_correction_bias.double()
        k = router.config.num_experts_per_token
        if k < scores.shape[-1]:
            top = scores.topk(k + 1, dim=-1).values
            torch.minimum(gaps, top[:, k - 1] - top[:, k], out=gaps)

    hooks = [m.register_forward_hook(record) for m in model.modules() if isinstance(m, Router)]
    try:
        with torch.no_grad():
            model(torch.tensor(ids, dtype=torch.long), None)
    finally:
        for h in hooks:
            h.remove()
    return gaps


def tie_explains(model: KimiK3ForCausalLM, prompt: list[int], expect: list[int], got: list[int]) -> str | None:
    """Why `got` may differ from the reference `expect` (a near tie), or None when nothing explains it."""
    j = next((i for i, (a, b) in enumerate(zip(expect, got, strict=False)) if a != b), None)
    if j is None:  # one is a prefix of the other: a length bug, never a tie
        return None
    context = prompt + expect[:j]
    with torch.no_grad():
        logits = model(torch.tensor(context, dtype=torch.long), None).logits[-1].double()
    logit_gap = float(logits[expect[j]] - logits[got[j]])
    router_gap = float(router_margins(model, context).min())
    if logit_gap < LOGIT_TIE * max(1.0, float(logits.abs().max())) or router_gap < ROUTER_TIE:
        return f"near tie before token {j}: logit gap {logit_gap:.2e}, router gap {router_gap:.2e}"
    return None


def assert_greedy_matches(model: KimiK3ForCausalLM, jobs, outputs, max_tied: int = 2) -> None:
    """`jobs` are (prompt, max_tokens, reference tokens); every output must equal its reference unless a
    near tie explains the difference, and ties may excuse at most `max_tied` jobs (else the check is void)."""
    tied = []
    for (prompt, _, expect), got in zip(jobs, outputs, strict=True):
        if got == expect:
            continue
        why = tie_explains(model, prompt, expect, got)
        assert why is not None, f"prompt of {len(prompt)} tokens: {got} != reference {expect}, and no near tie"
        tied.append(f"prompt of {len(prompt)} tokens: {why}")
    assert len(tied) <= max_tied, f"too many jobs excused by near ties to trust the check: {tied}"
