"""A test and benchmark stand-in for the draft: it proposes the target's own greedy continuation,
each draft position wrong with probability `error_rate` (a wrong token ends acceptance there).

With error rate e a verify row of k drafts accepts min(k, first error) drafts, so every accepted
length 0..k occurs and the engine's accept/trim/pending-prefix paths are exercised at a chosen
acceptance rate. It needs each request's full greedy sequence (`references`), computed beforehand
with the reference model. The draft KV pool still runs as in real serving.
"""

from __future__ import annotations

import random

import torch

from mstar.engine.speculation import Speculation
from mstar.models.dspark.model import DraftProposal
from mstar.resources.step import StepDecl


class OracleSpeculation(Speculation):
    def __init__(self, base: Speculation, references: dict[str, list[int]], error_rate: float,
                 rng: random.Random | None = None):
        super().__init__(base.proposer, base.schedule, base.method)
        self.references = references
        self.error_rate = error_rate
        self.rng = rng or random.Random()

    def propose(self, decl: StepDecl, requests) -> dict[int, DraftProposal]:
        self.draft_plan = self.proposer.kv.plan(decl)
        vocab = self.proposer.config.vocab_size
        drafts = {}
        for b, s in enumerate(decl.seqs):
            if not (s.verify and s.num_drafts):
                continue
            truth = self.references[s.request_id][s.num_computed + 1 : s.num_computed + 1 + s.num_drafts]
            tokens = torch.tensor([t if self.rng.random() >= self.error_rate else (t + 1) % vocab for t in truth])
            probs = torch.nn.functional.one_hot(tokens, vocab).float()
            drafts[b] = DraftProposal(tokens=tokens, probs=probs)
        return drafts
