"""Several weights that multiply the same input, held as one tensor of their rows: one GEMM instead of many.

At decode a K3 layer's small projections of one input (KDA's q, k, v, f_a, b and g_a; a gated MLP's
gate and up) cost a launch each and read too few bytes to reach full bandwidth alone. Stacked, one
GEMM reads them all. Projections whose outputs are summed (a MoE layer's latent up projection and its
shared experts' down projection) stack by columns instead: one GEMM over the concatenated inputs.

The stack never holds the bytes twice. Where the weights already are consecutive row blocks of one
storage (an earlier stack of the same weights), the stack is a view of it. Otherwise their rows are
copied into a new tensor and each weight's storage moves to its rows there (`Tensor.data`: the
weight keeps its values and its identity; the old storage is freed). So whatever reads the weights
themselves (a reference forward) reads the same numbers, and stacking them again is free.

A row stack is padded with zero rows to a multiple of ROW_ALIGN: the GEMM's output rows then start 16 bytes
apart at 16-bit widths, and so do the column views of them that feed further GEMMs. Unpadded, KDA's stacked
inputs (6284 rows at a TP8 rank of K3) made cuBLAS fall back to an sm80 kernel for 2-byte-aligned operands
past the rows the skinny kernel takes (112 us a layer at 160 rows, benchmarks/emulate_rank/README.md).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

ROW_ALIGN = 8  # rows a row stack is padded to a multiple of: 16 bytes of bf16



def rows_view(tensors: Sequence[torch.Tensor], rows: int | None = None) -> torch.Tensor | None:
    """`torch.cat(tensors)` as a view, when the tensors are consecutive, contiguous row blocks of one storage
    (same trailing shape and dtype); else None. `rows` (at least theirs): the view runs on over the storage's
    rows after them where the storage ends right there (an earlier padded stack's zero rows), else None."""
    first = tensors[0]
    offset = first.storage_offset()
    for t in tensors:
        if (not t.is_contiguous() or t.dtype != first.dtype or t.shape[1:] != first.shape[1:]
                or t.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()
                or t.storage_offset() != offset):
            return None
        offset += t.numel()
    have = sum(t.shape[0] for t in tensors)
    rows = have if rows is None else rows
    row_numel = first[0].numel() if have else 0
    end = (offset + (rows - have) * row_numel) * first.element_size()
    if end > first.untyped_storage().nbytes() or (rows > have and end != first.untyped_storage().nbytes()):
        return None
    return first.detach().as_strided((rows, *first.shape[1:]), first.stride(), first.storage_offset())


def padded_rows(rows: int, align: int = ROW_ALIGN) -> int:
    """Rows of a row stack of `rows` weight rows: the next multiple of `align`."""
    return -(-rows // align) * align


def stack_rows(tensors: Sequence[torch.Tensor], align: int = 1) -> torch.Tensor:
    """The rows of `tensors`, in order, as one tensor whose row blocks the tensors then are (module doc), with
    zero rows after them up to a multiple of `align`."""
    rows = sum(t.shape[0] for t in tensors)
    padded = padded_rows(rows, align)
    view = rows_view(tensors, padded)
    if view is not None:
        return view
    first = tensors[0]
    pad = [first.new_zeros(padded - rows, *first.shape[1:])] if padded > rows else []
    stacked = torch.cat([t.detach() for t in tensors] + pad)
    start = 0
    for t in tensors:
        t.data = stacked[start : start + t.shape[0]]
        start += t.shape[0]
    return stacked


def columns_view(tensors: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """`torch.cat(tensors, dim=1)` as a view, when the 2-D tensors are consecutive column blocks of one
    row-major tensor (what `stack_columns` leaves behind); else None."""
    first = tensors[0]
    width = sum(t.shape[1] for t in tensors)
    offset = first.storage_offset()
    for t in tensors:
        if (t.dim() != 2 or t.dtype != first.dtype or t.shape[0] != first.shape[0] or t.stride() != (width, 1)
                or t.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()
                or t.storage_offset() != offset):
            return None
        offset += t.shape[1]
    return first.detach().as_strided((first.shape[0], width), (width, 1), first.storage_offset())


def stack_columns(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The columns of the 2-D `tensors`, in order, as one tensor whose column blocks the tensors then are (as
    `stack_rows` does for rows: the weights keep their values and identity, the bytes are held once)."""
    if len({t.shape[0] for t in tensors}) != 1:
        raise ValueError(f"stack_columns needs tensors of one row count, got {[tuple(t.shape) for t in tensors]}")
    view = columns_view(tensors)
    if view is not None:
        return view
    stacked = torch.cat([t.detach() for t in tensors], dim=1)
    start = 0
    for t in tensors:
        t.data = stacked[:, start : start + t.shape[1]]
        start += t.shape[1]
    return stacked


class StackedLinear:
    """Bias-free projections of one input (their weights [out_i, in]) as one GEMM over the stacked weight, whose
    last `pad` rows are zeros (ROW_ALIGN)."""

    def __init__(self, weights: Sequence[torch.Tensor]):
        if len({w.shape[1] for w in weights}) != 1:
            shapes = [tuple(w.shape) for w in weights]
            raise ValueError(f"StackedLinear stacks weights of one input width, got {shapes}")
        self.widths = [w.shape[0] for w in weights]
        self.weight = stack_rows(weights, ROW_ALIGN)
        self.pad = self.weight.shape[0] - sum(self.widths)

    def __call__(self, x: torch.Tensor, gemm: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = F.linear
                 ) -> list[torch.Tensor]:
        """Each projection of x, as column blocks (views) of one GEMM's output; `gemm(x, weight)` runs it."""
        return list(gemm(x, self.weight).split(self.widths + [self.pad], dim=-1)[:len(self.widths)])
