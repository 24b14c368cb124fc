"""Pages shared by content: the key chain, references, LRU eviction, and atomic admission with a prefix."""

import random

import pytest
import torch

from mstar.resources.latent_kv import PagedLatentKV
from mstar.resources.page_allocator import PageAllocator
from mstar.resources.page_keys import ROOT, extend_keys, page_key
from mstar.resources.step import SeqStep, StepDecl

PAGE = 4


def tokens(n):
    return [random.randrange(1000) for _ in range(n)]


def test_a_key_covers_the_whole_prefix_before_its_page():
    a = tokens(3 * PAGE + 2)
    keys = []
    extend_keys(keys, a, PAGE)
    assert len(keys) == 3  # full pages only
    assert keys[0] == page_key(ROOT, a[:PAGE]) and keys[2] == page_key(keys[1], a[2 * PAGE : 3 * PAGE])
    b = list(a)
    b[0] += 1  # the first page differs: every later page's key differs, though its tokens are the same
    other = []
    extend_keys(other, b, PAGE)
    assert all(x != y for x, y in zip(keys, other, strict=True))
    more = list(keys)
    extend_keys(more, a + tokens(PAGE), PAGE)  # extending keeps the keys already there
    assert more[:3] == keys and len(more) == 4


def keyed(allocator, n):
    """Allocate n pages and publish them under fresh keys: (pages, keys)."""
    pages = allocator.allocate(n)
    keys = []
    extend_keys(keys, tokens(n * PAGE), PAGE)
    for page, key in zip(pages, keys, strict=True):
        allocator.publish(page, key)
    return pages, keys


def test_references_keep_a_page_until_its_last_holder_frees_it():
    alloc = PageAllocator(8, PAGE)
    pages, keys = keyed(alloc, 3)
    assert alloc.claim(keys[:2]) == pages[:2]  # a second holder of the first two pages
    alloc.free(pages)
    assert alloc.num_used == 2 and alloc.num_cached == 1
    alloc.free(pages[:2])
    assert alloc.num_used == 0 and alloc.num_cached == 3 and alloc.num_free == alloc.capacity
    assert alloc.match(keys) == 3  # cached pages still match
    with pytest.raises(RuntimeError, match="freed more often"):
        alloc.free(pages[:1])


def test_eviction_takes_free_pages_first_then_the_least_recently_used_prefix_tail():
    alloc = PageAllocator(7, PAGE)  # 6 pages
    evicted = []
    alloc.on_evict = evicted.append
    old, old_keys = keyed(alloc, 3)
    new, new_keys = keyed(alloc, 2)
    alloc.free(old)
    alloc.free(new)  # old's pages were released first: they are the least recently used
    assert alloc.num_cached == 5
    assert alloc.allocate(1) not in old + new  # the one unkeyed free page goes first
    alloc.allocate(1)
    assert evicted == [old_keys[2]]  # a prefix is cut from its end: its first pages still match
    assert alloc.match(old_keys) == 2 and alloc.match(new_keys) == 2
    alloc.claim(old_keys[:2])  # touched: now the most recently used
    alloc.free(old[:2])
    alloc.allocate(2)
    assert evicted == [old_keys[2], new_keys[1], new_keys[0]]
    assert alloc.match(old_keys) == 2


def test_a_duplicate_key_leaves_the_second_page_private():
    alloc = PageAllocator(8, PAGE)
    [first], [key] = keyed(alloc, 1)
    [second] = alloc.allocate(1)
    alloc.publish(second, key)  # the same prefix computed twice at once
    alloc.free([second])
    assert alloc.num_cached == 0  # the duplicate went back to the free list
    alloc.free([first])
    assert alloc.num_cached == 1 and alloc.claim([key]) == [first]


def test_reset_forgets_every_key_and_keeps_holders_pages():
    alloc = PageAllocator(8, PAGE)
    held, held_keys = keyed(alloc, 2)
    cached, cached_keys = keyed(alloc, 2)
    alloc.free(cached)
    alloc.reset()
    assert alloc.match(held_keys) == 0 and alloc.match(cached_keys) == 0
    assert alloc.num_cached == 0 and alloc.num_used == 2
    alloc.free(held)
    assert alloc.num_free == alloc.capacity and alloc.num_cached == 0


def make_kv(num_pages):
    return PagedLatentKV(num_layers=2, num_pages=num_pages, page_size=PAGE, width=3, dtype=torch.float32)


