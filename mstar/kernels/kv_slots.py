"""A step's latent KV addressing in one launch, when a verify step in flight shifts its positions.

Planned while that step runs, sequence b's new rows sit advance[b] positions past what the host knows
(resources/latent_kv.py): each row's position, its slot (page_table[b, pos // page_size] * page_size +
pos % page_size) and each sequence's cached length follow on the device. In torch that is eight launches
(two gathers, adds, a floor division, a remainder), twice a speculative step (the target's KV and the
draft's), each costing the host a dispatch; here it is one.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 256


def shifted_slots(page_table: torch.Tensor, row_seq: torch.Tensor, positions: torch.Tensor, lens: torch.Tensor,
                  advance: torch.Tensor, page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """page_table [B, P], row_seq [N] (each row's sequence), positions [N] and lens [B] as the host knows them,
    advance [B] (all long, on one device; trusted: every shifted position lies within its sequence's pages) ->
    (slot_mapping [N], context_lens [B] = lens + advance)."""
    B, N = page_table.shape[0], positions.shape[0]
    if page_table.dim() != 2 or row_seq.shape != (N,) or lens.shape != (B,) or advance.shape != (B,):
        raise ValueError(f"shifted_slots takes page_table [B, P], row_seq and positions [N], lens and advance [B]; "
                         f"got {tuple(page_table.shape)}, {tuple(row_seq.shape)}, {tuple(positions.shape)}, "
                         f"{tuple(lens.shape)}, {tuple(advance.shape)}")
    slots = torch.empty(N, dtype=torch.long, device=positions.device)
    context_lens = torch.empty(B, dtype=torch.long, device=positions.device)
    grid = (triton.cdiv(max(N, B, 1), _BLOCK),)
    _shifted_slots_kernel[grid](page_table, row_seq, positions, lens, advance, slots, context_lens,
                                page_table.stride(0), N, B, page_size, BLOCK=_BLOCK, num_warps=4)
    return slots, context_lens


@triton.jit
def _shifted_slots_kernel(table_ptr, row_seq_ptr, pos_ptr, lens_ptr, advance_ptr, slots_ptr, context_lens_ptr,
                          stride_table, N, B, page_size, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    row = i < N
    seq = tl.load(row_seq_ptr + i, mask=row, other=0)
    pos = tl.load(pos_ptr + i, mask=row, other=0) + tl.load(advance_ptr + seq, mask=row, other=0)
    page = tl.load(table_ptr + seq * stride_table + pos // page_size, mask=row, other=0)
    tl.store(slots_ptr + i, page * page_size + pos % page_size, mask=row)
    seqs = i < B
    shifted = tl.load(lens_ptr + i, mask=seqs, other=0) + tl.load(advance_ptr + i, mask=seqs, other=0)
    tl.store(context_lens_ptr + i, shifted, mask=seqs)
