"""MXFP4 (compressed-tensors "mxfp4-pack-quantized") against compressed-tensors itself.

Reference functions from the installed compressed-tensors (0.20):
- packing: ``compressors.nvfp4.helpers.pack_fp4_to_uint8`` (float E2M1 values -> bytes) and
  ``unpack_fp4_from_uint8`` (bytes -> float values);
- dequantisation: ``MXFP4PackedCompressor.decompress`` (its unpack + ``decompress_mx_scale``);
- quantisation: the minmax observer's statistic (per-group min and max, as computed by
  ``compute_dynamic_scales_and_zp`` -> ``calculate_qparams`` -> ``generate_mx_scales``) followed by
  ``MXFP4PackedCompressor.compress`` (``quantize`` + ``pack_fp4_to_uint8`` + ``compress_mx_scale``),
  with the weight args of the K3 checkpoint's quantization_config.
"""

from __future__ import annotations

import pytest
import torch

from mstar.quant.mxfp4 import (
    E2M1_MAGNITUDES,
    GROUP_SIZE,
    decode_e2m1,
    dequantize_mxfp4,
    pack_fp4_codes,
    quantize_mxfp4,
    random_mxfp4,
    unpack_fp4_codes,
)

ct_mxfp4 = pytest.importorskip("compressed_tensors.compressors.mxfp4.base")
ct_fp4 = pytest.importorskip("compressed_tensors.compressors.nvfp4.helpers")
ct_quant = pytest.importorskip("compressed_tensors.quantization")
ct_helpers = pytest.importorskip("compressed_tensors.quantization.utils.helpers")

# config_groups.group_0.weights of the K3 checkpoint (reference section 7).
K3_WEIGHT_ARGS = {
    "num_bits": 4,
    "type": "float",
    "strategy": "group",
    "group_size": 32,
    "symmetric": True,
    "dynamic": False,
    "observer": "minmax",
    "scale_dtype": "torch.uint8",
}
SCHEME = ct_quant.QuantizationScheme(
    targets=["Linear"], weights=ct_quant.QuantizationArgs.model_validate(K3_WEIGHT_ARGS)
)
E2M1_TIES = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


@pytest.fixture
def gen() -> torch.Generator:
    """A generator with a fresh seed per test; the seed is printed so a failure can be replayed."""
    generator = torch.Generator()
    print(f"seed = {generator.seed()}")
    return generator


def bits(x: torch.Tensor) -> torch.Tensor:
    """Bit patterns of a float tensor, so that comparisons also see the sign of zero."""
    return x.view({torch.bfloat16: torch.int16, torch.float32: torch.int32, torch.float64: torch.int64}[x.dtype])


def ct_quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """compressed-tensors' weight_packed and weight_scale for a float weight [out, in]."""
    scale, zero_point = ct_helpers.compute_dynamic_scales_and_zp(weight, SCHEME.weights, None)
    state = {"weight": weight, "weight_scale": scale, "weight_zero_point": zero_point}
    compressed = ct_mxfp4.MXFP4PackedCompressor.compress(state, SCHEME)
    return compressed["weight_packed"], compressed["weight_scale"]


def ct_dequantize(weight_packed: torch.Tensor, weight_scale: torch.Tensor) -> torch.Tensor:
    state = {"weight_packed": weight_packed, "weight_scale": weight_scale}
    return ct_mxfp4.MXFP4PackedCompressor.decompress(state, SCHEME)["weight"]


def random_bytes(shape: tuple[int, ...], gen: torch.Generator, high: int = 256) -> torch.Tensor:
    return torch.randint(0, high, shape, generator=gen, dtype=torch.uint8)


# ----------------------------------------------------------------------------------------------
# Packing
# ----------------------------------------------------------------------------------------------


def test_pack_matches_compressed_tensors(gen):
    codes = random_bytes((24, 96), gen, high=16)
    # compressed-tensors packs float E2M1 values; build them from its own table (-0.0 for code 8).
    magnitude = ct_fp4.kE2M1ToFloat[(codes & 7).long()]
    values = torch.where((codes & 8) != 0, -magnitude, magnitude)
    assert torch.equal(pack_fp4_codes(codes), ct_fp4.pack_fp4_to_uint8(values))


