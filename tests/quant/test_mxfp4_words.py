"""The expert kernels' word layout: a bijection on packed words, and the decode its module doc gives."""

import pytest
import torch

from mstar.quant.mxfp4 import dequantize_mxfp4, random_mxfp4, unpack_fp4_codes
from mstar.quant.mxfp4_words import from_word_layout, to_word_layout

MASK = 0xFFFFFFFF


def unsigned_words(packed: torch.Tensor) -> torch.Tensor:
    return packed.contiguous().view(torch.int32).to(torch.int64) & MASK


def decoded_pairs(packed_words: torch.Tensor) -> list[torch.Tensor]:
    """The 4 pairs of each word-layout word as the kernels build them (sign at 15/31, magnitude at 8..6/24..22)."""
    w = unsigned_words(packed_words)
    clean = 0x81C081C0
    return [w & clean, (w << 3) & clean & MASK, (w << 6) & clean & MASK,
            ((w >> 4) & 0x00C000C0) | ((w >> 5) & 0x01000100) | ((w << 1) & 0x80008000 & MASK)]


def test_round_trip_of_random_bytes():
    gen = torch.Generator().manual_seed(0)
    packed = torch.randint(0, 256, (3, 7, 64), generator=gen, dtype=torch.int32).to(torch.uint8)
    placed = to_word_layout(packed)
    assert placed.shape == packed.shape and placed.dtype == torch.uint8
    assert not torch.equal(placed, packed)
    assert torch.equal(from_word_layout(placed), packed)
    assert torch.equal(to_word_layout(from_word_layout(packed)), packed)


def test_every_code_at_every_place_decodes_to_its_pair():
    """Pair i of a word holds columns 2i (low half) and 2i + 1 (high half): each code's sign at bit 15 of its
    half and its magnitude at bits 8..6, for all 16 codes at each of the 8 places of a word."""
    codes = torch.arange(16, dtype=torch.uint8)
    for place in range(8):
        column_codes = torch.zeros(16, 8, dtype=torch.uint8)
        column_codes[:, place] = codes
        column_codes[:, (place + 3) % 8] = 15 - codes  # a neighbour that must not leak in
        natural = column_codes[:, 0::2] | (column_codes[:, 1::2] << 4)  # [16, 4] bytes: one word each
        pairs = decoded_pairs(to_word_layout(natural))
        for column in range(8):
            half = (pairs[column // 2][:, 0] >> (16 * (column % 2))) & 0xFFFF
            code = column_codes[:, column].to(torch.int64)
            assert torch.equal(half, ((code >> 3) << 15) | ((code & 7) << 6)), (place, column)


def test_dequantized_weights_are_unchanged():
    gen = torch.Generator().manual_seed(1)
    packed, scale = random_mxfp4(16, 256, gen)
    assert torch.equal(dequantize_mxfp4(from_word_layout(to_word_layout(packed)), scale),
                       dequantize_mxfp4(packed, scale))
    assert torch.equal(unpack_fp4_codes(from_word_layout(to_word_layout(packed))), unpack_fp4_codes(packed))


def test_partial_words_are_refused():
    with pytest.raises(ValueError, match="multiple of 4"):
        to_word_layout(torch.zeros(2, 6, dtype=torch.uint8))
    with pytest.raises(ValueError, match="uint8"):
        from_word_layout(torch.zeros(2, 8, dtype=torch.int32))
