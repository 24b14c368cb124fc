"""Communicators over a torch.distributed process group: gloo on CPU, NCCL on GPU.

Both run the group's own collective (`dist.all_reduce`, an all-gather) on the group they are given:
the tensor-parallel group of the model's ranks, never the group rank 0 sends its step messages on
(control.py), so model collectives and control messages cannot interleave.

They differ in where the tensors live and how the all-gather is called: gloo works on CPU tensors
(a GPU tensor, under `--tensor-comm-protocol GLOO`, is staged through host memory: a debugging path)
and gathers into a list; NCCL takes CUDA tensors and gathers into one flat tensor
(`all_gather_into_tensor`, one kernel, and capturable in a CUDA graph).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .communicator import Communicator


class _ProcessGroupCommunicator(Communicator):
    def __init__(self, group: dist.ProcessGroup):
        super().__init__(dist.get_rank(group), dist.get_world_size(group))
        self.group = group


class GlooCommunicator(_ProcessGroupCommunicator):
    """gloo over TCP between processes: the CPU path (and the tests)."""

    name = "gloo"

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        host = x.contiguous() if x.device.type == "cpu" else x.cpu()
        dist.all_reduce(host, op=dist.ReduceOp.SUM, group=self.group)
        return host.to(x.device)

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        host = x.contiguous() if x.device.type == "cpu" else x.cpu()
        pieces = [torch.empty_like(host) for _ in range(self.world_size)]
        dist.all_gather(pieces, host, group=self.group)
        return torch.cat(pieces, dim=-1).to(x.device)


class NcclCommunicator(_ProcessGroupCommunicator):
    """NCCL between GPUs (NVLink inside a node, the network across nodes): large messages and all-gathers."""

    name = "nccl"
    graph_capturable = True  # NCCL collectives on the current stream are captured by CUDA graphs

    def _check_device(self, x: torch.Tensor) -> None:
        if not x.is_cuda:
            raise ValueError(f"NCCL collectives take CUDA tensors, got one on {x.device}")

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        self._check_device(x)
        x = x.contiguous()
        dist.all_reduce(x, op=dist.ReduceOp.SUM, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        self._check_device(x)
        x = x.contiguous()
        out = torch.empty((self.world_size, *x.shape), dtype=x.dtype, device=x.device)
        dist.all_gather_into_tensor(out, x, group=self.group)
        return out.movedim(0, -2).reshape(*x.shape[:-1], self.world_size * x.shape[-1])

    def reduce_scatter_rows(self, x: torch.Tensor) -> torch.Tensor:
        self._check_device(x)
        x = x.contiguous()
        out = torch.empty(self.piece_rows(x).shape, dtype=x.dtype, device=x.device)
        dist.reduce_scatter_tensor(out, x, op=dist.ReduceOp.SUM, group=self.group)
        return out

    def all_gather_rows(self, x: torch.Tensor) -> torch.Tensor:
        self._check_device(x)
        x = x.contiguous()
        out = torch.empty((self.world_size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
        dist.all_gather_into_tensor(out, x, group=self.group)
        return out

    def reduce_scatter_rounded(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """NCCL's reduce-scatter cuts its input's first dim: the ranks' column runs are laid out one after another
        first, in one copy that also rounds to `dtype`."""
        self._check_device(x)
        width = self.piece(x).shape[-1]
        staged = x.reshape(*x.shape[:-1], self.world_size, width).movedim(-2, 0).to(dtype).contiguous()
        out = torch.empty(staged.shape[1:], dtype=dtype, device=x.device)
        dist.reduce_scatter_tensor(out, staged, op=dist.ReduceOp.SUM, group=self.group)
        return out
