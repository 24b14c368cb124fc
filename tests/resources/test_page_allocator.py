"""PageAllocator and PagedLatentKV admission: page 0 never handed out, all-or-nothing admission, every page
back after release; random request sizes each run."""

from __future__ import annotations

import random

import pytest
import torch

from mstar.resources.latent_kv import PagedLatentKV
from mstar.resources.page_allocator import PageAllocator
from mstar.resources.step import SeqStep, StepDecl


def prefill(request_id: str, num_tokens: int, num_computed: int = 0) -> SeqStep:
    return SeqStep(request_id, num_computed, (1,) * num_tokens, sample=True)


def test_allocator_hands_out_every_page_but_the_sink_once():
    pages, page_size = random.randint(2, 40), random.randint(1, 16)
    allocator = PageAllocator(pages, page_size)
    assert allocator.capacity == allocator.num_free == pages - 1 and allocator.num_used == 0
    got = []
    while allocator.num_free:
        got += allocator.allocate(random.randint(1, allocator.num_free))
    assert sorted(got) == list(range(1, pages))  # each page once, never page 0
    assert allocator.num_used == allocator.capacity
    with pytest.raises(RuntimeError, match="admit first"):
        allocator.allocate(1)
    random.shuffle(got)
    allocator.free(got[: len(got) // 2])
    allocator.free(got[len(got) // 2 :])
    assert allocator.num_free == pages - 1 and allocator.num_used == 0
    assert sorted(allocator.allocate(pages - 1)) == list(range(1, pages))


def test_pages_for_rounds_up():
    allocator = PageAllocator(4, 16)
    assert [allocator.pages_for(n) for n in (0, 1, 15, 16, 17, 32, 33)] == [0, 1, 1, 1, 2, 2, 3]


@pytest.mark.parametrize("num_pages, page_size", [(1, 16), (0, 16), (8, 0)])
def test_allocator_refuses_a_geometry_it_cannot_serve(num_pages, page_size):
    with pytest.raises(ValueError, match="num_pages|page_size"):
        PageAllocator(num_pages, page_size)


def kv(num_pages: int, page_size: int) -> PagedLatentKV:
    return PagedLatentKV(num_layers=1, num_pages=num_pages, page_size=page_size, width=2, dtype=torch.float32)


def test_a_refused_step_claims_nothing():
    """A step whose requests need one page more than is free is refused whole: no request of it gets a page.
    Without its last request it fits, and claims exactly the pages its requests need."""
    page_size = random.randint(1, 8)
    cache = kv(num_pages=random.randint(4, 12), page_size=page_size)
    free = cache.allocator.num_free
    cuts = sorted(random.sample(range(1, free + 1), random.randint(1, free)))  # free + 1 pages in parts
    parts = [b - a for a, b in zip([0, *cuts], [*cuts, free + 1], strict=True)]
    sizes = [n * page_size - random.randint(0, page_size - 1) for n in parts]  # n pages each
    decl = StepDecl(tuple(prefill(f"r{i}", n) for i, n in enumerate(sizes)))
    assert cache.pages_needed(decl) == free + 1 and not cache.can_admit(decl)
    assert cache.allocator.num_free == free and not cache.pages  # asking claims nothing
    fits = StepDecl(decl.seqs[:-1])
    assert cache.can_admit(fits)
    cache.admit(fits)
    assert {r: len(p) for r, p in cache.pages.items()} == {f"r{i}": n for i, n in enumerate(parts[:-1])}
    assert cache.allocator.num_free == parts[-1] - 1


def test_admission_grows_a_request_by_the_pages_its_step_crosses_into():
    page_size = 4
    cache = kv(num_pages=10, page_size=page_size)
    cache.admit(StepDecl((prefill("a", 5),)))  # positions 0..4: two pages
    assert len(cache.pages["a"]) == 2
    decode = StepDecl((SeqStep("a", 5, (1,), sample=True),))  # position 5: still page 2
    assert cache.pages_needed(decode) == 0
    cache.admit(decode)
    cache.commit(decode)
    assert len(cache.pages["a"]) == 2 and cache.lengths["a"] == 6
    crossing = StepDecl((SeqStep("a", 8, (1,), sample=True),))  # position 8: a third page
    assert cache.pages_needed(crossing) == 1
    cache.admit(crossing)
    assert len(cache.pages["a"]) == 3 and len(set(cache.pages["a"])) == 3 and 0 not in cache.pages["a"]


def test_release_returns_every_page():
    page_size = random.randint(1, 8)
    lengths = {f"r{i}": random.randint(1, 40) for i in range(random.randint(1, 6))}
    # room for them all (64 pages failed at page size 1 with 6 long requests), plus the sink page
    cache = kv(num_pages=1 + sum(-(-n // page_size) for n in lengths.values()), page_size=page_size)
    decl = StepDecl(tuple(prefill(r, n) for r, n in lengths.items()))
    assert cache.can_admit(decl)
    cache.admit(decl)
    cache.commit(decl)
    held = [p for pages in cache.pages.values() for p in pages]
    assert len(held) == len(set(held)) == cache.allocator.num_used == sum(map(cache.allocator.pages_for,
                                                                               lengths.values()))
    for request_id in random.sample(list(lengths), len(lengths)):
        cache.release(request_id)
    assert cache.allocator.num_used == 0 and not cache.pages and not cache.lengths
    cache.release("never-admitted")  # releasing a request that holds nothing is a no-op
    assert cache.allocator.num_free == cache.allocator.capacity
