"""The name a process shows in `ps`, `top` and /proc/PID/comm: mstar's spawned processes (tensor-parallel
follower ranks, tokenizer workers) all run `python -c "from multiprocessing.spawn import spawn_main..."`,
so without a name an operator (or a test) cannot tell them apart."""

from __future__ import annotations

import contextlib
from pathlib import Path

MAX_CHARS = 15  # Linux keeps at most 15 characters of a process's name


def set_process_name(name: str) -> None:
    """Linux only; elsewhere the process keeps python's name."""
    if len(name) > MAX_CHARS:
        raise ValueError(f"process name {name!r} is longer than {MAX_CHARS} characters")
    with contextlib.suppress(OSError):
        Path("/proc/self/comm").write_text(name)
