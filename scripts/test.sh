#!/usr/bin/env bash
# The test command for a fresh machine: makes .venv, installs mstar with its test extra, then runs
# ruff and the CPU test suite, one pytest-xdist worker per core (8 at most: each holds torch and the
# tiny models). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
    python3 -m venv .venv
fi
. .venv/bin/activate
python -m pip install -q --upgrade pip
# The CPU build of torch (on these machines pip takes it from local disk); a plain `torch` would pull CUDA.
python -m pip install -q "torch==2.13.0"
python -m pip install -q -e ".[test]"
ruff check .
python -m pytest -n auto --maxprocesses 8 "$@"
