"""KDA layers of a ragged batch on the GPU through fla-core, with state in the `RecurrentStatePool`.

One call runs every sequence of a step at once:
  1. projections of all rows (one GEMM each), the short causal conv continued from each slot's
     window (batched over sequences by padding), SiLU;
  2. the delta-rule recurrence in fla's kernels, varlen over `cu_seqlens`, starting from the states
     gathered from the pool slots: `chunk_kda` when some sequence has many rows (prefill chunks),
     the recurrent kernel `fused_recurrent_kda_fwd` when all are short (decode, verify blocks) or
     the model is fp32 (see `use_recurrent_kernel`);
     fla fuses the L2 norm of q/k, the K3 gate (lower_bound·sigmoid(exp(A_log)·(f + dt_bias))) and
     the sigmoid of beta;
  3. final states and conv windows scattered back to the slots (only where the rows are folded in),
     the gated head norm and o_proj.

Speculative verify rows follow the pool's checkpoint + pending prefix rule (recurrent_pool.py):
each slot's accepted pending prefix is first replayed from the checkpoint (folded), then the verify
block runs from there without being folded; its layer inputs become the next pending prefix.

Steps of short blocks (`kda_block_step`: verify blocks, a decode row after a verify, short prompts;
at most RECURRENT_MAX_ROWS rows per sequence with its pending prefix) run each sequence's [accepted
prefix ; rows] in one pass of our own kernels (kernels/kda_blocks.py), folding only the prefix of a
verify block: the checkpoint + pending prefix rule in one launch per layer, without a state copy.

Decode steps (`kda_decode`: one row per sequence, no pending prefix) skip all host-side logic: the
conv windows are updated by slot index, and fla's recurrent kernel reads and writes each sequence's
state in the pool in place (its continuous-batching mode, `ssm_state_indices`), so no state is
gathered or scattered and the step is CUDA-graph capturable.

Captured prefill steps (`kda_prefill_step`: up to a fixed number of sequences of any lengths, no
pending prefix) take their lengths from a `PrefillLayout` staged on the device: the conv of every row
continues its slot's window (kernels/kda_blocks.py, as verify blocks do), the states are gathered and
scattered by slot on the device, and fla's chunked kernel runs over row offsets padded to a fixed
count (`chunk_kda(use_graph=True)`), so nothing reads a length on the host.

The torch path (serving.TorchMixerOps.kda) is the oracle this is tested against.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from mstar.kernels import kda_blocks
from mstar.kernels import kda_decode as kda_decode_kernels
from mstar.kernels.stacked_linear import StackedLinear
from mstar.models.kimi_k3.kda import KimiDeltaAttention
from mstar.resources.recurrent_pool import RecurrentStatePool

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


def stack_input_projections(attn: KimiDeltaAttention) -> None:
    """Make x's projections one GEMM (q, k, v, f_a, b and the gate's first stage; `StackedLinear`)."""
    gate = attn.g_proj if attn.use_full_rank_gate else attn.g_a_proj
    attn.stacked_inputs = StackedLinear([attn.q_proj, attn.k_proj, attn.v_proj, attn.f_a_proj, attn.b_proj, gate])


def input_projections(attn: KimiDeltaAttention, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(q, k, v pre-conv, the gate f before the kernel's activation, beta before its sigmoid, the output
    gate) of rows x, through the stacked GEMM when the layer has one. Stacked, the blocks are strided
    views of one output: fla's kernels assume contiguous rows, so what goes to them straight (beta) is
    made contiguous there (`.float()` copies a bf16 beta but returns an fp32 one as it is; the H200 run
    that found this measured 11% error for fp32 models, bf16 passed)."""
    first_gate = attn.g_proj if attn.use_full_rank_gate else attn.g_a_proj
    stacked = attn.stacked_inputs
    if stacked is not None:
        q, k, v, f_a, beta, g = stacked(x)
    else:
        q, k, v, f_a, beta, g = (p(x) for p in (attn.q_proj, attn.k_proj, attn.v_proj, attn.f_a_proj, attn.b_proj,
                                                first_gate))
    return q, k, v, attn.f_b_proj(f_a), beta, g if attn.use_full_rank_gate else attn.g_b_proj(g)


