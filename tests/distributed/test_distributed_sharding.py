"""Sharding rules, ExpertSharding, the communicator choice and the step-message protocol, in one process."""

from __future__ import annotations

import copy
import random
from dataclasses import replace

import pytest
import torch
from engine_run import run_to_completion

from mstar.config import EngineConfig
from mstar.distributed.comm_choice import CommConfig, CommKind, Message, choose_communicator
from mstar.distributed.communicator import NullCommunicator
from mstar.distributed.control import GEOMETRY, STEP, StepMessage, plan_on
from mstar.distributed.expert_sharding import INVALID_ID, ExpertSharding
from mstar.distributed.loader import rank_module
from mstar.distributed.sharding import ShardingPlan
from mstar.distributed.worker import LeaderExecutor, apply_step, follow, follower_runner, pool_geometry
from mstar.engine.core import EngineCore
from mstar.engine.params import SamplingParams
from mstar.models.kimi_k3.config import load_config, parse_config
from mstar.models.kimi_k3.model import KimiK3ForCausalLM
from mstar.models.kimi_k3.tokenizer import KimiTokenizer
from mstar.models.kimi_k3.weights import expected_checkpoint_shapes
from mstar.tools.make_tiny import k3_fixture, real_dims_raw_config

LAYOUTS = [(2, 1), (2, 2), (4, 2), (4, 4), (8, 1), (8, 2), (8, 8)]


@pytest.mark.parametrize("tp, ep", LAYOUTS)
def test_every_expert_column_is_held_by_exactly_one_rank(tp, ep):
    experts, width = 16, 64
    held = torch.zeros(experts, width, dtype=torch.int64)
    for rank in range(tp):
        s = ExpertSharding(experts, width, tp, ep, rank)
        start, stop = s.intermediate_range
        for e in s.local_experts:
            held[e, start:stop] += 1
        ids = s.local_ids()
        assert (ids[list(s.local_experts)] == torch.arange(len(s.local_experts), dtype=torch.int32)).all()
        assert ((ids == INVALID_ID).sum() == experts - len(s.local_experts)).item()
        assert s.group_size * ep == tp and s.local_intermediate_size * s.group_size == width
    assert (held == 1).all()


def test_expert_sharding_refuses_uneven_splits():
    with pytest.raises(ValueError, match="must divide tp_size"):
        ExpertSharding(16, 64, tp_size=4, ep_size=3)
    with pytest.raises(ValueError, match="num_experts"):
        ExpertSharding(10, 64, tp_size=4, ep_size=4)
    with pytest.raises(ValueError, match="moe_intermediate_size"):
        ExpertSharding(16, 60, tp_size=8, ep_size=1)
    with pytest.raises(ValueError, match="32-wide scale groups"):
        ExpertSharding(16, 64, tp_size=4, ep_size=1).check_mxfp4()
    ExpertSharding(16, 64, tp_size=4, ep_size=2).check_mxfp4()  # 32 columns per rank: whole groups


def test_rank_config_divides_heads_and_widths(tiny_dir):
    cfg = load_config(tiny_dir)
    rank = ShardingPlan(2, 1).rank_config(cfg)
    assert rank.num_attention_heads * 2 == cfg.num_attention_heads
    assert rank.linear_attn.num_heads * 2 == cfg.linear_attn.num_heads
    assert rank.intermediate_size * 2 == cfg.intermediate_size
    assert rank.vocab_size == cfg.vocab_size  # the vocabulary split lives in the vocab-parallel modules
    with pytest.raises(ValueError, match="num_attention_heads"):
        ShardingPlan(3).check(cfg)


def _k3_layers(num_layers: int, num_experts: int) -> dict:
    """The real K3 shapes, cut to a few layers and experts (whole, not yet split)."""
    raw = real_dims_raw_config(num_layers, num_experts, tp_size=1, tp_rank=0)
    del raw["mstar_rank_shard"]
    return raw


