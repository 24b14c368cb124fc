"""The modeled communicator of an emulated rank: its cost model, and a tally that counts exactly the
collectives a forward makes (checked against an independent count in Python)."""

from __future__ import annotations

import pytest
import torch

from mstar.distributed.communicator import NullCommunicator
from mstar.distributed.modeled_comm import ALL_GATHER_TRAFFIC, MIN_LATENCY_S, CollectiveCost, ModeledCommunicator
from mstar.distributed.sharding import ShardingPlan
from mstar.kernels.gpu_delay import delay
from mstar.models.kimi_k3 import moe as moe_module
from mstar.models.kimi_k3 import sequence_parallel
from mstar.models.kimi_k3.config import parse_config
from mstar.tools.emulate_rank import Step, build, first_layers
from mstar.tools.make_tiny import tiny_k3_raw_config


def test_cost_is_latency_then_bandwidth():
    cost = CollectiveCost(latency_s=6e-6, small_bytes=64 * 1024, bytes_per_s=150e9)
    assert cost.seconds(0) == cost.seconds(64 * 1024) == 6e-6
    assert cost.seconds(64 * 1024 + 150_000) == pytest.approx(6e-6 + 1e-6)
    # an all-gather's output bytes carry half an all-reduce's link traffic (nccl-tests' bus-bandwidth factors)
    assert cost.seconds(64 * 1024 + 150_000, ALL_GATHER_TRAFFIC) == pytest.approx(6e-6 + 0.5e-6)
    assert cost.seconds(1000, ALL_GATHER_TRAFFIC) == 6e-6
    with pytest.raises(ValueError, match="below"):
        CollectiveCost(latency_s=MIN_LATENCY_S / 2)
    with pytest.raises(ValueError, match="bytes_per_s"):
        CollectiveCost(bytes_per_s=0)


def test_delay_checks_its_arguments():
    with pytest.raises(ValueError, match="int64"):
        delay(10, 10, torch.zeros(3))
    with pytest.raises(ValueError, match=">= 0"):
        delay(-1, 10, torch.zeros(3, dtype=torch.int64))


class CountingCommunicator(NullCommunicator):
    """The null communicator, counting calls, bytes and their modeled cost in Python: the independent count."""

    def __init__(self, world_size: int, cost: CollectiveCost):
        super().__init__(world_size)
        self.cost = cost
        self.calls, self.bytes, self.seconds = 0, 0, 0.0

    def _count(self, t: torch.Tensor, seconds_per_byte: float) -> None:
        nbytes = t.numel() * t.element_size()
        self.calls, self.bytes = self.calls + 1, self.bytes + nbytes
        self.seconds += self.cost.latency_s + max(0, nbytes - self.cost.small_bytes) * seconds_per_byte

    def all_reduce(self, x):
        self._count(x, 1 / self.cost.bytes_per_s)
        return x

    def all_gather(self, x):
        out = super().all_gather(x)
        self._count(out, 0.5 / self.cost.bytes_per_s)  # half an all-reduce's traffic a byte (2(n-1)/n against (n-1)/n)
        return out

    def reduce_scatter_rounded(self, x, dtype):
        self._count(x.to(dtype), 0.5 / self.cost.bytes_per_s)  # its input, at half an all-reduce's traffic a byte
        return self.piece(x)

    def reduce_scatter_rows(self, x):
        self._count(x, 0.5 / self.cost.bytes_per_s)
        return self.piece_rows(x)

    def all_gather_rows(self, x):
        out = torch.cat([x] * self.world_size)
        self._count(out, 0.5 / self.cost.bytes_per_s)
        return out


def test_tally_counts_what_a_forward_calls():
    config = first_layers(parse_config(tiny_k3_raw_config()), 4)
    steps = [Step("decode", 2, 1, 8), Step("prefill", 1, 24, 0)]
    cost = CollectiveCost(latency_s=5e-6, small_bytes=256, bytes_per_s=1e9)
    emulation = build(config, ShardingPlan(2), steps, dtype=torch.float32, device=torch.device("cpu"), page_size=16,
                      seed=0, comm_cost=cost)
    comm = emulation.comm
    model = emulation.serving.model
    assert isinstance(comm, ModeledCommunicator) and model.comm is comm
    for step in steps:
        plan = emulation.plan_for(step)
        comm.reset()
        logits, _ = emulation.serving.forward(plan)
        tally = comm.tally()
        counting = CountingCommunicator(2, cost)
        for module in model.modules():  # the same model, counted in Python instead
            if getattr(module, "comm", None) is comm:
                module.comm = counting
        try:
            emulation.serving.forward(plan)
        finally:
            for module in model.modules():
                if getattr(module, "comm", None) is counting:
                    module.comm = comm
        assert (tally.calls, tally.bytes) == (counting.calls, counting.bytes), step
        assert tally.calls >= 2 * config.num_hidden_layers  # a mixer and an MLP/MoE all-reduce per layer
        assert tally.seconds == pytest.approx(counting.seconds, abs=tally.calls * 1e-9)  # ns rounding per call
        assert tally.seconds > tally.calls * cost.latency_s  # some messages pass small_bytes: bandwidth is charged
        assert torch.isfinite(logits).all()