@dataclass(frozen=True)
class DecodeConstants:
    """A KDA layer's parameters as the decode kernels take them, converted once (not every step)."""

    conv_weight: torch.Tensor  # fp32 [3, W, width]: the q, k, v depthwise kernels, taps oldest first
    a_log: torch.Tensor  # fp32 [H]
    dt_bias: torch.Tensor  # fp32 [width]

    @classmethod
    def of(cls, attn: KimiDeltaAttention) -> DecodeConstants:
        convs = (attn.q_conv1d, attn.k_conv1d, attn.v_conv1d)
        return cls(torch.stack([c.weight[:, 0].T.float() for c in convs]).contiguous(), attn.A_log.float(),
                   attn.dt_bias.float())


def kda_decode(attn: KimiDeltaAttention, layer: int, x: torch.Tensor, slots: torch.Tensor,
               pool: RecurrentStatePool, consts: DecodeConstants) -> torch.Tensor:
    """One KDA layer for a decode step: row b of `x` [B, D] continues slot `slots[b]`, whose state and
    conv window are updated in place (the caller guarantees no slot has a pending prefix)."""
    from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd

    B, (H, K) = x.shape[0], (attn.num_heads, attn.head_dim)
    q, k, v, f, beta, gate = input_projections(attn, x)
    q, k, v = kda_decode_kernels.decode_conv(q, k, v, pool.conv[layer], slots, consts.conv_weight).view(3, B, 1, H, K)
    o, _ = fused_recurrent_kda_fwd(
        q=q, k=k, v=v, g=f.view(B, 1, H, K), beta=beta.view(B, 1, H).float().contiguous(),
        A_log=consts.a_log, dt_bias=consts.dt_bias, scale=attn.scale,
        initial_state=pool.state[layer], inplace_final_state=True, ssm_state_indices=slots,
        use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
        lower_bound=attn.gate_lower_bound,
    )
    o = attn.o_norm(o.view(B, H, K).to(x.dtype), gate.view(B, H, K))
    return attn.o_proj(o.reshape(B, -1))


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

    @classmethod
    def build(cls, seq_starts: tuple[int, ...], slots: tuple[int, ...], pending: list[int], verify: tuple[bool, ...],
              max_block: int, device: torch.device, *, capacity: int | None = None) -> BlockLayout:
        """The compact layout; or, with `capacity` (rows per sequence, at least max_block + its rows), one
        whose sizes depend only on the sequence and row counts, as a captured step needs: sequence b owns
        rows b * capacity onwards, and every sequence lists max_block prefix rows, those past its
        pending prefix landing on unused rows of its own segment."""
        starts, ends, fold, row_seq, x_dest, prefix_dest, prefix_src, keep_dest, keep_src = ([] for _ in range(9))
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
            if is_verify:  # its inputs become the slot's next pending prefix
                keep_dest += range(slot * max_block, slot * max_block + n)
                keep_src += range(seq_starts[b], seq_starts[b + 1])
            size = p + n if capacity is None else capacity
            if p + n + (listed - p) > size:
                raise ValueError(f"sequence {b}: {p} prefix + {n} rows do not fit a capacity of {capacity}")
            row_seq += [b] * size
            first += size
        index = {"dtype": torch.long, "device": device}
        as_t = (torch.tensor(v, **index) for v in (slots, starts, ends, fold, row_seq, x_dest, prefix_dest,
                                                    prefix_src, keep_dest, keep_src))
        return cls(first, *as_t)

    def copy_(self, other: BlockLayout) -> None:
        """Take `other`'s values (same sizes): a captured step's layout is staged into fixed tensors."""
        if other.num_rows != self.num_rows:
            raise ValueError(f"layout of {other.num_rows} rows staged into one of {self.num_rows}")
        for name in ("slots", "starts", "ends", "fold", "row_seq", "x_dest", "prefix_dest", "prefix_src",
                     "keep_dest", "keep_src"):
            getattr(self, name).copy_(getattr(other, name))


