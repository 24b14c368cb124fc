"""The GPU collectives and a tensor-parallel engine on CUDA. Skips without CUDA.

- torch symmetric memory one-shot / two-shot all-reduce (2 GPUs: it refuses two ranks on one device);
- NCCL all-reduce / all-gather and the chooser's communicator (2 GPUs);
- TP2 greedy on CUDA equals the CPU fp32 reference: NCCL + symmetric memory on 2 GPUs, or both ranks
  on one GPU with gloo staging through the host.
"""

from __future__ import annotations

import random
import socket
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from engine_run import run_to_completion

from mstar.config import EngineConfig
from mstar.distributed.comm_choice import CommConfig, CommKind, build_communicator
from mstar.distributed.worker import Timeouts, start_ranks
from mstar.engine.params import SamplingParams
from mstar.models.kimi_k3.generate import greedy_generate
from mstar.models.kimi_k3.tokenizer import KimiTokenizer

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

SIZES = (1, 7, 1000, 4097, 7168 * 3)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _join(rank: int, port: int, backend: str) -> torch.device:
    device = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0, timeout=timedelta(seconds=60))
    dist.init_process_group(backend, store=store, rank=rank, world_size=2, timeout=timedelta(seconds=60))
    return device


def _rank_input(rank: int, n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * rank + n)
    return torch.randn(n, generator=g).to(dtype=dtype, device=device)


def _check_sum(out: torch.Tensor, n: int, dtype: torch.dtype, device: torch.device) -> None:
    expect = sum(_rank_input(r, n, torch.float32, device) for r in range(2))
    tol = 1e-6 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), expect, rtol=tol, atol=tol)
    # every rank holds the same bits (what keeps routing identical on all ranks)
    host = out.float().cpu()
    both = [torch.empty_like(host) for _ in range(2)]
    dist.all_gather(both, host, group=_cpu_group())
    assert torch.equal(both[0], both[1])


_CPU_GROUP = None


def _cpu_group():
    global _CPU_GROUP
    if _CPU_GROUP is None:
        _CPU_GROUP = dist.new_group(backend="gloo")
    return _CPU_GROUP


def _symm_mem_worker(rank: int, port: int) -> None:
    from mstar.distributed.symm_mem_comm import ONE_SHOT, TWO_SHOT, SymmetricBuffer, SymmMemCommunicator

    device = _join(rank, port, "nccl")
    _cpu_group()
    for dtype in (torch.bfloat16, torch.float32):
        buffer = SymmetricBuffer(dist.group.WORLD, device, dtype, max_bytes=1 << 20)
        for algorithm in (ONE_SHOT, TWO_SHOT):
            comm = SymmMemCommunicator(buffer, algorithm)
            for n in SIZES:
                _check_sum(comm.all_reduce(_rank_input(rank, n, dtype, device)), n, dtype, device)
    dist.destroy_process_group()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_symm_mem_one_and_two_shot_all_reduce():
    torch.multiprocessing.spawn(_symm_mem_worker, args=(_free_port(),), nprocs=2, join=True)


def _nccl_worker(rank: int, port: int) -> None:
    device = _join(rank, port, "nccl")
    _cpu_group()
    config = CommConfig(protocol="SHM", one_shot_max_bytes=4096, two_shot_max_bytes=1 << 16)
    comm = build_communicator(dist.group.WORLD, device, config, torch.bfloat16)
    assert set(comm.implementations) == {CommKind.NCCL, CommKind.SYMM_MEM_ONE_SHOT, CommKind.SYMM_MEM_TWO_SHOT}
    for n in (*SIZES, 1 << 16):  # the last goes to NCCL: above two_shot_max_bytes
        for dtype in (torch.bfloat16, torch.float32):  # fp32 goes to NCCL: the buffer is bf16
            _check_sum(comm.all_reduce(_rank_input(rank, n, dtype, device)), n, dtype, device)
    x = torch.full((3, 4), float(rank), device=device)
    gathered = comm.all_gather(x)
    assert gathered.shape == (3, 8) and (gathered[:, :4] == 0).all() and (gathered[:, 4:] == 1).all()
    dist.destroy_process_group()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_nccl_and_chooser_on_two_gpus():
    torch.multiprocessing.spawn(_nccl_worker, args=(_free_port(),), nprocs=2, join=True)


def test_tp2_greedy_on_cuda_equals_cpu_reference(tiny_dir, tiny_model):
    torch.backends.cuda.matmul.allow_tf32 = False
    protocol = "SHM" if torch.cuda.device_count() > 1 else "GLOO"  # one GPU: both ranks on it, gloo via the host
    engine = EngineConfig(max_seq_len=256, resources={"mla_kv": {"page_size": 16, "max_num_pages": 64},
                                                      "kda_state": {"max_slots": 9}},
                          scheduler={"max_num_seqs": 8, "max_num_batched_tokens": 64})
    core, ranks = start_ranks(tiny_dir, KimiTokenizer.from_dir(tiny_dir), engine, tp_size=2, dtype=torch.float32,
                              device_type="cuda", comm=CommConfig(protocol=protocol),
                              timeouts=Timeouts(startup_s=300, control_s=60))
    try:
        rng = random.Random()
        jobs = []
        for i, n in enumerate((1, 17, 40, 100)):
            prompt = [rng.randrange(1000) for _ in range(n)]
            max_tokens = rng.randint(4, 16)
            jobs.append((prompt, greedy_generate(tiny_model, prompt, max_tokens)))
            core.add_request(f"r{i}", prompt, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
        got = run_to_completion(core).tokens_per_request()
        for i, (prompt, expect) in enumerate(jobs):
            assert got[f"r{i}"] == expect, f"prompt of {len(prompt)} tokens"
    finally:
        ranks.stop()
    assert [p.exitcode for p in ranks.processes] == [0]

