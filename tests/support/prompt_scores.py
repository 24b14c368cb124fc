"""The reference of prompt_logprobs: the reference model's full-sequence log-softmax (fp32, CPU)."""

from __future__ import annotations

import pytest
import torch

from mstar.engine.outputs import PromptLogprob

TOL = 2e-4  # fp32: a batched step against one sequence alone, through a dozen layers


def reference_logprobs(model, prompt: list[int]) -> torch.Tensor:
    """[len(prompt), vocab] fp32 log-softmax of the reference model's logits over the whole prompt."""
    with torch.no_grad():
        logits = model(torch.tensor(prompt, dtype=torch.long), None).logits
    return torch.log_softmax(logits.float(), dim=-1)


def assert_prompt_logprobs(model, prompt: list[int], got: list[PromptLogprob], k: int, tol: float = TOL) -> None:
    """Entry i - 1 scores prompt token i given tokens 0..i-1: logprob, rank (ties within `tol` either way) and
    the k best (ids whose reference logprobs are the k best ones, within `tol`)."""
    ref = reference_logprobs(model, prompt)
    assert [e.token_id for e in got] == prompt[1:]
    for i, entry in enumerate(got, start=1):
        row = ref[i - 1]
        want = float(row[prompt[i]])
        assert entry.logprob == pytest.approx(want, abs=tol), f"prompt token {i}"
        assert int((row >= want + tol).sum()) <= entry.rank <= int((row >= want - tol).sum()), f"rank of token {i}"
        assert len(entry.top) == k
        best = row.topk(k).values.tolist()
        for (token, logprob), value in zip(entry.top, best, strict=True):
            assert logprob == pytest.approx(float(row[token]), abs=tol) and logprob == pytest.approx(value, abs=tol)
