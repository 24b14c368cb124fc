"""The README's first commands, exactly as written, on a fresh copy of the repository in a new venv.

This is what every newcomer runs first: the install line must give a base install that serves the mini
model (no test extra, so no triton or fla-core on a CPU), and the request must come back with text. The
commands are read from the README itself, so the test and the README cannot drift apart; only the port
is changed (to a free one), so that parallel runs do not collide.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import time

import pytest
from paths import ROOT

COPIED = ("mstar", "configs", "models", "pyproject.toml", "README.md")
INSTALL_S = 900  # a fresh venv, torch from the local wheel store, and mstar's dependencies


def readme_first_block() -> list[str]:
    """The lines of the first bash block under '## On a fresh machine', with continuations joined."""
    text = (ROOT / "README.md").read_text()
    section = text.split("## On a fresh machine", 1)[1]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    return [line.strip() for line in block.replace("\\\n", " ").splitlines() if line.strip()]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fresh_env() -> dict[str, str]:
    """The environment of a new shell: no venv of ours on PATH, nothing of the test run's imports."""
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "TRITON_INTERPRET")}
    venv = os.environ.get("VIRTUAL_ENV")
    if venv:
        env["PATH"] = os.pathsep.join(p for p in env["PATH"].split(os.pathsep) if not p.startswith(venv))
    return env


def test_readme_install_serves_the_mini_model(tmp_path):
    install, serve, request = readme_first_block()
    assert serve.endswith("&") and "--port 8000" in serve and "localhost:8000" in request, \
        "the README's first block changed shape: update this test with it"
    repo = tmp_path / "repo"
    repo.mkdir()
    for name in COPIED:
        src = ROOT / name
        if src.is_dir():
            shutil.copytree(src, repo / name, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        else:
            shutil.copy(src, repo / name)
    env = fresh_env()
    done = subprocess.run(["bash", "-c", install], cwd=repo, env=env, capture_output=True, text=True,
                          timeout=INSTALL_S)
    assert done.returncode == 0, f"the README's install line failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    port = str(free_port())
    serve = serve.removesuffix("&").replace("8000", port)
    request = request.replace("8000", port)
    log = (tmp_path / "serve.log").open("w")
    server = subprocess.Popen(["bash", "-c", f". .venv/bin/activate && exec {serve}"], cwd=repo, env=env,
                              stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while True:
            assert server.poll() is None, f"mstar-serve exited:\n{(tmp_path / 'serve.log').read_text()[-4000:]}"
            answer = subprocess.run(["bash", "-c", request], capture_output=True, text=True, timeout=120)
            if answer.returncode == 0 and answer.stdout:
                break
            if time.monotonic() > deadline:
                pytest.fail(f"no answer within 300 s:\n{(tmp_path / 'serve.log').read_text()[-4000:]}")
            time.sleep(2)
        body = json.loads(answer.stdout)
        choice = body["choices"][0]
        assert choice["text"] and choice["finish_reason"] in ("length", "stop"), body
        assert body["usage"]["completion_tokens"] > 0, body
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=60)
