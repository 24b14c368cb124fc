"""Greedy decoding with the reference model: the prompt in one pass, then one token per step."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from .model import KimiK3ForCausalLM


def greedy_tokens(
    model: KimiK3ForCausalLM,
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    stop_ids: Sequence[int] = (),
    *,
    absorbed: bool = True,
) -> Iterator[int]:
    """Yield greedy tokens until `max_new_tokens` or a stop id (which is yielded too)."""
    if not prompt_ids:
        raise ValueError("the prompt is empty: give at least one token id")
    vocab = model.config.vocab_size
    bad = [t for t in prompt_ids if not 0 <= t < vocab]
    if bad:
        raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary 0..{vocab - 1}")
    ids = torch.tensor(list(prompt_ids), dtype=torch.long)
    state = None
    for _ in range(max_new_tokens):
        out = model(ids, state, absorbed=absorbed)
        state = out.state
        token = int(out.logits[-1].argmax())
        yield token
        if token in stop_ids:
            return
        ids = torch.tensor([token], dtype=torch.long)


def greedy_generate(model: KimiK3ForCausalLM, prompt_ids: Sequence[int], max_new_tokens: int,
                    stop_ids: Sequence[int] = (), *, absorbed: bool = True) -> list[int]:
    return list(greedy_tokens(model, prompt_ids, max_new_tokens, stop_ids, absorbed=absorbed))
