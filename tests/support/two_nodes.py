"""Two "nodes" on loopback for the multi-node tests: two `mstar-serve --nnodes 2 --node-rank N` process
trees (each in a session of its own, with two local ranks) serving configs/kimi_k3_tiny_tp4_ep2.yaml."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
from paths import CONFIGS, ROOT
from processes import descendants, free_port, gone, is_spawned_rank

CONFIG = CONFIGS / "kimi_k3_tiny_tp4_ep2.yaml"
MODEL = "kimi_k3_tiny"


def overrides(tiny_dirs: tuple[Path, Path], dspark: bool = False) -> list[str]:
    """Small pools for the tiny model; with `dspark`, its draft at k = 3."""
    target_dir, draft_dir = tiny_dirs
    small = [f"checkpoint={target_dir}", "max_seq_len=512", "resources.mla_kv.max_num_pages=64",
             "scheduler.max_num_batched_tokens=128"]
    if dspark:  # a decode step of 16 rows x (1 + 3 drafts) fits the 128 tokens
        small += ["model_kwargs.speculative_tokens=3", f"model_kwargs.speculative_draft={draft_dir}",
                  "scheduler.max_num_seqs=16"]
    return small


class Node:
    """One node's mstar-serve; node 0 serves HTTP on `http_port`."""

    def __init__(self, node_rank: int, master_port: int, log_path: Path, config_overrides: list[str], *,
                 http_port: int | None = None, rendezvous_timeout: float = 120):
        self.log_path = log_path
        args = [sys.executable, "-m", "mstar.serve", "--config", str(CONFIG), "--nnodes", "2",
                "--node-rank", str(node_rank), "--master-addr", "127.0.0.1", "--master-port", str(master_port),
                "--nproc-per-node", "2", "--tensor-comm-protocol", "GLOO",
                "--rendezvous-timeout", str(rendezvous_timeout)]
        if http_port is not None:
            args += ["--port", str(http_port)]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        with open(log_path, "w") as log:
            self.proc = subprocess.Popen(args + config_overrides, env=env, stdout=log, stderr=subprocess.STDOUT,
                                         cwd=ROOT, start_new_session=True)
        self.tree: list[int] = []  # the launcher's descendants once the node is up: its ranks, a resource tracker

    def log(self) -> str:
        return self.log_path.read_text()

    def kill_tree(self) -> None:
        for pid in [self.proc.pid, *self.tree]:
            if not gone(pid):
                os.kill(pid, signal.SIGKILL)

    def all_gone(self) -> bool:
        return self.proc.poll() is not None and all(gone(pid) for pid in self.tree)


class TwoNodes:
    def __init__(self, tmp_path: Path, config_overrides: list[str]):
        master_port, http_port = free_port(), free_port()
        self.url = f"http://127.0.0.1:{http_port}"
        self.node0 = Node(0, master_port, tmp_path / "node0.log", config_overrides, http_port=http_port)
        self.node1 = Node(1, master_port, tmp_path / "node1.log", config_overrides)

    def logs(self) -> str:
        return f"--- node 0:\n{self.node0.log()}\n--- node 1:\n{self.node1.log()}"

    def wait_ready(self, timeout: float = 240) -> TwoNodes:
        deadline = time.monotonic() + timeout
        while True:
            for node in (self.node0, self.node1):
                assert node.proc.poll() is None, f"a node exited with {node.proc.returncode}:\n{self.logs()}"
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, f"the nodes did not come up:\n{self.logs()}"
            time.sleep(0.3)
        for node, ranks in ((self.node0, 1), (self.node1, 2)):  # node 0's launcher is rank 0 itself
            node.tree = descendants(node.proc.pid)
            assert sum(map(is_spawned_rank, node.tree)) == ranks, (node.tree, self.logs())
        return self

    def close(self) -> None:
        for node in (self.node0, self.node1):
            node.kill_tree()
            node.proc.wait(10)


def complete_all(url: str, jobs) -> list[list[int] | None]:
    """The jobs' (prompt, max_tokens, _) greedy completions, sent at once (they share the ranks' steps)."""
    outputs: list[list[int] | None] = [None] * len(jobs)

    def one(i: int, prompt: list[int], max_tokens: int) -> None:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "return_token_ids": True,
                "temperature": 0, "ignore_eos": True}
        outputs[i] = httpx.post(url + "/v1/completions", json=body, timeout=120).json()["choices"][0]["token_ids"]

    threads = [threading.Thread(target=one, args=(i, prompt, n)) for i, (prompt, n, _) in enumerate(jobs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(150)
    return outputs
