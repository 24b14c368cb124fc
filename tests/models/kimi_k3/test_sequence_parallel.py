"""Sequence parallelism of the AttnRes stream (sequence_parallel.py): TP2 ranks as threads (tests/support/lockstep.py)
of the sharded-latent tiny model, each mixing its half of the rows, give the single rank's hidden states and taps;
the row collectives; when a step shards its rows. Without CUDA the GPU ops run in Triton's interpreter (fp32)."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from lockstep import Lockstep, LockstepCommunicator  # noqa: E402

from mstar.distributed.communicator import NullCommunicator  # noqa: E402
from mstar.distributed.loader import load_rank_model  # noqa: E402
from mstar.distributed.sharding import ShardingPlan  # noqa: E402
from mstar.models.kimi_k3 import sequence_parallel  # noqa: E402
from mstar.models.kimi_k3.gpu_ops import GpuLayerOps  # noqa: E402
from mstar.models.kimi_k3.layer_ops import LayerOps  # noqa: E402
from mstar.models.kimi_k3.model import dense_mixer  # noqa: E402
from mstar.models.kimi_k3.sequence_parallel import shards_rows  # noqa: E402


def rel(a, b):
    return float((a - b).norm() / b.norm())


def test_row_collectives_cut_and_stack_rows():
    lockstep = Lockstep(2)
    xs = [torch.randn(6, 5) for _ in range(2)]

    def body(rank):
        comm = LockstepCommunicator(lockstep, rank)
        return comm.reduce_scatter_rows(xs[rank]), comm.all_gather_rows(xs[rank])

    (s0, g0), (s1, g1) = lockstep.run(body)
    total = xs[0] + xs[1]
    assert torch.equal(torch.cat([s0, s1]), total)
    assert torch.equal(g0, torch.cat(xs)) and torch.equal(g1, g0)
    with pytest.raises(ValueError, match="do not divide"):
        NullCommunicator(4, 1).piece_rows(torch.zeros(6, 2))


@pytest.mark.parametrize("gpu_ops", [False, True], ids=["reference-ops", "gpu-ops"])
def test_tp2_ranks_mixing_half_the_rows_equal_the_single_rank(tiny_dir, tiny_model, monkeypatch, gpu_ops):
    """Each rank holds half of the stream's rows (SEQUENCE_PARALLEL_MIN_ROWS lowered to fit the test); the
    sublayers' partial sums are reduce-scattered into them and the mixes' outputs gathered whole: every rank's final
    hidden states and DSpark taps are the single rank's (fp32 rounding). With the GPU ops the stream also reads its
    closed blocks' stats from a table of its own rows."""
    monkeypatch.setattr(sequence_parallel, "SEQUENCE_PARALLEL_MIN_ROWS", 8)
    whole = tiny_model.model
    ids = torch.randint(0, whole.config.vocab_size - 256, (10,))
    taps = (1, 3)
    with torch.no_grad():
        expect, expect_taps = whole(ids, dense_mixer(whole, tiny_model.new_state(), False), taps)
    lockstep = Lockstep(2)
    models = [load_rank_model(tiny_dir, ShardingPlan(2, rank, latent_sharded=True),
                              LockstepCommunicator(lockstep, rank)) for rank in range(2)]
    opses = [GpuLayerOps() if gpu_ops else LayerOps() for _ in range(2)]
    for model in models:
        assert shards_rows(model.model, model.model.comm, len(ids))

    def forward(rank):
        model = models[rank]
        with torch.no_grad():
            return model.model(ids, dense_mixer(model.model, model.new_state(), False), taps, opses[rank])

    for hidden, got_taps in lockstep.run(forward):
        assert hidden.shape == expect.shape and rel(hidden, expect) < 1e-5, rel(hidden, expect)
        for got, want in zip(got_taps, expect_taps, strict=True):
            assert rel(got, want) < 1e-5


def test_steps_shard_their_rows_only_where_it_pays_and_fits(tiny_dir, tiny_model):
    """Several ranks, SEQUENCE_PARALLEL_MIN_ROWS rows or more dividing evenly, every MoE output a partial sum."""
    rows = sequence_parallel.SEQUENCE_PARALLEL_MIN_ROWS
    assert not shards_rows(tiny_model.model, NullCommunicator(), rows)  # one rank
    sharded = load_rank_model(tiny_dir, ShardingPlan(2, 0, latent_sharded=True), NullCommunicator(2, 0)).model
    assert shards_rows(sharded, sharded.comm, rows) and not shards_rows(sharded, sharded.comm, rows - 2)
    assert not shards_rows(sharded, sharded.comm, rows + 1)
    replicated = load_rank_model(tiny_dir, ShardingPlan(2, 0), NullCommunicator(2, 0)).model
    assert not shards_rows(replicated, replicated.comm, rows)  # its MoE layers reduce inside
