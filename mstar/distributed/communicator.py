"""The collective interface the model calls, and the null communicator of a single rank.

The model never touches torch.distributed: where a row-parallel output joins the replicated residual
stream it calls `all_reduce` (a sum over ranks), and the vocabulary-parallel lm_head calls
`all_gather`. One subclass per implementation lives beside this file (gloo, NCCL, torch symmetric
memory); `comm_choice.choose_communicator` is the one place that picks among them.

Contract of every implementation:
- `all_reduce(x)` returns the elementwise sum of `x` over the ranks of the group. It may reduce in
  place, so the caller must not use `x` afterwards. Every rank receives the same bits (ring, tree and
  symmetric-memory algorithms all reduce each element in one place and copy it out), which is what
  keeps routing and every other data-dependent decision identical on all ranks.
- `all_reduce_rounded(x, dtype)` is `all_reduce(x.to(dtype))`: the sum of each rank's x rounded to `dtype`
  first (a reference that rounds its partial sums before reducing them). An implementation that copies its
  message anyway (symmetric memory stages it into its buffer) rounds in that copy instead of a kernel of its own.
- `all_gather(x)` returns the ranks' tensors concatenated along the last dim, in rank order.
- `reduce_scatter_rounded(x, dtype)` returns this rank's piece of `all_reduce_rounded(x, dtype)`: the last dim
  cut into world_size equal runs of columns, run `rank`. Half an all-reduce's link traffic where the
  implementation has a real reduce-scatter (NCCL); the others reduce everything and keep their piece.
- `reduce_scatter_rows(x)` / `all_gather_rows(x)`: the same along the first dim (rows, `piece_rows`): the pair
  that replaces an all-reduce where the rows between them are worked on a rank's share at a time (sequence
  parallelism, models/kimi_k3/sequence_parallel.py). Fallbacks through `all_reduce` and `all_gather` here.
- Every rank calls the same collectives in the same order (lockstep); nothing here checks that.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch


class Communicator(ABC):
    """Collectives over the ranks that hold one model (the tensor-parallel group)."""

    name: str = "abstract"
    # Whether its collectives can be recorded into a CUDA graph (decode graphs need every one to be).
    graph_capturable: bool = False

    def __init__(self, rank: int, world_size: int):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside 0..{world_size - 1}")
        self.rank = rank
        self.world_size = world_size

    @abstractmethod
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of `x` over all ranks (may reuse `x`'s memory)."""

    def all_reduce_rounded(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """`all_reduce(x.to(dtype))` (the module doc's contract)."""
        return self.all_reduce(x.to(dtype))

    @abstractmethod
    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """The ranks' `x` concatenated along the last dim in rank order: [..., world_size * n]."""

    def reduce_scatter_rounded(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """This rank's columns of `all_reduce_rounded(x, dtype)` (the module doc's contract): [..., n / world_size]."""
        return self.piece(self.all_reduce_rounded(x, dtype))

    def reduce_scatter_rows(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's rows of `all_reduce(x)`: [n / world_size, ...] (the module doc's contract)."""
        return self.piece_rows(self.all_reduce(x))

    def all_gather_rows(self, x: torch.Tensor) -> torch.Tensor:
        """The ranks' x [n, D] stacked along the first dim in rank order: [world_size * n, D]."""
        if x.dim() != 2:
            raise ValueError(f"all_gather_rows takes [rows, columns], got shape {tuple(x.shape)}")
        gathered = self.all_gather(x).view(x.shape[0], self.world_size, x.shape[1])
        return gathered.transpose(0, 1).reshape(self.world_size * x.shape[0], x.shape[1])

    def piece_rows(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's run of x's rows, cut into world_size equal runs."""
        if x.shape[0] % self.world_size:
            raise ValueError(f"rows are cut over {self.world_size} ranks in equal runs; {x.shape[0]} do not divide")
        n = x.shape[0] // self.world_size
        return x[self.rank * n: (self.rank + 1) * n]

    def piece(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's run of x's last dim, cut into world_size equal runs."""
        width = x.shape[-1]
        if width % self.world_size:
            raise ValueError(f"a reduce-scatter over {self.world_size} ranks cuts the last dim into equal runs; "
                             f"{width} columns do not divide")
        n = width // self.world_size
        return x[..., self.rank * n: (self.rank + 1) * n]

    def __repr__(self) -> str:
        return f"{type(self).__name__}(rank={self.rank}, world_size={self.world_size})"


class NullCommunicator(Communicator):
    """No other ranks: the single-rank model, and one rank's shard emulated alone on one device.

    With world_size 1 (the default) both collectives are the identity, so a model built with it is
    exactly the single-rank reference. With world_size > 1 it stands in for the missing ranks
    without moving data: `all_reduce` returns the local partial sum and `all_gather` repeats the
    local piece, so a rank's shapes, weights and kernels run at their true size (benchmarks of one
    TP8 rank on one GPU) while the numbers are not the model's.
    """

    name = "null"
    graph_capturable = True

    def __init__(self, world_size: int = 1, rank: int = 0):
        super().__init__(rank, world_size)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        if self.world_size == 1:
            return x
        return torch.cat([x] * self.world_size, dim=-1)
