"""The scheduler with prefix caching, on the real pools without a model: where a request resumes, where
its chunks end, and that shared pages and snapshot slots are counted, never double-freed or leaked."""

import random

import torch

from mstar.config import SchedulerConfig
from mstar.engine.params import SamplingParams
from mstar.engine.prefix_cache import PrefixCache
from mstar.engine.request import Request
from mstar.engine.scheduler import Scheduler
from mstar.resources.latent_kv import PagedLatentKV
from mstar.resources.recurrent_pool import RecurrentStatePool

PAGE, INTERVAL = 4, 8


class Setup:
    def __init__(self, pages=40, slots=6, max_num_seqs=3, budget=24):
        self.kv = PagedLatentKV(1, pages, PAGE, 2, torch.float32)
        self.pool = RecurrentStatePool(1, slots, 1, 2, 2, torch.float32, torch.float32, snapshot_interval=INTERVAL)
        self.prefix = PrefixCache([self.kv], self.pool)
        config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, max_prefill_seqs=4)
        self.scheduler = Scheduler(config, [self.kv, self.pool], prefix=self.prefix)
        self.arrivals = 0
        self.steps = []

    def add(self, request_id, prompt, max_tokens=3):
        request = Request(request_id, list(prompt), SamplingParams(max_tokens=max_tokens), self.arrivals,
                          frozenset(), text=None)
        self.arrivals += 1
        self.scheduler.add(request)
        return request

    def step(self):
        """Schedule one step and commit it as the engine would (sampled rows get a token); its declaration."""
        decl = self.scheduler.schedule()
        self.steps.append(decl)
        self.scheduler.commit(decl)
        for s in decl.seqs:
            request = next(r for r in self.scheduler.running if r.request_id == s.request_id)
            request.num_computed = s.committed_end
            if s.sample:
                request.output_ids.append(random.randrange(1000))
            self.scheduler.publish(request)
            if len(request.output_ids) >= request.params.max_tokens:
                self.scheduler.release(request)
        return decl

    def run(self):
        while self.scheduler.has_work():
            self.step()
            assert len(self.steps) < 500

    def assert_empty(self):
        assert self.kv.allocator.num_used == 0 and not self.kv.pages and not self.kv.published
        assert self.pool.num_used == 0 and self.pool.num_free == self.pool.capacity


def tokens(n):
    return [random.randrange(1000) for _ in range(n)]


def test_a_new_request_resumes_at_the_snapshot_and_chunks_end_on_boundaries():
    setup = Setup()
    prompt = tokens(30)
    setup.add("a", prompt)
    first = setup.step()
    assert [(s.num_computed, s.num_tokens) for s in first.seqs] == [(0, 24)]  # budget 24, a boundary: no cut
    pages_a = list(setup.kv.pages["a"])
    second = setup.step()
    assert [(s.num_computed, s.num_tokens) for s in second.seqs] == [(24, 6)]
    setup.run()
    assert setup.pool.num_snapshots == 2  # at 24 (a chunk's end) and 32 (the decode step that reached it)
    b = setup.add("b", prompt[:27] + tokens(5))
    decl = setup.step()
    [s] = decl.seqs
    assert s.num_computed == 24 and len(s.prefix) == 6 and b.num_cached_tokens == 24
    assert setup.kv.pages["b"][:6] == pages_a
    setup.run()
    assert setup.prefix.num_hits == 24 and setup.prefix.num_queries == 30 + 32
    setup.assert_empty()


def test_a_chunk_crossing_boundaries_ends_at_the_last_one():
    setup = Setup(budget=20)
    setup.add("a", tokens(19))
    setup.add("b", tokens(30))
    decl = setup.step()
    assert [(s.num_computed, s.num_tokens) for s in decl.seqs] == [(0, 16), (0, 4)]  # a cut at 16; b gets the rest
    decl = setup.step()
    # b's chunk from 4 would end at 21, crossing 8 and 16: it ends at 16
    assert [(s.request_id, s.num_computed, s.num_tokens) for s in decl.seqs] == [("a", 16, 3), ("b", 4, 12)]
    setup.run()
    setup.assert_empty()


def test_preempting_a_request_that_shares_pages_frees_only_its_references():
    setup = Setup(pages=11, slots=4, max_num_seqs=2, budget=32)  # 10 pages; a and b need 4 shared + 4 + 4
    system = tokens(16)
    setup.add("warm", system + tokens(1), max_tokens=1)
    setup.run()
    assert setup.kv.allocator.num_cached == 4
    a = setup.add("a", system + tokens(2), max_tokens=12)
    b = setup.add("b", system + tokens(3), max_tokens=12)
    while not setup.scheduler.num_preemptions:
        setup.step()
        shared = setup.kv.pages.get("a", [])[:4]
        if "b" in setup.kv.pages and shared:
            assert setup.kv.pages["b"][:4] == shared  # both map the system prompt's pages
    victim = b if b.status.value == "waiting" else a
    survivor = a if victim is b else b
    assert victim.request_id not in setup.kv.pages
    # the survivor still holds the shared pages, which stay keyed: nothing was freed under it
    assert setup.kv.match(survivor.page_keys[:4]) == 4
    assert setup.kv.allocator.num_used == len(setup.kv.pages[survivor.request_id])
    setup.run()
    assert victim.num_preemptions == 1
    setup.assert_empty()


def test_a_resume_that_does_not_fit_waits_with_nothing_claimed():
    setup = Setup(pages=9, slots=4, max_num_seqs=2, budget=32)  # 8 pages, 3 slots
    system = tokens(16)
    setup.add("warm", system + tokens(1), max_tokens=1)
    setup.run()
    setup.add("big", tokens(12), max_tokens=8)  # 3 pages after its two chunks, 5 in the end
    setup.step()
    late = setup.add("late", system + tokens(15), max_tokens=1)  # 4 cached pages + 4 new: 1 is free
    decl = setup.step()
    assert [s.request_id for s in decl.seqs] == ["big"] and late.status.value == "waiting"
    assert "late" not in setup.kv.pages and "late" not in setup.pool.slots and late.num_cached_tokens == 0
    # nothing claimed: the cached pages, and the snapshots (warm's at 16, big's at 8), are all still there
    assert setup.kv.allocator.num_cached == 4 and setup.pool.num_snapshots == 2 and setup.pool.num_used == 1
    setup.run()
    assert late.num_cached_tokens in (0, 16)  # resumed once big released its pages, unless they evicted it
    setup.assert_empty()
