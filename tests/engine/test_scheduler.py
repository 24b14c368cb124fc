"""The scheduler against real resources (paged latent KV, KDA slots), with the model's work done by hand:
admission (first come, first served, max_num_seqs), the token budget and chunked prefill, prefill-first
steps, preemption order, and refusals that leave nothing half-claimed."""

from __future__ import annotations

import random

import torch

from mstar.config import SchedulerConfig
from mstar.engine.params import SamplingParams
from mstar.engine.request import Request, Status
from mstar.engine.scheduler import Scheduler
from mstar.resources.latent_kv import PagedLatentKV
from mstar.resources.recurrent_pool import RecurrentStatePool

PAGE = 4


class Harness:
    """A scheduler over a KV cache of `pages` pages of PAGE rows and `slots` KDA slots (sinks included);
    `step` declares a step and does what the engine would: advance what ran, sample token 7, commit, and
    release requests that reached max_tokens."""

    def __init__(self, pages: int = 64, slots: int = 17, mixed_prefill_decode: bool = True,
                 step_sizes: tuple[int, ...] = (), **config):
        self.kv = PagedLatentKV(1, pages, PAGE, 2, torch.float32)
        self.pool = RecurrentStatePool(1, slots, 1, 1, 2, torch.float32, torch.float32)
        self.scheduler = Scheduler(SchedulerConfig(**config), [self.kv, self.pool],
                                   mixed_prefill_decode=mixed_prefill_decode, step_sizes=step_sizes)
        self.requests: dict[str, Request] = {}

    def add(self, request_id: str, prompt_len: int, max_tokens: int = 4) -> Request:
        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        # text (detokenization) is the engine's business, never the scheduler's
        request = Request(request_id, [1] * prompt_len, params, len(self.requests), frozenset(), text=None)
        self.requests[request_id] = request
        self.scheduler.add(request)
        return request

    def step(self) -> dict[str, int]:
        """Run one step; {request id: tokens it fed}."""
        decl = self.scheduler.schedule()
        assert decl is not None
        for s in decl.seqs:
            request = self.requests[s.request_id]
            assert s.num_computed == request.num_computed
            request.num_computed = s.committed_end
            if s.sample:
                request.output_ids.append(7)
        self.scheduler.commit(decl)
        for s in decl.seqs:
            if self.requests[s.request_id].sampling_done:
                self.scheduler.release(self.requests[s.request_id])
        return {s.request_id: s.num_tokens for s in decl.seqs}

    def holds(self, request_id: str) -> tuple[int, bool]:
        """(KV pages, whether a KDA slot) that request_id holds."""
        return len(self.kv.pages.get(request_id, ())), request_id in self.pool.slots

    def assert_everything_returned(self) -> None:
        assert self.kv.allocator.num_used == 0 and not self.kv.pages
        assert self.pool.num_used == 0 and self.pool.num_free == self.pool.capacity
        assert not self.scheduler.has_work()


def test_admission_is_first_come_first_served_up_to_max_num_seqs():
    h = Harness(max_num_seqs=3, max_num_batched_tokens=1000)
    for i in range(5):
        h.add(f"r{i}", random.randint(1, 20))
    assert set(h.step()) == {"r0", "r1", "r2"}  # the first three prefill; r3, r4 wait
    assert [r.request_id for r in h.scheduler.waiting] == ["r3", "r4"]
    assert all(h.requests[r].status == Status.RUNNING for r in ("r0", "r1", "r2"))
    assert h.holds("r3") == (0, False) and h.holds("r4") == (0, False)
    assert h.step() == {"r0": 1, "r1": 1, "r2": 1}  # decode rows; no room for another request
    while h.scheduler.has_work():
        h.step()
    h.assert_everything_returned()


def test_a_prompt_over_the_budget_is_chunked_and_decode_rows_share_the_budget():
    budget = random.randint(6, 12)
    h = Harness(max_num_batched_tokens=budget)
    h.add("a", 2, max_tokens=20)
    long = random.randint(2 * budget + 1, 3 * budget)
    h.add("b", long)
    assert h.step() == {"a": 2, "b": budget - 2}  # a's prompt, then b's first chunk fills the budget
    fed = budget - 2
    while fed < long:
        step = h.step()
        assert step["a"] == 1 and step["b"] == min(budget - 1, long - fed)  # a's decode row takes one token
        assert sum(step.values()) <= budget
        fed += step["b"]
    assert h.requests["b"].output_ids == [7]  # sampled once, at the end of its prompt
    assert h.holds("b")[0] == h.kv.allocator.pages_for(long)


