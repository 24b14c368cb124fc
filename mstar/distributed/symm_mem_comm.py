"""All-reduce through torch symmetric memory: one-shot and two-shot, for small messages inside a node.

Every rank allocates one staging buffer with `torch.distributed._symmetric_memory.empty` and
exchanges its handle once (`rendezvous`, a collective); afterwards each rank's GPU reads its peers'
buffers directly over NVLink:

- one-shot (`torch.ops.symm_mem.one_shot_all_reduce_out`): every rank reads all peers' whole
  buffers and sums them itself. One round of latency: the fastest for the few-KB to ~100s-of-KB
  messages of decode (a [rows, 7168] bf16 activation).
- two-shot (`torch.ops.symm_mem.two_shot_all_reduce_`): a reduce-scatter (each rank sums its 1/n
  of the elements from all peers) then an all-gather of the sums. Moves 1/n of the bytes per rank
  per phase: better once messages reach hundreds of KB, until NCCL's pipelined rings win.

Both sum each element in one fixed order, so every rank gets the same bits.

NVLink multicast (the `multimem_*` ops, NVLS) is never used: the machines keep it off
(`NCCL_NVLS_ENABLE=0`, `TORCH_SYMM_MEM_DISABLE_MULTICAST=1`), and this module does not read or
change those variables.

Messages up to the buffer size in the buffer's dtype go through here; `comm_choice` sends
everything else (and every all-gather) to NCCL.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .communicator import Communicator

ONE_SHOT = "one_shot"
TWO_SHOT = "two_shot"
ALGORITHMS = (ONE_SHOT, TWO_SHOT)
# Bytes each message's length is padded to in the buffer (the ops want 16-byte-aligned sizes).
ALIGN_BYTES = 16


class SymmetricBuffer:
    """One rank's staging buffer in symmetric memory, its handle exchanged with the group's peers."""

    def __init__(self, group: dist.ProcessGroup, device: torch.device, dtype: torch.dtype, max_bytes: int):
        import torch.distributed._symmetric_memory as symm_mem

        self.group_name = group.group_name
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        self.dtype = dtype
        self.max_bytes = max_bytes
        elem = torch.empty((), dtype=dtype).element_size()
        self.align = max(1, ALIGN_BYTES // elem) * self.world_size  # elements
        capacity = -(-max_bytes // elem // self.align) * self.align
        self.tensor = symm_mem.empty(capacity, dtype=dtype, device=device)
        symm_mem.rendezvous(self.tensor, group)  # collective: every rank of the group allocates here

    def stage(self, x: torch.Tensor) -> torch.Tensor:
        """Copy `x` (flattened) into the buffer, zero-padded to the alignment; the padded view."""
        n = x.numel()
        padded = -(-n // self.align) * self.align
        staged = self.tensor[:padded]
        staged[:n].copy_(x.reshape(-1))
        if padded != n:
            staged[n:].zero_()
        return staged


class SymmMemCommunicator(Communicator):
    """All-reduce of CUDA tensors in the buffer's dtype, up to its size, by one algorithm."""

    name = "symm_mem"

    def __init__(self, buffer: SymmetricBuffer, algorithm: str):
        super().__init__(buffer.rank, buffer.world_size)
        if algorithm not in ALGORITHMS:
            raise ValueError(f"algorithm={algorithm!r}: expected one of {ALGORITHMS}")
        self.buffer = buffer
        self.algorithm = algorithm

    def fits(self, x: torch.Tensor, dtype: torch.dtype | None = None) -> bool:
        """Whether x (rounded to `dtype` first, if given) is a message of this buffer."""
        b, dtype = self.buffer, dtype or x.dtype
        return dtype == b.dtype and x.is_cuda and x.numel() * b.tensor.element_size() <= b.max_bytes

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return self.all_reduce_rounded(x, x.dtype)

    def all_reduce_rounded(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The staging copy into the buffer rounds x to the buffer's dtype: no cast kernel of its own."""
        if not self.fits(x, dtype):
            b = self.buffer
            raise ValueError(
                f"symmetric-memory all-reduce takes {b.dtype} CUDA tensors of at most {b.max_bytes} bytes; got "
                f"{x.dtype} rounded to {dtype} on {x.device}, {x.numel() * dtype.itemsize} bytes (comm_choice routes "
                "those elsewhere)"
            )
        staged = self.buffer.stage(x)
        n = x.numel()
        if self.algorithm == ONE_SHOT:
            out = torch.empty_like(staged)
            torch.ops.symm_mem.one_shot_all_reduce_out(staged, "sum", self.buffer.group_name, out)
            return out[:n].view(x.shape)
        torch.ops.symm_mem.two_shot_all_reduce_(staged, "sum", self.buffer.group_name)
        return staged[:n].view(x.shape).clone()  # the buffer is reused by the next message

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError("symmetric-memory all-gather is not used: comm_choice sends all-gathers to NCCL")
