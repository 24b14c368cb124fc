"""A long prompt's chunked prefill does not starve running streams: with mixed prefill and decode, every
decoding request gets a token in every step while the prompt prefills, one chunk (the step's token
budget less the decode rows) per step. So a stream's worst inter-token gap is one step, and that step
costs a decode step plus one chunk, never the whole prompt's prefill. The bound is asserted in steps,
which wall-clock noise cannot blur; the gap is measured on the wall clock too, and must stay a fraction
of the prefill's time (benchmarks/chunked_prefill_gap.py measures it for several chunk sizes, against
prefilling the prompt whole)."""

from __future__ import annotations

import random
import time

from mstar.config import EngineConfig
from mstar.engine.core import EngineCore
from mstar.engine.params import SamplingParams

STREAMS = 4
BUDGET = 40  # scheduler.max_num_batched_tokens: the decode rows plus one prefill chunk
LONG_PROMPT = 300


def test_a_long_prefill_gives_running_streams_a_token_every_step(tiny_model, tokenizer):
    cfg = EngineConfig(max_seq_len=512, resources={"mla_kv": {"page_size": 16, "max_num_pages": 256},
                                                   "kda_state": {"max_slots": STREAMS + 2}},
                       scheduler={"max_num_seqs": STREAMS + 1, "max_num_batched_tokens": BUDGET,
                                  "chunked_prefill": True},
                       model_kwargs={"mixed_prefill_decode": True})
    engine = EngineCore(tiny_model, tokenizer, cfg)
    declared: list = []
    schedule = engine.scheduler.schedule

    def recording_schedule():
        decl = schedule()
        declared.append(decl)
        return decl

    engine.scheduler.schedule = recording_schedule
    rng = random.Random()
    vocab = tiny_model.config.vocab_size - 256
    greedy = dict(temperature=0, ignore_eos=True)
    streams = [f"s{i}" for i in range(STREAMS)]
    for rid in streams:
        engine.add_request(rid, [rng.randrange(vocab) for _ in range(rng.randint(3, 8))],
                           SamplingParams(max_tokens=60, **greedy))
    started: set[str] = set()
    while started != set(streams):  # every stream decoding
        started |= {o.request_id for o in engine.step() if o.new_token_ids}

    engine.add_request("long", [rng.randrange(vocab) for _ in range(LONG_PROMPT)],
                       SamplingParams(max_tokens=1, **greedy))
    chunks: list[int] = []  # prompt rows of the long request in each step
    start = time.perf_counter()
    last_token = dict.fromkeys(streams, (-1, start))  # per stream: the step and the time of its last token
    worst_gap, worst_gap_s = 0, 0.0  # in steps and in seconds, between two tokens of one stream
    step, long_done = 0, False
    while not long_done:
        declared.clear()
        outputs = engine.step()
        now = time.perf_counter()
        [decl] = declared
        chunks.append(sum(s.num_tokens for s in decl.seqs if s.request_id == "long"))
        for out in outputs:
            long_done |= out.request_id == "long" and out.finished
            if out.request_id in last_token and out.new_token_ids:
                then_step, then = last_token[out.request_id]
                worst_gap, worst_gap_s = max(worst_gap, step - then_step), max(worst_gap_s, now - then)
                last_token[out.request_id] = (step, now)
        step += 1
        assert step < 50, "the long prompt made no progress"
    prefill_s = time.perf_counter() - start
    assert sum(chunks) == LONG_PROMPT and len(chunks) >= LONG_PROMPT // BUDGET
    assert max(chunks) <= BUDGET - STREAMS  # one chunk per step: the decode rows take their part of the budget
    assert min(s for s, _ in last_token.values()) == step - 1 and worst_gap == 1, (last_token, worst_gap)
    # On the wall clock: one step of about len(chunks) similar ones, so a small part of the whole prefill
    # (a third leaves room for a step slowed 3x by a busy machine).
    print(f"worst inter-token gap {worst_gap_s * 1e3:.0f} ms over {len(chunks)} chunk steps "
          f"({prefill_s * 1e3:.0f} ms in all)")
    assert worst_gap_s < prefill_s / 3, (worst_gap_s, prefill_s, len(chunks))
    while engine.has_work():
        engine.step()
