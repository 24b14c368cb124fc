"""KDA layers of a ragged batch on the GPU through fla-core, with state in the `RecurrentStatePool`.

These functions take one layer's input projections of the step's rows (q, k, v before the conv, the
gate input f, beta before its sigmoid), its parameters as plain tensors (`KDAWeights`) and the layer's
slices of the pool, and return the recurrence's output per row and head; the module-aware glue
around them (the projections, the gated head norm, o_proj) is models/kimi_k3/gpu_ops.py.

One call runs every sequence of a step at once:
  1. projections of all rows (one GEMM each), the short causal conv continued from each slot's
     window (batched over sequences by padding), SiLU;
  2. the delta-rule recurrence in fla's kernels, varlen over `cu_seqlens`, starting from the states
     gathered from the pool slots: `chunk_kda` when some sequence has many rows (prefill chunks),
     the recurrent kernel `fused_recurrent_kda_fwd` when all are short (decode, verify blocks) or
     the model is fp32 (see `use_recurrent_kernel`);
     fla fuses the L2 norm of q/k, the K3 gate (lower_bound·sigmoid(exp(A_log)·(f + dt_bias))) and
     the sigmoid of beta;
  3. final states and conv windows scattered back to the slots (only where the rows are folded in).

Speculative verify rows follow the pool's checkpoint + pending prefix rule (recurrent_pool.py):
each slot's accepted pending prefix is first replayed from the checkpoint (folded), then the verify
block runs from there without being folded; its layer inputs become the next pending prefix (the glue
runs `varlen` twice: the prefixes, then the step's rows).

Steps of short blocks (`block_rows`, `block_recurrence`, `keep_block_inputs`: verify blocks, a decode
row after a verify, short prompts; at most RECURRENT_MAX_ROWS rows per sequence with its pending
prefix) run each sequence's [accepted prefix ; rows] in one pass of our own kernels
(kernels/kda_blocks.py), folding only the prefix of a verify block: the checkpoint + pending prefix
rule in one launch per layer, without a state copy.

Decode steps (one row per sequence, no pending prefix) of up to kda_decode.DECODE_STEP_MAX_ROWS rows do not
come here: kernels/kda_decode.py's `decode_step` runs everything of theirs after the input GEMM in one launch.
Larger ones (`decode`) skip all host-side logic: the conv windows are updated by slot index, and fla's
recurrent kernel reads and writes each sequence's state in the pool in place (its continuous-batching mode,
`ssm_state_indices`), so no state is gathered or scattered and the step is CUDA-graph capturable.

Captured prefill steps (`prefill`: up to a fixed number of sequences of any lengths, no
pending prefix) take their lengths from a `PrefillLayout` staged on the device: the conv of every row
continues its slot's window (kernels/kda_blocks.py, as verify blocks do), the states are gathered and
scattered by slot on the device, and fla's chunked kernel runs over row offsets padded to a fixed
count (`chunk_kda(use_graph=True)`'s forward, over a chunk table staged once a step), so nothing reads a length
on the host.

The torch path (serving.TorchMixerOps.kda) is the oracle this is tested against.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from mstar.kernels import kda_blocks
from mstar.kernels import kda_decode as kda_decode_kernels

RECURRENT_MAX_ROWS = 16  # at most this many rows per sequence: the recurrent kernel; else the chunked one


def exact_recurrence(dtype: torch.dtype) -> bool:
    """Whether rows of this dtype must take the recurrent kernel at any length: it is exact fp32
    arithmetic, while `chunk_kda` multiplies on tensor cores (TF32 for fp32 inputs), which flips
    near-tied greedy tokens of an fp32 model against the fp32 reference (seen on the H200)."""
    return dtype in (torch.float32, torch.float64)


def use_recurrent_kernel(lengths: list[int], dtype: torch.dtype) -> bool:
    """fp32/fp64 models always take the recurrent kernel (`exact_recurrence`); bf16 and fp16 models take
    the chunked one for sequences longer than RECURRENT_MAX_ROWS (prefill)."""
    return max(lengths) <= RECURRENT_MAX_ROWS or exact_recurrence(dtype)


def available() -> bool:
    if not torch.cuda.is_available():
        return False
    try:
        import fla.ops.kda  # noqa: F401
    except ImportError:
        return False
    return True


def varlen_short_conv(x: torch.Tensor, weight: torch.Tensor, windows: torch.Tensor, lengths: list[int]
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """SiLU(causal depthwise conv) of B ragged sequences, each continuing from its window.

    x [N, C] rows of all sequences; weight [C, 1, W]; windows [B, W-1, C]. Returns (y [N, C], the new
    windows [B, W-1, C]). Sequences are padded to the longest so one conv1d covers the batch.
    """
    B, hist, C = windows.shape
    longest = max(lengths)
    padded = x.new_zeros(B, hist + longest, C)
    padded[:, :hist] = windows.to(x.dtype)
    rows = _row_index(lengths, x.device)  # (sequence, position) of every row
    padded[rows[0], hist + rows[1]] = x
    xf = padded.float() if x.dtype in (torch.bfloat16, torch.float16) else padded
    y = F.conv1d(xf.transpose(1, 2), weight.to(xf.dtype), groups=C).transpose(1, 2)  # [B, longest, C]
    out = F.silu(y[rows[0], rows[1]]).to(x.dtype)
    ends = torch.tensor(lengths, device=x.device)[:, None] + torch.arange(hist, device=x.device)[None]
    new_windows = padded.gather(1, ends[..., None].expand(B, hist, C))
    return out, new_windows


def _row_index(lengths: list[int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    seq = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    starts = torch.tensor([0, *lengths[:-1]]).cumsum(0)
    pos = torch.arange(int(sum(lengths))) - starts[seq]
    return seq.to(device), pos.to(device)


@dataclass(frozen=True)
class KDAWeights:
    """A KDA layer's parameters as the kernels take them, converted once per serving model (not every step)."""

    conv_weight: torch.Tensor  # fp32 [3, W, width]: the q, k, v depthwise kernels, taps oldest first
    conv1d: tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # the same as held, [width, 1, W] each (`varlen`)
    a_log: torch.Tensor  # fp32 [H]
    dt_bias: torch.Tensor  # fp32 [width]
    num_heads: int
    head_dim: int
    scale: float  # of q (head_dim ** -0.5)
    lower_bound: float | None  # K3's gate lower bound; None: Kimi-Linear's gate
    l2_eps: float  # of the q and k L2 norms (fla's l2norm takes the same)

    def fla_args(self) -> dict:
        """What every fla KDA call takes from the layer."""
        return dict(A_log=self.a_log, dt_bias=self.dt_bias, scale=self.scale, use_qk_l2norm_in_kernel=True,
                    use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, lower_bound=self.lower_bound)


def decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, f: torch.Tensor, beta: torch.Tensor,
           conv: torch.Tensor, state: torch.Tensor, slots: torch.Tensor, w: KDAWeights) -> torch.Tensor:
    """A decode step: row b continues slot `slots[b]`, whose conv window (`conv` [slots, 3, W-1, width]) and
    state (`state` [slots, H, K, V]) are updated in place (the caller guarantees no slot has a pending
    prefix). Returns o [B, H, K]."""
    from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd

    B, H, K = q.shape[0], w.num_heads, w.head_dim
    q, k, v = kda_decode_kernels.decode_conv(q, k, v, conv, slots, w.conv_weight).view(3, B, 1, H, K)
    # fla's kernel loads beta as fp32 itself and writes every row of o: no cast, no zero fill (at B=1 the
    # [1, H] slice of the stacked projection is already contiguous, so no copy either)
    o, _ = fused_recurrent_kda_fwd(
        q=q, k=k, v=v, g=f.view(B, 1, H, K), beta=beta.contiguous().view(B, 1, H),
        initial_state=state, inplace_final_state=True, ssm_state_indices=slots, out=torch.empty_like(v),
        **w.fla_args(),
    )
    return o.view(B, H, K)


def _index_tensors(*lists: list[int], device: torch.device) -> list[torch.Tensor]:
    """Host int lists as long tensors on `device`, views of one copied through pinned memory: queued, never
    waited for (a pageable copy would block the host until the GPU's queue drains; a copy per list costs the
    host a pinned allocation and a launch each; resources/transfer.py does the same for the engine, which
    kernels do not import). Each view starts 16 bytes aligned, as Triton's pointer specialization assumes of
    the tensors it is given (an unaligned one would compile the kernel again)."""
    flat, offsets = [], []
    for values in lists:
        offsets.append(len(flat))
        flat += values
        flat += [0] * (len(flat) % 2)
    if torch.device(device).type != "cuda":
        joined = torch.tensor(flat, dtype=torch.long, device=device)
    else:
        joined = torch.tensor(flat, dtype=torch.long, pin_memory=True).to(device, non_blocking=True)
    return [joined[start : start + len(values)] for start, values in zip(offsets, lists, strict=True)]


