"""prompt_logprobs on CUDA: the tiny model in fp32 (eager, the GPU kernels where they take its dims, async
scheduling on, DSpark on and off) equals the CPU fp32 reference; the shipped mini in bf16 with CUDA graphs
(prefill graphs that replay prompt rows too) stays within bf16 noise of its fp32 reference and of the same
engine run eagerly. Skips without a GPU. The bounds are loose on purpose: a misplaced row (the wrong position
or token scored) is off by nats, rounding by hundredths."""

from __future__ import annotations

import random

import pytest
import torch
from engine_run import run_to_completion
from paths import ROOT
from prompt_scores import assert_prompt_logprobs, reference_logprobs

from mstar.config import EngineConfig
from mstar.engine.core import EngineCore, SpeculativeModels
from mstar.engine.params import SamplingParams
from mstar.kernels import kda_fla
from mstar.models.dspark.model import K3DSparkModel
from mstar.models.kimi_k3.generate import greedy_generate
from mstar.models.kimi_k3.tokenizer import KimiTokenizer
from mstar.models.kimi_k3.weights import load_model
from mstar.runner.prefill_graphs import PrefillGraphs

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
MINI = ROOT / "models" / "kimi_k3_mini"
FP32_TOL = 1e-2  # Triton kernels (fla's KDA among them) may take TF32 dot products even in an fp32 model


def scored(k: int, max_tokens: int = 4) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, prompt_logprobs=k)


@pytest.mark.parametrize("speculative", [False, True])
def test_cuda_prompt_logprobs_equal_the_cpu_reference(tiny_dirs, tiny_model, speculative):
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 means fp32
    torch.backends.cudnn.allow_tf32 = False
    tiny_dir, draft_dir = tiny_dirs
    spec = SpeculativeModels(K3DSparkModel.from_checkpoint(draft_dir, dtype=torch.float32).to("cuda")) \
        if speculative else None
    config = EngineConfig(max_seq_len=512, resources={"mla_kv": {"page_size": 16, "max_num_pages": 256},
                                                      "kda_state": {"max_slots": 9}},
                          scheduler={"max_num_seqs": 8, "max_num_batched_tokens": 96},
                          model_kwargs={"speculative_tokens": 3 if speculative else 0, "cuda_graphs": False,
                                        "async_scheduling": True})
    engine = EngineCore(load_model(tiny_dir, dtype=torch.float32, device="cuda"), KimiTokenizer.from_dir(tiny_dir),
                        config, spec)
    rng = random.Random()
    prompts = [[rng.randrange(1000) for _ in range(n)] for n in (5, rng.randint(150, 300), 40)]
    jobs = [("decoding", prompts[0], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)),
            ("long", prompts[1], scored(3)), ("short", prompts[2], scored(0))]
    run = run_to_completion(engine, jobs, per_step=1)
    assert_prompt_logprobs(tiny_model, prompts[1], run.outputs["long"][0].prompt_logprobs, 3, FP32_TOL)
    assert_prompt_logprobs(tiny_model, prompts[2], run.outputs["short"][0].prompt_logprobs, 0, FP32_TOL)
    for (name, prompt, params) in jobs:
        assert run.tokens(name) == greedy_generate(tiny_model, prompt, params.max_tokens), name


def mini_scores(target, tokenizer, prompts, graphs: bool) -> tuple[list[list[float]], EngineCore]:
    config = EngineConfig(max_seq_len=512, resources={"mla_kv": {"page_size": 16, "max_num_pages": 256},
                                                      "kda_state": {"max_slots": 9}},
                          scheduler={"max_num_seqs": 8, "max_num_batched_tokens": 128},
                          model_kwargs={"cuda_graphs": graphs})
    engine = EngineCore(target, tokenizer, config)
    jobs = [(f"r{i}", p, scored(2, 8)) for i, p in enumerate(prompts)]
    run = run_to_completion(engine, jobs, per_step=1)
    return [[e.logprob for e in run.outputs[f"r{i}"][0].prompt_logprobs] for i in range(len(prompts))], engine


@pytest.mark.skipif(not kda_fla.available(), reason="needs CUDA and fla-core")
def test_mini_bf16_prompt_logprobs_through_cuda_graphs():
    target = load_model(MINI, dtype=torch.bfloat16, device="cuda")
    tokenizer = KimiTokenizer.from_dir(MINI)
    texts = ["def main():\n", "import os\nimport sys\n\n\nclass Config:\n    def __init__(self, path):\n",
             "for i in range(10):\n    print(i)\n" * 6]
    prompts = [tokenizer.encode(t) for t in texts]
    captured, engine = mini_scores(target, tokenizer, prompts, graphs=True)
    assert sum(g.replays for g in engine.runner.graphs if isinstance(g, PrefillGraphs)) > 0
    eager, _ = mini_scores(target, tokenizer, prompts, graphs=False)
    reference = load_model(MINI, dtype=torch.float32)
    for prompt, got, other in zip(prompts, captured, eager, strict=True):
        ref = reference_logprobs(reference, prompt)
        want = torch.tensor([float(ref[i - 1, prompt[i]]) for i in range(1, len(prompt))])
        got, other = torch.tensor(got), torch.tensor(other)
        # bf16 logits (~1e-2 each, more on the unlikely tokens), never a different distribution
        assert (got - want).abs().mean() < 0.1 and (got - want).abs().max() < 1.0, (got - want).abs().max()
        assert (got - other).abs().max() < 0.5, (got - other).abs().max()
