"""`MSTAR_TORCH_PROFILE=DIR[:START[:COUNT]]`: a torch.profiler trace of a window of engine steps.

Steps that do work are counted from 0; steps START .. START+COUNT-1 (default 10 and 5: past the
first steps, which compile kernels and warm allocators) run under `torch.profiler` (CPU, and CUDA
when the engine runs there, with shapes). When the window closes, DIR/mstar_steps_<first>-<last>.json
(a Chrome / Perfetto trace) is written and the top operators by self time are logged. Off unless set.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

log = logging.getLogger(__name__)

ENV_VAR = "MSTAR_TORCH_PROFILE"
DEFAULT_START, DEFAULT_COUNT = 10, 5


class StepProfiler:
    """Profiles engine steps [start, start + count) and writes one trace."""

    def __init__(self, out_dir: Path, start: int = DEFAULT_START, count: int = DEFAULT_COUNT, cuda: bool = False):
        if start < 0 or count < 1:
            raise ValueError(f"{ENV_VAR}: START must be >= 0 and COUNT >= 1, got START={start} COUNT={count}")
        self.out_dir, self.start, self.count = out_dir, start, count
        self.activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        self.steps_seen = 0
        self._profile: profile | None = None
        self.trace_path: Path | None = None

    @classmethod
    def from_env(cls, device: torch.device) -> StepProfiler | None:
        value = os.environ.get(ENV_VAR)
        if not value:
            return None
        directory, *numbers = value.split(":")
        try:
            start, count = ([int(n) for n in numbers] + [DEFAULT_START, DEFAULT_COUNT][len(numbers):])[:2]
        except ValueError:
            raise ValueError(f"{ENV_VAR}={value!r}: expected DIR[:START[:COUNT]] with whole numbers, "
                             "e.g. /tmp/prof:10:5") from None
        if len(numbers) > 2 or not directory:
            raise ValueError(f"{ENV_VAR}={value!r}: expected DIR[:START[:COUNT]], e.g. /tmp/prof:10:5")
        profiler = cls(Path(directory), start, count, cuda=device.type == "cuda")
        log.warning("%s is set: engine steps %d..%d will be profiled into %s", ENV_VAR, start, start + count - 1,
                    directory)
        return profiler

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """Wrap one engine step that does work."""
        index = self.steps_seen
        self.steps_seen += 1
        if index == self.start:
            self._profile = profile(activities=self.activities, record_shapes=True)
            self._profile.__enter__()
        try:
            yield
        finally:
            if self._profile is not None and index == self.start + self.count - 1:
                self._finish()

    def _finish(self) -> None:
        prof, self._profile = self._profile, None
        prof.__exit__(None, None, None)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        path = self.out_dir / f"mstar_steps_{self.start}-{self.start + self.count - 1}.json"
        prof.export_chrome_trace(str(path))
        self.trace_path = path
        sort = "self_cuda_time_total" if ProfilerActivity.CUDA in self.activities else "self_cpu_time_total"
        log.warning("wrote %s; top operators:\n%s", path, prof.key_averages().table(sort_by=sort, row_limit=15))
