"""Where a node's ranks meet the others: the rendezvous contract torchrun, Slurm and Kubernetes set.

Every node runs one launcher (`mstar-serve ... --nnodes 2 --node-rank N`), which starts that node's
local ranks. The contract is torchrun's: the master's address and port (node 0 listens there), the
number of nodes, this node's rank, and the ranks per node. Each comes from a flag or, when the flag is
not given, from torchrun's environment variable (so a job script under torchrun, or one that exports
the same names from Slurm's or a Kubernetes job's variables, needs no flags):

    flag                 environment                                  default
    --master-addr        MASTER_ADDR                                  127.0.0.1
    --master-port        MASTER_PORT                                  a free port (one node only)
    --nnodes             NNODES, else WORLD_SIZE / LOCAL_WORLD_SIZE   1
    --node-rank          NODE_RANK, else GROUP_RANK                   0
    --nproc-per-node     LOCAL_WORLD_SIZE                             tp_size / nnodes
    --rendezvous-timeout                                              300 s

The rendezvous timeout bounds how long the nodes wait for each other at startup: a node other than 0 for
node 0's store to answer, node 0 for every other node to join. Either one that waits longer says who it
waited for and exits non-zero.

Global rank = node_rank * nproc_per_node + local rank, so node 0's local rank 0 is rank 0 (it serves
HTTP); tp_size must equal nnodes * nproc_per_node.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from dataclasses import dataclass

DEFAULT_TIMEOUT_S = 300.0


class RendezvousError(ValueError):
    """The rendezvous settings are incomplete or contradict the config."""


@dataclass(frozen=True)
class Rendezvous:
    master_addr: str
    master_port: int  # 0: pick a free port (only where every rank is on this node)
    nnodes: int
    node_rank: int
    nproc_per_node: int
    timeout_s: float = DEFAULT_TIMEOUT_S  # how long the nodes wait for each other at startup

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node

    @property
    def multi_node(self) -> bool:
        return self.nnodes > 1

    def global_rank(self, local_rank: int) -> int:
        if not 0 <= local_rank < self.nproc_per_node:
            raise RendezvousError(f"local rank {local_rank} is outside 0..{self.nproc_per_node - 1} (--nproc-per-node)")
        return self.node_rank * self.nproc_per_node + local_rank

    def local_ranks(self) -> range:
        """The global ranks this node's launcher starts."""
        first = self.node_rank * self.nproc_per_node
        return range(first, first + self.nproc_per_node)


def add_rendezvous_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("multi-node", "torchrun's rendezvous contract; each flag defaults to its "
                                                     "environment variable (mstar/distributed/rendezvous.py)")
    group.add_argument("--nnodes", type=int, help="number of nodes (NNODES, or WORLD_SIZE / LOCAL_WORLD_SIZE)")
    group.add_argument("--node-rank", type=int, help="this node's rank, 0 serves HTTP (NODE_RANK or GROUP_RANK)")
    group.add_argument("--master-addr", help="address of node 0, reachable from every node (MASTER_ADDR)")
    group.add_argument("--master-port", type=int, help="port node 0 listens on for the rendezvous (MASTER_PORT)")
    group.add_argument("--nproc-per-node", type=int, help="ranks (GPUs) on each node (LOCAL_WORLD_SIZE)")
    group.add_argument("--rendezvous-timeout", type=float, default=DEFAULT_TIMEOUT_S, metavar="SECONDS",
                       help="how long a node waits for node 0 (node 0: for the other nodes) at startup")


def _env_int(environ: Mapping[str, str], name: str) -> int | None:
    value = environ.get(name)
    if value is None or value == "":
        return None
    try:
        return int(value)
    except ValueError:
        raise RendezvousError(f"environment variable {name}={value!r} is not an integer") from None


def _first(*values: int | None) -> int | None:
    return next((v for v in values if v is not None), None)


def resolve_rendezvous(args: argparse.Namespace, tp_size: int, environ: Mapping[str, str]) -> Rendezvous:
    """The rendezvous from the flags, else torchrun's environment, checked against `tp_size`."""
    local_world = _env_int(environ, "LOCAL_WORLD_SIZE")
    world = _env_int(environ, "WORLD_SIZE")
    nnodes_from_world = world // local_world if world is not None and local_world else None
    nnodes = _first(args.nnodes, _env_int(environ, "NNODES"), nnodes_from_world, 1)
    node_rank = _first(args.node_rank, _env_int(environ, "NODE_RANK"), _env_int(environ, "GROUP_RANK"), 0)
    port = _first(args.master_port, _env_int(environ, "MASTER_PORT"))
    addr = args.master_addr or environ.get("MASTER_ADDR") or None
    if nnodes < 1:
        raise RendezvousError(f"--nnodes {nnodes}: needs at least 1 node")
    nproc = _first(args.nproc_per_node, local_world)
    if nproc is None:
        if tp_size % nnodes:
            raise RendezvousError(f"tp_size={tp_size} does not split over {nnodes} nodes: set tp_size to a multiple "
                                  "of --nnodes, or give --nproc-per-node")
        nproc = tp_size // nnodes
    if nproc < 1:
        raise RendezvousError(f"--nproc-per-node {nproc}: needs at least 1 rank per node")
    if not 0 <= node_rank < nnodes:
        raise RendezvousError(f"--node-rank {node_rank} is outside 0..{nnodes - 1} (--nnodes {nnodes})")
    if nnodes * nproc != tp_size:
        raise RendezvousError(f"tp_size={tp_size} but {nnodes} node(s) x {nproc} rank(s) per node = {nnodes * nproc} "
                              "ranks: set tp_size (config or override tp_size=N) to nnodes x nproc_per_node")
    if nnodes > 1 and (addr is None or port is None):
        raise RendezvousError(f"{nnodes} nodes need node 0's address and port: give --master-addr and --master-port "
                              "(or MASTER_ADDR and MASTER_PORT), the same on every node")
    if port is not None and not 0 <= port < 65536:
        raise RendezvousError(f"--master-port {port} is not a TCP port")
    if not args.rendezvous_timeout > 0:
        raise RendezvousError(f"--rendezvous-timeout {args.rendezvous_timeout:g}: must be positive (seconds)")
    return Rendezvous(addr or "127.0.0.1", port or 0, nnodes, node_rank, nproc, args.rendezvous_timeout)
