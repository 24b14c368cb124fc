"""The MXFP4 expert kernels' word layout: each 32-bit word's E2M1 codes re-placed so that decoding is cheap.

The checkpoint packs two codes per byte (`mxfp4.py`): read as a little-endian 32-bit word, the word holds
the codes of 8 consecutive columns, column n in bits 4n..4n+3. The kernels decode a word into 4 pairs of bf16
numbers (pair i = columns 2i and 2i + 1, as the low and high half of one 32-bit register) with each code's
sign at bit 15 of its half and its three magnitude bits at bits 8..6, which makes the half that code's value
times 2^-126 exactly (0 and 0.5 as bf16 subnormals); one packed multiply by the scale finishes it. From the
checkpoint's nibbles that placement costs two shifts and two masks a pair (the sign and the magnitude move by
different amounts). Re-placed once at load, it costs:

    pair 0: w & 0x81C081C0                            (the bits are where the pair wants them)
    pair 1: (w << 3) & 0x81C081C0
    pair 2: (w << 6) & 0x81C081C0
    pair 3: ((w >> 4) & 0x00C000C0) | ((w >> 5) & 0x01000100) | ((w << 1) & 0x80008000)

i.e. 11 integer operations a word instead of 16 (15 with the 4 multiplies instead of 19, read off the sm_90
SASS: benchmarks/kernels/sass_moe_mxfp4.py). Three pairs cannot all sit at shifts of one word with the fourth
as well: shifted copies of the 8 positions a pair needs tile the 32 bits only for shifts 0, 3 and 6, leaving
bits 10, 11, 13, 14 (and 16 above) for pair 3, which three shifts gather.

Bit positions in a word (low half; the high half's code of the same pair sits 16 bits above):

    code of column 2i (i < 3): magnitude bits 6 - 3i .. 8 - 3i, sign bit 15 - 3i
    code of column 6:          magnitude bits 0, 1 at 10, 11 and bit 2 at 13, sign at 14
    (column 2i + 1: the same + 16)

`to_word_layout` and `from_word_layout` convert whole tensors (rows of whole words: the packed bytes' last
dimension a multiple of 4, which every MXFP4 tensor is: 32 columns a scale group); the scales keep their layout.
"""

from __future__ import annotations

import torch

WORD_BYTES = 4

# (natural bit, width, word-layout bit) for every field of the 8 codes of a word: the bijection between layouts.
_MOVES: tuple[tuple[int, int, int], ...] = tuple(
    move
    for n in range(8)
    for move in (
        ((4 * n, 3, 6 - 3 * (n // 2) + 16 * (n % 2)), (4 * n + 3, 1, 15 - 3 * (n // 2) + 16 * (n % 2)))
        if n // 2 < 3 else
        ((4 * n, 2, 10 + 16 * (n % 2)), (4 * n + 2, 1, 13 + 16 * (n % 2)), (4 * n + 3, 1, 14 + 16 * (n % 2)))
    )
)


CHUNK_WORDS = 1 << 22  # words converted at once: bounds the int64 temporaries (a layer's experts are ~0.5 GB)


def _move(packed: torch.Tensor, forward: bool, what: str) -> torch.Tensor:
    if packed.dtype != torch.uint8 or packed.ndim == 0 or packed.shape[-1] % WORD_BYTES:
        raise ValueError(f"{what}: packed MXFP4 must be uint8 with a last dimension that is a multiple of "
                         f"{WORD_BYTES} (whole words), got {packed.dtype} {tuple(packed.shape)}")
    words = packed.contiguous().view(torch.int32).reshape(-1)
    out = torch.empty_like(words)
    for start in range(0, words.numel(), CHUNK_WORDS):
        chunk = words[start : start + CHUNK_WORDS].to(torch.int64) & 0xFFFFFFFF  # unsigned: shifts bring in zeros
        moved = torch.zeros_like(chunk)
        for natural, width, placed in _MOVES:
            src, dst = (natural, placed) if forward else (placed, natural)
            moved |= ((chunk >> src) & ((1 << width) - 1)) << dst
        # back to int32 bits (the two's complement of the unsigned value)
        out[start : start + CHUNK_WORDS] = torch.where(moved >= 2**31, moved - 2**32, moved)
    return out.view(torch.uint8).view(packed.shape)


def to_word_layout(packed: torch.Tensor) -> torch.Tensor:
    """Checkpoint-packed MXFP4 bytes [..., K/2] -> the same codes in the kernels' word layout (a new tensor)."""
    return _move(packed, True, "to_word_layout")


def from_word_layout(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of `to_word_layout`: word-layout bytes back to the checkpoint's packing."""
    return _move(packed, False, "from_word_layout")
