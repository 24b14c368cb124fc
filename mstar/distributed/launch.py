"""The launcher of every node but node 0: join node 0's store, start this node's ranks, watch them.

    node 0:  mstar-serve --config C --nnodes 2 --node-rank 0 --master-addr A --master-port P   (rank 0: HTTP)
    node n:  mstar-serve --config C --nnodes 2 --node-rank n --master-addr A --master-port P   (this module)

Node n serves no HTTP and holds no request state. It waits (up to --rendezvous-timeout) for the
TCPStore that rank 0 opened at A:P, reads rank 0's RankSetup from it (the engine config without the
server section: no API key leaves node 0), spawns ranks n * nproc .. n * nproc + nproc - 1 with
`follower_main`, beats in the store and watches node 0's beat (node_beats.py). Of this node's config
only the checkpoint path counts (each node may mount the checkpoint elsewhere); rank 0 decides the rest.

It exits with
- 0 when all its ranks exited 0 (rank 0 drained and sent STOP), after telling the store;
- EXIT_RANK_FAILED (3) when one of its ranks died, or node 0 is gone or silent: it kills its other
  ranks first, so that nothing of the job outlives it;
- EXIT_NO_MASTER (4) when node 0's store did not answer within the rendezvous timeout;
- 2 (mstar-serve's) when its config or flags do not fit node 0's.
SIGTERM and Ctrl-C: rank 0 decides when the ranks stop (node 0 drains, then every node ends with 0), so
the first one is only logged; a second one kills this node's ranks at once (status 3; node 0 then stops
too).
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing.connection
import os
import pickle
import signal
import socket
import sys
import time
from dataclasses import replace
from datetime import timedelta

import torch
import torch.distributed as dist

from mstar.config import ServeConfig

from .node_beats import NodeBeats, stopped_key
from .rendezvous import Rendezvous, RendezvousError
from .worker import EXIT_RANK_FAILED, RANK_NAME, SETUP_KEY, RankSetup, follower_main

log = logging.getLogger("mstar.distributed")

EXIT_NO_MASTER = 4


class NoMasterError(RuntimeError):
    """Node 0's store did not answer within the rendezvous timeout."""


def connect_to_master(rdzv: Rendezvous) -> dist.TCPStore:
    """Node 0's TCPStore, once its port accepts connections (retried until the rendezvous timeout: node 0
    may start later than this node)."""
    where = f"{rdzv.master_addr}:{rdzv.master_port}"
    start = time.monotonic()
    deadline = start + rdzv.timeout_s
    while True:
        remaining = deadline - time.monotonic()
        try:
            with socket.create_connection((rdzv.master_addr, rdzv.master_port), timeout=max(0.1, min(2.0, remaining))):
                break
        except OSError as e:
            if time.monotonic() + 0.5 > deadline:
                raise NoMasterError(
                    f"node {rdzv.node_rank} could not reach node 0 at {where} (--master-addr, --master-port) in "
                    f"{time.monotonic() - start:.1f} s (--rendezvous-timeout {rdzv.timeout_s:g}): "
                    f"{e.strerror or type(e).__name__}. Start mstar-serve --node-rank 0 there, and check that the "
                    "address is node 0's as this node sees it and that the port is open between the nodes") from None
        time.sleep(0.5)
    try:
        return dist.TCPStore(rdzv.master_addr, rdzv.master_port, None, is_master=False,
                             timeout=timedelta(seconds=max(5.0, deadline - time.monotonic())))
    except RuntimeError as e:
        raise NoMasterError(f"node {rdzv.node_rank}: {where} accepts connections but is not node 0's rendezvous "
                            f"store: {str(e).splitlines()[0]}") from None


def read_setup(store: dist.TCPStore, rdzv: Rendezvous, cfg: ServeConfig) -> RankSetup:
    """Rank 0's RankSetup, checked against this node's rendezvous, with this node's checkpoint path."""
    try:
        setup: RankSetup = pickle.loads(store.get(SETUP_KEY))
    except RuntimeError as e:
        raise NoMasterError(f"node {rdzv.node_rank}: node 0's store at {rdzv.master_addr}:{rdzv.master_port} "
                            f"holds no setup: {str(e).splitlines()[0]}") from None
    if setup.tp_size != rdzv.world_size or setup.nproc_per_node != rdzv.nproc_per_node:
        raise RendezvousError(
            f"node 0 runs tp_size={setup.tp_size} as {setup.nnodes} node(s) x {setup.nproc_per_node} rank(s), but this "
            f"node (--node-rank {rdzv.node_rank}) has {rdzv.nnodes} x {rdzv.nproc_per_node}: give every node the same "
            "config tp_size, --nnodes and --nproc-per-node")
    return replace(setup, checkpoint=str(cfg.checkpoint))