def kda_block_step(attn: KimiDeltaAttention, layer: int, x: torch.Tensor, layout: BlockLayout,
                   pool: RecurrentStatePool, consts: DecodeConstants) -> torch.Tensor:
    """One KDA layer for a step of short blocks (kernels/kda_blocks.py): each sequence runs [its accepted
    pending prefix ; its rows] from the slot's checkpoint in one pass, folding the prefix always and its
    rows unless they are a verify block, whose inputs then become the next pending prefix. No host logic:
    everything is in `layout`."""
    (H, K), D, M = (attn.num_heads, attn.head_dim), x.shape[1], layout.num_rows
    prefix_x = pool.prefix_x[layer].reshape(-1, D)
    rows = x.new_zeros(M, D)  # rows outside every sequence (a fixed-capacity layout's) stay harmless zeros
    rows[layout.x_dest] = x
    rows[layout.prefix_dest] = prefix_x[layout.prefix_src].to(x.dtype)
    q, k, v, f, beta, gate = input_projections(attn, rows)
    conv = pool.conv[layer]
    qkv = kda_blocks.block_conv(q, k, v, conv, layout.slots, layout.row_seq, layout.starts, consts.conv_weight)
    kda_blocks.fold_windows(q, k, v, conv, layout.slots, layout.starts, layout.fold)
    o = kda_blocks.fold_recurrent(qkv[0].view(M, H, K), qkv[1].view(M, H, K), qkv[2].view(M, H, K), f.view(M, H, K),
                                  beta, consts.a_log, consts.dt_bias, attn.scale, attn.gate_lower_bound,
                                  pool.state[layer], layout.slots, layout.starts, layout.ends, layout.fold)
    prefix_x[layout.keep_dest] = x[layout.keep_src].to(prefix_x.dtype)  # after the prefix rows were read
    o = attn.o_norm(o[layout.x_dest].to(x.dtype), gate[layout.x_dest].reshape(-1, H, K))
    return attn.o_proj(o.reshape(x.shape[0], -1))


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

    @classmethod
    def allocate(cls, num_rows: int, slots: torch.Tensor) -> PrefillLayout:
        """A layout of len(slots) - 1 sequences at most over num_rows rows, reading its slots from `slots`."""
        index = {"dtype": torch.long, "device": slots.device}
        seqs = slots.shape[0]
        return cls(torch.zeros(seqs + 1, **index), torch.zeros(seqs, **index), torch.zeros(num_rows, **index), slots)

    @property
    def num_rows(self) -> int:
        return self.row_seq.shape[0]

    @property
    def num_seqs(self) -> int:
        """Sequences the kernels see, padding ones included (fla's `max_num_seqs`)."""
        return self.lengths.shape[0]

    def first_rows(self, num_rows: int) -> PrefillLayout:
        """This layout over its first num_rows rows (a smaller capture bucket shares the tensors)."""
        return replace(self, row_seq=self.row_seq[:num_rows])

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


def kda_prefill_step(attn: KimiDeltaAttention, layer: int, x: torch.Tensor, layout: PrefillLayout,
                     pool: RecurrentStatePool, consts: DecodeConstants) -> torch.Tensor:
    """One KDA layer for a captured prefill step: row r of `x` [num_rows, D] belongs to sequence
    layout.row_seq[r], which continues the state and conv window of its slot and folds all its rows. No
    host logic: the conv reads every row's sequence from the layout (kda_blocks.block_conv), the states
    are gathered and scattered by slot on the device, and fla's chunked kernel takes the padded offsets as
    `chunk_kda(use_graph=True)` (fp32/fp64 models: the recurrent kernel, see `exact_recurrence`)."""
    from fla.ops.kda import chunk_kda
    from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd

    (H, K), M = (attn.num_heads, attn.head_dim), x.shape[0]
    if layout.num_rows != M:
        raise ValueError(f"{M} rows run through a prefill layout of {layout.num_rows}")
    q, k, v, f, beta, gate = input_projections(attn, x)
    conv, starts = pool.conv[layer], layout.cu_seqlens[:-1]
    qkv = kda_blocks.block_conv(q, k, v, conv, layout.slots, layout.row_seq, starts, consts.conv_weight)
    kda_blocks.fold_windows(q, k, v, conv, layout.slots, starts, layout.lengths)  # after the conv read them
    states = pool.state[layer]
    args = dict(
        q=qkv[0].view(1, M, H, K), k=qkv[1].view(1, M, H, K), v=qkv[2].view(1, M, H, K), g=f.view(1, M, H, K),
        beta=beta.view(1, M, H).float().contiguous(), A_log=consts.a_log, dt_bias=consts.dt_bias, scale=attn.scale,
        initial_state=states[layout.slots].float(), output_final_state=True, cu_seqlens=layout.cu_seqlens,
        use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
        lower_bound=attn.gate_lower_bound,
    )
    if exact_recurrence(x.dtype):
        o, final = fused_recurrent_kda_fwd(inplace_final_state=False, **args)
    else:
        o, final = chunk_kda(safe_gate=attn.gate_lower_bound is not None, use_graph=True,
                             max_num_seqs=layout.num_seqs, **args)
    states[layout.slots] = final.to(states.dtype)  # the padding and empty sequences all land on the sink
    o = attn.o_norm(o.view(M, H, K).to(x.dtype), gate.reshape(M, H, K))
    return attn.o_proj(o.reshape(M, -1))


