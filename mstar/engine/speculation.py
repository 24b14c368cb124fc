"""DSpark speculative decoding inside the engine step.

Before the target runs, the drafts of every verify row are proposed together (one draft forward)
from the draft's context cache and each row's anchor (the last emitted token). The target then
runs [anchor, d_1..d_k] for every verify row; `verify` keeps the drafts the target agrees with
(greedy, or lossless rejection sampling) and adds the correction or bonus token, all on the device.
The draft's context gets rows for every row of the block (written from the target's taps at launch;
those verification rejects are overwritten before they are read). Commit keeps only the anchor and
accepted rows: the target KV is trimmed by length, the KDA block stays a pending prefix of that
length. With async scheduling the next step is planned before the host knows how many were kept
(engine/core.py): its positions and pending prefixes then shift on the device (`BatchPlan.advance`).
"""

from __future__ import annotations

import torch

from mstar.engine.request import Request
from mstar.engine.sampler import SamplingBatch
from mstar.models.dspark.model import DraftProposal
from mstar.resources.latent_kv import LatentKVPlan
from mstar.resources.step import SeqStep, StepDecl
from mstar.resources.transfer import to_device, to_device_lists
from mstar.speculative.proposer import DSparkProposer
from mstar.speculative.schedule import DraftSchedule
from mstar.speculative.verify import VerifyResult, verify, verify_greedy


class Speculation:
    def __init__(self, proposer: DSparkProposer, schedule: DraftSchedule, method: str = "block"):
        self.proposer = proposer
        self.schedule = schedule
        self.method = method
        self.tap_layers = proposer.tap_layers
        self.generator = torch.Generator(device=proposer.kv.cache.device)
        self.draft_plan: LatentKVPlan | None = None
        self.num_rows = 0
        self.num_drafted = 0
        self.num_accepted = 0
        k = schedule.max_drafts
        self.drafted_by_position = [0] * k
        self.accepted_by_position = [0] * k

    def propose(self, decl: StepDecl, requests: dict[str, Request], input_ids: torch.Tensor,
                advance: torch.Tensor | None) -> dict[int, DraftProposal]:
        """Drafts for every verify row of the step, keyed by row index in `decl`: one draft forward for
        all of them (per-request forwards would cost ~100 small kernel launches each). `input_ids` [N] are the
        step's planned input ids (each anchor at its sequence's first row; on the device, where a token
        still in flight was gathered), `advance` the plan's (`BatchPlan.advance`)."""
        self.draft_plan = self.proposer.kv.plan(decl, advance)
        rows = [b for b, s in enumerate(decl.seqs) if s.verify and s.num_drafts]
        if not rows:
            return {}
        device = input_ids.device
        if decl.block_drafts:  # equal blocks, all drafting: views, no gathers
            starts = to_device([s.num_computed for s in decl.seqs], torch.long, device)
            anchors = input_ids.view(len(rows), decl.rows_each)[:, 0]
        else:
            first = decl.seq_starts
            anchor_rows, starts, rows_t = to_device_lists(
                [[first[b] for b in rows], [decl.seqs[b].num_computed for b in rows], rows], torch.long, device)
            anchors = input_ids[anchor_rows]
            advance = None if advance is None else advance[rows_t]
        if advance is not None:
            starts = starts + advance
        drafting = [requests[decl.seqs[b].request_id] for b in rows]
        proposals = self.proposer.propose(decl, self.draft_plan, rows, anchors, starts, [r.params for r in drafting],
                                          [r.generator for r in drafting])
        return dict(zip(rows, proposals, strict=True))

    def verify(self, seqs: list[SeqStep], requests: list[Request], logits: torch.Tensor, firsts: list[int],
               drafts: list[DraftProposal | None]) -> VerifyResult:
        """Verify each row's block: its 1 + num_drafts target logits rows start at `firsts[i]` of `logits`
        [rows, V]. The result stays on the device (the engine fetches it with the step's other results);
        `record` counts what the host then accepts. Equal blocks that are all the logits rows (a verify
        graph's step) are read in place, and greedy blocks need no draft distributions (nor fp32 logits: the
        greedy kernels read them as they are)."""
        width = max(s.num_drafts for s in seqs)
        vocab, device = logits.shape[-1], logits.device
        greedy = all(r.params.greedy for r in requests)
        equal = all(s.num_drafts == width for s in seqs)
        if equal and logits.shape[0] == len(seqs) * (width + 1) and firsts == list(range(0, logits.shape[0],
                                                                                           width + 1)):
            blocks = logits.view(len(seqs), width + 1, vocab)
            blocks = blocks if greedy else blocks.float()
        else:
            blocks = torch.zeros(len(seqs), width + 1, vocab, dtype=torch.float32, device=device)
            for i, (s, first) in enumerate(zip(seqs, firsts, strict=True)):
                blocks[i, : s.num_drafts + 1] = logits[first : first + s.num_drafts + 1]
        if equal and width and all(d is not None for d in drafts):
            tokens = drafts[0].tokens[None] if len(drafts) == 1 else torch.stack([d.tokens for d in drafts])
        else:
            tokens = torch.zeros(len(seqs), width, dtype=torch.long, device=device)
            for i, (s, d) in enumerate(zip(seqs, drafts, strict=True)):
                if d is not None:
                    tokens[i, : s.num_drafts] = d.tokens
        num_drafts = None if equal else to_device([s.num_drafts for s in seqs], torch.long, device)
        if greedy:  # the greedy rule reads no sampling parameters and no draft distributions
            return verify_greedy(blocks, tokens, num_drafts)
        batch = SamplingBatch.build([r.params for r in requests], [r.generator for r in requests], device)
        probs = None
        if not batch.all_greedy:
            probs = torch.zeros(len(seqs), width, vocab, dtype=torch.float32, device=device)
            for i, (s, d) in enumerate(zip(seqs, drafts, strict=True)):
                if d is not None:
                    probs[i, : s.num_drafts] = d.probs.float()
        return verify(blocks, tokens, probs, batch, self.method, num_drafts, self.generator)

    def record(self, drafted: int, accepted: int) -> None:
        """Count one verified row: `accepted` of its `drafted` drafts were kept."""
        self.num_rows += 1
        self.num_drafted += drafted
        self.num_accepted += accepted
        for i in range(drafted):
            self.drafted_by_position[i] += 1
            self.accepted_by_position[i] += i < accepted

    def write_context(self, decl: StepDecl, taps: torch.Tensor) -> None:
        """The draft context rows of every row of the step just launched (proposer.write_context)."""
        self.proposer.write_context(decl, self.draft_plan, taps)