BUCKETS = (256, 512, 1024, 2048)  # prefill_buckets(2048)


def test_a_chunk_just_past_a_bucket_is_cut_to_end_the_step_there():
    """Prefill steps padded to BUCKETS: a step that would pass 1,024 tokens by at most a quarter of it ends at 1,024
    (decode rows and earlier prompts included), the rest of the prompt riding in the next step; past by more, or
    past a bucket under STEP_SIZE_CUT_MIN, or with no buckets, the step stays whole."""
    h = Harness(pages=4096, max_num_batched_tokens=2048, step_sizes=BUCKETS)
    h.add("alone", 1100)
    assert h.step() == {"alone": 1024}
    assert h.step() == {"alone": 76}
    h.add("far", 1400)  # 376 past 1,024: a 2,048 step either way
    assert h.step() == {"alone": 1, "far": 1400}
    h.add("small", 300)  # 44 past 256, under the cut's minimum
    assert h.step() == {"alone": 1, "far": 1, "small": 300}
    plain = Harness(pages=4096, max_num_batched_tokens=2048)
    plain.add("alone", 1100)
    assert plain.step() == {"alone": 1100}


def test_decode_rows_and_earlier_prompts_count_toward_the_bucket():
    h = Harness(pages=4096, max_num_batched_tokens=2048, step_sizes=BUCKETS)
    for i in range(4):
        h.add(f"d{i}", 2, max_tokens=50)
    h.step()
    h.add("p", 1030, max_tokens=1)  # done once its prompt is in
    assert h.step() == {"d0": 1, "d1": 1, "d2": 1, "d3": 1, "p": 1020}  # 4 decode rows + 1,020 = 1,024
    assert h.step() == {"d0": 1, "d1": 1, "d2": 1, "d3": 1, "p": 10}
    h.add("a", 1000)
    h.add("b", 100)
    assert h.step() == {"d0": 1, "d1": 1, "d2": 1, "d3": 1, "a": 1000, "b": 20}  # b cut to end at 1,024
    h.add("c", 50)
    assert h.step() == {"d0": 1, "d1": 1, "d2": 1, "d3": 1, "a": 1, "b": 80, "c": 50}  # 137: no bucket passed
    h2 = Harness(pages=4096, max_num_batched_tokens=2048, step_sizes=BUCKETS)
    h2.add("full", 1024)
    h2.add("next", 50)
    assert h2.step() == {"full": 1024}  # the step ends at a bucket: "next" would carry it 50 past
    assert h2.step() == {"full": 1, "next": 50}
    while h.scheduler.has_work():
        h.step()
    h.assert_everything_returned()


def test_without_chunking_a_prompt_over_what_is_left_waits_for_a_step_of_its_own():
    h = Harness(max_num_batched_tokens=16, chunked_prefill=False)
    h.add("a", 10)
    h.add("b", 10)
    assert h.step() == {"a": 10}  # b does not fit in the 6 tokens left and is not cut
    assert h.step() == {"a": 1, "b": 10}


def test_at_most_max_prefill_seqs_prompts_a_step():
    h = Harness(max_prefill_seqs=2, max_num_batched_tokens=1000)
    for i in range(5):
        h.add(f"r{i}", 3)
    assert set(h.step()) == {"r0", "r1"}
    assert set(h.step()) == {"r0", "r1", "r2", "r3"}  # decode rows do not count against it


def test_without_mixing_a_step_prefills_first_then_decodes():
    h = Harness(mixed_prefill_decode=False, max_num_batched_tokens=1000)
    h.add("a", 3, max_tokens=5)
    assert h.step() == {"a": 3}
    h.add("b", 4)
    assert h.step() == {"b": 4}  # a waits while b prefills
    assert h.step() == {"a": 1, "b": 1}


