"""CUDA graphs of prefill steps, by token-count bucket.

Eagerly, one TP8 rank of K3 takes 705 ms to prefill 1,024 tokens against a FLOP floor of 48 ms: the
host cannot launch its kernels fast enough, and fla's `chunk_kda` alone spends about 1.8 ms of host
time per call (69 KDA layers). Captured, `chunk_kda(use_graph=True)` replays in 132 µs at 1,024 tokens.

A prefill step here is up to `max_seqs` sequences (model_runner.py `prefill_graph_seqs`) of any lengths
(prompt chunks, a chunked prompt's continuation over its cached pages, single rows of running requests
in a mixed step), none a verify block and none with a pending KDA prefix, T tokens in all. It replays
the graph of the smallest bucket >= T (`prefill_buckets`). What it reads is staged into the fixed
buffers of `StepGraphs` (cuda_graphs.py) and a `kda_fla.PrefillLayout`: its row offsets, padded to a
fixed count, and each row's sequence, both made on the device from the offsets. The rows past T are
one padding sequence on the sinks, which attends to no cached row (context 0: its rows come out zero,
at no cost), and the sequences after it are empty. The logits are computed for `max_seqs` rows: the
step's logits rows (the last row of each sequence that samples, and the prompt rows of a request scoring
its prompt, engine/core.py), then row 0 as padding; a step with more logits rows runs eagerly.
"""

from __future__ import annotations

import torch

from mstar.models.kimi_k3.gpu_ops import GpuMixerOps
from mstar.models.kimi_k3.serving import BatchPlan, ServingModel, StagedLayout, StepKind
from mstar.resources.transfer import to_device
from mstar.runner.cuda_graphs import StepGraphs

MAX_PREFILL_TOKENS = 8192  # the largest bucket: larger steps run eagerly, their launches amortized over the rows
SMALLEST_PREFILL_BUCKET = 256


def prefill_buckets(max_tokens: int, smallest: int = SMALLEST_PREFILL_BUCKET) -> tuple[int, ...]:
    """Token counts captured for steps of up to `max_tokens` (the scheduler's budget, capped at
    MAX_PREFILL_TOKENS): powers of two from `smallest`, then the cap itself. A step pads to at most twice
    its tokens; a padding row costs what a real one does in the GEMMs and experts, the smallest bucket
    costs little more than the launches it replaces."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens={max_tokens}: need at least 1")
    top = min(max_tokens, MAX_PREFILL_TOKENS)
    sizes, size = {top}, smallest
    while size < top:
        sizes.add(size)
        size *= 2
    return tuple(sorted(sizes))


class PrefillGraphs(StepGraphs):
    """Captured prefill steps (module doc) for the token counts in `buckets` (default `prefill_buckets`)."""

    kind = "prefill"
    unit = "tokens"
    pad_context = 0  # the padding sequence and the empty ones attend to nothing

    def __init__(self, serving: ServingModel, *, max_tokens: int, max_seqs: int, max_seq_len: int,
                 tap_layers: tuple[int, ...] = (), buckets: tuple[int, ...] | None = None):
        if max_seqs < 1:
            raise ValueError(f"max_seqs={max_seqs}: a prefill step holds at least one sequence")
        self.max_seqs = max_seqs  # before the buckets' shapes are asked for
        super().__init__(serving, buckets if buckets is not None else prefill_buckets(max_tokens),
                         max_seq_len=max_seq_len, tap_layers=tap_layers)
        # one layout for all buckets (each uses its first rows), its slots the staged kda_slots
        self.layout = GpuMixerOps.capture_prefill_layout(self.buckets[-1], self.kda_slots)

    def bucket_shape(self, bucket: int) -> tuple[int, int, int]:
        # the step's sequences, the padding one, the empty ones: max_seqs + 1 in the kernels
        return self.max_seqs + 1, bucket, self.max_seqs

    def size_of(self, plan: BatchPlan) -> int:
        return plan.input_ids.shape[0]

    def can_run(self, plan: BatchPlan) -> bool:
        """At most `max_seqs` sequences and logits rows, within the largest bucket, no
        verify block, no pending KDA prefix (its replay would need a layout of its own), and an ordinary
        plan (not one of the staged ones)."""
        batch = len(plan.seq_starts) - 1
        if not 1 <= batch <= self.max_seqs or self.bucket_for(self.size_of(plan)) is None:
            return False
        if plan.sample_rows.shape[0] > self.max_seqs or plan.kv.page_table.shape[1] > self.page_table.shape[1]:
            return False
        if any(plan.verify) or plan.kind in (StepKind.STAGED_BLOCKS, StepKind.STAGED_PREFILL):
            return False
        prefix_len = self.serving.pool.prefix_len
        return not any(prefix_len[s] for s in plan.host_slots())

    def bucket_plan(self, bucket: int) -> BatchPlan:
        seqs, rows, _ = self.bucket_shape(bucket)
        # seq_starts and num_computed describe the capture (all rows padding); a replay's lengths are those
        # staged on the device, and the kind (STAGED_PREFILL) tells the mixers not to read these
        return BatchPlan(**self._views(bucket), seq_starts=(0,) + (rows,) * seqs, num_computed=(0,) * seqs,
                         kind=StepKind.STAGED_PREFILL,
                         staged=StagedLayout(self.layout.cu_seqlens, self.layout.first_rows(rows), max_query_len=rows))

    def _stage_layout(self, bucket: int, plan: BatchPlan | None) -> None:
        starts = list(plan.seq_starts) if plan is not None else [0]
        self.layout.first_rows(bucket).stage(to_device(starts, torch.long, self.input_ids.device))
