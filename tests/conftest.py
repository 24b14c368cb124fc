"""Shared fixtures: the tiny checkpoints are written once per test session."""

from __future__ import annotations

import pytest
import torch

from mstar.tools.make_tiny import write_tiny


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
