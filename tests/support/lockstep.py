"""Tensor-parallel ranks as threads of one process, their collectives exchanged in memory: `Lockstep`."""

from __future__ import annotations

import threading

import torch

from mstar.distributed.communicator import Communicator


class Lockstep:
    """Ranks as threads of this process that take turns: one runs at a time (Triton's interpreter patches
    triton.language for each launch, so two launches must never overlap), handing the turn on in collectives."""

    def __init__(self, world_size: int):
        self.world_size = world_size
        self.turn = threading.Lock()
        self.barrier = threading.Barrier(world_size, timeout=120)
        self.pieces: list[torch.Tensor | None] = [None] * world_size

    def run(self, fn):
        """[fn(rank) for every rank], each in its own thread; the first error raised again."""
        results, errors = [None] * self.world_size, []

        def body(rank):
            with self.turn:
                try:
                    results[rank] = fn(rank)
                except BaseException as e:
                    errors.append(e)
                    self.barrier.abort()

        threads = [threading.Thread(target=body, args=(rank,)) for rank in range(self.world_size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        return results

    def exchange(self, rank: int, x: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's x, in rank order."""
        self.pieces[rank] = x
        self._wait()
        pieces = list(self.pieces)
        self._wait()  # all have read them before the next collective writes
        return pieces

    def _wait(self):
        self.turn.release()
        try:
            self.barrier.wait()
        finally:
            self.turn.acquire()


class LockstepCommunicator(Communicator):
    """A rank's collectives through its `Lockstep` (the base class's fallbacks for the rest)."""

    def __init__(self, lockstep: Lockstep, rank: int):
        super().__init__(rank, lockstep.world_size)
        self.lockstep = lockstep

    def all_reduce(self, x):
        return torch.stack(self.lockstep.exchange(self.rank, x)).sum(0)

    def all_gather(self, x):
        return torch.cat(self.lockstep.exchange(self.rank, x), dim=-1)
