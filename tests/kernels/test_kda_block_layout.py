"""The KDA block layout of a captured verify step: derived on the device from the slots and pending prefixes
(`BlockLayout.equal_blocks`, what the graph computes) it is the layout the host builds from its lists
(`BlockLayout.build` at the same fixed capacity), for random slots, prefixes and block widths."""

import random

import pytest
import torch

from mstar.kernels import kda_fla

FIELDS = ("slots", "starts", "ends", "fold", "row_seq", "x_dest", "prefix_dest", "prefix_src", "keep_dest",
          "keep_src", "row_src")


@pytest.mark.parametrize("seed", range(6))
def test_equal_blocks_derived_on_the_device_equal_the_host_built_layout(seed):
    rng = random.Random(seed)
    batch, rows, max_block = rng.randint(1, 9), rng.randint(2, 8), 8
    slots = tuple(rng.sample(range(1, 40), batch))
    pending = [rng.randint(0, max_block) for _ in range(batch)]
    built = kda_fla.BlockLayout.build(tuple(range(0, batch * rows + 1, rows)), slots, pending, (True,) * batch,
                                      max_block, torch.device("cpu"), capacity=rows + max_block)
    derived = kda_fla.BlockLayout.equal_blocks(torch.tensor(slots), torch.tensor(pending), rows, max_block)
    assert derived.num_rows == built.num_rows
    for name in FIELDS:
        assert getattr(derived, name).tolist() == getattr(built, name).tolist(), name