@dataclass(frozen=True)
class BlockLayout:
    """Where each sequence's [accepted pending prefix ; rows] sit in one step's combined rows, as device
    index tensors built once per step from the host's bookkeeping (every KDA layer of the step shares it)."""

    num_rows: int  # M, the combined rows
    slots: torch.Tensor  # [B] KDA slot of each sequence
    starts: torch.Tensor  # [B] first combined row of each sequence
    ends: torch.Tensor  # [B] one past its last
    fold: torch.Tensor  # [B] how many of its rows fold into the slot's state and window
    row_seq: torch.Tensor  # [M] sequence of each combined row
    x_dest: torch.Tensor  # [N] combined row of each of the step's rows
    prefix_dest: torch.Tensor  # [P] combined row of each pending-prefix row
    prefix_src: torch.Tensor  # [P] its row in one layer's prefix_x, flattened to [slots * max_block, D]
    keep_dest: torch.Tensor  # [V] flattened prefix_x row where each verify row's input waits
    keep_src: torch.Tensor  # [V] which of the step's rows
    row_src: torch.Tensor  # [M] where each combined row comes from (kda_blocks.gather_block_rows' codes)

    @classmethod
    def build(cls, seq_starts: tuple[int, ...], slots: tuple[int, ...], pending: list[int], verify: tuple[bool, ...],
              max_block: int, device: torch.device, *, capacity: int | None = None,
              exact_pending: torch.Tensor | None = None) -> BlockLayout:
        """The compact layout; or, with `capacity` (rows per sequence, at least max_block + its rows), one
        whose sizes depend only on the sequence and row counts, as a captured step needs: sequence b owns
        rows b * capacity onwards, and every sequence lists max_block prefix rows, those past its
        pending prefix landing on unused rows of its own segment.

        `exact_pending` [B] (on the device): the pending prefixes are known only there (a verify step in
        flight decides them), and `pending` holds upper bounds: each sequence's segment and listed prefix
        rows are sized by its bound, and where its rows start inside them is computed on the device."""
        starts, ends, fold, row_seq, x_dest, prefix_dest, prefix_src, keep_dest, keep_src = ([] for _ in range(9))
        x_seq, x_j, pre_seq, pre_j, lengths = [], [], [], [], []  # what the device needs to place exact prefixes
        first = 0
        for b, slot in enumerate(slots):
            n, p = seq_starts[b + 1] - seq_starts[b], pending[b]
            is_verify = bool(verify and verify[b])
            starts.append(first)
            ends.append(first + p + n)
            fold.append(p + (0 if is_verify else n))
            x_dest += range(first + p, first + p + n)
            listed = p if capacity is None else max_block
            prefix_dest += [first + j if j < p else first + n + j for j in range(listed)]
            prefix_src += range(slot * max_block, slot * max_block + listed)
            x_seq += [b] * n
            x_j += range(n)
            pre_seq += [b] * listed
            pre_j += range(listed)
            lengths.append(n)
            if is_verify:  # its inputs become the slot's next pending prefix
                keep_dest += range(slot * max_block, slot * max_block + n)
                keep_src += range(seq_starts[b], seq_starts[b + 1])
            size = p + n if capacity is None else capacity
            if p + n + (listed - p) > size:
                raise ValueError(f"sequence {b}: {p} prefix + {n} rows do not fit a capacity of {capacity}")
            row_seq += [b] * size
            first += size
        host = [slots, starts, ends, fold, row_seq, x_dest, prefix_dest, prefix_src, keep_dest, keep_src,
                _row_sources(first, x_dest, prefix_dest, prefix_src)]
        if exact_pending is None:
            return cls(first, *_index_tensors(*host, device=device))
        unfolded = [0 if verify and verify[b] else 1 for b in range(len(slots))]
        *as_t, n, unfolded_t, x_seq_t, pre_seq_t, x_j_t, j = _index_tensors(*host, lengths, unfolded, x_seq, pre_seq,
                                                                           x_j, pre_j, device=device)
        p = exact_pending.to(device=device, dtype=torch.long)
        starts_t = as_t[1]
        as_t[2] = starts_t + p + n  # ends
        as_t[3] = p + n * unfolded_t  # fold
        as_t[5] = starts_t[x_seq_t] + p[x_seq_t] + x_j_t  # x_dest
        as_t[6] = starts_t[pre_seq_t] + torch.where(j < p[pre_seq_t], j, n[pre_seq_t] + j)  # prefix_dest
        as_t[10] = torch.full((first,), kda_blocks.ZERO_ROW, dtype=torch.long, device=device)  # row_src
        as_t[10][as_t[5]] = torch.arange(len(x_dest), device=device)
        as_t[10][as_t[6]] = kda_blocks.PREFIX_ROW - as_t[7]
        return cls(first, *as_t)

    @classmethod
    def equal_blocks(cls, slots: torch.Tensor, pending: torch.Tensor, rows: int, max_block: int) -> BlockLayout:
        """`build`'s fixed-capacity layout of B verify blocks of `rows` rows each (capacity rows + max_block),
        from device tensors alone: the slots [B] and pending prefixes [B]. A captured verify step derives it
        inside its graph, so that a replay stages just those two (no host lists, no per-step launches)."""
        device, capacity = slots.device, rows + max_block
        slots, pending = slots.long(), pending.long()
        seq = torch.arange(slots.shape[0], device=device)
        starts = seq * capacity
        j_rows, j_prefix = torch.arange(rows, device=device), torch.arange(max_block, device=device)
        x_dest = ((starts + pending)[:, None] + j_rows).flatten()
        prefix_dest = (starts[:, None] + torch.where(j_prefix < pending[:, None], j_prefix, rows + j_prefix)).flatten()
        prefix_src = (slots[:, None] * max_block + j_prefix).flatten()
        row_src = torch.full((slots.shape[0] * capacity,), kda_blocks.ZERO_ROW, dtype=torch.long, device=device)
        row_src[x_dest] = torch.arange(x_dest.shape[0], device=device)
        row_src[prefix_dest] = kda_blocks.PREFIX_ROW - prefix_src
        return cls(num_rows=slots.shape[0] * capacity, slots=slots, starts=starts, ends=starts + pending + rows,
                   fold=pending, row_seq=torch.arange(row_src.shape[0], device=device) // capacity, x_dest=x_dest,
                   prefix_dest=prefix_dest, prefix_src=prefix_src,
                   keep_dest=(slots[:, None] * max_block + j_rows).flatten(),
                   keep_src=torch.arange(x_dest.shape[0], device=device), row_src=row_src)

    def copy_(self, other: BlockLayout) -> None:
        """Take `other`'s values (same sizes): a captured step's layout is staged into fixed tensors."""
        if other.num_rows != self.num_rows:
            raise ValueError(f"layout of {other.num_rows} rows staged into one of {self.num_rows}")
        for name in ("slots", "starts", "ends", "fold", "row_seq", "x_dest", "prefix_dest", "prefix_src",
                     "keep_dest", "keep_src", "row_src"):
            getattr(self, name).copy_(getattr(other, name))