def prefill(kv, request_id, n, prefix=()):
    """Admit, commit and publish one request's whole prompt of n tokens after `prefix`; its keys."""
    start = len(prefix) * PAGE
    decl = StepDecl((SeqStep(request_id, start, tuple(range(n - start)), sample=True, prefix=tuple(prefix)),))
    assert kv.can_admit(decl)
    kv.admit(decl)
    kv.commit(decl)
    keys = list(prefix)
    extend_keys(keys, tokens(n), PAGE)  # fresh content after the prefix, chained to it
    kv.publish(request_id, keys[: n // PAGE])
    return keys[: n // PAGE]


def test_a_request_maps_cached_pages_and_admission_counts_them():
    kv = make_kv(8)  # 7 pages
    keys = prefill(kv, "a", 3 * PAGE)
    pages_a = list(kv.pages["a"])
    kv.release("a")
    assert kv.allocator.num_used == 0 and kv.match(keys) == 3
    decl = StepDecl((SeqStep("b", 2 * PAGE, tuple(range(PAGE + 1)), sample=True, prefix=tuple(keys[:2])),))
    assert kv.pages_needed(decl) == 2  # 12 + 1 tokens: 4 pages, 2 of them mapped
    kv.admit(decl)
    assert kv.lengths["b"] == 2 * PAGE and kv.pages["b"][:2] == pages_a[:2]
    kv.commit(decl)
    plan = kv.plan(decl)
    assert plan.slot_mapping.tolist()[0] == kv.pages["b"][2] * PAGE  # the first new row goes past the prefix
    kv.release("b")
    assert kv.allocator.num_used == 0 and not kv.pages and not kv.published


def test_refusal_claims_nothing():
    kv = make_kv(6)  # 5 pages
    keys = prefill(kv, "a", 3 * PAGE)
    kv.release("a")  # 3 pages cached, 2 free
    prefix = tuple(keys[:3])
    free_before, cached_before = kv.allocator.num_free, kv.allocator.num_cached
    # 3 mapped pages + 3 more: claiming the cached pages leaves only the 2 free ones to allocate
    too_big = StepDecl((SeqStep("b", 3 * PAGE, tuple(range(3 * PAGE)), sample=True, prefix=prefix),))
    assert not kv.can_admit(too_big)
    assert (kv.allocator.num_free, kv.allocator.num_cached) == (free_before, cached_before) and not kv.pages
    fits = StepDecl((SeqStep("b", 3 * PAGE, tuple(range(2 * PAGE)), sample=True, prefix=prefix),))
    assert kv.can_admit(fits)
    kv.admit(fits)
    assert kv.allocator.num_free == 0 and kv.match(keys) == 3  # its allocations evicted none of its own prefix


def test_two_new_requests_of_one_step_share_a_prefix():
    kv = make_kv(8)
    keys = prefill(kv, "a", 2 * PAGE)
    kv.release("a")
    prefix = tuple(keys)
    decl = StepDecl(tuple(SeqStep(r, 2 * PAGE, (1, 2), sample=True, prefix=prefix) for r in ("b", "c")))
    assert kv.pages_needed(decl) == 2
    kv.admit(decl)
    assert kv.pages["b"][:2] == kv.pages["c"][:2] and kv.allocator.num_used == 4
    kv.release("b")
    assert kv.allocator.num_used == 3  # c still holds the shared pages: b freed only its own references
    kv.release("c")
    assert kv.allocator.num_used == 0 and kv.allocator.num_cached == 2


def test_an_evicted_prefix_page_refuses_the_step_that_named_it():
    kv = make_kv(4)  # 3 pages
    keys = prefill(kv, "a", 2 * PAGE)
    kv.release("a")
    prefill(kv, "x", 3 * PAGE)  # takes every page: the cached prefix is evicted
    decl = StepDecl((SeqStep("b", 2 * PAGE, (1,), sample=True, prefix=tuple(keys)),))
    assert kv.match(keys) == 0 and not kv.can_admit(decl)


def test_after_a_reset_running_requests_key_their_pages_again():
    kv = make_kv(8)
    keys = prefill(kv, "a", 2 * PAGE)
    kv.reset_prefix_cache()
    assert kv.match(keys) == 0
    kv.publish("a", keys)  # its next publish: from its first page, so the chain is reachable again
    assert kv.match(keys) == 2
    kv.release("a")
    assert kv.allocator.num_cached == 2 and kv.allocator.num_used == 0
