"""kernels/l2_prefetch, the parts that run anywhere: the byte ranges a prefetch is given and what it refuses
(tests/kernels/test_kernel_l2_prefetch.py runs the kernel on the GPU)."""

from __future__ import annotations

import pytest
import torch

from mstar.kernels import l2_prefetch
from mstar.kernels.l2_prefetch import Segment


def test_a_tensor_is_one_range_and_a_stacked_one_a_range_per_expert():
    t = torch.zeros(6, 5, 32, dtype=torch.uint8)
    assert Segment.of(t) == Segment(t.data_ptr(), 6 * 5 * 32)
    assert Segment.of(t, per_expert=True) == Segment(t.data_ptr(), 5 * 32, 5 * 32)
    assert Segment.of(t[1:3]) == Segment(t.data_ptr() + 160, 320)
    with pytest.raises(ValueError, match="contiguous"):
        Segment.of(t[:, :, :16])
    with pytest.raises(ValueError, match="contiguous rows"):
        Segment.of(t[:, :, :16], per_expert=True)


def test_alignment_only_shrinks_a_range():
    assert Segment(4096, 1000).aligned() == Segment(4096, 992)  # the last 8 bytes are not a whole 16
    assert Segment(4100, 1000).aligned() == Segment(4112, 976)  # starts at the next 16, ends at the last
    assert Segment(4100, 8).aligned() == Segment(4112, 0)  # nothing whole inside: nothing prefetched
    assert Segment(0, 64, 160).aligned() == Segment(0, 64, 160)
    with pytest.raises(ValueError, match="stride"):
        Segment(0, 64, 72).aligned()


def test_bad_calls_are_refused_before_any_launch():
    with pytest.raises(ValueError, match="1 to 4 segments"):
        l2_prefetch.prefetch([])
    with pytest.raises(ValueError, match="1 to 4 segments"):
        l2_prefetch.prefetch([Segment(0, 16)] * 5)
    with pytest.raises(ValueError, match="pass ids"):
        l2_prefetch.prefetch([Segment(0, 16, 32)])


def test_nothing_is_issued_off_hopper():
    assert not l2_prefetch.supported("cpu")