def _row_sources(num_rows: int, x_dest: list[int], prefix_dest: list[int], prefix_src: list[int]) -> list[int]:
    """Each combined row's source as `kda_blocks.gather_block_rows` reads it (x rows placed first, then the
    prefix rows, as the layout lists them)."""
    sources = [kda_blocks.ZERO_ROW] * num_rows
    for i, dest in enumerate(x_dest):
        sources[dest] = i
    for dest, src in zip(prefix_dest, prefix_src, strict=True):
        sources[dest] = kda_blocks.PREFIX_ROW - src
    return sources


def block_rows(x: torch.Tensor, layout: BlockLayout, prefix_x: torch.Tensor) -> torch.Tensor:
    """The combined rows [M, D] of a step of short blocks: each sequence's accepted pending prefix (read from
    `prefix_x` [slots, max_block, D]), then its rows of x. Rows outside every sequence (a fixed-capacity
    layout's) are harmless zeros. One launch."""
    return kda_blocks.gather_block_rows(x, prefix_x.view(-1, x.shape[1]), layout.row_src)


def block_recurrence(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, f: torch.Tensor, beta: torch.Tensor,
                     layout: BlockLayout, conv: torch.Tensor, state: torch.Tensor, w: KDAWeights) -> torch.Tensor:
    """A step of short blocks over its combined rows (kernels/kda_blocks.py): each sequence runs [its accepted
    pending prefix ; its rows] from the slot's checkpoint in one pass, folding the prefix always and its
    rows unless they are a verify block. No host logic: everything is in `layout`. Returns o [M, H, K]."""
    M, H, K = layout.num_rows, w.num_heads, w.head_dim
    qkv = kda_blocks.block_conv(q, k, v, conv, layout.slots, layout.row_seq, layout.starts, w.conv_weight)
    kda_blocks.fold_windows(q, k, v, conv, layout.slots, layout.starts, layout.fold)
    return kda_blocks.fold_recurrent(qkv[0].view(M, H, K), qkv[1].view(M, H, K), qkv[2].view(M, H, K),
                                     f.view(M, H, K), beta, w.a_log, w.dt_bias, w.scale, w.lower_bound, w.l2_eps,
                                     state, layout.slots, layout.starts, layout.ends, layout.fold)


