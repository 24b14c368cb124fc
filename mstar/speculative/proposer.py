"""The DSpark draft as the engine runs it: a paged context cache per draft layer, and proposals.

The draft's context rows (one [c_kv | k_pe] row per draft layer and position) are computed from the
target's taps and written when the step that ran those positions launches: every prefill row, and
every row of a verify block, before its verification (`write_context` says why the rows it then
rejects are never read). The draft KV pool is admitted, committed and released with the same step
declarations as the target's KV, so both always cover the same positions.

The draft has no embedding or lm_head of its own: it borrows the target's (`VocabHeads`). On one
rank those are the target's modules. On tensor-parallel ranks the target's are vocabulary slices
whose forward is a collective, which rank 0 cannot run alone while it drafts; there rank 0 holds
full-vocabulary copies for the draft (mstar/distributed/worker.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from mstar.engine.params import SamplingParams
from mstar.models.dspark import paged
from mstar.models.dspark.model import (
    BlockBatch,
    DraftProposal,
    DraftSampling,
    Embed,
    K3DSparkModel,
    LMHead,
)
from mstar.models.kimi_k3.model import KimiK3ForCausalLM
from mstar.resources.latent_kv import LatentKVPlan, PagedLatentKV
from mstar.resources.step import StepDecl
from mstar.resources.transfer import to_device, to_device_lists
from mstar.speculative.context_graphs import ContextGraphs
from mstar.speculative.draft_graphs import DraftGraphs
from mstar.speculative.schedule import DraftSchedule


@dataclass(frozen=True)
class VocabHeads:
    """The full-vocabulary embedding and lm_head the draft borrows from its target."""

    embed: Embed  # token ids [k] -> [k, D]
    lm_head: LMHead  # hidden [k, D] -> logits [k, V]

    @classmethod
    def of_target(cls, target: KimiK3ForCausalLM) -> VocabHeads:
        """The target's own modules, which are whole only on a single rank."""
        if target.comm.world_size > 1:
            raise ValueError(
                f"the target is rank {target.comm.rank} of {target.comm.world_size}: its embedding and lm_head hold "
                "a slice of the vocabulary and run collectives, so the draft cannot borrow them; pass full-vocabulary "
                "VocabHeads (SpeculativeModels.heads; mstar.distributed.worker.start_ranks loads them on rank 0)"
            )
        return cls(target.model.embed_tokens, target.lm_head)


