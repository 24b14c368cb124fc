"""Nodes that watch each other through the rendezvous store: how a node that goes silent is noticed.

A rank that dies next to its peers closes its sockets, and gloo / NCCL fail the next collective at once
(worker.py turns that into a stop). A node that loses power, or a network that splits, closes nothing:
the other ranks would wait in their collectives until the groups' timeouts. So each node's launcher
counts up a key of its own in the TCPStore (hosted by rank 0 on node 0) every `interval_s`, and reads
the counters of the nodes it depends on: node 0 watches every other node, every other node watches node
0. A counter that does not move for `timeout_s`, a store that fails, or one that stops answering for
that long, means the node is gone; so does a failure the node reported itself (`report`, naming the
rank that died). The watcher then ends its own ranks (worker.py, launch.py).

A node counts as watched from its first beat: until then the rendezvous timeout covers it. The beats
run on a store connection of their own: a TCPStore client runs one operation at a time, and the waits
of init_process_group (for the slowest rank, minutes on a large checkpoint) would hold the beat back.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Sequence
from datetime import timedelta

import torch.distributed as dist


def alive_key(node_rank: int) -> str:
    return f"mstar/alive/{node_rank}"


def failed_key(node_rank: int) -> str:
    """Set by a node's launcher to why it is ending its ranks, so that the nodes watching it can say."""
    return f"mstar/failed/{node_rank}"


def stopped_key(node_rank: int) -> str:
    """Set by a node's launcher when its ranks ended after rank 0's STOP; rank 0 keeps the store up until
    every node has set it (or its stop timeout passed), so an orderly end never looks like a lost master."""
    return f"mstar/stopped/{node_rank}"


class NodeBeats:
    """One node's beat in the store and its watch over `watched` nodes, in a daemon thread.
    When a watched node or the store is gone, `lost` says why and `on_lost(message)`, if given, is called
    once (from that thread, or from the caller of `check_store`)."""

    def __init__(self, host: str, port: int, node_rank: int, watched: Sequence[int], *, interval_s: float,
                 timeout_s: float, on_lost: Callable[[str], None] | None = None):
        self.store = dist.TCPStore(host, port, None, is_master=False, timeout=timedelta(seconds=timeout_s))
        self.node_rank = node_rank
        self.watched = tuple(watched)
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.on_lost = on_lost
        self.lost: str | None = None
        self._last_answer = time.monotonic()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="mstar-node-beats", daemon=True)

    def start(self) -> NodeBeats:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def report(self, message: str, wait_s: float = 1.0) -> None:
        """Tell the nodes watching this one why it ends its ranks. Best effort, for at most `wait_s`: the
        store may be gone, or hang (and its client may be held by the beat thread)."""

        def send() -> None:
            with contextlib.suppress(RuntimeError):
                self.store.set(failed_key(self.node_rank), message)

        sender = threading.Thread(target=send, name="mstar-node-report", daemon=True)
        sender.start()
        sender.join(wait_s)

    def check_store(self) -> None:
        """Called by the owner's own loop: a store that hangs (its host stopped answering) blocks the beat
        thread, which then cannot say so itself."""
        silent = time.monotonic() - self._last_answer
        if silent > self.timeout_s + self.interval_s:
            self._lose(f"the rendezvous store (on node 0) has not answered for {silent:.0f} s")

    def _lose(self, message: str) -> None:
        with self._lock:
            if self.lost is not None or self._stop.is_set():
                return
            self.lost = message
        if self.on_lost is not None:
            self.on_lost(message)

    def _run(self) -> None:
        changed: dict[int, tuple[int, float]] = {}  # node -> (its counter, when this node saw it move)
        while not self._stop.is_set():
            try:
                self.store.add(alive_key(self.node_rank), 1)
                now = time.monotonic()
                for node in self.watched:
                    if self.store.check([failed_key(node)]):
                        self._lose(f"node {node} failed: {self.store.get(failed_key(node)).decode()}")
                        return
                    count = self.store.add(alive_key(node), 0)
                    if count == 0:
                        continue  # not started yet
                    if node not in changed or changed[node][0] != count:
                        changed[node] = (count, now)
                    elif now - changed[node][1] > self.timeout_s:
                        self._lose(f"node {node} sent no heartbeat for {now - changed[node][1]:.0f} s (it stopped, "
                                   "or the network between the nodes is down)")
                        return
                self._last_answer = time.monotonic()
            except Exception as e:  # the store's host (node 0) is gone
                self._lose(f"the rendezvous store (on node 0) failed: {type(e).__name__}: {str(e).splitlines()[0]}")
                return
            self._stop.wait(self.interval_s)
