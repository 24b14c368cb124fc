"""Uploads through the pinned ring (resources/transfer.py) on the GPU: every value arrives, in every dtype
and shape, while the GPU is still busy with earlier work and the ring comes round several times (the host
must wait for a half's copies before overwriting it, or the later uploads would read newer bytes)."""

import random

import pytest
import torch
from test_transfer import check_lists_arrive_as_separate_aligned_views

from mstar.resources import transfer

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_uploads_arrive_intact_across_laps_of_a_small_ring(monkeypatch):
    rng = random.Random(0)
    ring = transfer._UploadRing(nbytes=4096)
    monkeypatch.setattr(transfer._rings, "ring", ring, raising=False)
    torch.cuda._sleep(200_000_000)  # the copies queue behind ~0.1 s of GPU work
    sent, arrived = [], []
    for _ in range(300):  # ~40 KB: ten laps of the ring
        dtype = rng.choice([torch.long, torch.int32, torch.float32, torch.bool])
        shape = rng.choice([(rng.randint(1, 40),), (rng.randint(1, 6), rng.randint(1, 9))])
        values = torch.randint(0, 2 if dtype is torch.bool else 1000, shape).to(dtype)
        sent.append(values)
        arrived.append(transfer.to_device(values.tolist(), dtype, "cuda"))
    torch.cuda.synchronize()
    assert ring.left[0] is not None and ring.left[1] is not None  # it came round
    for values, device_values in zip(sent, arrived, strict=True):
        assert device_values.dtype == values.dtype and device_values.device.type == "cuda"
        assert torch.equal(device_values.cpu(), values)


def test_an_upload_larger_than_half_the_ring_still_arrives(monkeypatch):
    monkeypatch.setattr(transfer._rings, "ring", transfer._UploadRing(nbytes=4096), raising=False)
    values = list(range(1000))  # 8 KB of int64
    assert transfer.to_device(values, torch.long, "cuda").cpu().tolist() == values


def test_several_lists_in_one_upload_arrive_as_separate_aligned_views():
    check_lists_arrive_as_separate_aligned_views("cuda")
