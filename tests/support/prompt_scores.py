"""The reference of prompt_logprobs: the reference model's full-sequence log-softmax (fp32, CPU)."""

from __future__ import annotations

import torch
from greedy_ties import ROUTER_TIE, router_margins

from mstar.engine.outputs import PromptLogprob

TOL = 2e-4  # fp32: a batched step against one sequence alone, through a dozen layers


def reference_logprobs(model, prompt: list[int]) -> torch.Tensor:
    """[len(prompt), vocab] fp32 log-softmax of the reference model's logits over the whole prompt."""
    with torch.no_grad():
        logits = model(torch.tensor(prompt, dtype=torch.long), None).logits
    return torch.log_softmax(logits.float(), dim=-1)


def assert_prompt_logprobs(model, prompt: list[int], got: list[PromptLogprob], k: int, tol: float = TOL) -> None:
    """Entry i - 1 scores prompt token i given tokens 0..i-1: logprob, rank (ties within `tol` either way) and
    the k best (ids whose reference logprobs are the k best ones, within `tol`). A router near tie at a
    position (greedy_ties.py) may flip an expert there, which changes that position's entry and those after:
    from the first entry that differs, the rest are excused when the reference shows such a tie at or before
    it."""
    ref = reference_logprobs(model, prompt)
    assert [e.token_id for e in got] == prompt[1:]
    for i, entry in enumerate(got, start=1):
        wrong = _entry_error(ref[i - 1], prompt[i], entry, k, tol)
        if wrong is None:
            continue
        gaps = router_margins(model, prompt[:i])
        assert float(gaps.min()) < ROUTER_TIE, (f"prompt token {i}: {wrong}; no router near tie before it "
                                                f"(smallest gap {float(gaps.min()):.2e})")
        return


def _entry_error(row: torch.Tensor, token: int, entry: PromptLogprob, k: int, tol: float) -> str | None:
    """What is wrong with one entry against its reference log-softmax row, or None."""
    want = float(row[token])
    if abs(entry.logprob - want) > tol:
        return f"logprob {entry.logprob} != reference {want}"
    if not int((row >= want + tol).sum()) <= entry.rank <= int((row >= want - tol).sum()):
        return f"rank {entry.rank} is not the reference's"
    if len(entry.top) != k:
        return f"{len(entry.top)} alternatives, asked for {k}"
    best = row.topk(k).values.tolist()
    for (alternative, logprob), value in zip(entry.top, best, strict=True):
        if abs(logprob - float(row[alternative])) > tol or abs(logprob - value) > tol:
            return f"alternative {alternative} at {logprob}: reference {float(row[alternative])}, k-best {value}"
    return None
