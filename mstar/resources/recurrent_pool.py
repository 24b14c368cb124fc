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

Prefix caching keeps *snapshots* in the slots no request holds: when the state a step leaves is at a
multiple of `snapshot_interval` tokens (an ordinary row ending there, or a verify block starting there),
commit copies the slot's state and conv window to a spare slot. The snapshot is keyed, once the
tokens before it are known on the host, by the content key of the KV page it ends at (`publish`); a
new request whose step declares that page key as the last of its `prefix` starts from a copy of it
instead of the zero state. Snapshots are cache, not
holdings: admission takes their slots back (least recently used first) when a request needs one, and
a snapshot goes when the page it ends at is evicted. Every copy between slots is logged in `copies`
until `take_copies`, for tensor-parallel followers to replay (each rank holds its own heads' state).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from mstar.resources.step import StepDecl
from mstar.resources.transfer import to_device


@dataclass
class _Snapshot:
    request_id: str  # whose row it was taken from
    position: int  # tokens folded into it
    key: bytes | None = None  # the content key of the page ending at `position`, once known


class RecurrentStatePool:
    def __init__(self, num_layers: int, max_slots: int, num_heads: int, head_dim: int, conv_kernel: int,
                 state_dtype: torch.dtype, conv_dtype: torch.dtype, device: torch.device | str = "cpu",
                 *, hidden_size: int = 0, max_block: int = 0, snapshot_interval: int = 0):
        """`snapshot_interval`: commit snapshots the state at multiples of this many tokens (0: never)."""
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
        self.snapshot_interval = snapshot_interval
        self._snapshots: OrderedDict[int, _Snapshot] = OrderedDict()  # by slot, least recently used first
        self._snapshot_of: dict[bytes, int] = {}  # keyed snapshots' slots
        self.copies: list[tuple[int, int]] = []  # (from slot, to slot) since the last take_copies

    @property
    def capacity(self) -> int:
        return self.max_slots - 1

    @property
    def num_used(self) -> int:
        return len(self.slots)

    @property
    def num_free(self) -> int:
        """Slots a new request can get: free ones and those holding snapshots, which admission takes back."""
        return len(self._free) + len(self._snapshots)

    @property
    def num_snapshots(self) -> int:
        return len(self._snapshots)

    def bytes_per_slot(self) -> int:
        """Memory one request's KDA state takes over all layers (state + conv window)."""
        state, conv = self.state[:, 0], self.conv[:, 0]
        return state.numel() * state.element_size() + conv.numel() * conv.element_size()

    def _new(self, decl: StepDecl) -> list[str]:
        return [s.request_id for s in decl.seqs if s.request_id not in self.slots]

    def _sources(self, decl: StepDecl) -> set[int]:
        """The snapshot slots the step's new requests resume from."""
        return {self._snapshot_of[s.prefix[-1]] for s in decl.seqs if s.prefix and s.request_id not in self.slots}

    def can_admit(self, decl: StepDecl) -> bool:
        resuming = [s.prefix[-1] for s in decl.seqs if s.prefix and s.request_id not in self.slots]
        if not all(key in self._snapshot_of for key in resuming):
            return False  # a snapshot the scheduler matched has been evicted since
        return len(self._new(decl)) <= self.num_free - len(self._sources(decl))

    def admit(self, decl: StepDecl) -> None:
        sources = self._sources(decl)
        for s in decl.seqs:
            if s.request_id in self.slots:
                continue
            slot = self._spare_slot(keep=sources)
            if s.prefix:
                source = self._snapshot_of[s.prefix[-1]]
                self._copy(source, slot)
                self._snapshots.move_to_end(source)
            else:
                self.state[:, slot].zero_()
                self.conv[:, slot].zero_()
            self.prefix_len[slot] = 0
            self.slots[s.request_id] = slot

    def _spare_slot(self, keep: set[int] = frozenset()) -> int | None:
        """A free slot, else the least recently used snapshot's (not one of `keep`); None when neither."""
        if not self._free:
            victim = next((slot for slot in self._snapshots if slot not in keep), None)
            if victim is None:
                return None
            self._drop(victim)
        return self._free.pop()

    def _copy(self, source: int, target: int) -> None:
        self.apply_copies([(source, target)])
        self.copies.append((source, target))

    def apply_copies(self, copies: list[tuple[int, int]] | tuple[tuple[int, int], ...]) -> None:
        """Copy state and conv window from slot to slot, in order (a follower replays rank 0's `copies`)."""
        for source, target in copies:
            self.state[:, target].copy_(self.state[:, source])
            self.conv[:, target].copy_(self.conv[:, source])

    def plan(self, decl: StepDecl) -> torch.Tensor:
        return to_device([self.slots[s.request_id] for s in decl.seqs], torch.long, self.state.device)

    def has_pending(self, decl: StepDecl) -> bool:
        """Whether some request of the step has a pending prefix to replay first."""
        return any(self.prefix_len[self.slots[s.request_id]] for s in decl.seqs)

    def commit(self, decl: StepDecl) -> None:
        """Ordinary rows were folded into the state by the forward; a verify block's accepted rows
        become the pending prefix. A state that now sits on a snapshot boundary leaves a snapshot."""
        for s in decl.seqs:
            slot = self.slots[s.request_id]
            self.prefix_len[slot] = s.committed if s.verify else 0
            # The forward folded in an ordinary row's tokens, but of a verify block only the pending prefix
            # before it: the state is that at the block's start. Where a verify block in flight decides that
            # start (`SeqStep.lag`), the host does not know it: no snapshot (one labelled num_computed would
            # hold the state of a later position).
            folded = s.num_computed if s.verify else s.committed_end
            if self.snapshot_interval and folded and folded % self.snapshot_interval == 0 and not s.lag:
                self._snapshot(s.request_id, slot, folded)

    def _snapshot(self, request_id: str, slot: int, position: int) -> None:
        if any(snap.request_id == request_id and snap.position == position for snap in self._snapshots.values()):
            return  # taken at the row that ended there, before the verify block that starts there
        spare = self._spare_slot()
        if spare is None:
            return  # every slot runs a request: a snapshot is only ever cache
        self._copy(slot, spare)
        self._snapshots[spare] = _Snapshot(request_id, position)

    def release(self, request_id: str) -> None:
        """Give back the request's slot; its snapshots that never got a key go too."""
        slot = self.slots.pop(request_id, None)
        if slot is not None:
            self._free.append(slot)
        for spare, snap in list(self._snapshots.items()):
            if snap.request_id == request_id and snap.key is None:
                self._drop(spare)

    # --- prefix caching ------------------------------------------------------------------------
    def has_snapshot(self, key: bytes) -> bool:
        return key in self._snapshot_of

    def publish(self, request_id: str, keys_at: dict[int, bytes]) -> None:
        """Key the request's snapshots: keys_at[p] is the content key of the page ending at position p,
        for the positions whose tokens are known. A key that has a snapshot already keeps that one."""
        for spare, snap in list(self._snapshots.items()):
            if snap.request_id != request_id or snap.key is not None or snap.position not in keys_at:
                continue
            key = keys_at[snap.position]
            if key in self._snapshot_of:
                self._drop(spare)
            else:
                snap.key = key
                self._snapshot_of[key] = spare

    def drop_snapshot(self, key: bytes) -> None:
        """The page `key` names was evicted: its snapshot can never be matched again."""
        slot = self._snapshot_of.get(key)
        if slot is not None:
            self._drop(slot)

    def reset_prefix_cache(self) -> None:
        for slot in list(self._snapshots):
            self._drop(slot)

    def _drop(self, slot: int) -> None:
        snap = self._snapshots.pop(slot)
        if snap.key is not None:
            del self._snapshot_of[snap.key]
        self._free.append(slot)

    def take_copies(self) -> list[tuple[int, int]]:
        """The slot copies made since the last call, in order (for tensor-parallel followers)."""
        copies, self.copies = self.copies, []
        return copies
