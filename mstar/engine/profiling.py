"""`MSTAR_TORCH_PROFILE=DIR[:START[:COUNT]]`: a torch.profiler trace of a window of engine steps.

Steps that do work are counted from 0; steps START .. START+COUNT-1 (default 10 and 5: past the
first steps, which compile kernels and warm allocators) run under `torch.profiler` (CPU, and CUDA
when the engine runs there, with shapes). When the window closes, DIR/mstar_steps_<first>-<last>.json
(a Chrome / Perfetto trace) is written and the top operators by self time are logged. Off unless set.
The variable is parsed with the other environment knobs (mstar/config.py, `Environment`).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from mstar.config import ProfileWindow

log = logging.getLogger(__name__)


class StepProfiler:
    """Profiles engine steps [start, start + count) and writes one trace."""

    def __init__(self, out_dir: Path, start: int, count: int, cuda: bool = False):
        self.out_dir, self.start, self.count = out_dir, start, count
        self.activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        self.steps_seen = 0
        self._profile: profile | None = None
        self.trace_path: Path | None = None

    @classmethod
    def from_window(cls, window: ProfileWindow | None, device: torch.device) -> StepProfiler | None:
        """The profiler MSTAR_TORCH_PROFILE asks for (`Environment.torch_profile`); None when it is unset."""
        if window is None:
            return None
        log.warning("MSTAR_TORCH_PROFILE is set: engine steps %d..%d will be profiled into %s", window.start,
                    window.start + window.count - 1, window.directory)
        return cls(window.directory, window.start, window.count, cuda=device.type == "cuda")

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