def keep_block_inputs(x: torch.Tensor, layout: BlockLayout, prefix_x: torch.Tensor) -> None:
    """Each verify block's rows of x become its slot's next pending prefix (after `block_rows` read the old)."""
    kda_blocks.copy_rows(x, layout.keep_src, prefix_x.view(-1, x.shape[1]), layout.keep_dest)


@dataclass(frozen=True)
class PrefillLayout:
    """The rows of a captured prefill step as device tensors whose sizes depend only on the capacity
    (max_seqs sequences, num_rows rows); staged per step (`stage`), shared by all its KDA layers.

    The step's B <= max_seqs sequences come first. The rows after them, up to num_rows, form one padding
    sequence, and the sequences after that are empty (fla's `chunk_kda(use_graph=True)` takes its row
    offsets padded with zero-length tail sequences). The padding sequence exists so that every row
    belongs to a sequence and every kernel writes defined values into it: a row that no sequence owns
    keeps whatever its buffer held, possibly NaN, and a NaN row's router picks expert ids that do not
    exist. Its outputs are never read; its slot (like the empty sequences') is the caller's sink.
    """

    cu_seqlens: torch.Tensor  # [max_seqs + 2] row offsets
    lengths: torch.Tensor  # [max_seqs + 1] rows of each sequence (all of them fold into its state and window)
    row_seq: torch.Tensor  # [num_rows] sequence of each row
    slots: torch.Tensor  # [max_seqs + 1] KDA slot of each sequence: the caller stages these (padding: its sink)
    # fla's chunk table over the row offsets (`_chunk_table_rows` rows: its (sequence, chunk) of each chunk, -1 past
    # the last) and each sequence's first chunk: made once a step by `stage`, not once per layer by chunk_kda
    chunk_indices: torch.Tensor
    chunk_offsets: torch.Tensor  # [max_seqs + 2]

    @classmethod
    def allocate(cls, num_rows: int, slots: torch.Tensor) -> PrefillLayout:
        """A layout of len(slots) - 1 sequences at most over num_rows rows, reading its slots from `slots`."""
        index = {"dtype": torch.long, "device": slots.device}
        seqs = slots.shape[0]
        return cls(torch.zeros(seqs + 1, **index), torch.zeros(seqs, **index), torch.zeros(num_rows, **index), slots,
                   torch.zeros(_chunk_table_rows(num_rows, seqs), 2, **index), torch.zeros(seqs + 1, **index))

    @property
    def num_rows(self) -> int:
        return self.row_seq.shape[0]

    @property
    def num_seqs(self) -> int:
        """Sequences the kernels see, padding ones included (fla's `max_num_seqs`)."""
        return self.lengths.shape[0]

    def first_rows(self, num_rows: int) -> PrefillLayout:
        """This layout over its first num_rows rows (a smaller capture bucket shares the tensors)."""
        return replace(self, row_seq=self.row_seq[:num_rows],
                       chunk_indices=self.chunk_indices[: _chunk_table_rows(num_rows, self.num_seqs)])

    def stage(self, seq_starts: torch.Tensor) -> None:
        """Lay out the sequences whose row offsets are `seq_starts` ([B + 1] on the device, B <= max_seqs,
        the last offset at most num_rows: the caller checks that, since reading it would wait for the
        device). The padding, the lengths and each row's sequence are made on the device."""
        count = seq_starts.shape[0] - 1
        if not 0 <= count < self.num_seqs:
            raise ValueError(f"a prefill layout of at most {self.num_seqs - 1} sequences cannot take {count}")
        self.cu_seqlens[: count + 1].copy_(seq_starts)
        self.cu_seqlens[count + 1:] = self.num_rows  # the padding sequence ends here; the ones after are empty
        ends = self.cu_seqlens[1:]
        torch.sub(ends, self.cu_seqlens[:-1], out=self.lengths)
        rows = torch.arange(self.num_rows, device=self.row_seq.device)
        torch.searchsorted(ends, rows, right=True, out=self.row_seq)  # the first sequence ending after the row
        from fla.ops.utils.index import prepare_chunk_indices_static

        indices, offsets = prepare_chunk_indices_static(self.cu_seqlens, FLA_CHUNK, self.chunk_indices.shape[0])
        self.chunk_indices.copy_(indices)
        self.chunk_offsets.copy_(offsets)


