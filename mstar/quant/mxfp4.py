"""MXFP4 weights in the compressed-tensors "mxfp4-pack-quantized" format (reference section 7).

A weight W [out, in] is stored as two uint8 tensors:

- ``weight_packed`` [out, in/2]: one 4-bit E2M1 code per element, two per byte. Byte
  ``packed[r, c // 2]`` holds column c in its LOW nibble when c is even and in its HIGH nibble
  when c is odd.
- ``weight_scale`` [out, in/32]: one E8M0 byte per group of 32 consecutive input columns.

An E2M1 code has a sign bit (bit 3) and a 3-bit magnitude index into
``E2M1_MAGNITUDES = (0, 0.5, 1, 1.5, 2, 3, 4, 6)``; an E8M0 byte b means 2^(b - 127). So

    W[r, c] = (-1)^(code >> 3) * E2M1_MAGNITUDES[code & 7] * 2^(scale[r, c // 32] - 127)

Every such value has at most two significant bits, so dequantising to fp32 or bf16 is exact
(within their exponent range, i.e. scale bytes <= 252).

Quantisation follows compressed-tensors 0.20 (minmax observer, ``calculate_qparams`` with
``generate_mx_scales``, then ``quantize`` + ``pack_fp4_to_uint8``):

- Scale: take the group's absolute maximum a = m * 2^e (1 <= m < 2). Round it to a power of two,
  *up* only when m >= 1.75, giving 2^e'; the scale byte is clamp(127 + e' - 2, 0, 255). The
  "- 2" is floor(log2(6)): it maps the rounded maximum to 4, so the group maximum lands in
  [3.5, 7) and anything above 6 saturates. An all-zero group gets byte 0.
- Elements: x / scale is rounded to the nearest E2M1 magnitude with ties going to the even
  code (0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4) and values
  above 5 saturating to 6.
- Sign: the sign bit is set iff x < 0. A negative value that rounds to zero therefore becomes
  code 8 ("negative zero"), while an input of -0.0 becomes code 0.
"""

import math

import torch

GROUP_SIZE = 32  # input columns that share one E8M0 scale byte
E8M0_BIAS = 127
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_SIGN_BIT = 8  # bit 3 of a 4-bit code
# log2 of the power of two the scale maps a group's rounded absmax to: floor(log2(6)) = 2.
_E2M1_MAX_EXPONENT = 2
# Midpoints between consecutive magnitudes; a tie at midpoint i lies between codes i and i + 1.
_E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


# ----------------------------------------------------------------------------------------------
# Decoding
# ----------------------------------------------------------------------------------------------