def test_the_latest_arrival_is_preempted_when_a_decode_row_needs_a_page():
    """Three prompts fill the cache; when their decode rows need new pages, the last to arrive gives back its
    pages and slot, waits at the front of the queue and is later recomputed whole (prompt and output)."""
    h = Harness(pages=6, max_num_batched_tokens=1000)  # 5 usable pages of 4 rows
    h.add("a", 4, max_tokens=3)  # 1 page
    h.add("b", 8, max_tokens=3)  # 2 pages
    h.add("c", 8, max_tokens=3)  # 2 pages
    h.add("d", 1, max_tokens=1)
    assert h.step() == {"a": 4, "b": 8, "c": 8}  # the cache is full: d waits
    assert h.kv.allocator.num_free == 0
    assert h.step() == {"a": 1, "b": 1}  # each decode row needs a page: c, the latest, made room
    c = h.requests["c"]
    assert c.status == Status.WAITING and c.num_computed == 0 and c.num_preemptions == 1
    assert h.holds("c") == (0, False) and [r.request_id for r in h.scheduler.waiting] == ["c", "d"]
    assert h.scheduler.num_preemptions == 1
    assert h.step() == {"a": 1, "b": 1}  # both finish; c (3 pages) did not fit beside them, nor did d pass it
    assert h.step() == {"c": 9, "d": 1}  # c recomputes its prompt and its one output
    while h.scheduler.has_work():
        h.step()
    assert all(len(r.output_ids) == r.params.max_tokens for r in h.requests.values())
    h.assert_everything_returned()


def test_a_request_preempted_with_a_verify_block_in_flight_waits_for_its_tokens():
    """With speculative steps overlapped, a preempted request whose verify block is still in flight emits an
    unknown number of tokens (1 to drafts + 1): it is recomputed only once they reached the host, and no
    later arrival overtakes it meanwhile."""
    h = Harness(pages=6, max_num_batched_tokens=1000)
    h.add("a", 4, max_tokens=3)
    h.add("b", 8, max_tokens=3)
    h.add("c", 8, max_tokens=5)
    h.add("d", 1, max_tokens=1)
    h.step()
    c = h.requests["c"]
    c.unresolved = 3  # as core.py's launch leaves it: a verify block of 3 drafts in flight
    assert h.step() == {"a": 1, "b": 1}  # c is preempted
    assert c.status == Status.WAITING and c.unresolved == 3
    assert h.step() == {"a": 1, "b": 1}  # a and b finish
    assert not h.scheduler.running and h.scheduler.schedule() is None  # c (and d behind it) wait
    c.output_ids += [7, 7]  # the block's tokens reach the host (core.py `_settle`)
    c.unresolved = 0
    assert h.step() == {"c": 11, "d": 1}  # c recomputes its prompt and the block's tokens
    while h.scheduler.has_work():
        h.step()
    h.assert_everything_returned()


def test_a_request_refused_by_one_resource_holds_nothing_of_the_other():
    """Two free KDA slots, three prompts that fit the KV: the third is refused by the slot pool, and the KV
    cache, which could have taken it, holds none of its pages; it starts once a slot is back."""
    h = Harness(slots=3, max_num_batched_tokens=1000)  # two slots besides the sink
    for i in range(3):
        h.add(f"r{i}", 6, max_tokens=2)
    assert set(h.step()) == {"r0", "r1"}
    assert h.holds("r2") == (0, False) and h.kv.allocator.num_used == 2 * h.kv.allocator.pages_for(6)
    assert h.step() == {"r0": 1, "r1": 1}  # both finish and give back their slots
    assert h.step() == {"r2": 6}
    while h.scheduler.has_work():
        h.step()
    h.assert_everything_returned()


def test_a_waiting_request_that_does_not_fit_is_not_overtaken():
    h = Harness(pages=6, max_num_batched_tokens=1000)  # 5 usable pages
    h.add("a", 12, max_tokens=2)  # 3 pages
    h.add("big", 12)  # 3 pages: does not fit next to a
    h.add("small", 1)  # 1 page: would fit, but arrived later
    assert h.step() == {"a": 12}
    assert h.holds("big") == (0, False) and h.holds("small") == (0, False)
    assert h.step() == {"a": 1}  # a finishes: its pages come back
    assert h.step() == {"big": 12, "small": 1}