def test_unpack_matches_compressed_tensors(gen):
    packed = random_bytes((24, 48), gen)
    ours = decode_e2m1(unpack_fp4_codes(packed), torch.float32)
    theirs = ct_fp4.unpack_fp4_from_uint8(packed, 24, 96, dtype=torch.float32)
    assert torch.equal(bits(ours), bits(theirs))


def test_pack_unpack_round_trip_any_leading_shape(gen):
    packed = random_bytes((3, 5, 8), gen)
    codes = unpack_fp4_codes(packed)
    assert codes.shape == (3, 5, 16) and codes.dtype == torch.uint8 and int(codes.max()) < 16
    assert torch.equal(codes[..., 0::2], packed & 0x0F) and torch.equal(codes[..., 1::2], packed >> 4)
    assert torch.equal(pack_fp4_codes(codes), packed)


# ----------------------------------------------------------------------------------------------
# Dequantisation
# ----------------------------------------------------------------------------------------------


def test_dequantize_matches_compressed_tensors(gen):
    out_features, in_features = 16, 256
    packed = random_bytes((out_features, in_features // 2), gen)
    # Bytes above 252 overflow bfloat16/float32 (4 * 2^126 = 2^128), in both implementations.
    scale = random_bytes((out_features, in_features // GROUP_SIZE), gen, high=253)
    theirs = ct_dequantize(packed, scale)
    assert theirs.dtype == torch.bfloat16
    assert torch.equal(bits(dequantize_mxfp4(packed, scale, dtype=torch.bfloat16)), bits(theirs))
    # Lossless: float32 and float64 hold the very same values.
    assert torch.equal(bits(dequantize_mxfp4(packed, scale)), bits(theirs.float()))
    assert torch.equal(bits(dequantize_mxfp4(packed, scale, dtype=torch.float64)), bits(theirs.double()))


def test_dequantize_follows_the_element_formula(gen):
    packed = random_bytes((4, 32), gen)
    scale = random_bytes((4, 2), gen, high=253)
    weight = dequantize_mxfp4(packed, scale, dtype=torch.float64)
    row, col = int(torch.randint(4, (), generator=gen)), int(torch.randint(64, (), generator=gen))
    byte = int(packed[row, col // 2])
    code = byte & 0x0F if col % 2 == 0 else byte >> 4
    expected = (-1.0 if code & 8 else 1.0) * E2M1_MAGNITUDES[code & 7] * 2.0 ** (int(scale[row, col // 32]) - 127)
    assert float(weight[row, col]) == expected


# ----------------------------------------------------------------------------------------------
# Quantisation
# ----------------------------------------------------------------------------------------------


def pick_groups(num_groups: int, count: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randperm(num_groups, generator=gen)[:count]


def random_signs(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    return torch.randint(0, 2, shape, generator=gen).double() * 2 - 1


def hard_weight(out_features: int, in_features: int, gen: torch.Generator, min_exp: int, max_exp: int) -> torch.Tensor:
    """A float64 weight whose groups exercise every corner of the MXFP4 rules.

    Every group is normal noise times its own power of two in [2^min_exp, 2^max_exp]; some groups
    are then replaced by: all zeros (with some -0.0), elements exactly at the E2M1 rounding ties,
    a group maximum exactly at or just below the scale rounding point 1.75 * 2^k, or one large
    outlier among tiny values (whose negatives round to negative zero).
    """
    num_groups = out_features * in_features // GROUP_SIZE
    shape = (num_groups, GROUP_SIZE)
    group_exp = torch.randint(min_exp, max_exp + 1, (num_groups, 1), generator=gen).double()
    groups = torch.randn(shape, generator=gen, dtype=torch.float64) * torch.exp2(group_exp)
    special = pick_groups(num_groups, 5 * (num_groups // 8), gen).chunk(5)

    zeros, ties, scale_ties, below_scale_ties, outliers = special
    groups[zeros] = torch.where(torch.rand(len(zeros), GROUP_SIZE, generator=gen) < 0.5, 0.0, -0.0).double()

    # Elements at every tie (and every E2M1 value) of a group whose maximum 4 * 2^k pins scale 2^k.
    tie_table = torch.tensor(E2M1_TIES + E2M1_MAGNITUDES, dtype=torch.float64)
    tie_values = tie_table[torch.randint(len(tie_table), (len(ties), GROUP_SIZE), generator=gen)]
    tie_values[:, 0] = 4.0
    groups[ties] = tie_values * random_signs(tie_values.shape, gen) * torch.exp2(group_exp[ties])

    # Group maximum right at the point where the scale rounds up (1.75) and at the largest
    # bfloat16 below it; the other elements stay smaller.
    for rows, mantissa in ((scale_ties, 1.75), (below_scale_ties, 1.75 - 2.0**-7)):
        noise = torch.randn(len(rows), GROUP_SIZE, generator=gen, dtype=torch.float64).clamp(-1.0, 1.0)
        groups[rows] = noise * torch.exp2(group_exp[rows])
        groups[rows, 0] = mantissa * torch.exp2(group_exp[rows, 0]) * random_signs((len(rows),), gen)

    groups[outliers] = groups[outliers] * 2.0**-12
    groups[outliers, 7] = torch.exp2(group_exp[outliers, 0]) * random_signs((len(outliers),), gen) * 3.0
    return groups.reshape(out_features, in_features)


@pytest.mark.parametrize(
    ("dtype", "min_exp", "max_exp"),
    [
        (torch.float32, -20, 20),
        (torch.bfloat16, -20, 20),
        (torch.float64, -20, 20),
        # Down to the subnormal range of float32 / bfloat16, where the scale byte clamps at 0.
        (torch.float32, -134, -110),
        (torch.bfloat16, -130, -110),
        # Up to the top of the float32 / bfloat16 range (scale bytes up to 252).
        (torch.float32, 100, 125),
        (torch.bfloat16, 100, 125),
    ],
)
def test_quantize_matches_compressed_tensors(gen, dtype, min_exp, max_exp):
    weight = hard_weight(64, 256, gen, min_exp, max_exp).to(dtype)
    packed, scale = quantize_mxfp4(weight)
    ct_packed, ct_scale = ct_quantize(weight)
    assert packed.dtype == scale.dtype == torch.uint8
    assert packed.shape == (64, 128) and scale.shape == (64, 8)
    assert torch.equal(scale, ct_scale)
    assert torch.equal(packed, ct_packed)


def test_quantize_picks_the_scale_that_fits_the_group_maximum(gen):
    weight = hard_weight(32, 128, gen, -10, 10)
    packed, scale = quantize_mxfp4(weight)
    scaled_max = weight.unflatten(-1, (-1, GROUP_SIZE)).abs().amax(-1) / torch.exp2(scale.double() - 127)
    nonzero = scaled_max > 0
    assert bool(((scaled_max[nonzero] >= 3.5) & (scaled_max[nonzero] < 7)).all())
    assert bool((scale[~nonzero] == 0).all())
    # Each element is the nearest E2M1 value (saturating at 6 times the scale).
    error = (dequantize_mxfp4(packed, scale, dtype=torch.float64) - weight).abs()
    step = torch.exp2(scale.double() - 127).repeat_interleave(GROUP_SIZE, dim=-1)
    saturated = weight.abs() > 6 * step
    assert bool((error[~saturated] <= step[~saturated]).all())


# ----------------------------------------------------------------------------------------------
# Random canonical weights
# ----------------------------------------------------------------------------------------------


def assert_canonical_codes(packed: torch.Tensor) -> None:
    """The two facts behind the round trip: no negative zero, and a 4 or 6 (code 6 or 7) in every group."""
    codes = unpack_fp4_codes(packed)
    assert not bool((codes == 8).any())
    assert bool(((codes & 7).unflatten(-1, (-1, GROUP_SIZE)).amax(-1) >= 6).all())


def test_random_mxfp4_pins_every_group_scale(gen):
    # A group of 32 uniform codes lacks a 6 or 7 with probability 0.75^32 = 1e-4 only, so look at
    # enough groups (65536) that such a group would occur unless it is ruled out by construction.
    assert_canonical_codes(random_mxfp4(2048, 1024, gen)[0])


@pytest.mark.parametrize(("out_features", "in_features"), [(8, 32), (64, 256), (128, 1024)])
def test_random_mxfp4_is_canonical_and_well_scaled(gen, out_features, in_features):
    packed, scale = random_mxfp4(out_features, in_features, gen)
    assert packed.shape == (out_features, in_features // 2) and packed.dtype == torch.uint8
    assert scale.shape == (out_features, in_features // GROUP_SIZE) and scale.dtype == torch.uint8
    assert_canonical_codes(packed)
    for dtype in (torch.float32, torch.bfloat16):
        requantized = quantize_mxfp4(dequantize_mxfp4(packed, scale, dtype=dtype))
        assert torch.equal(requantized[0], packed) and torch.equal(requantized[1], scale)
    rms = dequantize_mxfp4(packed, scale).pow(2).mean().sqrt()
    # About 1/sqrt(in_features); 8 groups (the 8 x 32 case) spread wider: 0.49-2.22 over 20,000 seeds, and the
    # [0.5, 2] bound of the larger cases failed 0.3% of them.
    spread = 3.0 if out_features * in_features // GROUP_SIZE < 64 else 2.0
    assert 1 / spread < float(rms) * in_features**0.5 < spread


def test_random_mxfp4_without_jitter_and_reproducible(gen):
    seed = int(torch.randint(2**62, (), generator=gen))
    first = random_mxfp4(16, 64, torch.Generator().manual_seed(seed), scale_jitter=0)
    second = random_mxfp4(16, 64, torch.Generator().manual_seed(seed), scale_jitter=0)
    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])
    assert bool((first[1] == first[1][0, 0]).all())
    assert torch.equal(quantize_mxfp4(dequantize_mxfp4(*first))[0], first[0])


# ----------------------------------------------------------------------------------------------
# Errors
# ----------------------------------------------------------------------------------------------


def test_dequantize_rejects_inconsistent_shapes():
    packed = torch.zeros(4, 32, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"weight_packed \(4, 32\), weight_scale \(4, 3\)"):
        dequantize_mxfp4(packed, torch.zeros(4, 3, dtype=torch.uint8))
    with pytest.raises(ValueError, match=r"weight_packed \(4, 32\), weight_scale \(2, 2\)"):
        dequantize_mxfp4(packed, torch.zeros(2, 2, dtype=torch.uint8))
    with pytest.raises(ValueError, match=r"multiple of the group size.*weight_packed \(4, 24\)"):
        dequantize_mxfp4(torch.zeros(4, 24, dtype=torch.uint8), torch.zeros(4, 1, dtype=torch.uint8))
    with pytest.raises(ValueError, match="2-D"):
        dequantize_mxfp4(torch.zeros(2, 4, 32, dtype=torch.uint8), torch.zeros(2, 4, 2, dtype=torch.uint8))
    with pytest.raises(TypeError, match="weight_scale torch.float32"):
        dequantize_mxfp4(packed, torch.zeros(4, 2))


def test_quantize_and_pack_reject_bad_inputs():
    with pytest.raises(ValueError, match=r"\(4, 48\) must be a multiple of the MXFP4 group size 32"):
        quantize_mxfp4(torch.zeros(4, 48))
    with pytest.raises(ValueError, match="2-D"):
        quantize_mxfp4(torch.zeros(64))
    with pytest.raises(ValueError, match="NaN or inf"):
        quantize_mxfp4(torch.full((1, 32), float("inf")))
    with pytest.raises(ValueError, match="must be even"):
        pack_fp4_codes(torch.zeros(2, 3, dtype=torch.uint8))
    with pytest.raises(ValueError, match="4-bit"):
        pack_fp4_codes(torch.full((2, 4), 16, dtype=torch.uint8))
    with pytest.raises(ValueError, match="in_features=40"):
        random_mxfp4(4, 40)
