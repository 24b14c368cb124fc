"""mstar-serve binds its HTTP socket first: a port in use is a clear error naming it, exit status 2,
before any model is loaded."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

from paths import ROOT


def test_a_port_in_use_is_exit_status_2_naming_it(tiny_dir):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        start = time.monotonic()
        config = ROOT / "configs" / "kimi_k3_tiny.yaml"
        proc = subprocess.run([sys.executable, "-m", "mstar.serve", "--config", str(config), "--port", str(port),
                               f"checkpoint={tiny_dir}"],
                              capture_output=True, text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert f"127.0.0.1:{port}" in proc.stderr and "--port" in proc.stderr
    assert "loading" not in proc.stderr  # nothing was loaded before the socket was refused
    assert time.monotonic() - start < 60
