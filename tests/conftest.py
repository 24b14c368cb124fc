"""Shared fixtures: the tiny checkpoints are written once per test session."""

from __future__ import annotations

import os

import pytest
import torch

from mstar.tools.make_tiny import write_tiny

# Without a GPU, Triton kernels run in Triton's interpreter. The variable must be set before anything
# imports triton (the engine imports the kernel modules), so it is set here, first.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The tiny models are far too small to gain from intra-op threads, and on a 2-core machine OpenMP's
# spinning threads slow every op by ~100x as soon as another process competes for a core.
os.environ.setdefault("OMP_NUM_THREADS", "1")  # inherited by subprocesses the tests start
torch.set_num_threads(1)



@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory):
    """(target_dir, draft_dir) of the deterministic tiny K3 and its DSpark draft."""
    return write_tiny(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="session")
def tiny_dir(tiny_dirs):
    return tiny_dirs[0]


@pytest.fixture(scope="session")
def tiny_model(tiny_dir):
    from mstar.models.kimi_k3.weights import load_model

    return load_model(tiny_dir, dtype=torch.float32)


@pytest.fixture(scope="session")
def tiny_model_fp64(tiny_dir):
    from mstar.models.kimi_k3.weights import load_model

    return load_model(tiny_dir, dtype=torch.float64)
