"""Several lists in one upload (resources/transfer.to_device_lists): each arrives as its own view, starting
16-byte aligned, and writes into one leave the others as they were. On the GPU too (test_gpu_transfer.py
runs the same checks there)."""

import random

import pytest
import torch

from mstar.resources.transfer import to_device_lists


def _lists(rng: random.Random, dtype: torch.dtype) -> list[list]:
    high = 2 if dtype is torch.bool else 1000
    return [[rng.randrange(high) for _ in range(rng.choice([0, 1, 2, 3, 7, 16, 33]))] for _ in range(rng.randint(1, 6))]


def check_lists_arrive_as_separate_aligned_views(device: str) -> None:
    rng = random.Random(0)
    for _ in range(40):
        dtype = rng.choice([torch.long, torch.int32, torch.float32, torch.bool])
        lists = _lists(rng, dtype)
        arrived = to_device_lists(lists, dtype, device)
        assert len(arrived) == len(lists)
        for values, tensor in zip(lists, arrived, strict=True):
            assert tensor.dtype == dtype and tensor.device.type == device and tensor.shape == (len(values),)
            assert tensor.data_ptr() % 16 == 0
            assert torch.equal(tensor.cpu(), torch.tensor(values, dtype=dtype))
        written = rng.randrange(len(lists))
        arrived[written].fill_(1)  # every view but this one keeps its values
        for i, (values, tensor) in enumerate(zip(lists, arrived, strict=True)):
            expected = [1] * len(values) if i == written else values
            assert torch.equal(tensor.cpu(), torch.tensor(expected, dtype=dtype))


def test_lists_arrive_as_separate_aligned_views():
    check_lists_arrive_as_separate_aligned_views("cpu")


def test_no_lists_is_no_tensors():
    assert to_device_lists([], torch.long, "cpu") == ()


@pytest.mark.parametrize("dtype", [torch.long, torch.float32])
def test_empty_lists_are_empty_views(dtype):
    first, empty, last = to_device_lists([[1, 2], [], [3]], dtype, "cpu")
    assert first.tolist() == [1, 2] and empty.numel() == 0 and last.tolist() == [3]
