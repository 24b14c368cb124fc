"""Uploads (resources/transfer.py) on the GPU: every value arrives, in every dtype and shape, while the GPU
is still busy with earlier work (the pinned source must outlive its queued copy); several lists in one
upload arrive as separate aligned views."""

import random

import pytest
import torch
from test_transfer import check_lists_arrive_as_separate_aligned_views

from mstar.resources import transfer

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_uploads_queued_behind_a_busy_gpu_arrive_intact():
    rng = random.Random(0)
    torch.cuda._sleep(200_000_000)  # the copies queue behind ~0.1 s of GPU work
    sent, arrived = [], []
    for _ in range(300):
        dtype = rng.choice([torch.long, torch.int32, torch.float32, torch.bool])
        shape = rng.choice([(rng.randint(1, 40),), (rng.randint(1, 6), rng.randint(1, 9))])
        values = torch.randint(0, 2 if dtype is torch.bool else 1000, shape).to(dtype)
        sent.append(values)
        arrived.append(transfer.to_device(values.tolist(), dtype, "cuda"))
    torch.cuda.synchronize()
    for values, device_values in zip(sent, arrived, strict=True):
        assert device_values.dtype == values.dtype and device_values.device.type == "cuda"
        assert torch.equal(device_values.cpu(), values)


def test_several_lists_in_one_upload_arrive_as_separate_aligned_views():
    torch.cuda._sleep(100_000_000)
    check_lists_arrive_as_separate_aligned_views("cuda")
