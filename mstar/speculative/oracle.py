"""A test and benchmark stand-in for the draft: it proposes the target's own greedy continuation,
each draft position wrong with probability `error_rate` (a wrong token ends acceptance there).

With error rate e a verify row of k drafts accepts min(k, first error) drafts, so every accepted
length 0..k occurs and the engine's accept/trim/pending-prefix paths are exercised at a chosen
acceptance rate. A block's errors are drawn from a generator seeded by (seed, request, position, length),
not from one stream: two engines that draft the same block draw the same errors whatever else they
drafted before (an overlapped engine drafts blocks for requests that turn out to have stopped). It
needs each request's full greedy sequence (`references`), computed beforehand with the reference model.
The draft KV pool still runs as in real serving.
"""

from __future__ import annotations

import random

import torch

from mstar.engine.speculation import Speculation
from mstar.models.dspark.model import DraftProposal
from mstar.resources.step import StepDecl


class OracleSpeculation(Speculation):
    def __init__(self, base: Speculation, references: dict[str, list[int]], error_rate: float,
                 seed: int = 0):
        super().__init__(base.proposer, base.schedule, base.method)
        self.references = references
        self.error_rate = error_rate
        self.seed = seed

    def propose(self, decl: StepDecl, requests, input_ids: torch.Tensor,
                advance: torch.Tensor | None) -> dict[int, DraftProposal]:
        """As `Speculation.propose`; the anchors' positions are read to the host (a sync, where a step in
        flight shifts them: this stand-in needs them to look its truth up)."""
        self.draft_plan = self.proposer.kv.plan(decl, advance)
        vocab = self.proposer.config.vocab_size
        shift = advance.tolist() if advance is not None else [0] * len(decl.seqs)
        drafts = {}
        for b, s in enumerate(decl.seqs):
            if not (s.verify and s.num_drafts):
                continue
            start = s.num_computed + shift[b]
            truth = self.references[s.request_id][start + 1 : start + 1 + s.num_drafts]
            truth += [0] * (s.num_drafts - len(truth))  # past max_tokens (blocks are not cut): dropped anyway
            rng = random.Random(f"{self.seed}/{s.request_id}/{start}/{s.num_drafts}")
            tokens = torch.tensor([t if rng.random() >= self.error_rate else (t + 1) % vocab for t in truth])
            probs = torch.nn.functional.one_hot(tokens, vocab).float()
            drafts[b] = DraftProposal(tokens=tokens, probs=probs)
        return drafts
