"""A long prompt's chunked prefill does not starve running streams: with mixed prefill and decode, every
decoding request gets a token in every step while the prompt prefills, one chunk (the step's token
budget less the decode rows) per step. So a stream's worst inter-token gap is one step, and that step
costs a decode step plus one chunk, never the whole prompt's prefill (counted in steps, which wall-clock
noise cannot blur)."""

from __future__ import annotations

import random

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
    last_token_step = dict.fromkeys(streams, -1)
    worst_gap = 0  # in steps, between two tokens of one stream
    step, long_done = 0, False
    while not long_done:
        declared.clear()
        outputs = engine.step()
        [decl] = declared
        chunks.append(sum(s.num_tokens for s in decl.seqs if s.request_id == "long"))
        for out in outputs:
            long_done |= out.request_id == "long" and out.finished
            if out.request_id in last_token_step and out.new_token_ids:
                worst_gap = max(worst_gap, step - last_token_step[out.request_id])
                last_token_step[out.request_id] = step
        step += 1
        assert step < 50, "the long prompt made no progress"
    assert sum(chunks) == LONG_PROMPT and len(chunks) >= LONG_PROMPT // BUDGET
    assert max(chunks) <= BUDGET - STREAMS  # one chunk per step: the decode rows take their part of the budget
    assert min(last_token_step.values()) == step - 1 and worst_gap == 1, (last_token_step, worst_gap)
    while engine.has_work():
        engine.step()
