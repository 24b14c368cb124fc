"""Shuffled page tables and the relative error the paged-attention kernel tests share."""

from __future__ import annotations

import torch


def make_pages(context_lens: list[int], page_size: int, *, spare: int = 3, dtype=torch.int32, device="cpu",
               keep_sink: bool = False) -> tuple[torch.Tensor, int]:
    """A shuffled, non-contiguous page table: every sequence draws its pages at random from one pool
    (with spare pages nobody owns); rows are padded with page 0, which with `keep_sink` no sequence owns (the
    slots of padding rows write there). Returns (table [B, max_pages], pool size)."""
    need = [-(-n // page_size) for n in context_lens]
    num_pages = sum(need) + spare
    order = torch.randperm(num_pages - 1) + 1 if keep_sink else torch.randperm(num_pages)
    table = torch.zeros(len(context_lens), max(max(need), 1) + 1, dtype=dtype)  # one unused column too
    taken = 0
    for b, n in enumerate(need):
        table[b, :n] = order[taken: taken + n].to(dtype)
        taken += n
    return table.to(device), num_pages


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()
