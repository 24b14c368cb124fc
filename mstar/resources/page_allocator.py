"""Fixed-size pages of the paged latent KV cache, handed out per request and shared by content.

Page 0 is never handed out: padding rows (CUDA-graph buckets) write there, so a captured graph
never touches a live request's pages.

Prefix caching: a full page whose rows are committed can be *published* under its content key
(page_keys.py). Requests whose tokens start with the same pages then *claim* it instead of
computing it again; every holder counts one reference. A page whose last reference goes stays
cached, in least-recently-used order, and is evicted (its key forgotten) only when an allocation
finds no free page. Pages that hold no key go straight back to the free list.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence


class PageAllocator:
    def __init__(self, num_pages: int, page_size: int):
        if num_pages < 2:
            raise ValueError(f"num_pages={num_pages}: need at least 2 (page 0 is the padding sink)")
        if page_size < 1:
            raise ValueError(f"page_size={page_size} must be >= 1")
        self.num_pages = num_pages
        self.page_size = page_size
        self._free = list(range(num_pages - 1, 0, -1))  # unkeyed and unreferenced; pop() hands out low ids first
        self._refs = [0] * num_pages
        self._page_of: dict[bytes, int] = {}
        self._key_of: dict[int, bytes] = {}
        self._cached: OrderedDict[int, None] = OrderedDict()  # keyed, unreferenced pages, least recently used first
        self.on_evict: Callable[[bytes], None] | None = None  # told each key whose page is evicted or reset

    @property
    def capacity(self) -> int:
        return self.num_pages - 1

    @property
    def num_free(self) -> int:
        """Pages an allocation can get: free ones and cached ones it may evict."""
        return len(self._free) + len(self._cached)

    @property
    def num_used(self) -> int:
        """Pages some request holds a reference to."""
        return self.capacity - self.num_free

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    # --- content keys -------------------------------------------------------------------------
    def match(self, keys: Sequence[bytes]) -> int:
        """How many of `keys`, from the first, name a page held here."""
        n = 0
        while n < len(keys) and keys[n] in self._page_of:
            n += 1
        return n

    def num_evictable_among(self, keys: Sequence[bytes]) -> int:
        """How many distinct pages named by `keys` are cached unreferenced (claiming them takes them off the
        pages an allocation may evict)."""
        return len({self._page_of[k] for k in keys if self._page_of[k] in self._cached})

    def claim(self, keys: Sequence[bytes]) -> list[int]:
        """One more reference to the page of each key (all must be held: `match` first)."""
        pages = [self._page_of[k] for k in keys]
        for page in pages:
            self._refs[page] += 1
            self._cached.pop(page, None)
        return pages

    def publish(self, page: int, key: bytes) -> None:
        """Name a full, committed page by its content key. Another page may hold the key already (two
        requests computed the same prefix at once): that one stays the cached copy and this page stays
        private, returning to the free list when its holder lets go."""
        if key not in self._page_of and page not in self._key_of:
            self._page_of[key] = page
            self._key_of[page] = key

    def reset(self) -> None:
        """Forget every key: cached pages become free, pages in use stay with their holders but unkeyed."""
        for key in list(self._page_of):
            self._forget(key)
        self._free.extend(reversed(self._cached))
        self._cached.clear()

    # --- references ---------------------------------------------------------------------------
    def allocate(self, n: int) -> list[int]:
        if n > self.num_free:
            raise RuntimeError(f"asked for {n} pages with {self.num_free} free or cached: admit first")
        pages = []
        for _ in range(n):
            if self._free:
                page = self._free.pop()
            else:
                page, _ = self._cached.popitem(last=False)
                self._forget(self._key_of[page])
            self._refs[page] = 1
            pages.append(page)
        return pages

    def free(self, pages: list[int]) -> None:
        """Drop one reference to each of a request's pages, in order; keyed pages stay cached. The last page
        of a prefix enters the LRU order first, so eviction cuts prefixes from their ends, never their roots
        (a page past a missing one cannot be matched)."""
        unkeyed = []
        for page in reversed(pages):
            self._refs[page] -= 1
            if self._refs[page] < 0:
                raise RuntimeError(f"page {page} freed more often than it was handed out")
            if self._refs[page]:
                continue
            if page in self._key_of:
                self._cached[page] = None
            else:
                unkeyed.append(page)
        self._free.extend(unkeyed)  # pop() hands out the request's first page first

    def _forget(self, key: bytes) -> None:
        del self._key_of[self._page_of.pop(key)]
        if self.on_evict is not None:
            self.on_evict(key)