FLA_CHUNK = 64  # rows of fla's KDA chunks (chunk_kda's default)


def _chunk_table_rows(num_rows: int, num_seqs: int) -> int:
    """Rows of fla's chunk table over num_rows rows cut into num_seqs sequences (chunk_kda's nt_max with use_graph):
    every sequence may end one chunk early."""
    return (num_rows + FLA_CHUNK - 1) // FLA_CHUNK + num_seqs - 1


def prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, f: torch.Tensor, beta: torch.Tensor,
            layout: PrefillLayout, conv: torch.Tensor, state: torch.Tensor, w: KDAWeights) -> torch.Tensor:
    """A captured prefill step: row r belongs to sequence layout.row_seq[r], which continues the state and
    conv window of its slot and folds all its rows. No host logic: the conv reads every row's sequence from
    the layout (kda_blocks.block_conv), the states are gathered and scattered by slot on the device, and
    fla's chunked kernel runs over the padded offsets and the chunk table staged with them (`_chunk_kda_staged`;
    fp32/fp64 models: the recurrent kernel, see `exact_recurrence`). Returns o [M, H, K]."""
    from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd

    M, H, K = q.shape[0], w.num_heads, w.head_dim
    if layout.num_rows != M:
        raise ValueError(f"{M} rows run through a prefill layout of {layout.num_rows}")
    starts = layout.cu_seqlens[:-1]
    qkv = kda_blocks.block_conv(q, k, v, conv, layout.slots, layout.row_seq, starts, w.conv_weight)
    kda_blocks.fold_windows(q, k, v, conv, layout.slots, starts, layout.lengths)  # after the conv read them
    # The states by slot in one copy launch each way (indexing took 19 + 59 us a KDA layer at a TP8 rank: the empty
    # sequences' states all landed on the sink, from every SM at once); the empty sequences' are not written back.
    seqs, pool = layout.num_seqs, state.view(state.shape[0], -1)
    initial = torch.empty(seqs, *state.shape[1:], dtype=torch.float32, device=state.device)
    kda_blocks.copy_rows(pool, layout.slots, initial.view(seqs, -1), None)
    args = dict(
        q=qkv[0].view(1, M, H, K), k=qkv[1].view(1, M, H, K), v=qkv[2].view(1, M, H, K), g=f.view(1, M, H, K),
        beta=beta.view(1, M, H).float().contiguous(), initial_state=initial,
        output_final_state=True, cu_seqlens=layout.cu_seqlens, **w.fla_args(),
    )
    if exact_recurrence(q.dtype):
        o, final = fused_recurrent_kda_fwd(inplace_final_state=False, **args)
    else:
        o, final = _chunk_kda_staged(layout, w, **args)
    # the padding sequence (if any rows are padding) lands on the sink
    kda_blocks.copy_rows(final.reshape(seqs, -1), None, pool, layout.slots, live=layout.lengths)
    return o.view(M, H, K)


