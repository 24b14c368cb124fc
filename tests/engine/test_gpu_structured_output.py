"""Structured outputs on CUDA with DSpark: grammar requests are drafted there too (the block's drafts are
read to the host after the forward is queued, and each verify row gets its own mask), and their greedy
output equals the undrafted constrained engine's on the CPU. Skips without a GPU."""

import copy
import json
import random

import pytest
import torch
from engine_run import mode_engine, run_to_completion

from mstar.engine.params import SamplingParams
from mstar.engine.structured_output import Grammar
from mstar.models.kimi_k3.weights import load_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

SCHEMA = {"type": "object",
          "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}, "ok": {"type": "boolean"}},
          "required": ["n", "ok"], "additionalProperties": False}
GRAMMARS = {"schema": Grammar("json_schema", json.dumps(SCHEMA), "response_format"),
            "regex": Grammar("regex", "([a-z]{2,5} ){3}[0-9]{2,5}", "guided_regex")}


@pytest.mark.parametrize("overlap", [False, True])
def test_cuda_dspark_grammar_requests_equal_the_cpu_constrained_engine(tiny_dir, tiny_model, tokenizer, draft,
                                                                      overlap):
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 means fp32: TF32 would change near-tied argmaxes
    rng = random.Random()
    vocab = tiny_model.config.vocab_size
    prompts = {rid: [rng.randrange(vocab - 256) for _ in range(rng.randint(3, 30))] for rid in GRAMMARS}
    jobs = [(rid, prompts[rid], SamplingParams(max_tokens=60, temperature=0, grammar=g)) for rid, g in GRAMMARS.items()]
    expect = run_to_completion(mode_engine(tiny_model, tokenizer, "sync"), jobs).tokens_per_request()
    gpu_model = load_model(tiny_dir, dtype=torch.float32, device="cuda")
    engine = mode_engine(gpu_model, tokenizer, "dspark", copy.deepcopy(draft).to("cuda"))
    engine._overlap = overlap
    got = run_to_completion(engine, jobs).tokens_per_request()
    assert got == expect
    assert engine.spec.num_drafted > 0
    assert engine.kv.allocator.num_used == 0 and engine.pool.num_used == 0