def decode_e2m1(codes: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Values of 4-bit E2M1 codes (uint8, any shape). Code 8 decodes to -0.0."""
    magnitudes = torch.tensor(E2M1_MAGNITUDES, dtype=dtype, device=codes.device)
    values = magnitudes[(codes & 7).long()]
    return torch.where((codes & E2M1_SIGN_BIT) != 0, -values, values)


def decode_e8m0(scale_bytes: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """2^(b - 127) for uint8 E8M0 bytes b, exact wherever the dtype can hold it.

    Built from the float64 bit pattern (biased exponent b - 127 + 1023, zero mantissa), which
    holds every byte exactly, instead of trusting exp2/pow to be exact at integers.
    """
    float64_exponent = scale_bytes.to(torch.int64) + (1023 - E8M0_BIAS)
    return (float64_exponent << 52).view(torch.float64).to(dtype)


# ----------------------------------------------------------------------------------------------
# Packing two 4-bit codes per byte
# ----------------------------------------------------------------------------------------------


def pack_fp4_codes(codes: torch.Tensor) -> torch.Tensor:
    """Pack uint8 codes [..., n] (values 0..15, n even) into bytes [..., n/2].

    Even column -> low nibble, odd column -> high nibble.
    """
    if codes.dtype != torch.uint8:
        raise TypeError(f"pack_fp4_codes: codes must be uint8, got {codes.dtype}")
    if codes.ndim == 0 or codes.shape[-1] % 2 != 0:
        raise ValueError(f"pack_fp4_codes: the last dimension of codes {tuple(codes.shape)} must be even")
    if codes.numel() and int(codes.max()) > 15:
        raise ValueError(f"pack_fp4_codes: codes must be 4-bit (0..15), got a maximum of {int(codes.max())}")
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_fp4_codes(packed: torch.Tensor) -> torch.Tensor:
    """Unpack uint8 bytes [..., n] into 4-bit codes [..., 2n] (low nibble first)."""
    if packed.dtype != torch.uint8:
        raise TypeError(f"unpack_fp4_codes: packed must be uint8, got {packed.dtype}")
    if packed.ndim == 0:
        raise ValueError("unpack_fp4_codes: packed must have at least one dimension")
    return torch.stack((packed & 0x0F, packed >> 4), dim=-1).flatten(-2)


# ----------------------------------------------------------------------------------------------
# Dequantisation
# ----------------------------------------------------------------------------------------------


def check_packed_pair(weight_packed: torch.Tensor, weight_scale: torch.Tensor) -> None:
    """Raise unless weight_packed [out, in/2] and weight_scale [out, in/32] are consistent uint8."""
    shapes = f"weight_packed {tuple(weight_packed.shape)}, weight_scale {tuple(weight_scale.shape)}"
    if weight_packed.dtype != torch.uint8 or weight_scale.dtype != torch.uint8:
        raise TypeError(
            f"MXFP4 tensors must be uint8, got weight_packed {weight_packed.dtype} and weight_scale "
            f"{weight_scale.dtype} ({shapes})"
        )
    if weight_packed.ndim != 2 or weight_scale.ndim != 2:
        raise ValueError(f"MXFP4 tensors must be 2-D [out, in/2] and [out, in/32], got {shapes}")
    out_features, half_in = weight_packed.shape
    if half_in % (GROUP_SIZE // 2) != 0:
        raise ValueError(
            f"weight_packed has {half_in} bytes per row, i.e. {2 * half_in} input features, which is not "
            f"a multiple of the group size {GROUP_SIZE} ({shapes})"
        )
    expected_scale_shape = (out_features, 2 * half_in // GROUP_SIZE)
    if tuple(weight_scale.shape) != expected_scale_shape:
        raise ValueError(f"weight_scale should have shape {expected_scale_shape} to match weight_packed ({shapes})")


def dequantize_mxfp4(
    weight_packed: torch.Tensor, weight_scale: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Dense weight [out, in] from weight_packed uint8 [out, in/2] and weight_scale uint8 [out, in/32].

    Always exact in float64. In float32 and bfloat16 it is exact for scale bytes up to 252; larger
    bytes overflow their 8-bit exponent range to inf, as they do in compressed-tensors. (Byte 255 is
    read as 2^128, like compressed-tensors does, not as the OCP E8M0 NaN; real checkpoints sit
    far below either.)
    """
    check_packed_pair(weight_packed, weight_scale)
    # Products of a 2-significant-bit value and a power of two are exact in float32 down to
    # 0.5 * 2^-127 (a float32 subnormal), so float32 is wide enough for every output but float64.
    compute_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    values = decode_e2m1(unpack_fp4_codes(weight_packed), compute_dtype)
    scales = decode_e8m0(weight_scale, compute_dtype)
    grouped = values.unflatten(-1, (weight_scale.shape[-1], GROUP_SIZE)) * scales.unsqueeze(-1)
    return grouped.flatten(-2).to(dtype)


# ----------------------------------------------------------------------------------------------
# Quantisation (compressed-tensors semantics)
# ----------------------------------------------------------------------------------------------


def e8m0_scale_for_absmax(absmax: torch.Tensor) -> torch.Tensor:
    """E8M0 scale bytes (uint8) for non-negative group absolute maxima, as compressed-tensors picks them.

    absmax = m * 2^e with 1 <= m < 2 is rounded to 2^(e + 1) if m >= 1.75, else to 2^e; the byte
    is 127 + that exponent - 2, clamped to 0..255. Zero (and anything tiny enough) gives byte 0.
    """
    # frexp gives absmax = f * 2^k with 0.5 <= f < 1, so m = 2f and e = k - 1.
    fraction, exponent = torch.frexp(absmax.to(torch.float64))
    rounded_exponent = exponent.to(torch.int64) - 1 + (fraction >= 0.875).to(torch.int64)
    biased = (rounded_exponent + (E8M0_BIAS - _E2M1_MAX_EXPONENT)).clamp(0, 255)
    return torch.where(absmax == 0, 0, biased).to(torch.uint8)


def round_to_e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """Nearest E2M1 codes (uint8) for already-scaled values x.

    Ties go to the even code, magnitudes above 5 saturate to 6, and the sign bit is set iff x < 0
    (so small negatives give negative zero, code 8, while -0.0 gives code 0).
    """
    magnitude = x.abs()
    midpoints = torch.tensor(_E2M1_MIDPOINTS, dtype=magnitude.dtype, device=x.device)
    # bucketize (right=False) counts the midpoints strictly below each value: ties round down.
    code = torch.bucketize(magnitude, midpoints)
    # A tie at midpoint `code` is between codes `code` and `code + 1`; move up when `code` is odd.
    is_tie = magnitude == midpoints[code.clamp(max=len(_E2M1_MIDPOINTS) - 1)]
    code = code + (is_tie & (code % 2 == 1)).to(code.dtype)
    return (code | torch.where(x < 0, E2M1_SIGN_BIT, 0)).to(torch.uint8)


def quantize_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight_packed uint8 [out, in/2], weight_scale uint8 [out, in/32]) for a float weight [out, in].

    Bit-identical to compressed-tensors' MXFP4 quantize + compress for float32, bfloat16 and
    float64 weights. The work is done in float64, where dividing by a power-of-two scale is exact;
    float16 weights get the same exact rule (compressed-tensors instead holds its scale in float16,
    which underflows or overflows for group maxima outside about [2^-22, 2^17]).
    """
    if weight.ndim != 2:
        raise ValueError(f"quantize_mxfp4: weight must be 2-D [out, in], got shape {tuple(weight.shape)}")
    if not weight.is_floating_point():
        raise TypeError(f"quantize_mxfp4: weight must be a float tensor, got {weight.dtype}")
    out_features, in_features = weight.shape
    if in_features % GROUP_SIZE != 0:
        raise ValueError(
            f"quantize_mxfp4: in_features of weight {tuple(weight.shape)} must be a multiple of the "
            f"MXFP4 group size {GROUP_SIZE}"
        )
    if not bool(torch.isfinite(weight).all()):
        raise ValueError("quantize_mxfp4: weight contains NaN or inf; MXFP4 has no encoding for them")

    groups = weight.to(torch.float64).unflatten(-1, (in_features // GROUP_SIZE, GROUP_SIZE))
    weight_scale = e8m0_scale_for_absmax(groups.abs().amax(dim=-1))
    scaled = groups / decode_e8m0(weight_scale, torch.float64).unsqueeze(-1)
    codes = round_to_e2m1_codes(scaled).flatten(-2)
    return pack_fp4_codes(codes), weight_scale


# ----------------------------------------------------------------------------------------------
# Random canonical weights for tiny test checkpoints
# ----------------------------------------------------------------------------------------------

# Codes whose magnitude pins the group scale: after dequantisation the group maximum is 4 or 6
# times the scale, and only those two map back to the same scale byte (2 or 3 would give a
# byte one lower).
_SCALE_PINNING_MAGNITUDES = (6, 7)


def random_mxfp4(
    out_features: int,
    in_features: int,
    generator: torch.Generator | None = None,
    *,
    scale_jitter: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random canonical (weight_packed [out, in/2], weight_scale [out, in/32]) on the generator's device.

    Canonical means ``quantize_mxfp4(dequantize_mxfp4(p, s)) == (p, s)`` bit for bit, which holds
    because:
    - no element uses code 8 (negative zero dequantises to -0.0, which quantises to code 0), and
    - every group contains a magnitude code 6 or 7 (value 4 or 6 times the scale), so the group
      maximum maps back to the same scale byte.

    Magnitudes are uniform over the 8 E2M1 codes; the scale byte of each group is a base byte,
    chosen so that the weight's root mean square is about 1/sqrt(in_features) (a well-scaled
    linear layer), plus a uniform random offset in [-scale_jitter, scale_jitter].
    """
    if in_features % GROUP_SIZE != 0 or in_features <= 0 or out_features <= 0:
        raise ValueError(
            f"random_mxfp4: need out_features > 0 and in_features a positive multiple of {GROUP_SIZE}, "
            f"got out_features={out_features}, in_features={in_features}"
        )
    if scale_jitter < 0:
        raise ValueError(f"random_mxfp4: scale_jitter must be >= 0, got {scale_jitter}")
    device = generator.device if generator is not None else torch.device("cpu")
    num_groups = in_features // GROUP_SIZE

    def randint(low: int, high: int, shape: tuple[int, ...]) -> torch.Tensor:
        return torch.randint(low, high, shape, generator=generator, device=device)

    magnitude = randint(0, 8, (out_features, num_groups, GROUP_SIZE))
    pin_position = randint(0, GROUP_SIZE, (out_features, num_groups, 1))
    pin_magnitude = randint(_SCALE_PINNING_MAGNITUDES[0], _SCALE_PINNING_MAGNITUDES[1] + 1, pin_position.shape)
    magnitude = magnitude.scatter(-1, pin_position, pin_magnitude)
    negative = randint(0, 2, magnitude.shape).bool() & (magnitude > 0)  # never negative zero
    codes = (magnitude | torch.where(negative, E2M1_SIGN_BIT, 0)).to(torch.uint8).flatten(-2)

    offset = randint(-scale_jitter, scale_jitter + 1, (out_features, num_groups))
    scale_bytes = (_base_scale_byte(in_features, scale_jitter) + offset).clamp(0, 252)
    return pack_fp4_codes(codes), scale_bytes.to(torch.uint8)


def _base_scale_byte(in_features: int, scale_jitter: int) -> int:
    """E8M0 byte making the expected weight mean square about 1/in_features.

    The mean square of a random_mxfp4 weight is E[v^2] * E[4^j] * 2^(2(b - 127)), with v a
    uniform E2M1 magnitude and j the uniform scale offset; rounding b to an integer leaves the
    root mean square within a factor sqrt(2) of 1/sqrt(in_features). The one pinned element per
    group of 32 shifts E[v^2] by only a few percent, so it is ignored.
    """
    mean_square_code = sum(v * v for v in E2M1_MAGNITUDES) / len(E2M1_MAGNITUDES)
    offsets = range(-scale_jitter, scale_jitter + 1)
    mean_square_jitter = sum(4.0**j for j in offsets) / len(offsets)
    log2_scale = -0.5 * math.log2(in_features * mean_square_code * mean_square_jitter)
    return E8M0_BIAS + round(log2_scale)