class PagedContext(Sequence[torch.Tensor]):
    """Per draft layer, the context rows of B requests, [B, length, width], gathered from their pages when
    that layer is read. The draft reads its layers one after another, so one layer's copy is alive at a
    time, not all of them (B x length x width x layers elements at once).

    Rows at or past a request's own length (its page table's 0-padding, or its last page's tail) are
    zeroed: the draft's mask hides them, but a reused page may still hold a finished request's rows,
    NaN ones included, and a hidden row still enters the attention's value sum with weight 0."""

    def __init__(self, kv: PagedLatentKV, page_table: torch.Tensor, lengths: torch.Tensor, context_len: int):
        self.kv = kv
        self.page_table = page_table[:, : -(-context_len // kv.page_size)]  # the pages holding context_len rows
        self.context_len = context_len
        self.hidden = (torch.arange(context_len, device=lengths.device) >= lengths[:, None])[..., None]

    def __len__(self) -> int:
        return self.kv.cache.shape[0]

    def __getitem__(self, layer: int) -> torch.Tensor:
        if not 0 <= layer < len(self):
            raise IndexError(f"draft layer {layer} of {len(self)}")
        rows = self.kv.cache[layer, self.page_table].flatten(1, 2)[:, : self.context_len]
        return rows.masked_fill(self.hidden, 0)


class DSparkProposer:
    def __init__(self, draft: K3DSparkModel, target: KimiK3ForCausalLM, *, num_pages: int, page_size: int,
                 heads: VocabHeads | None = None):
        cfg = draft.config
        draft.config.check_matches_target(target.config.hidden_size, target.config.num_hidden_layers,
                                          target.config.vocab_size)
        param = next(target.parameters())
        self.draft = draft
        self.config = cfg
        self.tap_layers = tuple(cfg.target_layer_ids)
        self.kv = PagedLatentKV(cfg.num_hidden_layers, num_pages, page_size, cfg.kv_lora_rank + cfg.qk_rope_head_dim,
                                param.dtype, param.device)
        self.heads = heads or VocabHeads.of_target(target)
        # Blocks attend through the paged MLA kernel over the draft KV (models/dspark/paged.py) where it runs;
        # elsewhere (CPU, fp32) through the reference's gathered context. Tests may set it.
        self.paged = paged.kernel_fits(draft, param.device)
        self.graphs: dict[int, DraftGraphs] = {}  # captured greedy steps by draft count (capture_graphs)
        self.context_graphs: ContextGraphs | None = None  # captured context writes of verify steps (capture_graphs)
        self._countdown: torch.Tensor | None = None  # N, N - 1, .., 1 (`_behind`)

    # --- the resource protocol: the draft KV pool follows the target's steps ------------------
    def can_admit(self, decl: StepDecl) -> bool:
        return self.kv.can_admit(decl)

    def admit(self, decl: StepDecl) -> None:
        self.kv.admit(decl)

    def commit(self, decl: StepDecl) -> None:
        self.kv.commit(decl)

    def release(self, request_id: str) -> None:
        self.kv.release(request_id)

    # --- proposals ----------------------------------------------------------------------------
    @torch.no_grad()
    def propose(self, decl: StepDecl, plan: LatentKVPlan, rows: Sequence[int], anchors: torch.Tensor,
                starts: torch.Tensor, params: Sequence[SamplingParams],
                generators: Sequence[torch.Generator | None]) -> list[DraftProposal]:
        """Drafts for the step's rows `rows` in one draft forward: row b drafts num_drafts tokens after its
        anchor (anchors[i], on the device: it may be a token the step in flight samples) at position starts[i]
        (on the device: the step in flight may decide it), over its starts[i] context rows, drawn as its
        request samples (greedy when `SamplingParams.greedy`) with params[i] and generators[i]."""
        seqs = [decl.seqs[b] for b in rows]
        for s in seqs:  # each anchor needs the rows of every position before it written to the draft KV
            if not s.lag and s.token_ids[0] >= 0:  # else anchor and position exist on the device only
                self.draft.check_block(s.token_ids[0], s.num_computed, s.num_drafts,
                                       self.kv.lengths.get(s.request_id, 0))
        device = self.kv.cache.device
        num_drafts = tuple(s.num_drafts for s in seqs)
        k_max = max(num_drafts)
        whole = decl.block_drafts is not None  # equal blocks, all drafting
        if whole:  # every sequence's page table row, and its block's rows but the last: views, no gathers
            table = plan.page_table
        else:
            rows_t, slot_rows = to_device_lists([list(rows), self._block_rows(decl, rows, k_max) if self.paged
                                                 else []], torch.long, device)
            table = plan.page_table[rows_t]
        sampling = [
            DraftSampling(0.0 if p.greedy else p.temperature, p.top_k or None, p.top_p if p.top_p < 1 else None,
                          p.min_p or None, g)
            for p, g in zip(params, generators, strict=True)
        ]
        if self.paged:
            # [B, k_max] the draft KV slots of each block's rows; entries past a block's k are padding (sunk later)
            row_slots = (plan.slot_mapping.view(len(rows), k_max + 1)[:, :k_max] if whole
                         else plan.slot_mapping[slot_rows].view(len(rows), k_max))
            graphs = self.graphs.get(num_drafts[0])
            if graphs is not None and graphs.can_run(num_drafts, sampling):
                return graphs.run(anchors, starts, table, row_slots)
            anchors = anchors.contiguous()  # the kernels index it as a flat [B]
            blocks = paged.PagedBlocks.build(anchors, starts, num_drafts, table, row_slots, self.kv.page_size)
            hidden = paged.paged_blocks_hidden(self.draft, self.kv.cache, blocks, self.heads.embed)
            return self.draft.propose_from_hidden(hidden, anchors, num_drafts, self.heads.lm_head, sampling,
                                                  paged.kernel_chain(self.draft))
        context_len = max(s.num_computed + s.lag for s in seqs)
        blocks = BlockBatch(anchors=anchors, starts=starts, num_drafts=num_drafts,
                            context=PagedContext(self.kv, table, starts, context_len), context_len=context_len)
        return self.draft.propose_blocks(blocks, self.heads.embed, self.heads.lm_head, sampling)

    def capture_graphs(self, schedule: DraftSchedule, buckets: tuple[int, ...], max_seq_len: int) -> None:
        """Capture the greedy draft step for every batch bucket in `buckets` and draft count the schedule gives a
        batch that runs in it (speculative/draft_graphs.py), all in one memory pool. Only the paged path can be
        captured."""
        if not self.paged:
            raise RuntimeError("the draft's steps can be captured only on the paged kernel path (a CUDA GPU the MLA "
                               "kernel supports, a bf16/fp16 draft)")
        by_drafts: dict[int, set[int]] = {}
        for n in range(1, max(buckets) + 1):
            k = schedule.drafts_for(n)
            if k:
                by_drafts.setdefault(k, set()).add(next(b for b in buckets if b >= n))
        pool = torch.cuda.graph_pool_handle()
        for k, sizes in sorted(by_drafts.items()):
            self.graphs[k] = DraftGraphs(self.draft, self.heads.embed, self.heads.lm_head, self.kv.cache, drafts=k,
                                         buckets=tuple(sizes), max_seq_len=max_seq_len)
            self.graphs[k].capture(pool)
        if by_drafts:  # a verify step of B blocks of k drafts writes B * (k + 1) context rows
            rows = tuple(b * (k + 1) for k, sizes in by_drafts.items() for b in sizes)
            self.context_graphs = ContextGraphs(self._write_rows, buckets=rows, dtype=self.draft.dtype,
                                                tap_width=self.config.context_input_size,
                                                page_size=self.kv.page_size, device=self.kv.cache.device)
            self.context_graphs.capture(pool)

    @staticmethod
    def _block_rows(decl: StepDecl, rows: Sequence[int], k_max: int) -> list[int]:
        """The step rows of each block's rows (positions p .. p + k - 1: the step's anchor and draft rows, which the
        step admitted), k_max per block: a block of fewer drafts repeats its last."""
        first = decl.seq_starts
        return [first[b] + min(j, decl.seqs[b].num_drafts - 1) for b in rows for j in range(k_max)]

    @torch.no_grad()
    def write_context(self, decl: StepDecl, plan: LatentKVPlan, taps: torch.Tensor) -> None:
        """Write the draft context rows of every row of the step (from the target's taps [N, ...]), at the
        positions `plan` gives them (on the device: a verify step in flight may shift them), when it launches;
        by replay where a captured write takes the step's rows (`capture_graphs`).

        A verify block's rows are all written, before verification: the rows it rejects sit at positions from
        the next anchor's on, which the next block writes (its own rows, models/dspark/paged.py) or hides (the
        gathered context) before anything reads them, and the step after writes them again."""
        if decl.rows_each:  # [B, r] rows: each row r - j before its sequence's end, for j < r
            positions = (plan.context_lens[:, None] - self._behind(decl.rows_each, taps.device)).flatten()
        else:
            counts = [s.num_tokens for s in decl.seqs]
            # each row's sequence, then its rows to the block's end: one upload
            seq_of_row = [b for b, n in enumerate(counts) for _ in range(n)]
            index = to_device(seq_of_row + [n - j for n in counts for j in range(n)], torch.long, taps.device)
            row_seq, behind = index.view(2, -1)
            positions = plan.context_lens[row_seq] - behind
        if self.context_graphs is None or not self.context_graphs.run(taps, positions, plan.slot_mapping):
            self._write_rows(taps, positions, plan.slot_mapping)

    def _behind(self, rows: int, device: torch.device) -> torch.Tensor:
        """[rows] = rows, rows - 1, .., 1 on `device`: the tail of one countdown, made again only when a step has
        more rows than any before (a launch fewer in every step)."""
        if self._countdown is None or self._countdown.numel() < rows:
            self._countdown = torch.arange(max(rows, 64), 0, -1, device=device)
        return self._countdown[-rows:]

    def _write_rows(self, taps: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> None:
        rows_of = paged.paged_context_kv if self.paged else K3DSparkModel.context_kv
        for layer, rows in enumerate(rows_of(self.draft, taps, positions)):
            self.kv.write(layer, slots, rows)

