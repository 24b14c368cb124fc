"""Prefix caching in the served path: the same tokens with the cache on and off (and as the reference),
hits where the pages and a KDA snapshot are, shared pages under preemption and eviction, DSpark on."""

import random

import pytest
from engine_run import run_to_completion
from greedy_ties import assert_greedy_matches

from mstar.config import EngineConfig
from mstar.engine.core import EngineCore, SpeculativeModels
from mstar.engine.params import SamplingParams
from mstar.models.kimi_k3.generate import greedy_generate

PAGE, INTERVAL = 8, 16


def make_engine(model, tokenizer, *, cache=True, pages=128, slots=9, draft=None, max_num_seqs=4, budget=64,
                overlap=False):
    cfg = EngineConfig(max_seq_len=256,
                       resources={"mla_kv": {"page_size": PAGE, "max_num_pages": pages},
                                  "kda_state": {"max_slots": slots}},
                       scheduler={"max_num_seqs": max_num_seqs, "max_num_batched_tokens": budget},
                       prefix_cache={"enabled": cache, "kda_snapshot_interval": INTERVAL},
                       model_kwargs={"speculative_tokens": 3 if draft is not None else 0,
                                     "async_scheduling": overlap})
    return EngineCore(model, tokenizer, cfg, SpeculativeModels(draft) if draft is not None else None)


def greedy(max_tokens):
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)


def serve(engine, jobs, arrivals_per_step=1):
    """Add (request id, prompt, max_tokens) jobs a few per step, step until done: {id: (tokens, cached tokens)}."""
    got: dict[str, list[int]] = {}
    cached: dict[str, int] = {}
    pending, steps = list(jobs), 0
    while pending or engine.has_work():
        for _ in range(arrivals_per_step):
            if pending:
                request_id, prompt, n = pending.pop(0)
                engine.add_request(request_id, prompt, greedy(n))
        for out in engine.step():
            got.setdefault(out.request_id, []).extend(out.new_token_ids)
            cached[out.request_id] = out.num_cached_tokens
            if out.finished:
                assert out.finish_reason == "length", out
        steps += 1
        assert steps < 3000, "no progress"
    return {r: (got[r], cached[r]) for r in got}


def assert_reference(model, prompt, n, *served):
    """Each served continuation equals the reference's greedy one (near ties excused, as everywhere: the cache
    changes how steps are batched, and so the last bits of fp32 sums)."""
    ref = greedy_generate(model, prompt, n)
    assert_greedy_matches(model, [(prompt, n, ref)] * len(served), list(served))


def assert_pools_empty(engine):
    pools = [engine.kv] + ([engine.spec.proposer.kv] if engine.spec else [])
    for kv in pools:
        assert kv.allocator.num_used == 0 and not kv.pages and not kv.published and not kv.lengths
    assert engine.pool.num_used == 0 and engine.pool.num_free == engine.pool.capacity
    assert not engine.requests and not engine.scheduler.running and not engine.scheduler.waiting


def words(model, n):
    return [random.randrange(model.config.vocab_size - 256) for _ in range(n)]


def expected_hit(shared: int, prompt_len: int) -> int:
    """The longest snapshot boundary within the shared tokens that leaves the prompt's last token to compute."""
    return min(shared, prompt_len - 1) // INTERVAL * INTERVAL


def conversation(model, turns, first=37):
    """Prompts of a multi-turn chat: each turn resends the last prompt, its answer and a new message."""
    return [words(model, first)] + [words(model, random.randint(3, 20)) for _ in range(turns - 1)]


