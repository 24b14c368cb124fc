"""`RecurrentStatePool`: each running request's KDA state in fixed slots, one per request.

Per KDA layer and slot: the recurrent state [H, K, V] (key-first, as `KDAState.recurrent`; at least
fp32) and the short-conv window [3, W-1, width] (the last W-1 pre-conv q, k, v rows, oldest first).
Slot 0 is never handed out: padding rows of captured batches point there.
A slot is zeroed when it is handed to a request, so a new sequence starts from the zero state.

Speculative decoding never rolls the state back. A verify step runs its block of rows from the
slot's state but does not fold them in: the state stays a *checkpoint*, the block's layer inputs
are kept as a *pending prefix*, and commit records how many of its rows verification accepted.
The next step first replays that accepted prefix from the checkpoint, then runs its own rows.
The cost is replaying at most k+1 rows per step; there are no per-token snapshots and no copies.
"""

from __future__ import annotations

import torch

from mstar.resources.step import StepDecl
from mstar.resources.transfer import to_device


class RecurrentStatePool:
    def __init__(self, num_layers: int, max_slots: int, num_heads: int, head_dim: int, conv_kernel: int,
                 state_dtype: torch.dtype, conv_dtype: torch.dtype, device: torch.device | str = "cpu",
                 *, hidden_size: int = 0, max_block: int = 0):
        if max_slots < 2:
            raise ValueError(f"max_slots={max_slots}: need at least 2 (slot 0 is the padding sink)")
        width = num_heads * head_dim
        self.max_slots = max_slots
        self.state = torch.zeros(num_layers, max_slots, num_heads, head_dim, head_dim, dtype=state_dtype,
                                 device=device)
        self.conv = torch.zeros(num_layers, max_slots, 3, conv_kernel - 1, width, dtype=conv_dtype, device=device)
        # Pending prefix per layer and slot: the layer inputs of the last verify block (max_block rows).
        self.prefix_x = torch.zeros(num_layers, max_slots, max_block, hidden_size, dtype=conv_dtype, device=device)
        self.prefix_len = [0] * max_slots
        self.slots: dict[str, int] = {}
        self._free = list(range(max_slots - 1, 0, -1))

    @property
    def capacity(self) -> int:
        return self.max_slots - 1

    @property
    def num_used(self) -> int:
        return len(self.slots)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def bytes_per_slot(self) -> int:
        """Memory one request's KDA state takes over all layers (state + conv window)."""
        state, conv = self.state[:, 0], self.conv[:, 0]
        return state.numel() * state.element_size() + conv.numel() * conv.element_size()

    def _new(self, decl: StepDecl) -> list[str]:
        return [s.request_id for s in decl.seqs if s.request_id not in self.slots]

    def can_admit(self, decl: StepDecl) -> bool:
        return len(self._new(decl)) <= len(self._free)

    def admit(self, decl: StepDecl) -> None:
        for request_id in self._new(decl):
            slot = self._free.pop()
            self.state[:, slot].zero_()
            self.conv[:, slot].zero_()
            self.prefix_len[slot] = 0
            self.slots[request_id] = slot

    def plan(self, decl: StepDecl) -> torch.Tensor:
        return to_device([self.slots[s.request_id] for s in decl.seqs], torch.long, self.state.device)

    def has_pending(self, decl: StepDecl) -> bool:
        """Whether some request of the step has a pending prefix to replay first."""
        return any(self.prefix_len[self.slots[s.request_id]] for s in decl.seqs)

    def commit(self, decl: StepDecl) -> None:
        """Ordinary rows were folded into the state by the forward; a verify block's accepted rows
        become the pending prefix."""
        for s in decl.seqs:
            self.prefix_len[self.slots[s.request_id]] = s.committed if s.verify else 0

    def release(self, request_id: str) -> None:
        slot = self.slots.pop(request_id, None)
        if slot is not None:
            self._free.append(slot)
