"""The paged latent KV cache of the MLA layers: one 576-wide row per token per layer.

Storage is [num_mla_layers, num_pages, page_size, kv_lora_rank + rope]: all MLA layers share each
request's page list, since they cache the same positions. A row holds [c_kv (normed) | k_pe].

Full committed pages are shared by content (page_allocator.py): a new request whose step declares a
`prefix` of page keys maps those cached pages and starts after them. Its own rows go only to
positions past the prefix, so a shared page is never written again.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mstar.resources.page_allocator import PageAllocator
from mstar.resources.step import SeqStep, StepDecl
from mstar.resources.transfer import to_device_lists


def shift_slots(page_table: torch.Tensor, row_seq: torch.Tensor, positions: torch.Tensor, lens: torch.Tensor,
                advance: torch.Tensor, page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(slot_mapping [N], context_lens [B]) of rows whose sequences sit advance [B] positions past the host's
    positions [N] and lens [B]: one kernel on a GPU (kernels/kv_slots.py), the same arithmetic in torch elsewhere."""
    if page_table.is_cuda:
        from mstar.kernels.kv_slots import shifted_slots  # imports triton: the serving path must load without it

        return shifted_slots(page_table, row_seq, positions, lens, advance, page_size)
    shifted = positions + advance[row_seq]
    return page_table[row_seq, shifted // page_size] * page_size + shifted % page_size, lens + advance


@dataclass(frozen=True)
class LatentKVPlan:
    page_table: torch.Tensor  # [B, max_pages] page ids, 0-padded
    slot_mapping: torch.Tensor  # [N] flat row (page * page_size + offset) each new token writes
    context_lens: torch.Tensor  # [B] tokens cached after this step


class PagedLatentKV:
    def __init__(self, num_layers: int, num_pages: int, page_size: int, width: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu"):
        self.allocator = PageAllocator(num_pages, page_size)
        self.page_size = page_size
        self.width = width
        self.cache = torch.zeros(num_layers, num_pages, page_size, width, dtype=dtype, device=device)
        self.pages: dict[str, list[int]] = {}
        self.lengths: dict[str, int] = {}  # tokens committed per request
        self.published: dict[str, int] = {}  # leading pages of each request that hold a content key

    # --- admission ----------------------------------------------------------------------------
    def _extra_pages(self, s: SeqStep) -> int:
        held = len(self.pages[s.request_id]) if s.request_id in self.pages else len(s.prefix)
        return max(0, self.allocator.pages_for(s.end) - held)

    def _claimed_keys(self, decl: StepDecl) -> list[bytes]:
        """The cached pages the step's new requests map (a request that holds pages maps none)."""
        return [k for s in decl.seqs if s.request_id not in self.pages for k in s.prefix]

    def pages_needed(self, decl: StepDecl) -> int:
        return sum(self._extra_pages(s) for s in decl.seqs)

    def can_admit(self, decl: StepDecl) -> bool:
        claimed = self._claimed_keys(decl)
        if self.allocator.match(claimed) < len(claimed):
            return False  # a page the scheduler matched has been evicted since
        return self.pages_needed(decl) <= self.allocator.num_free - self.allocator.num_evictable_among(claimed)

    def admit(self, decl: StepDecl) -> None:
        # Claims first: an allocation below may evict cached pages, but never one this step maps.
        for s in decl.seqs:
            if s.request_id not in self.pages:
                self.pages[s.request_id] = self.allocator.claim(s.prefix)
                self.published[s.request_id] = len(s.prefix)
                self.lengths[s.request_id] = len(s.prefix) * self.page_size
        for s in decl.seqs:
            self.pages[s.request_id].extend(self.allocator.allocate(self._extra_pages(s)))

    # --- prefix caching ------------------------------------------------------------------------
    def match(self, keys: list[bytes]) -> int:
        """How many of a prompt's leading page keys have their pages here."""
        return self.allocator.match(keys)

    def publish(self, request_id: str, keys: list[bytes]) -> None:
        """Name the request's first len(keys) pages by their content keys: the caller vouches that their
        rows are committed and that keys[i] is the key of the tokens they hold."""
        pages = self.pages[request_id]
        for i in range(self.published[request_id], len(keys)):
            self.allocator.publish(pages[i], keys[i])
        self.published[request_id] = max(self.published[request_id], len(keys))

    def reset_prefix_cache(self) -> None:
        """Forget every content key: cached pages become free. The pages running requests hold are keyed
        again when they next publish (from their first page, so that their prefixes stay reachable)."""
        self.allocator.reset()
        for request_id in self.published:
            self.published[request_id] = 0

    # --- plan / commit / release --------------------------------------------------------------
    def plan(self, decl: StepDecl, advance: torch.Tensor | None = None) -> LatentKVPlan:
        """The step's addressing, copied to the device without waiting for a step in flight.

        `advance` [B] (on the device; None: all zero) shifts sequence b's rows advance[b] positions on
        (`SeqStep.lag`: what the verify step in flight keeps, known only there): the slots and context
        lengths are then computed on the device from the page table, which covers the furthest shift."""
        device, size = self.cache.device, self.page_size
        max_pages = max(len(self.pages[s.request_id]) for s in decl.seqs)
        table = [p for s in decl.seqs for p in self._padded_pages(s.request_id, max_pages)]
        lens = [s.num_computed + s.num_tokens for s in decl.seqs]
        positions = [range(s.num_computed, s.num_computed + s.num_tokens) for s in decl.seqs]
        if advance is None:
            slots = [table[b * max_pages + pos // size] * size + pos % size for b, rows in enumerate(positions)
                     for pos in rows]
            table_t, lens_t, slots_t = to_device_lists([table, lens, slots], torch.long, device)
            return LatentKVPlan(table_t.view(len(lens), max_pages), slots_t, lens_t)
        row_seq = [b for b, rows in enumerate(positions) for _ in rows]
        flat_positions = [p for rows in positions for p in rows]
        table_t, lens_t, row_seq_t, pos = to_device_lists([table, lens, row_seq, flat_positions], torch.long, device)
        table_t = table_t.view(len(lens), max_pages)
        return LatentKVPlan(table_t, *shift_slots(table_t, row_seq_t, pos, lens_t, advance, size))

    def _padded_pages(self, request_id: str, width: int) -> list[int]:
        pages = self.pages[request_id]
        return pages + [0] * (width - len(pages))

    def commit(self, decl: StepDecl) -> None:
        """Record the rows that survived: rejected draft rows stay in their pages, unread, and are
        overwritten by the next step's rows at the same positions."""
        for s in decl.seqs:
            self.lengths[s.request_id] = s.committed_end

    def release(self, request_id: str) -> None:
        self.allocator.free(self.pages.pop(request_id, []))
        self.lengths.pop(request_id, None)
        self.published.pop(request_id, None)

    # --- data access (the torch path; kernels address `cache` directly) -----------------------
    def rows(self, layer: int, page_ids: torch.Tensor, length: int) -> torch.Tensor:
        """The first `length` cached rows of one request, gathered from its pages: [length, width]."""
        n_pages = -(-length // self.page_size)
        return self.cache[layer, page_ids[:n_pages]].reshape(-1, self.width)[:length]

    def write(self, layer: int, slot_mapping: torch.Tensor, rows: torch.Tensor) -> None:
        self.cache[layer].view(-1, self.width)[slot_mapping] = rows.to(self.cache.dtype)