def _chunk_kda_staged(layout: PrefillLayout, w: KDAWeights, q, k, v, g, beta, initial_state, cu_seqlens,
                      use_qk_l2norm_in_kernel, use_beta_sigmoid_in_kernel, **rest) -> tuple[torch.Tensor, torch.Tensor]:
    """What `chunk_kda(use_graph=True, max_num_seqs=layout.num_seqs, **args)` returns (its forward: the q/k L2 norms,
    beta's sigmoid, `chunk_kda_fwd`), over the chunk table the layout staged once for the step: chunk_kda would
    build it again in every KDA layer (~18 small launches each in the captured step). This follows fla-core's
    internals, pinned in pyproject.toml: tests/kernels/test_gpu_kda.py holds the two bit-equal, and the
    interpreter's test (test_kda_fla_interpreted.py) that fla's steps get the same arguments."""
    from fla.modules.norm.l2norm import l2norm_fwd
    from fla.ops.common.gate import fused_beta_sigmoid
    from fla.ops.kda.chunk_fwd import chunk_kda_fwd

    assert use_qk_l2norm_in_kernel and use_beta_sigmoid_in_kernel  # KDAWeights.fla_args
    q, k, v, g, beta = (t.contiguous() for t in (q, k, v, g, beta))  # as chunk_kda's input_guard leaves them
    q, _ = l2norm_fwd(q)
    k, _ = l2norm_fwd(k)
    out = chunk_kda_fwd(q=q, k=k, v=v, g=g, beta=fused_beta_sigmoid(x=beta, scale=1.0), initial_state=initial_state,
                        cu_seqlens=cu_seqlens, chunk_indices=layout.chunk_indices, chunk_offsets=layout.chunk_offsets,
                        chunk_size=FLA_CHUNK, safe_gate=w.lower_bound is not None, use_graph=True, **rest)
    return out[0].type_as(q), out[1]


def varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, f: torch.Tensor, beta: torch.Tensor,
           lengths: list[int], slots: tuple[int, ...], fold: list[bool], conv: torch.Tensor, state: torch.Tensor,
           w: KDAWeights) -> torch.Tensor:
    """Ragged rows of len(lengths) sequences from their slots' states and conv windows; the states and
    windows of the sequences marked `fold` are written back. Returns o [N, H, K]. Slots and lengths come
    from the host: nothing here reads the device back."""
    from fla.ops.kda import chunk_kda
    from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd

    H, K, device = w.num_heads, w.head_dim, q.device
    slot_index = torch.tensor(slots, device=device)
    windows = conv[slot_index]  # [B, 3, W-1, width]
    q, q_win = varlen_short_conv(q, w.conv1d[0], windows[:, 0], lengths)
    k, k_win = varlen_short_conv(k, w.conv1d[1], windows[:, 1], lengths)
    v, v_win = varlen_short_conv(v, w.conv1d[2], windows[:, 2], lengths)
    cu_host = torch.tensor([0, *lengths]).cumsum(0)
    args = dict(
        q=q.view(1, -1, H, K), k=k.view(1, -1, H, K), v=v.view(1, -1, H, K), g=f.view(1, -1, H, K),
        beta=beta.view(1, -1, H).float().contiguous(), initial_state=state[slot_index].float().contiguous(),
        output_final_state=True, cu_seqlens=cu_host.to(device), **w.fla_args(),
    )
    if use_recurrent_kernel(lengths, q.dtype):
        o, final = fused_recurrent_kda_fwd(inplace_final_state=False, **args)
    else:
        # the host copy of the offsets spares fla's chunk indexing a device-to-host read per layer
        o, final = chunk_kda(safe_gate=w.lower_bound is not None, cu_seqlens_cpu=cu_host, **args)
    folded = [b for b, keep in enumerate(fold) if keep]
    if folded:
        rows = torch.tensor(folded, device=device)
        kept = torch.tensor([slots[b] for b in folded], device=device)
        state[kept] = final[rows].to(state.dtype)
        conv[kept] = torch.stack([q_win, k_win, v_win], dim=1)[rows].to(conv.dtype)
    return o.view(-1, H, K)
