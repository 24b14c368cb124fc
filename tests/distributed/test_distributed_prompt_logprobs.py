"""prompt_logprobs at TP2 (real gloo processes, rank 0 in this process): the lm_head's vocabulary slices are
gathered for the prompt rows as for the sampled ones, so the scores equal the single-rank reference."""

from __future__ import annotations

import random

from engine_run import run_to_completion
from prompt_scores import assert_prompt_logprobs

from mstar.config import EngineConfig
from mstar.distributed.worker import Timeouts, start_ranks
from mstar.engine.params import SamplingParams
from mstar.models.kimi_k3.generate import greedy_generate
from mstar.models.kimi_k3.tokenizer import KimiTokenizer

TIMEOUTS = Timeouts(startup_s=120, control_s=20, collective_s=60, stop_s=10)


def test_tp2_prompt_logprobs_equal_the_reference(tiny_dir, tiny_model):
    engine = EngineConfig(max_seq_len=128, resources={"mla_kv": {"page_size": 16, "max_num_pages": 24},
                                                      "kda_state": {"max_slots": 5}},
                          scheduler={"max_num_seqs": 4, "max_num_batched_tokens": 48})
    core, ranks = start_ranks(tiny_dir, KimiTokenizer.from_dir(tiny_dir), engine, tp_size=2, timeouts=TIMEOUTS)
    vocab = tiny_model.config.vocab_size - 256
    prompts = [[random.randrange(vocab) for _ in range(n)] for n in (random.randint(60, 100), 9)]
    jobs = [(f"r{i}", p, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, prompt_logprobs=3))
            for i, p in enumerate(prompts)]
    try:
        run = run_to_completion(core, jobs, max_steps=200)
        assert ranks.failed is None
    finally:
        ranks.stop()
    for i, prompt in enumerate(prompts):
        assert_prompt_logprobs(tiny_model, prompt, run.outputs[f"r{i}"][0].prompt_logprobs, 3)
        assert run.tokens(f"r{i}") == greedy_generate(tiny_model, prompt, 4)
