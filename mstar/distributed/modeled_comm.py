"""One rank emulated alone, with every collective charged at a modeled cost: `ModeledCommunicator`.

The null communicator makes a rank's collectives free, which flatters a step: a TP8 decode step of
K3 holds about 190 all-reduces. This one moves no data either (the numbers are not the model's, as
with the null communicator: `all_reduce` returns the local partial sum, `all_gather` repeats the
local piece, written by the wait's own launch), but each call queues a GPU-side wait
(kernels/gpu_delay.py) as long as the modeled collective, so inside a captured step it serialises where
the real one would, and it tallies the calls, their bytes and the modeled time on the device, so a
replayed graph reports exactly what it holds.

The model (`CollectiveCost`): a latency term for every message up to `small_bytes` per rank, plus the
bytes beyond it over a link bandwidth. Default: 6 us up to 64 KiB, then 150 GB/s: the range published
for one-shot (Lamport-style) all-reduce kernels on 8 H100s over NVLink for small messages, and a
conservative NVLink ring rate beyond; `mstar-emulate-rank --comm-latency-us/--comm-small-kib/
--comm-gb-per-s` change it, never below MIN_LATENCY_S (no collective across GPUs has been measured
faster), and `--comm-latency-us 0` turns it off for a comparison with the null communicator.

The rate is an all-reduce's: message bytes a second. An all-gather's bytes (its output, what each rank ends up
holding) and a reduce-scatter's (its input) pass at twice it, because they move half the traffic: over n ranks a
ring or tree all-reduce of S bytes sends 2(n-1)/n S bytes over each rank's links, an all-gather of S output bytes
and a reduce-scatter of S input bytes (n-1)/n S (the bus-bandwidth factors of NVIDIA's nccl-tests,
doc/PERFORMANCE.md, by which all three reach the same bus bandwidth on one NVLink node). Charged alike, the
all-gathers of the sharded-latent MoE cost twice what the links carry.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mstar.kernels.gpu_delay import calibrate, delay

from .communicator import Communicator

MIN_LATENCY_S = 4e-6
# Link traffic per byte of message against an all-reduce's (module doc): an all-gather's output bytes and a
# reduce-scatter's input bytes move half ((n-1)/n S against 2(n-1)/n S).
ALL_REDUCE_TRAFFIC, ALL_GATHER_TRAFFIC, REDUCE_SCATTER_TRAFFIC = 1.0, 0.5, 0.5


@dataclass(frozen=True)
class CollectiveCost:
    latency_s: float = 6e-6  # every collective, up to small_bytes per rank
    small_bytes: int = 64 * 1024
    bytes_per_s: float = 150e9  # the bytes beyond small_bytes

    def __post_init__(self):
        if self.latency_s < MIN_LATENCY_S:
            raise ValueError(f"a collective's latency of {self.latency_s * 1e6:g} us is below the "
                             f"{MIN_LATENCY_S * 1e6:g} us that no GPU collective beats; use the null communicator "
                             "for free collectives")
        if self.small_bytes < 0 or self.bytes_per_s <= 0:
            raise ValueError(f"small_bytes={self.small_bytes} must be >= 0 and bytes_per_s={self.bytes_per_s} > 0")

    def seconds(self, nbytes: int, traffic: float = ALL_REDUCE_TRAFFIC) -> float:
        """A collective of `nbytes` per rank whose link traffic is `traffic` times an all-reduce's of that size."""
        return self.latency_s + max(0, nbytes - self.small_bytes) * traffic / self.bytes_per_s


@dataclass(frozen=True)
class CommTally:
    calls: int
    bytes: int
    seconds: float


class ModeledCommunicator(Communicator):
    """Rank `rank` of `world_size` alone on its device; every collective waits its modeled cost there."""

    name = "modeled"
    graph_capturable = True

    def __init__(self, world_size: int, rank: int, cost: CollectiveCost, device: torch.device | str):
        super().__init__(rank, world_size)
        self.cost = cost
        self.counters = torch.zeros(3, dtype=torch.int64, device=device)  # calls, bytes, ns
        self.delay_overhead_ns = calibrate(device)  # what each wait's own kernel costs: subtracted from it

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        self._charge(x.numel() * x.element_size())
        return x

    def all_reduce_rounded(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """x as it is (no cast kernel: the real rank's symmetric-memory all-reduce rounds as it stages its message,
        and the kernels that read the sum round what they load), charged as the rounded message."""
        self._charge(x.numel() * dtype.itemsize)
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        if self.world_size == 1:
            self._charge(x.numel() * x.element_size(), ALL_GATHER_TRAFFIC)
            return x
        rows = x.reshape(-1, x.shape[-1])
        out = x.new_empty(*x.shape[:-1], self.world_size * x.shape[-1])
        pieces = out.view(rows.shape[0], self.world_size, x.shape[-1]).unbind(1)  # rank k's columns of each row
        self._charge(out.numel() * out.element_size(), ALL_GATHER_TRAFFIC, rows, pieces)  # what each rank holds
        return out

    def reduce_scatter_rounded(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """This rank's piece of x as it is (as `all_reduce_rounded`), charged as the rounded input."""
        piece = self.piece(x)
        self._charge(x.numel() * dtype.itemsize, REDUCE_SCATTER_TRAFFIC)
        return piece

    def reduce_scatter_rows(self, x: torch.Tensor) -> torch.Tensor:
        piece = self.piece_rows(x)
        self._charge(x.numel() * x.element_size(), REDUCE_SCATTER_TRAFFIC)
        return piece

    def all_gather_rows(self, x: torch.Tensor) -> torch.Tensor:
        if self.world_size == 1:
            self._charge(x.numel() * x.element_size(), ALL_GATHER_TRAFFIC)
            return x
        out = x.new_empty(self.world_size * x.shape[0], *x.shape[1:])
        self._charge(out.numel() * out.element_size(), ALL_GATHER_TRAFFIC, x.reshape(x.shape[0], -1),
                     out.view(self.world_size, x.shape[0], -1).unbind(0))
        return out

    def _charge(self, nbytes: int, traffic: float = ALL_REDUCE_TRAFFIC, source: torch.Tensor | None = None,
                pieces: tuple[torch.Tensor, ...] | None = None) -> None:
        """Wait the modeled cost of a collective of `nbytes` per rank; a gathering one fills its output's `pieces`
        with `source` within that wait (kernels/gpu_delay.py), as the real one fills it within its time."""
        delay(round(self.cost.seconds(nbytes, traffic) * 1e9), nbytes, self.counters, source=source,
              copies=None if pieces is None else list(pieces))

    def reset(self) -> None:
        self.counters.zero_()

    def tally(self) -> CommTally:
        """What the collectives since the last `reset` amount to (reads the device counters: a sync)."""
        calls, nbytes, ns = self.counters.tolist()
        return CommTally(calls, nbytes, ns * 1e-9)
