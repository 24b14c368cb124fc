"""Which collective implementation carries each message: `choose_communicator`, the one rule.

    world size 1                                   -> null (no communication)
    CPU tensors, or --tensor-comm-protocol GLOO    -> gloo
    CUDA all-reduce, protocol SHM (one node), symmetric memory built, message in its dtype:
        size <= one_shot_max_bytes                 -> symmetric-memory one-shot
        size <= two_shot_max_bytes                 -> symmetric-memory two-shot
    every other CUDA message (all-gathers, reduce-scatters, larger all-reduces, TCP/NCCL across nodes) -> NCCL

The byte limits are starting points for 8 H200s of one node (decode activations are a few KB to
~1 MB: rows x 7168 x 2 B), to be set from a measured sweep; they are configuration, not constants
buried in a class. `build_communicator` makes the implementations a rank needs and, when there is
more than one, a `ChoosingCommunicator` that asks `choose_communicator` per message.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .communicator import Communicator, NullCommunicator

PROTOCOLS = ("SHM", "TCP", "NCCL", "GLOO")  # mstar-serve --tensor-comm-protocol


class CommKind(enum.Enum):
    NULL = "null"
    GLOO = "gloo"
    NCCL = "nccl"
    SYMM_MEM_ONE_SHOT = "symm_mem_one_shot"
    SYMM_MEM_TWO_SHOT = "symm_mem_two_shot"


@dataclass(frozen=True)
class CommConfig:
    protocol: str = "SHM"  # SHM: all ranks on one node (NVLink); TCP / NCCL: NCCL only; GLOO: gloo only
    one_shot_max_bytes: int = 256 << 10
    two_shot_max_bytes: int = 8 << 20
    symm_mem: bool = True  # allow torch symmetric memory when the protocol is SHM

    def __post_init__(self) -> None:
        if self.protocol not in PROTOCOLS:
            raise ValueError(f"tensor comm protocol {self.protocol!r}: expected one of {', '.join(PROTOCOLS)}")
        if not 0 <= self.one_shot_max_bytes <= self.two_shot_max_bytes:
            raise ValueError("need 0 <= one_shot_max_bytes <= two_shot_max_bytes")


@dataclass(frozen=True)
class Message:
    op: str  # "all_reduce", "all_gather" or "reduce_scatter"
    device_type: str  # "cpu" or "cuda"
    dtype: torch.dtype
    nbytes: int

    @classmethod
    def of(cls, op: str, x: torch.Tensor, dtype: torch.dtype | None = None) -> Message:
        """The message of x, or of x rounded to `dtype` (`Communicator.all_reduce_rounded`)."""
        dtype = dtype or x.dtype
        return cls(op, x.device.type, dtype, x.numel() * dtype.itemsize)


def choose_communicator(message: Message, world_size: int, config: CommConfig,
                        symm_mem_dtype: torch.dtype | None = None) -> CommKind:
    """The implementation for one message (see the module docstring); `symm_mem_dtype` is the dtype
    of the symmetric buffer when one was built (None: none)."""
    if world_size == 1:
        return CommKind.NULL
    if message.device_type != "cuda" or config.protocol == "GLOO":
        return CommKind.GLOO
    small_node_all_reduce = (message.op == "all_reduce" and config.protocol == "SHM" and config.symm_mem
                             and symm_mem_dtype is not None and message.dtype == symm_mem_dtype)
    if small_node_all_reduce and message.nbytes <= config.one_shot_max_bytes:
        return CommKind.SYMM_MEM_ONE_SHOT
    if small_node_all_reduce and message.nbytes <= config.two_shot_max_bytes:
        return CommKind.SYMM_MEM_TWO_SHOT
    return CommKind.NCCL


class ChoosingCommunicator(Communicator):
    """Holds several implementations and sends each message where `choose_communicator` says."""

    name = "choosing"

    def __init__(self, implementations: dict[CommKind, Communicator], config: CommConfig,
                 symm_mem_dtype: torch.dtype | None):
        first = next(iter(implementations.values()))
        super().__init__(first.rank, first.world_size)
        self.implementations = implementations
        self.graph_capturable = all(c.graph_capturable for c in implementations.values())
        self.config = config
        self.symm_mem_dtype = symm_mem_dtype

    def _pick(self, op: str, x: torch.Tensor, dtype: torch.dtype | None = None) -> Communicator:
        kind = choose_communicator(Message.of(op, x, dtype), self.world_size, self.config, self.symm_mem_dtype)
        if kind not in self.implementations:
            raise RuntimeError(f"{op} of {x.dtype} on {x.device.type} needs the {kind.value} communicator, "
                               f"which this rank did not build (it has {[k.value for k in self.implementations]})")
        return self.implementations[kind]

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return self._pick("all_reduce", x).all_reduce(x)

    def all_reduce_rounded(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return self._pick("all_reduce", x, dtype).all_reduce_rounded(x, dtype)

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        return self._pick("all_gather", x).all_gather(x)

    def reduce_scatter_rounded(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return self._pick("reduce_scatter", x, dtype).reduce_scatter_rounded(x, dtype)

    def reduce_scatter_rows(self, x: torch.Tensor) -> torch.Tensor:
        return self._pick("reduce_scatter", x).reduce_scatter_rows(x)

    def all_gather_rows(self, x: torch.Tensor) -> torch.Tensor:
        return self._pick("all_gather", x).all_gather_rows(x)


def build_communicator(group: dist.ProcessGroup | None, device: torch.device, config: CommConfig,
                       dtype: torch.dtype) -> Communicator:
    """The communicator of one rank for a model on `device` with activations in `dtype`.

    Collective over `group` (every rank calls it in the same order): building the symmetric buffer
    is a rendezvous. On CPU, or with one rank, there is a single implementation and it is returned
    as it is.
    """
    if group is None or dist.get_world_size(group) == 1:
        return NullCommunicator()
    from .process_group_comm import GlooCommunicator, NcclCommunicator

    if device.type != "cuda" or config.protocol == "GLOO":
        return GlooCommunicator(group)
    implementations: dict[CommKind, Communicator] = {CommKind.NCCL: NcclCommunicator(group)}
    symm_dtype = None
    if config.protocol == "SHM" and config.symm_mem and config.two_shot_max_bytes > 0:
        from .symm_mem_comm import ONE_SHOT, TWO_SHOT, SymmetricBuffer, SymmMemCommunicator

        buffer = SymmetricBuffer(group, device, dtype, config.two_shot_max_bytes)  # shared by both algorithms
        implementations[CommKind.SYMM_MEM_ONE_SHOT] = SymmMemCommunicator(buffer, ONE_SHOT)
        implementations[CommKind.SYMM_MEM_TWO_SHOT] = SymmMemCommunicator(buffer, TWO_SHOT)
        symm_dtype = dtype
    return ChoosingCommunicator(implementations, config, symm_dtype)

