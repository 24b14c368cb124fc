"""Prefix caching: which cached prefix a new request resumes from, and what finished steps leave behind.

A hybrid model's prefix is cached in two parts. The MLA layers' latent rows live in shared KV pages
keyed by content (resources/page_allocator.py); so do the DSpark draft's context rows, in the draft's
own page pool, paged and keyed the same way (so the draft's context for a cached prefix is reused,
never rebuilt). The KDA layers' recurrent state cannot be cut at any position: it exists only where
a snapshot was taken, every `kda_snapshot_interval` tokens (resources/recurrent_pool.py). A request
therefore resumes at the longest prefix whose pages every pool holds and whose end has a snapshot,
and always computes at least its last token, whose logits pick its next one.

Snapshots are taken where a step leaves the state on a boundary: the end of a prefill chunk (the
scheduler ends each chunk at the last boundary it crosses, so a long prompt leaves one near its end,
which the next turn of a conversation resumes from), each boundary a decode step reaches, and with
speculation only a boundary where a verify block starts (blocks skip over most positions). A prompt
that shares cached pages past its snapshot hit (another conversation's system prompt) also ends its
first chunk at the last boundary inside the shared part, so the requests after it resume there.

Content keys need the tokens on the host, which a step in flight may not have sent yet: pages and
snapshots are published after each step finishes, for the tokens known by then (`publish`).
"""

from __future__ import annotations

from collections.abc import Sequence

from mstar.engine.request import Request
from mstar.resources.latent_kv import PagedLatentKV
from mstar.resources.page_keys import extend_keys, root
from mstar.resources.recurrent_pool import RecurrentStatePool


class PrefixCache:
    def __init__(self, page_pools: Sequence[PagedLatentKV], pool: RecurrentStatePool):
        """`page_pools`: the target's KV first, then any other pool that follows the same steps (the draft's)."""
        self.page_pools = tuple(page_pools)
        self.pool = pool
        self.page_size = page_pools[0].page_size
        self.pages_per_snapshot = pool.snapshot_interval // self.page_size
        # A snapshot is only reachable through the pages before it: it goes when the page it ends at does.
        page_pools[0].allocator.on_evict = pool.drop_snapshot
        self.num_queries = 0  # tokens of the requests admitted (vLLM's prefix_cache_queries)
        self.num_hits = 0  # of those, tokens served from the cache (vLLM's prefix_cache_hits)

    def _keys(self, request: Request) -> list[bytes]:
        """The request's page keys, extended over the full pages of its tokens on the host."""
        known = len(request.prompt_ids) + len(request.output_ids)
        if len(request.page_keys) < known // self.page_size:
            extend_keys(request.page_keys, request.prompt_ids + request.output_ids, self.page_size,
                        root(request.params.cache_salt))
        return request.page_keys

    def lookup(self, request: Request) -> tuple[tuple[bytes, ...], int]:
        """(the page keys of the longest cached prefix `request` can resume from, the tokens of the longest
        prefix whose pages are cached, snapshot or not). Nothing is claimed: the step's admission does
        that, atomically, or refuses."""
        usable = (request.num_tokens - 1) // self.page_size  # pages that leave the last token to compute
        if usable < self.pages_per_snapshot:
            return (), 0
        keys = self._keys(request)[:usable]
        held = min(kv.match(keys) for kv in self.page_pools)
        pages = held - held % self.pages_per_snapshot
        while pages and not self.pool.has_snapshot(keys[pages - 1]):
            pages -= self.pages_per_snapshot
        return tuple(keys[:pages]), held * self.page_size

    def record(self, request: Request, prefix: tuple[bytes, ...]) -> None:
        """Count an admission that resumed from `prefix` (its first one gives the request's cached tokens)."""
        cached = len(prefix) * self.page_size
        self.num_queries += request.num_tokens
        self.num_hits += cached
        if not request.num_preemptions:
            request.num_cached_tokens = cached

    def publish(self, request: Request) -> None:
        """Key the request's full pages whose rows are committed and whose tokens are known, and its
        snapshots at their ends."""
        target = self.page_pools[0]
        if request.request_id not in target.pages:
            return
        known = len(request.prompt_ids) + len(request.output_ids)
        full = min(target.lengths[request.request_id], known) // self.page_size
        if full <= target.published[request.request_id]:
            return
        keys = self._keys(request)[:full]
        for kv in self.page_pools:
            kv.publish(request.request_id, keys)
        step = self.pages_per_snapshot
        self.pool.publish(request.request_id, {(i + 1) * self.page_size: keys[i]
                                               for i in range(step - 1, full, step)})

    def reset(self) -> None:
        """Forget every cached prefix (benchmarks measure cold prompts after it)."""
        for kv in self.page_pools:
            kv.reset_prefix_cache()
        self.pool.reset_prefix_cache()
