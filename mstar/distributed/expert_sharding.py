"""`ExpertSharding`: which routed experts, and which slice of each, one rank holds. Pure bookkeeping.

The `tp_size` ranks of a model form `ep_size` expert-parallel groups of `tp_size / ep_size`
consecutive ranks. Group g owns whole experts g*E/ep .. (g+1)*E/ep - 1; inside a group the ranks
split each owned expert's intermediate dim (w1/w3 rows, w2 columns) evenly, in rank order.

    tp 8, ep 1   pure TP: every rank holds 1/8 of every expert
    tp 8, ep 8   pure EP: every rank holds 1/8 of the experts, whole
    tp 8, ep 2   hybrid: ranks 0-3 hold experts 0..E/2-1, each split 4 ways; ranks 4-7 the rest

Whatever the split, a rank's routed output is a partial sum: over the intermediate dim inside an
expert, over experts across groups. Every rank sees every token (the activations are replicated),
so there is no dispatch: one all-reduce of the partial sums serves TP, EP and hybrids alike.
Routing runs on every rank on identical inputs; a token's expert that the rank does not hold maps
to `INVALID_ID` in `local_ids` and contributes nothing there.

MXFP4 experts store one scale per 32 input columns, so w2's column split must fall on whole
groups: the per-rank width must be a multiple of 32 (`check_mxfp4`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

INVALID_ID = -1
MXFP4_GROUP = 32


@dataclass(frozen=True)
class ExpertSharding:
    num_experts: int
    intermediate_size: int  # one whole expert's intermediate width (moe_intermediate_size)
    tp_size: int = 1
    ep_size: int = 1
    rank: int = 0

    def __post_init__(self) -> None:
        if self.tp_size < 1 or self.ep_size < 1 or self.tp_size % self.ep_size:
            raise ValueError(f"ep_size={self.ep_size} must divide tp_size={self.tp_size}")
        if not 0 <= self.rank < self.tp_size:
            raise ValueError(f"rank {self.rank} is outside 0..{self.tp_size - 1}")
        if self.num_experts % self.ep_size:
            raise ValueError(f"ep_size={self.ep_size} must divide num_experts={self.num_experts}")
        if self.intermediate_size % self.group_size:
            raise ValueError(
                f"moe_intermediate_size={self.intermediate_size} must split evenly over the {self.group_size} "
                f"ranks of an expert-parallel group (tp_size={self.tp_size} / ep_size={self.ep_size})"
            )

    # --- groups ---------------------------------------------------------------------------------
    @property
    def group_size(self) -> int:
        """Ranks that share each expert (split its intermediate dim)."""
        return self.tp_size // self.ep_size

    @property
    def ep_rank(self) -> int:
        return self.rank // self.group_size

    @property
    def rank_in_group(self) -> int:
        return self.rank % self.group_size

    # --- what this rank holds -------------------------------------------------------------------
    @property
    def experts_per_group(self) -> int:
        return self.num_experts // self.ep_size

    @property
    def local_experts(self) -> range:
        """Global ids of the experts this rank holds (a slice of each)."""
        start = self.ep_rank * self.experts_per_group
        return range(start, start + self.experts_per_group)

    @property
    def local_intermediate_size(self) -> int:
        return self.intermediate_size // self.group_size

    @property
    def intermediate_range(self) -> tuple[int, int]:
        """[start, stop) of this rank's slice of each held expert's intermediate dim."""
        start = self.rank_in_group * self.local_intermediate_size
        return start, start + self.local_intermediate_size

    @property
    def is_whole(self) -> bool:
        """Every expert, whole: the single-rank layout."""
        return self.group_size == 1 and self.ep_size == 1

    def owns(self, expert: int) -> bool:
        return expert in self.local_experts

    def local_ids(self, device: torch.device | str | None = None) -> torch.Tensor:
        """[num_experts] global id -> index among the local experts, INVALID_ID where not held
        (what an align/permute kernel takes to drop the other groups' experts)."""
        ids = torch.full((self.num_experts,), INVALID_ID, dtype=torch.int32, device=device)
        held = self.local_experts
        ids[held.start : held.stop] = torch.arange(len(held), dtype=torch.int32, device=device)
        return ids

    def check_mxfp4(self, what: str = "routed experts") -> None:
        """w2's column split must keep whole 32-wide MXFP4 scale groups."""
        if self.local_intermediate_size % MXFP4_GROUP:
            raise ValueError(
                f"{what}: each rank would hold {self.local_intermediate_size} of the {self.intermediate_size} "
                f"intermediate columns of an MXFP4 expert, not a multiple of its {MXFP4_GROUP}-wide scale groups; "
                f"use fewer ranks per expert-parallel group (raise ep_size, now {self.ep_size})"
            )