class NodeRanks:
    """This node's rank processes, watched until they all end or one of them (or node 0) fails."""

    def __init__(self, setup: RankSetup, rdzv: Rendezvous, store: dist.TCPStore):
        self.rdzv = rdzv
        self.store = store
        self.beats = NodeBeats(rdzv.master_addr, rdzv.master_port, rdzv.node_rank, [0],
                               interval_s=setup.timeouts.heartbeat_s, timeout_s=setup.timeouts.node_silence_s)
        context = torch.multiprocessing.get_context("spawn")
        self.processes = {rank: context.Process(target=follower_main, args=(setup, rank, os.getpid()),
                                                name=f"{RANK_NAME}{rank}") for rank in rdzv.local_ranks()}
        self.signals: list[int] = []

    def run(self) -> int:
        """Start the ranks and watch them; the exit status of this node (see the module docstring)."""
        self.beats.start()  # before the ranks: rank 0 waits for this node's first beat
        atexit.register(self.kill)
        for p in self.processes.values():
            p.start()
        log.info("node %d: started ranks %s (pids %s) for node 0 at %s:%d", self.rdzv.node_rank, list(self.processes),
                 [p.pid for p in self.processes.values()], self.rdzv.master_addr, self.rdzv.master_port)
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, self._on_signal)
        try:
            return self._watch()
        finally:
            self.beats.stop()
            self.kill()
            atexit.unregister(self.kill)

    def _on_signal(self, signum: int, frame) -> None:
        self.signals.append(signum)
        if len(self.signals) == 1:
            log.warning("node %d: %s: node 0 decides when the ranks stop (stop it to drain); send it again to "
                        "kill this node's ranks now", self.rdzv.node_rank, signal.Signals(signum).name)

    def _watch(self) -> int:
        while True:
            living = [p for p in self.processes.values() if p.exitcode is None]
            if not living:
                break
            multiprocessing.connection.wait([p.sentinel for p in living], timeout=0.25)
            for rank, p in self.processes.items():
                if p.exitcode not in (None, 0):
                    return self._fail(f"rank {rank} (pid {p.pid}) exited with status {p.exitcode}")
            self.beats.check_store()
            if self.beats.lost is not None:
                return self._fail(f"node 0 is gone: {self.beats.lost}", tell_node0=False)
            if len(self.signals) > 1:
                return self._fail(f"{signal.Signals(self.signals[-1]).name} again")
        try:
            self.store.set(stopped_key(self.rdzv.node_rank), "1")
        except RuntimeError as e:
            log.warning("node %d: could not tell node 0 that its ranks stopped: %s", self.rdzv.node_rank, e)
        log.info("node %d: its ranks stopped", self.rdzv.node_rank)
        return 0

    def _fail(self, message: str, tell_node0: bool = True) -> int:
        log.critical("node %d: %s; stopping its %d ranks, exiting with status %d", self.rdzv.node_rank, message,
                     len(self.processes), EXIT_RANK_FAILED)
        if tell_node0:  # first, so that rank 0 names the cause rather than the broken connections that follow
            self.beats.report(message)
        self.kill()
        return EXIT_RANK_FAILED

    def kill(self) -> None:
        """SIGKILL every rank of this node still alive and reap it."""
        for p in self.processes.values():
            if p.is_alive():
                p.kill()
        for p in self.processes.values():
            p.join(5)


def serve_node(cfg: ServeConfig, rdzv: Rendezvous) -> int:
    """mstar-serve on a node other than 0: its exit status (see the module docstring). A config that does
    not fit node 0's raises RendezvousError."""
    if rdzv.node_rank == 0:
        raise ValueError("node 0 runs rank 0 (mstar-serve's HTTP path), not serve_node")
    try:
        store = connect_to_master(rdzv)
        setup = read_setup(store, rdzv, cfg)
    except NoMasterError as e:
        print(f"mstar-serve: {e}", file=sys.stderr)
        return EXIT_NO_MASTER
    return NodeRanks(setup, rdzv, store).run()
