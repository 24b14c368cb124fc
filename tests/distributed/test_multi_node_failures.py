"""Failures across nodes: killing node 0's process tree ends node 1 within 10 s (tests/support/two_nodes.py);
a node pointed at a master that is not there says where it looked and how long, and exits 4; in one
process: node 0 names the nodes that never joined, SHM is refused across nodes, the beats find a silent
node or a dead store, and the setup leaves the API keys on node 0."""

from __future__ import annotations

import pickle
import re
import time
from datetime import timedelta

import pytest
import torch.distributed as dist
from live_server import wait_until
from processes import free_port
from two_nodes import Node

from mstar.config import EngineConfig, Environment, parse_serve_config
from mstar.distributed.comm_choice import CommConfig
from mstar.distributed.launch import EXIT_NO_MASTER
from mstar.distributed.node_beats import NodeBeats
from mstar.distributed.rendezvous import Rendezvous, RendezvousError
from mstar.distributed.worker import EXIT_RANK_FAILED, build_tp_engine, follower_setup, start_ranks
from mstar.models.kimi_k3.tokenizer import KimiTokenizer


def test_killing_node0_ends_node1(two_nodes):
    start = time.monotonic()
    two_nodes.node0.kill_tree()
    status = two_nodes.node1.proc.wait(timeout=30)
    elapsed = time.monotonic() - start
    assert status == EXIT_RANK_FAILED, two_nodes.logs()
    assert elapsed < 10, f"node 1 took {elapsed:.1f} s to stop"
    assert wait_until(two_nodes.node1.all_gone, 5), "a rank of node 1 outlived it"
    assert "node 1: " in two_nodes.node1.log() and "stopping its 2 ranks" in two_nodes.node1.log()


def test_a_node_without_its_master_says_where_it_looked_and_exits(tiny_dir, tmp_path):
    port = free_port()  # nothing listens there
    node = Node(1, port, tmp_path / "node1.log", [f"checkpoint={tiny_dir}"], rendezvous_timeout=2)
    try:
        assert node.proc.wait(timeout=90) == EXIT_NO_MASTER, node.log()
    finally:
        node.kill_tree()
    found = re.search(rf"could not reach node 0 at 127\.0\.0\.1:{port} .* in ([0-9.]+) s \(--rendezvous-timeout 2\)",
                      node.log())
    assert found, node.log()
    assert 1.5 <= float(found.group(1)) <= 4, "it did not wait for its rendezvous timeout, or far longer"


def test_node0_names_the_nodes_that_never_joined(tiny_dir):
    """One rank per node, so node 0 spawns nothing: it waits for node 1 for the rendezvous timeout, then says so."""
    engine = EngineConfig(max_seq_len=64, resources={"mla_kv": {"page_size": 16, "max_num_pages": 8},
                                                     "kda_state": {"max_slots": 3}},
                          scheduler={"max_num_seqs": 2, "max_num_batched_tokens": 32})
    rdzv = Rendezvous("127.0.0.1", free_port(), nnodes=2, node_rank=0, nproc_per_node=1, timeout_s=1.5)
    start = time.monotonic()
    with pytest.raises(RendezvousError, match=r"node\(s\) 1 did not join within 1.5 s \(--rendezvous-timeout\)"):
        start_ranks(tiny_dir, KimiTokenizer.from_dir(tiny_dir), engine, tp_size=2, rendezvous=rdzv)
    assert time.monotonic() - start < 10


def test_symmetric_memory_is_refused_across_nodes(tiny_dir):
    cfg = parse_serve_config({"model": "kimi_k3", "checkpoint": str(tiny_dir), "tp_size": 16, "device": "cuda"})
    rdzv = Rendezvous("10.0.0.1", 29500, nnodes=2, node_rank=0, nproc_per_node=8)
    with pytest.raises(ValueError, match="ranks of 2 nodes need --tensor-comm-protocol NCCL"):
        build_tp_engine(cfg, None, device="cuda", tensor_comm_protocol="SHM", rendezvous=rdzv)


def test_beats_find_a_silent_node_and_a_dead_store():
    store = dist.TCPStore("127.0.0.1", 0, None, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=5))
    lost: list[str] = []
    watcher = NodeBeats("127.0.0.1", store.port, 0, [1, 2], interval_s=0.1, timeout_s=1.0, on_lost=lost.append)
    node1 = NodeBeats("127.0.0.1", store.port, 1, [0], interval_s=0.1, timeout_s=1.0)
    watcher.start()
    node1.start()
    time.sleep(1.5)  # node 2 never beats: not watched yet (the rendezvous timeout covers it)
    assert lost == [] and node1.lost is None
    node1.stop()  # node 1 goes silent
    assert wait_until(lambda: lost, 3), "the silent node was not noticed"
    assert len(lost) == 1 and lost[0].startswith("node 1 sent no heartbeat for "), lost

    follower = NodeBeats("127.0.0.1", store.port, 1, [0], interval_s=0.1, timeout_s=1.0).start()
    time.sleep(0.3)
    watcher.stop()
    del store  # node 0's store ends
    assert wait_until(lambda: follower.lost is not None, 5), "the lost store was not noticed"
    assert "node 0" in follower.lost


def test_the_setup_sent_to_other_nodes_holds_no_api_key(tiny_dir):
    secret = "sk-never-leaves-node-0"
    cfg = parse_serve_config({"model": "kimi_k3", "checkpoint": str(tiny_dir), "tp_size": 4,
                              "server": {"api_keys": [secret + "-config"]}})
    env = Environment.read({"MSTAR_API_KEY": secret + "-env"})
    setup = follower_setup(cfg, env, checkpoint=str(tiny_dir), tp_size=4, ep_size=1, dtype=None, device_type="cpu",
                           comm=CommConfig(), store_host="10.0.0.1", store_port=29500, nproc_per_node=2)
    raw = pickle.dumps(setup)
    assert secret.encode() not in raw
    assert pickle.loads(raw).engine.max_seq_len == cfg.max_seq_len and setup.env.api_keys == ()
    assert setup.nnodes == 2 and setup.device(3).type == "cpu"
