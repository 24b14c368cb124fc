"""The vocabulary-parallel embedding and lm_head: each rank holds rows [r*V/tp, (r+1)*V/tp).

Embedding: a rank looks up the ids in its range (the others give zero rows), then one all-reduce
adds the ranks' rows. Each token's row comes from exactly one rank and the rest add exact zeros, so
the result equals the whole table's lookup bit for bit.

lm_head: each rank computes the logits of its vocabulary slice; one all-gather along the vocabulary
puts the full rows on every rank (rank 0 samples from them).

Both keep the nn.Module shapes and names of the checkpoint's tensors (`weight` [V/tp, D]), so the
rank's state_dict names are the checkpoint's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .communicator import Communicator


def vocab_range(vocab_size: int, comm: Communicator) -> tuple[int, int]:
    if vocab_size % comm.world_size:
        raise ValueError(f"vocab_size={vocab_size} must split evenly over {comm.world_size} ranks")
    size = vocab_size // comm.world_size
    return comm.rank * size, (comm.rank + 1) * size


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, comm: Communicator):
        super().__init__()
        self.comm = comm
        self.vocab_start, self.vocab_stop = vocab_range(vocab_size, comm)
        self.weight = nn.Parameter(torch.empty(self.vocab_stop - self.vocab_start, hidden_size).normal_())

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = (input_ids >= self.vocab_start) & (input_ids < self.vocab_stop)
        rows = F.embedding(torch.where(local, input_ids - self.vocab_start, 0), self.weight)
        return self.comm.all_reduce(rows * local.unsqueeze(-1).to(rows.dtype))


class VocabParallelLMHead(nn.Module):
    def __init__(self, hidden_size: int, vocab_size: int, comm: Communicator):
        super().__init__()
        self.comm = comm
        self.vocab_start, self.vocab_stop = vocab_range(vocab_size, comm)
        self.weight = nn.Parameter(torch.empty(self.vocab_stop - self.vocab_start, hidden_size))
        nn.init.normal_(self.weight, std=hidden_size**-0.5)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.comm.all_gather(F.linear(hidden, self.weight))
