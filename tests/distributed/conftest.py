"""Fixtures of the two-"node" tests: two process trees on loopback (tests/support/two_nodes.py)."""

import pytest
from two_nodes import TwoNodes, overrides


@pytest.fixture
def two_nodes(tiny_dirs, tmp_path):
    """Two nodes of 2 local ranks each serving the tiny model at TP4 x EP2, ready; torn down after the test."""
    nodes = TwoNodes(tmp_path, overrides(tiny_dirs))
    try:
        yield nodes.wait_ready()
    finally:
        nodes.close()
