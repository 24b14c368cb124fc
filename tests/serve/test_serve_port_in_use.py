"""mstar-serve binds its HTTP socket first: a port in use is a clear error naming it, exit status 2,
before any model is loaded and, with tp_size 2, before any follower rank or the rendezvous store
starts (they take ephemeral ports, and one of them could take the HTTP port; issue 22, case 10)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from paths import ROOT


def _session_members(sid: int) -> list[int]:
    """Processes of session `sid`: whatever the server started, even once it was re-parented."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[3]) == sid and fields[0] not in ("Z", "X"):
                found.append(int(entry.name))
    return found


@pytest.mark.parametrize("config", ["kimi_k3_tiny.yaml", "kimi_k3_tiny_tp2.yaml"])
def test_a_port_in_use_is_exit_status_2_naming_it(tiny_dir, config):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        start = time.monotonic()
        # A session of its own, so that a follower it started is found below even if it outlived the server.
        proc = subprocess.Popen([sys.executable, "-m", "mstar.serve", "--config", str(ROOT / "configs" / config),
                                 "--port", str(port), "--tensor-comm-protocol", "GLOO", f"checkpoint={tiny_dir}"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                                env={**os.environ, "OMP_NUM_THREADS": "1"})
        try:
            _, stderr = proc.communicate(timeout=120)
            left = _session_members(proc.pid)
        finally:
            for pid in [proc.pid, *_session_members(proc.pid)]:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
    assert proc.returncode == 2, stderr[-2000:]
    assert f"127.0.0.1:{port}" in stderr and "--port" in stderr
    assert "loading" not in stderr and "rank" not in stderr  # nothing was loaded nor started before the refusal
    assert left == [], f"processes left behind: {left}"
    assert time.monotonic() - start < 60
