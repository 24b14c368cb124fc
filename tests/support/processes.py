"""Process helpers for tests that start servers and ranks: free ports, process trees, exited processes."""

from __future__ import annotations

import socket
from pathlib import Path

from mstar.distributed.worker import RANK_NAME


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return True
    return state in ("Z", "X")  # exited (a zombie until whoever adopted it reaps it)


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (children, their children, ...)."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except OSError:
                continue
    found, frontier = [], [pid]
    while frontier:
        children = [child for child, parent in parents.items() if parent in frontier]
        found += children
        frontier = children
    return found


def is_spawned_rank(pid: int) -> bool:
    """A follower rank (mstar/distributed/worker.py names them mstar-rankN), not multiprocessing's resource
    tracker nor a tokenizer worker, which are spawned the same way."""
    try:
        return Path(f"/proc/{pid}/comm").read_text().startswith(RANK_NAME)
    except OSError:
        return False