@pytest.mark.parametrize("overlap", [False, True])
def test_a_multi_turn_conversation_gives_the_same_tokens_with_the_cache_on(tiny_model, tokenizer, overlap):
    on, off = make_engine(tiny_model, tokenizer, overlap=overlap), make_engine(tiny_model, tokenizer, cache=False)
    prompt = []
    for turn, message in enumerate(conversation(tiny_model, 4)):
        previous = len(prompt)
        prompt = prompt + message
        n = random.randint(4, 9)
        [(tokens, cached)] = serve(on, [(f"t{turn}", prompt, n)]).values()
        [(tokens_off, cached_off)] = serve(off, [(f"t{turn}", prompt, n)]).values()
        assert_reference(tiny_model, prompt, n, tokens, tokens_off)
        # everything the last turn computed is cached (its prompt and answer but the answer's last token, which
        # was sampled and never fed back, in chunks ending on snapshot boundaries)
        assert cached == expected_hit(max(previous - 1, 0), len(prompt)) and cached_off == 0, turn
        prompt = prompt + tokens
        assert_pools_empty(on)
    stats = on.stats()
    assert stats.prefix_cache_hits > 0 and stats.prefix_cache_queries > stats.prefix_cache_hits
    assert off.stats().prefix_cache_hits == off.stats().prefix_cache_queries == 0


def test_hits_at_every_offset_class(tiny_model, tokenizer):
    """Prompts sharing a cached prompt up to its snapshot boundary, to mid-page past it, to a page boundary
    before it (pages cached, no snapshot there: a miss that leaves one for the next such prompt), to less
    than one snapshot interval, and all of it (the last token is computed all the same)."""
    engine = make_engine(tiny_model, tokenizer)
    base = words(tiny_model, 4 * INTERVAL + 5)  # prefilled in chunks [0, 64) and [64, 69): a snapshot at 64
    serve(engine, [("base", base, 3)])
    cases = [("snapshot", 4 * INTERVAL, 4 * INTERVAL), ("mid_page", 4 * INTERVAL + 3, 4 * INTERVAL),
             ("no_snapshot", 3 * INTERVAL + PAGE, 0), ("after_no_snapshot", 3 * INTERVAL + PAGE, 3 * INTERVAL),
             ("short", INTERVAL - 2, 0), ("same", len(base), 4 * INTERVAL)]
    for name, shared, hit in cases:
        prompt = base[:shared] + words(tiny_model, 0 if name == "same" else 6)
        [(tokens, cached)] = serve(engine, [(name, prompt, 4)]).values()
        assert_reference(tiny_model, prompt, 4, tokens)
        assert cached == hit, name
    assert_pools_empty(engine)


def test_concurrent_requests_share_a_prefix(tiny_model, tokenizer):
    engine = make_engine(tiny_model, tokenizer)
    system = words(tiny_model, 3 * INTERVAL)
    serve(engine, [("warm", system + words(tiny_model, 3), 1)])
    jobs = [(f"r{i}", system + words(tiny_model, random.randint(1, 12)), random.randint(3, 10)) for i in range(6)]
    shared_pages = []

    def watch():
        held = [engine.kv.pages[r.request_id][:2] for r in engine.scheduler.running if r.num_computed]
        if len(held) > 1:
            shared_pages.append(all(p == held[0] for p in held))

    got, pending, steps = {}, list(jobs), 0
    while pending or engine.has_work():
        for _ in range(2):
            if pending:
                request_id, prompt, n = pending.pop(0)
                engine.add_request(request_id, prompt, greedy(n))
        for out in engine.step():
            got.setdefault(out.request_id, []).extend(out.new_token_ids)
        watch()
        steps += 1
    assert shared_pages and all(shared_pages)  # running requests held the very same first pages
    refs = [(prompt, n, greedy_generate(tiny_model, prompt, n)) for _, prompt, n in jobs]
    assert_greedy_matches(tiny_model, refs, [got[request_id] for request_id, _, _ in jobs], max_tied=1)
    assert_pools_empty(engine)


