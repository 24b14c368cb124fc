"""The multi-node rendezvous: flags over torchrun's environment, and the errors for what does not fit."""

from __future__ import annotations

import argparse
import random

import pytest

from mstar.config import Environment
from mstar.distributed.rendezvous import RendezvousError, add_rendezvous_args, resolve_rendezvous


def resolve(argv: list[str], tp_size: int, environ: dict[str, str] | None = None):
    parser = argparse.ArgumentParser()
    add_rendezvous_args(parser)
    return resolve_rendezvous(parser.parse_args(argv), tp_size, environ or {})


def test_one_node_by_default():
    rdzv = resolve([], tp_size=4)
    assert (rdzv.nnodes, rdzv.node_rank, rdzv.nproc_per_node, rdzv.master_port) == (1, 0, 4, 0)
    assert not rdzv.multi_node and list(rdzv.local_ranks()) == [0, 1, 2, 3]


def test_flags_give_the_global_ranks():
    nnodes, nproc = random.randint(2, 4), random.randint(1, 8)
    node = random.randrange(nnodes)
    rdzv = resolve(["--nnodes", str(nnodes), "--node-rank", str(node), "--master-addr", "10.0.0.1",
                    "--master-port", "29500"], tp_size=nnodes * nproc)
    assert (rdzv.master_addr, rdzv.master_port, rdzv.nproc_per_node) == ("10.0.0.1", 29500, nproc)
    assert [rdzv.global_rank(i) for i in range(nproc)] == list(rdzv.local_ranks())
    assert rdzv.global_rank(0) == node * nproc and rdzv.world_size == nnodes * nproc
    with pytest.raises(RendezvousError, match="local rank"):
        rdzv.global_rank(nproc)


def test_torchrun_environment():
    env = {"MASTER_ADDR": "node0", "MASTER_PORT": "29400", "WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8",
           "GROUP_RANK": "1"}
    rdzv = resolve([], tp_size=16, environ=env)
    assert (rdzv.master_addr, rdzv.master_port, rdzv.nnodes, rdzv.node_rank, rdzv.nproc_per_node) == \
        ("node0", 29400, 2, 1, 8)
    assert list(rdzv.local_ranks()) == list(range(8, 16))
    # NNODES / NODE_RANK win over the torchrun-derived values, and flags win over both.
    env |= {"NNODES": "4", "NODE_RANK": "3", "LOCAL_WORLD_SIZE": "4"}
    assert resolve([], tp_size=16, environ=env).node_rank == 3
    assert resolve(["--node-rank", "2"], tp_size=16, environ=env).node_rank == 2


def test_errors_name_what_to_fix():
    two = ["--nnodes", "2", "--master-addr", "a", "--master-port", "1"]
    with pytest.raises(RendezvousError, match="tp_size=6 but 2 node"):
        resolve(two + ["--nproc-per-node", "2"], tp_size=6)
    with pytest.raises(RendezvousError, match="does not split over 2 nodes"):
        resolve(two, tp_size=3)
    with pytest.raises(RendezvousError, match="--node-rank 2 is outside 0..1"):
        resolve(two + ["--node-rank", "2"], tp_size=4)
    with pytest.raises(RendezvousError, match="--master-addr and --master-port"):
        resolve(["--nnodes", "2"], tp_size=4)
    with pytest.raises(RendezvousError, match="MASTER_PORT='x'"):
        resolve([], tp_size=1, environ={"MASTER_PORT": "x"})


def test_mstar_serve_reads_torchrun_variables_through_its_environment():
    """serve.py passes `Environment.read().rendezvous()`: the variables set, under torchrun's names."""
    env = Environment.read({"MASTER_ADDR": "node0", "MASTER_PORT": "29400", "WORLD_SIZE": "8",
                            "LOCAL_WORLD_SIZE": "4", "GROUP_RANK": "1", "MSTAR_API_KEY": "k"})
    assert env.rendezvous() == {"MASTER_ADDR": "node0", "MASTER_PORT": "29400", "WORLD_SIZE": "8",
                                "LOCAL_WORLD_SIZE": "4", "GROUP_RANK": "1"}
    rdzv = resolve(["--rendezvous-timeout", "7"], tp_size=8, environ=env.rendezvous())
    assert (rdzv.nnodes, rdzv.node_rank, rdzv.nproc_per_node, rdzv.timeout_s) == (2, 1, 4, 7.0)
    with pytest.raises(RendezvousError, match="--rendezvous-timeout 0"):
        resolve(["--rendezvous-timeout", "0"], tp_size=1)