def test_sharded_latent_layout_adds_two_collectives_per_moe_layer():
    config = first_layers(parse_config(tiny_k3_raw_config()), 4)
    step = Step("decode", 2, 1, 8)
    calls = {}
    for latent in (False, True):
        emulation = build(config, ShardingPlan(2, 0, 1, latent), [step], dtype=torch.float32,
                          device=torch.device("cpu"), page_size=16, seed=0, comm_cost=CollectiveCost())
        emulation.comm.reset()
        logits, _ = emulation.serving.forward(emulation.plan_for(step))
        assert torch.isfinite(logits).all()
        calls[latent] = emulation.comm.tally().calls
    moe_layers = sum(config.is_moe_layer(i) for i in range(config.num_hidden_layers))
    assert moe_layers > 0 and calls[True] - calls[False] == 2 * moe_layers


def sharded_latent_prefill_tally(monkeypatch, module, constant: str, threshold: int, step: Step,
                                 cost: CollectiveCost):
    """The modeled tally of one prefill `step` of the 4-layer tiny model over TP2 sharded-latent ranks, with
    `module.constant` (a size from which a large-step path is taken) set to `threshold`."""
    monkeypatch.setattr(module, constant, threshold)
    emulation = build(first_layers(parse_config(tiny_k3_raw_config()), 4), ShardingPlan(2, 0, 1, True), [step],
                      dtype=torch.float32, device=torch.device("cpu"), page_size=16, seed=0, comm_cost=cost)
    emulation.comm.reset()
    logits, _ = emulation.serving.forward(emulation.plan_for(step))
    assert torch.isfinite(logits).all()
    return emulation.comm.tally()


def test_large_prefill_steps_reduce_scatter_the_routed_latent(monkeypatch):
    """From REDUCE_SCATTER_MIN_TOKENS tokens (lowered to fit the tiny model) a sharded-latent MoE layer
    reduce-scatters its routed latent and all-reduces the rows' square sums: one collective more a MoE layer, and
    the latent's link traffic halved (the cost model's bandwidth term made to dominate here)."""
    config = first_layers(parse_config(tiny_k3_raw_config()), 4)
    step = Step("prefill", 1, 24, 0)
    cost = CollectiveCost(latency_s=4e-6, small_bytes=0, bytes_per_s=1e6)
    whole, scattered = (sharded_latent_prefill_tally(monkeypatch, moe_module, "REDUCE_SCATTER_MIN_TOKENS", threshold,
                                                     step, cost) for threshold in (10**9, 16))
    moe_layers = sum(config.is_moe_layer(i) for i in range(config.num_hidden_layers))
    assert scattered.calls - whole.calls == moe_layers
    assert scattered.bytes - whole.bytes == moe_layers * step.rows * 4  # the [T] fp32 square sums
    latent_bytes = step.rows * config.moe_input_size * 4  # one routed latent message (fp32 here)
    saved = moe_layers * (0.5 * latent_bytes / cost.bytes_per_s - cost.latency_s - step.rows * 4 / cost.bytes_per_s)
    assert whole.seconds - scattered.seconds == pytest.approx(saved, rel=1e-3)


def test_sequence_parallel_prefill_trades_each_all_reduce_for_its_halves(monkeypatch):
    """With the stream's rows split over the ranks (SEQUENCE_PARALLEL_MIN_ROWS lowered to fit the tiny model), each
    sublayer's all-reduce becomes a reduce-scatter and the next input's all-gather: the same link traffic, one more
    latency a sublayer, and one more gather for the output head's input."""
    config = first_layers(parse_config(tiny_k3_raw_config()), 4)
    step = Step("prefill", 1, 24, 0)
    cost = CollectiveCost(latency_s=4e-6, small_bytes=0, bytes_per_s=1e6)
    whole, rows = (sharded_latent_prefill_tally(monkeypatch, sequence_parallel, "SEQUENCE_PARALLEL_MIN_ROWS",
                                                threshold, step, cost) for threshold in (10**9, 16))
    layers = config.num_hidden_layers
    assert rows.calls - whole.calls == 2 * layers + 1
    hidden_bytes = step.rows * config.hidden_size * 4  # one [T, D] fp32 message
    expect = (2 * layers + 1) * cost.latency_s + 0.5 * hidden_bytes / cost.bytes_per_s
    assert rows.seconds - whole.seconds == pytest.approx(expect, rel=1e-3)
