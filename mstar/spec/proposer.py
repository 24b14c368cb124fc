"""The DSpark draft as the engine runs it: a paged context cache per draft layer, and proposals.

The draft's context rows (one [c_kv | k_pe] row per draft layer and position) are computed from the
target's taps and written once, when the target has run that position and verification kept it:
every prefill row, and the anchor plus accepted drafts of each verify block. Rejected rows are
never written. The draft KV pool is admitted, committed and released with the same step
declarations as the target's KV, so both always cover the same positions.

The draft has no embedding or lm_head of its own: it borrows the target's (`VocabHeads`). On one
rank those are the target's modules. On tensor-parallel ranks the target's are vocabulary slices
whose forward is a collective, which rank 0 cannot run alone while it drafts; there rank 0 holds
full-vocabulary copies for the draft (mstar/distributed/worker.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mstar.engine.params import SamplingParams
from mstar.engine.step import StepDecl
from mstar.models.dspark.model import DraftCache, DraftProposal, Embed, K3DSparkModel, LMHead
from mstar.models.kimi_k3.model import KimiK3ForCausalLM
from mstar.resources.latent_kv import LatentKVPlan, PagedLatentKV


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
                "VocabHeads (SpeculativeConfig.heads; mstar.distributed.worker.start_ranks loads them on rank 0)"
            )
        return cls(target.model.embed_tokens, target.lm_head)


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
    def context(self, plan: LatentKVPlan, b: int, length: int) -> DraftCache:
        """Row b's first `length` context rows of every draft layer, gathered from its pages."""
        rows = [self.kv.rows(layer, plan.page_table[b], length) for layer in range(self.config.num_hidden_layers)]
        return DraftCache(rows)

    @torch.no_grad()
    def propose(self, context: DraftCache, anchor: int, anchor_pos: int, num_drafts: int, params: SamplingParams,
                generator: torch.Generator | None) -> DraftProposal:
        """Draft `num_drafts` tokens after `anchor`, drawn as the request samples (greedy at T=0)."""
        return self.draft.propose(
            context, anchor, anchor_pos, num_drafts, self.heads.embed, self.heads.lm_head,
            temperature=params.temperature,
            top_k=params.top_k or None,
            top_p=params.top_p if params.top_p < 1 else None,
            generator=generator,
        )

    @torch.no_grad()
    def write_context(self, decl: StepDecl, plan: LatentKVPlan, taps: torch.Tensor,
                      seq_starts: tuple[int, ...]) -> None:
        """Write the draft context rows of every committed row of the step (from the target's taps)."""
        slot_offset = 0
        for b, s in enumerate(decl.seqs):
            keep = s.committed
            if keep:
                rows = slice(seq_starts[b], seq_starts[b] + keep)
                positions = torch.arange(s.num_computed, s.num_computed + keep, device=taps.device)
                per_layer = self.draft.context_kv(taps[rows], positions)
                slots = plan.slot_mapping[slot_offset : slot_offset + keep]
                for layer, layer_rows in enumerate(per_layer):
                    self.kv.write(layer, slots, layer_rows)
            slot_offset += s.num_tokens