@pytest.mark.parametrize("tp, ep", [(8, 1), (8, 2), (8, 8)])
def test_rules_split_every_real_k3_tensor_evenly(tp, ep):
    """Each rank's module shape is the checkpoint shape, or an even piece of it along the rule's dim."""
    config = parse_config(_k3_layers(4, 16))
    full = expected_checkpoint_shapes(config)
    prefix = config.weight_prefix
    for rank in (0, tp - 1):
        plan = ShardingPlan(tp, rank, ep)
        experts = plan.expert_sharding(config)
        for name, t in rank_module(config, plan).state_dict().items():
            whole = full[prefix + name]
            split = plan.split_of(name, config)
            if name.endswith(".A_log"):
                assert t.shape == (config.linear_attn.num_heads // tp,)
            elif split is None:
                assert tuple(t.shape) == whole, name
            else:
                assert whole[split.dim] == t.shape[split.dim] * split.parts, name
                assert all(w == s for d, (w, s) in enumerate(zip(whole, t.shape, strict=True)) if d != split.dim)
        held = {int(n.split(".")[-3]) for n in rank_module(config, plan).state_dict() if ".experts." in n}
        assert held == set(experts.local_experts)


def test_real_dims_benchmark_shard_has_a_ranks_shapes():
    """make_tiny's --real-dims rank shard (its own per-rank config) has exactly the module shapes of a
    TP8 rank built by ShardingPlan, so kernel benchmarks on it measure what a rank runs."""
    shard = parse_config(real_dims_raw_config(4, 16, tp_size=8, tp_rank=0))
    with torch.device("meta"):
        shard_shapes = {n: tuple(t.shape) for n, t in KimiK3ForCausalLM(shard).state_dict().items()}
    rank_shapes = {n: tuple(t.shape) for n, t in
                   rank_module(parse_config(_k3_layers(4, 16)), ShardingPlan(8, 0)).state_dict().items()}
    assert shard_shapes == rank_shapes


def test_full_k3_fixture_shards_at_tp8():
    ShardingPlan(8, 0, 1).check(parse_config(k3_fixture()))
    ShardingPlan(8, 0, 8).check(parse_config(k3_fixture("kimi_k3_pruned75_config.json")))
    ShardingPlan(8, 0, 1).expert_sharding(parse_config(k3_fixture())).check_mxfp4()  # 384 columns per rank


# --- communicators --------------------------------------------------------------------------------------


def _msg(nbytes, device="cuda", op="all_reduce", dtype=torch.bfloat16):
    return Message(op, device, dtype, nbytes)


def test_choose_communicator_rule():
    shm = CommConfig(protocol="SHM", one_shot_max_bytes=1000, two_shot_max_bytes=5000)
    bf16 = torch.bfloat16
    assert choose_communicator(_msg(10), 1, shm, bf16) is CommKind.NULL
    assert choose_communicator(_msg(10, device="cpu"), 8, shm, bf16) is CommKind.GLOO
    assert choose_communicator(_msg(1000), 8, shm, bf16) is CommKind.SYMM_MEM_ONE_SHOT
    assert choose_communicator(_msg(1001), 8, shm, bf16) is CommKind.SYMM_MEM_TWO_SHOT
    assert choose_communicator(_msg(5000), 8, shm, bf16) is CommKind.SYMM_MEM_TWO_SHOT
    assert choose_communicator(_msg(5001), 8, shm, bf16) is CommKind.NCCL
    assert choose_communicator(_msg(10, op="all_gather"), 8, shm, bf16) is CommKind.NCCL
    assert choose_communicator(_msg(10, dtype=torch.float32), 8, shm, bf16) is CommKind.NCCL  # buffer is bf16
    assert choose_communicator(_msg(10), 8, shm, None) is CommKind.NCCL  # no symmetric buffer built
    for protocol in ("TCP", "NCCL"):  # across nodes: NCCL only
        assert choose_communicator(_msg(10), 8, CommConfig(protocol=protocol), bf16) is CommKind.NCCL
    assert choose_communicator(_msg(10), 8, CommConfig(protocol="GLOO"), bf16) is CommKind.GLOO
    assert choose_communicator(_msg(10), 8, CommConfig(symm_mem=False), bf16) is CommKind.NCCL
    with pytest.raises(ValueError, match="protocol"):
        CommConfig(protocol="RDMA")


def test_a_rounded_all_reduce_is_chosen_as_its_rounded_message():
    """`all_reduce_rounded(x, dtype)` goes where a message of x in `dtype` would: an fp32 partial sum rounded to
    the bf16 of the symmetric buffer takes it (in its staging copy), at the bf16 message's size."""
    fp32_sum = torch.zeros(3, 4, dtype=torch.float32)
    assert Message.of("all_reduce", fp32_sum, torch.bfloat16) == Message("all_reduce", "cpu", torch.bfloat16, 24)
    assert Message.of("all_reduce", fp32_sum) == Message("all_reduce", "cpu", torch.float32, 48)
    shm = CommConfig(protocol="SHM", one_shot_max_bytes=24, two_shot_max_bytes=5000)
    message = Message.of("all_reduce", fp32_sum.to("meta"), torch.bfloat16)
    assert choose_communicator(replace(message, device_type="cuda"), 8, shm, torch.bfloat16) \
        is CommKind.SYMM_MEM_ONE_SHOT
    four = NullCommunicator(world_size=4, rank=2)
    assert four.all_reduce_rounded(fp32_sum, torch.bfloat16).dtype == torch.bfloat16


def test_null_communicator():
    x = torch.randn(3, 4)
    one = NullCommunicator()
    assert one.all_reduce(x) is x and one.all_gather(x) is x
    four = NullCommunicator(world_size=4, rank=2)
    assert four.all_gather(x).shape == (3, 16)  # a rank's true shapes, alone on one device


def test_emulated_rank_shard_runs_alone(tiny_dir):
    """One TP2 rank's model with the null communicator runs at its true shapes (the numbers are not
    the model's: nothing is reduced)."""
    cfg = load_config(tiny_dir)
    model = KimiK3ForCausalLM(ShardingPlan(2, 1).rank_config(cfg), NullCommunicator(2, 1),
                              ShardingPlan(2, 1).expert_sharding(cfg))
    out = model(torch.tensor([1, 2, 3]))
    assert out.logits.shape == (3, cfg.vocab_size) and torch.isfinite(out.logits).all()


# --- the step messages: a follower that applies them mirrors rank 0's state ---------------------------


class _Recorder:
    """A control channel that keeps rank 0's step messages instead of broadcasting them."""

    def __init__(self):
        self.messages: list[StepMessage] = []
        self._replayed = 0

    def replay_new(self, follower) -> None:
        """Apply to `follower` the messages it has not had yet, as a follower rank receives them."""
        for message in self.messages[self._replayed:]:
            apply_step(follower, message, torch.device("cpu"))
        self._replayed = len(self.messages)

    def send_step(self, plan, prefix_lens, tap_layers, slot_copies=()):
        self.messages.append(StepMessage(STEP, len(self.messages), plan_on(plan, "cpu"), prefix_lens, tap_layers,
                                         slot_copies))

    def step_done(self):
        pass


class _Healthy:
    def check(self):
        pass


def test_follower_mirrors_rank0_state_through_step_messages(tiny_model, tiny_dir):
    """Every KDA state, conv window and latent KV row of a follower that only applies rank 0's step
    messages equals rank 0's after every step: through chunked prefill, mixed steps, preemption and
    slot reuse. (Same weights on both sides: this checks the protocol, not the sharding.)"""
    engine = EngineConfig(max_seq_len=128, resources={"mla_kv": {"page_size": 16, "max_num_pages": 10},
                                                      "kda_state": {"max_slots": 5}},
                          scheduler={"max_num_seqs": 4, "max_num_batched_tokens": 40})
    rng = random.Random()
    prompts = [[rng.randrange(1000) for _ in range(n)] for n in [3, 30, 70, 9, 50, 1]]
    core = _mirrored(tiny_model, tiny_dir, engine, prompts)
    assert core.scheduler.num_preemptions > 0, "the workload should preempt (re-prefill into a reset slot)"


def test_follower_mirrors_prefix_cache_snapshots_and_resumes(tiny_model, tiny_dir):
    """With prefix caching, rank 0's pool copies KDA state into snapshot slots and out of them into the slots
    of requests that resume from a cached prefix: the follower replays those copies and stays equal."""
    engine = EngineConfig(max_seq_len=128, resources={"mla_kv": {"page_size": 8, "max_num_pages": 40},
                                                      "kda_state": {"max_slots": 7}},
                          scheduler={"max_num_seqs": 3, "max_num_batched_tokens": 40},
                          prefix_cache={"kda_snapshot_interval": 16})
    rng = random.Random()
    system = [rng.randrange(1000) for _ in range(40)]
    prompts = [system + [rng.randrange(1000) for _ in range(n)] for n in (5, 9, 2, 20)]
    core = _mirrored(tiny_model, tiny_dir, engine, prompts, arrivals_per_step=1)
    assert core.stats().prefix_cache_hits > 0


def _mirrored(tiny_model, tiny_dir, engine, prompts, arrivals_per_step=None):
    """Serve `prompts` on rank 0 while a follower applies its step messages; after every step the follower's
    KDA states, conv windows and latent KV equal rank 0's. Rank 0's engine, when done."""
    tokenizer = KimiTokenizer.from_dir(tiny_dir)
    core = EngineCore(tiny_model, tokenizer, engine)
    channel = _Recorder()
    core.executor = LeaderExecutor(core.executor, core.pool, _Healthy(), channel)
    follower = follower_runner(tiny_model, engine)
    assert pool_geometry(follower.kv, follower.pool) == pool_geometry(core.kv, core.pool)
    rng = random.Random()
    jobs = [(f"r{i}", prompt, SamplingParams(max_tokens=rng.randint(4, 12), temperature=0, ignore_eos=True))
            for i, prompt in enumerate(prompts)]

    def mirror():
        channel.replay_new(follower)
        # snapshots rank 0 took at this step's commit reach the follower with the next step
        unsent = {target for _, target in core.pool.copies}
        same = [slot for slot in range(core.pool.max_slots) if slot not in unsent]
        assert torch.equal(follower.pool.state[:, same], core.pool.state[:, same])
        assert torch.equal(follower.pool.conv[:, same], core.pool.conv[:, same])
        assert torch.equal(follower.kv.cache, core.kv.cache)

    run_to_completion(core, jobs, per_step=arrivals_per_step, after_step=mirror)
    return core


class _Script:
    """A control channel that delivers a fixed list of messages."""

    rank = 1

    def __init__(self, messages):
        self.messages = list(messages)

    def receive(self):
        return self.messages.pop(0)


def test_follower_refuses_a_step_out_of_order_or_foreign_pools(tiny_model, tiny_dir):
    engine = EngineConfig(max_seq_len=64, resources={"mla_kv": {"page_size": 16, "max_num_pages": 8},
                                                     "kda_state": {"max_slots": 3}},
                          scheduler={"max_num_seqs": 2})
    runner = follower_runner(tiny_model, engine)
    geometry = pool_geometry(runner.kv, runner.pool)
    wrong = copy.deepcopy(geometry)
    wrong["kda_state"] = ((1, 2, 3), "torch.float32")
    with pytest.raises(RuntimeError, match="differ from rank 0"):
        follow(_Script([StepMessage(GEOMETRY, geometry=wrong)]), runner, torch.device("cpu"))
    with pytest.raises(RuntimeError, match="out of lockstep"):
        follow(_Script([StepMessage(GEOMETRY, geometry=geometry), StepMessage(STEP, step_id=1)]), runner,
               torch.device("cpu"))

