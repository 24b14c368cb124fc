"""Plain-loop references of min_tokens, logit_bias and the penalties (engine/logits_processing.py)."""

from __future__ import annotations

import torch

from mstar.engine.params import SamplingParams


def ref_process(logits: torch.Tensor, params: SamplingParams, prompt: list[int], output: list[int],
                stop_ids: frozenset[int]) -> torch.Tensor:
    """One row, token by token, in vLLM's order: min_tokens, logit_bias, repetition, frequency + presence."""
    x = [float(v) for v in logits]
    if len(output) < params.min_tokens:
        for t in stop_ids:
            x[t] = float("-inf")
    for t, b in params.logit_bias:
        x[t] += b
    for t in set(prompt) | set(output):
        p = params.repetition_penalty
        x[t] = x[t] / p if x[t] > 0 else x[t] * p
    for t in set(output):
        x[t] -= params.frequency_penalty * output.count(t)
        x[t] -= params.presence_penalty
    return torch.tensor(x, dtype=torch.float32)


def reference_processed_greedy(model, prompt: list[int], params: SamplingParams, stop_ids: frozenset[int]
                               ) -> list[int]:
    """The reference model one token at a time, the processing applied to each step's logits."""
    output: list[int] = []
    state, feed = None, prompt
    for _ in range(params.max_tokens):
        out = model(torch.tensor(feed), state)
        state = out.state
        token = int(ref_process(out.logits[-1], params, prompt, output, stop_ids).argmax())
        output.append(token)
        if token in stop_ids and len(output) >= params.min_tokens:
            break
        feed = [token]
    return output