def test_eviction_under_memory_pressure_and_preemption_of_sharing_requests(tiny_model, tokenizer):
    """33 pages of 8 tokens for 4 requests of up to ~120 tokens: cached pages are evicted, decodes preempt
    requests that share pages with others, and everything still matches the reference."""
    engine = make_engine(tiny_model, tokenizer, pages=33, slots=6, max_num_seqs=4, budget=32)
    system = words(tiny_model, 2 * INTERVAL)
    serve(engine, [("warm", system + words(tiny_model, 3), 1)])  # so that the first sharing request hits
    jobs = []
    for i in range(8):
        prompt = (system if i % 2 else words(tiny_model, 2 * INTERVAL)) + words(tiny_model, random.randint(20, 50))
        jobs.append((f"r{i}", prompt, random.randint(20, 40)))
    got = serve(engine, jobs, arrivals_per_step=4)
    assert engine.scheduler.num_preemptions > 0
    assert any(cached for _, cached in got.values())
    refs = [(prompt, n, greedy_generate(tiny_model, prompt, n)) for _, prompt, n in jobs]
    assert_greedy_matches(tiny_model, refs, [got[request_id][0] for request_id, _, _ in jobs], max_tied=1)
    assert_pools_empty(engine)


@pytest.mark.parametrize("overlap", [False, True])
def test_dspark_reuses_the_drafts_cached_context(tiny_model, tokenizer, draft, overlap):
    """Also with speculative steps overlapped: a verify block planned while the one before runs takes no
    snapshot (its start is known only on the device), the others as in the synchronous loop."""
    on = make_engine(tiny_model, tokenizer, draft=draft, overlap=overlap)
    off = make_engine(tiny_model, tokenizer, draft=draft, cache=False, overlap=overlap)
    prompt = []
    for turn, message in enumerate(conversation(tiny_model, 3, first=40)):
        asked, answered = len(prompt) - 8 * (turn > 0), len(prompt)  # the last turn's prompt, and with its answer
        prompt = prompt + message
        [(tokens, cached)] = serve(on, [(f"t{turn}", prompt, 8)]).values()
        [(tokens_off, _)] = serve(off, [(f"t{turn}", prompt, 8)]).values()
        assert_reference(tiny_model, prompt, 8, tokens, tokens_off)
        # the last prompt's prefill left a snapshot near its end; its answer's verify blocks may have, where one
        # started on a boundary
        assert expected_hit(asked, len(prompt)) <= cached <= expected_hit(answered, len(prompt)), turn
        assert cached % INTERVAL == 0
        prompt = prompt + tokens
        assert_pools_empty(on)
    assert on.stats().prefix_cache_hits > 0
    # the draft read the same context rows, cached or computed: it proposed as well
    assert on.spec.num_accepted >= off.spec.num_accepted - 2


def test_reset_forgets_every_prefix(tiny_model, tokenizer):
    engine = make_engine(tiny_model, tokenizer)
    prompt = words(tiny_model, 2 * INTERVAL + 3)
    serve(engine, [("a", prompt, 2)])
    assert engine.kv.allocator.num_cached and engine.pool.num_snapshots
    engine.reset_prefix_cache()
    assert engine.kv.allocator.num_cached == 0 and engine.pool.num_snapshots == 0
    [(tokens, cached)] = serve(engine, [("b", prompt, 2)]).values()
    assert cached == 0
    assert_reference(tiny_model, prompt, 2, tokens)
    assert_pools_empty(engine)


def test_a_cache_salt_shares_prefixes_only_with_its_own_salt(tiny_model, tokenizer):
    """vLLM's cache_salt: a salted request resumes only from pages of requests with the same salt."""
    engine = make_engine(tiny_model, tokenizer)
    prompt = words(tiny_model, 2 * INTERVAL + 3)
    hit = expected_hit(len(prompt), len(prompt))
    cached = {}
    for name, salt in [("plain", None), ("a", "tenant-a"), ("b", "tenant-b"), ("a_again", "tenant-a"),
                       ("plain_again", None)]:
        params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True, cache_salt=salt)
        run = run_to_completion(engine, [(name, prompt, params)])
        assert_reference(tiny_model, prompt, 2, run.tokens(name))
        cached[name] = run.outputs[name][-1].num_cached_tokens
    assert cached == {"plain": 0, "a": 0, "b": 0, "a_again": hit, "plain_again": hit}
    assert_pools_empty(engine)
