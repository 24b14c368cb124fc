"""The served path on CUDA (eager): greedy tokens equal the CPU fp32 reference. Skips without a GPU."""

import pytest
import torch
from engine_run import run_to_completion
from greedy_ties import assert_greedy_matches, random_jobs

from mstar.config import EngineConfig
from mstar.engine.core import EngineCore, SpeculativeModels
from mstar.engine.params import SamplingParams
from mstar.models.dspark.model import K3DSparkModel
from mstar.models.kimi_k3.tokenizer import KimiTokenizer
from mstar.models.kimi_k3.weights import load_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("kernels", ["torch", "auto"])
@pytest.mark.parametrize("speculative", [False, True])
@pytest.mark.parametrize("batch", [1, 16])
def test_cuda_served_greedy_equals_cpu_reference(tiny_dirs, tiny_model, kernels, speculative, batch):
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 means fp32: TF32 would change near-tied argmaxes
    torch.backends.cudnn.allow_tf32 = False
    tiny_dir, draft_dir = tiny_dirs
    gpu_model = load_model(tiny_dir, dtype=torch.float32, device="cuda")
    tokenizer = KimiTokenizer.from_dir(tiny_dir)
    spec = None
    if speculative:
        spec = SpeculativeModels(K3DSparkModel.from_checkpoint(draft_dir, dtype=torch.float32).to("cuda"))
    config = EngineConfig(max_seq_len=512, resources={"mla_kv": {"page_size": 16, "max_num_pages": 512},
                                                      "kda_state": {"max_slots": 17}},
                          scheduler={"max_num_seqs": batch, "max_num_batched_tokens": 128},
                          model_kwargs={"speculative_tokens": 7 if speculative else 0,
                                        "speculative_schedule": {4: 7, 16: 3},
                                        "cuda_graphs": False})  # fp32, tiny dims: not capturable
    engine = EngineCore(gpu_model, tokenizer, config, spec, kernels=kernels)
    lengths = [1, 7, 16, 17, 40, 100, 200, 300][: max(2, batch // 2)]
    jobs = random_jobs(tiny_model, lengths, (4, 24))
    for i, (prompt, max_tokens, _) in enumerate(jobs):
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
    got = run_to_completion(engine).tokens_per_request()
    # GPU and CPU fp32 sum in different orders: a token (or a router's choice) within that noise of a tie may
    # flip, as one of 8 requests did once on an H100 (greedy_ties.py: only a measured near tie excuses it).
    assert_greedy_matches(tiny_model, jobs, [got[f"r{i}"] for i in range(len(jobs))])
    assert engine.kv.allocator.num_used == 0 and engine.pool.num_used == 0
    if speculative:
        assert engine.spec.num_drafted > 0
