"""The README's first commands, exactly as written, on a fresh copy of the repository in a new venv.

This is what every newcomer runs first: the install line must give a base install that serves the mini
model (no test extra, so no triton or fla-core on a CPU), and the request must come back with text. The
commands are read from the README itself, so the test and the README cannot drift apart; only the port
is changed (to a free one), so that parallel runs do not collide. The README's second block, a short
guidellm run with the shipped tokenizer, then runs against the same server from the same venv.
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
# pip's words when no package index can be reached (a machine without network): the guidellm test skips
NO_INDEX = re.compile(r"No matching distribution found for guidellm|Failed to establish a new connection|"
                      r"Network is unreachable|Temporary failure in name resolution")


def readme_block(n: int) -> list[str]:
    """The lines of bash block n (from 0) under '## On a fresh machine', with continuations joined."""
    text = (ROOT / "README.md").read_text()
    section = text.split("## On a fresh machine", 1)[1].split("\n## ", 1)[0]
    block = re.findall(r"```bash\n(.*?)```", section, re.S)[n]
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


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(repo copy, environment, port, request command): the README's install run in a fresh venv, and
    mstar-serve started as the README says, answering its request."""
    install, serve, request = readme_block(0)
    assert serve.endswith("&") and "--port 8000" in serve and "localhost:8000" in request, \
        "the README's first block changed shape: update this test with it"
    tmp_path = tmp_path_factory.mktemp("readme")
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
    log_path = tmp_path / "serve.log"
    server = subprocess.Popen(["bash", "-c", f". .venv/bin/activate && exec {serve}"], cwd=repo, env=env,
                              stdout=log_path.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while True:
            assert server.poll() is None, f"mstar-serve exited:\n{log_path.read_text()[-4000:]}"
            answer = subprocess.run(["bash", "-c", request], capture_output=True, text=True, timeout=120)
            if answer.returncode == 0 and answer.stdout:
                break
            if time.monotonic() > deadline:
                pytest.fail(f"no answer within 300 s:\n{log_path.read_text()[-4000:]}")
            time.sleep(2)
        yield repo, env, port, answer.stdout
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=60)


def test_readme_install_serves_the_mini_model(served):
    body = json.loads(served[3])
    choice = body["choices"][0]
    assert choice["text"] and choice["finish_reason"] in ("length", "stop"), body
    assert body["usage"]["completion_tokens"] > 0, body


def test_guidellm_runs_with_the_shipped_tokenizer(served, tmp_path):
    """guidellm (vLLM's benchmark client) installed beside mstar as the README says, run as written: every
    request succeeds with the output length asked for, its tokenizer read from models/kimi_k3_mini."""
    repo, env, port, _ = served
    install, run = readme_block(1)
    assert install == "pip install guidellm" and "target=http://localhost:8000" in run and "count=4" in run, \
        "the README's guidellm block changed shape: update this test with it"
    done = subprocess.run(["bash", "-c", f". .venv/bin/activate && {install}"], cwd=repo, env=env,
                          capture_output=True, text=True, timeout=INSTALL_S)
    if done.returncode != 0 and NO_INDEX.search(done.stderr):
        pytest.skip(f"guidellm cannot be installed here (no package index): {done.stderr[-300:]}")
    assert done.returncode == 0, f"pip install guidellm failed:\n{done.stderr[-3000:]}"
    report = tmp_path / "guidellm.json"
    run = run.replace("8000", port) + f" --disable-console-interactive --output kind=json,path={report}"
    done = subprocess.run(["bash", "-c", f". .venv/bin/activate && {run}"], cwd=repo, env=env | {"HF_HUB_OFFLINE": "1"},
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"guidellm failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    [benchmark] = json.loads(report.read_text())["benchmarks"]
    state = benchmark["scheduler_state"]
    assert state["successful_requests"] == 4 and state["errored_requests"] == 0, state
    assert [r["output_tokens"] for r in benchmark["requests"]["successful"]] == [8] * 4
