"""Greedy verification of draft blocks in two Triton launches (the reference: speculative/verify.py's
`verify_greedy`, in torch).

A block of L drafts is verified against its L+1 target rows: draft j is kept while it equals the argmax of
row j, and the first row after the kept prefix gives the emitted token. In torch that is a cast of the
logits to fp32 (a copy of [B, L+1, V]), the argmax, the comparison, a cumulative product, a sum, a gather
and the assembly of the tokens: about fifteen launches, each a launch's worth of time for a few bytes,
on the host's critical path of every speculative step. Here one kernel finds each row's argmax (reading
the logits once, in their own dtype, compared in fp32) and one assembles each block.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_ARGMAX_CHUNK = 2048  # vocabulary columns one program compares per iteration


def greedy_verify(logits: torch.Tensor, drafts: torch.Tensor, num_drafts: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """logits [B, L+1, V] (unit column stride), drafts [B, L] ids, num_drafts [B] (0..L, trusted) ->
    (tokens [B, L+1] long: the kept drafts, then the argmax after them, then -1; num_accepted [B] long;
    finite [B, L+1] bool: whether every logit of the row is finite, checked while the row is read anyway).
    Ties go to the lowest id, as torch's argmax; in a row holding NaN the NaNs count as -inf (the engine drops
    rows whose logits are not finite)."""
    B, width, V = logits.shape
    if drafts.shape != (B, width - 1) or num_drafts.shape != (B,) or logits.stride(-1) != 1:
        raise ValueError(f"greedy_verify takes logits [B, L+1, V] with unit column stride, drafts [B, L] and "
                         f"num_drafts [B]; got {tuple(logits.shape)} strides {logits.stride()}, "
                         f"{tuple(drafts.shape)}, {tuple(num_drafts.shape)}")
    drafts = drafts.contiguous()
    best = torch.empty(B, width, dtype=torch.long, device=logits.device)
    finite = torch.empty(B, width, dtype=torch.bool, device=logits.device)
    _row_argmax_kernel[(B, width)](logits, best, finite, logits.stride(0), logits.stride(1), V,
                                   CHUNK=min(_ARGMAX_CHUNK, triton.next_power_of_2(V)), num_warps=4)
    tokens = torch.empty(B, width, dtype=torch.long, device=logits.device)
    accepted = torch.empty(B, dtype=torch.long, device=logits.device)
    _assemble_kernel[(B,)](best, drafts, num_drafts, tokens, accepted, drafts.stride(0), width,
                           WIDTH=triton.next_power_of_2(width), num_warps=1)
    return tokens, accepted, finite


@triton.jit
def _row_argmax_kernel(logits_ptr, best_ptr, finite_ptr, stride_b, stride_r, V, CHUNK: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    r = tl.program_id(1)
    row = logits_ptr + b * stride_b + r * stride_r
    cols = tl.arange(0, CHUNK)
    best_value = tl.full((), float("-inf"), tl.float32)
    best_index = tl.full((), 0, tl.int64)
    bad = tl.full((), 0, tl.int32)  # logits that are NaN or infinite
    for start in range(0, V, CHUNK):
        ok = start + cols < V
        x = tl.load(row + start + cols, mask=ok, other=float("-inf")).to(tl.float32)
        bad += tl.sum((ok & ((x != x) | (tl.abs(x) == float("inf")))).to(tl.int32), axis=0)
        x = tl.where(x != x, float("-inf"), x)  # a NaN row's id is dropped anyway: keep the argmax defined
        value = tl.max(x, axis=0)
        index = tl.argmax(x, axis=0, tie_break_left=True).to(tl.int64) + start
        better = value > best_value  # strictly: an equal maximum later in the row loses the tie
        best_index = tl.where(better, index, best_index)
        best_value = tl.where(better, value, best_value)
    tl.store(best_ptr + b * tl.num_programs(1) + r, best_index)
    tl.store(finite_ptr + b * tl.num_programs(1) + r, bad == 0)


@triton.jit
def _assemble_kernel(best_ptr, drafts_ptr, num_drafts_ptr, tokens_ptr, accepted_ptr, stride_d, width,
                     WIDTH: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, WIDTH)
    in_block = j < width
    best = tl.load(best_ptr + b * width + j, mask=in_block, other=0)
    n = tl.load(num_drafts_ptr + b)
    draft = tl.load(drafts_ptr + b * stride_d + j, mask=j < width - 1, other=-1).to(tl.int64)
    # the first position that breaks the prefix: a mismatch, or past the block's drafts
    breaks = (draft != best) | (j >= n)
    accepted = tl.min(tl.where(breaks, j, WIDTH), axis=0)
    tokens = tl.where(j < accepted, draft, tl.where(j == accepted, best, -1))
    tl.store(tokens_ptr + b * width + j, tokens, mask=in_block)
    tl.store(accepted_ptr + b, accepted.to(tl.int64))
