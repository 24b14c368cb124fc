"""Sampling masks over logits [..., V] with per-row parameters [...]: True where a token is dropped.

The target's sampler (engine/sampler.py) and the DSpark draft (models/dspark/model.py) filter with
these same functions, so a draft's q_j is masked exactly as the target's p_j would be.

Ties at a filter boundary are kept: tokens whose logit equals that of the last token top-k or top-p
keeps are kept too, so a mask never depends on how the sort happened to order equal values.
"""

from __future__ import annotations

import torch


def top_k_mask(logits: torch.Tensor, top_k: torch.Tensor, max_top_k: int | None = None) -> torch.Tensor:
    """Drop all but the k best tokens of each row (k == 0 or k >= V: keep all; ties with the k-th kept).

    `max_top_k`, a host-side bound on the nonzero k of the batch, lets the k-th value come from
    `torch.topk` instead of a full sort of the vocabulary.
    """
    vocab = logits.shape[-1]
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), torch.full_like(top_k, vocab))
    if max_top_k is not None and 0 < max_top_k < vocab:
        best = logits.topk(max_top_k, dim=-1).values
        kth = best.gather(-1, (k.clamp(max=max_top_k) - 1).unsqueeze(-1))
    else:
        best = logits.sort(dim=-1, descending=True).values
        kth = best.gather(-1, (k - 1).unsqueeze(-1))
    off = (k >= vocab).unsqueeze(-1)
    return (logits < kth) & ~off


def top_p_mask(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep each row's smallest best-first set of tokens with mass >= top_p (the best token always).

    Works from the low end: sorted ascending, a token is dropped when the mass of it and everything
    below it is <= 1 - top_p. Summing the small probabilities first keeps the tail mass accurate, and
    top_p == 1 keeps everything (even probabilities that underflow to 0).
    """
    ascending = logits.sort(dim=-1).values
    tail_mass = ascending.softmax(dim=-1).cumsum(dim=-1)
    dropped = tail_mass <= (1 - top_p).unsqueeze(-1)
    dropped[..., -1] = False  # the best token
    # Dropped positions form a prefix of the ascending order; the first kept value is the threshold.
    threshold = ascending.gather(-1, dropped.sum(dim=-1, keepdim=True))
    return (logits < threshold) & (top_p < 1).unsqueeze(-1)


def min_p_mask(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below min_p times the row's best probability."""
    probs = logits.softmax(dim=-1)
    best = probs.amax(dim=-1, keepdim=True)
    return probs < min_p.unsqueeze(-1) * best