def run_rows(attn: KimiDeltaAttention, layer: int, x: torch.Tensor, lengths: list[int], slots: tuple[int, ...],
             pool: RecurrentStatePool, fold: list[bool]) -> torch.Tensor:
    """Run ragged rows `x` [N, D] of len(lengths) sequences from their slots' states; write back the
    states of the sequences marked `fold`. Returns the layer output [N, D]. Slots and lengths come from
    the host: nothing here reads the device back."""
    from fla.ops.kda import chunk_kda
    from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd

    H, K = attn.num_heads, attn.head_dim
    device = x.device
    slot_index = torch.tensor(slots, device=device)
    windows = pool.conv[layer, slot_index]  # [B, 3, W-1, width]
    q, k, v, f, beta, gate = input_projections(attn, x)
    q, q_win = varlen_short_conv(q, attn.q_conv1d.weight, windows[:, 0], lengths)
    k, k_win = varlen_short_conv(k, attn.k_conv1d.weight, windows[:, 1], lengths)
    v, v_win = varlen_short_conv(v, attn.v_conv1d.weight, windows[:, 2], lengths)
    cu_host = torch.tensor([0, *lengths]).cumsum(0)
    cu = cu_host.to(device)
    state = pool.state[layer, slot_index].float().contiguous()  # [B, H, K, V]
    args = dict(
        q=q.view(1, -1, H, K), k=k.view(1, -1, H, K), v=v.view(1, -1, H, K), g=f.view(1, -1, H, K),
        beta=beta.view(1, -1, H).float().contiguous(), A_log=attn.A_log.float(), dt_bias=attn.dt_bias.float(),
        scale=attn.scale, initial_state=state, output_final_state=True, cu_seqlens=cu,
        use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
        lower_bound=attn.gate_lower_bound,
    )
    if use_recurrent_kernel(lengths, x.dtype):
        o, final = fused_recurrent_kda_fwd(inplace_final_state=False, **args)
    else:
        # the host copy of the offsets spares fla's chunk indexing a device-to-host read per layer
        o, final = chunk_kda(safe_gate=attn.gate_lower_bound is not None, cu_seqlens_cpu=cu_host, **args)
    folded = [b for b, keep in enumerate(fold) if keep]
    if folded:
        rows = torch.tensor(folded, device=device)
        kept = torch.tensor([slots[b] for b in folded], device=device)
        pool.state[layer, kept] = final[rows].to(pool.state.dtype)
        pool.conv[layer, kept] = torch.stack([q_win, k_win, v_win], dim=1)[rows].to(pool.conv.dtype)
    o = attn.o_norm(o.view(-1, H, K).to(x.dtype), gate.reshape(-1, H, K))
    return attn.o_proj(o.reshape(x.shape[0], -1))


def kda_step(attn: KimiDeltaAttention, layer: int, x: torch.Tensor, seq_starts: tuple[int, ...],
             slots: tuple[int, ...], verify: tuple[bool, ...], pool: RecurrentStatePool) -> torch.Tensor:
    """One KDA layer for a step's batch (see the module docstring); `slots` are the host's slot ids."""
    pending = [pool.prefix_len[s] for s in slots]
    with_prefix = [b for b, n in enumerate(pending) if n]
    if with_prefix:  # fold each accepted pending prefix into its checkpoint
        rows = torch.cat([pool.prefix_x[layer, slots[b], : pending[b]] for b in with_prefix])
        run_rows(attn, layer, rows, [pending[b] for b in with_prefix], tuple(slots[b] for b in with_prefix), pool,
                 [True] * len(with_prefix))
    lengths = [seq_starts[b + 1] - seq_starts[b] for b in range(len(slots))]
    fold = [not (verify and verify[b]) for b in range(len(slots))]
    y = run_rows(attn, layer, x, lengths, slots, pool, fold)
    for b, folded in enumerate(fold):
        if not folded:  # a verify block: its inputs wait as the next pending prefix
            pool.prefix_x[layer, slots[b], : lengths[b]] = x[seq_starts[b] : seq_starts[b + 1]]
    return y
