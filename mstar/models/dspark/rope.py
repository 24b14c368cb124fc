"""DeepSeek-V3 YaRN rotary embedding, interleaved pairs: the DSpark draft's RoPE (the K3 target has none).

For a rotary width d (qk_rope_head_dim, 64 in the real draft) and frequency index i = 0 .. d/2 - 1:

    extrapolated_i = theta^(-2i/d)                    the original RoPE frequency
    interpolated_i = extrapolated_i / factor          position interpolation by the yarn factor
    corr(n)        = d * ln(L0 / (2 pi n)) / (2 ln theta)     the index whose wavelength fits n turns in L0
    low, high      = max(floor(corr(beta_fast)), 0), min(ceil(corr(beta_slow)), d - 1)
    ramp_i         = clamp((i - low) / (high - low), 0, 1)    (high += 0.001 when low == high)
    inv_freq_i     = interpolated_i * ramp_i + extrapolated_i * (1 - ramp_i)

so fast-turning dims (i <= low) keep their frequency and slow ones (i >= high) are interpolated. L0 is
`original_max_position_embeddings` (32768 for K3's draft, theta 50000, factor 32, beta_fast 32, beta_slow 1:
low 15, high 26 of 32). The angle of position p is p * inv_freq_i, and cos/sin carry the magnitude factor
yarn_get_mscale(factor, mscale) / yarn_get_mscale(factor, mscale_all_dim), which is 1.0 for the K3 draft
(mscale == mscale_all_dim); the attention-side mscale^2 lives in `DSparkConfig.softmax_scale` instead.

Pairs are interleaved (`is_neox_style=False`, GPT-J layout): dims (2i, 2i+1) rotate together by angle i,
and the rotated vector keeps that layout, so the cached k_pe is interleaved too.

Sources (facts only): vLLM `vllm/model_executor/layers/rotary_embedding/deepseek_scaling_rope.py`
(`DeepseekScalingRotaryEmbedding._compute_inv_freq`, `_compute_cos_sin_cache`: fp32 table, cos/sin times
mscale; `forward_native`: `repeat_interleave` + `rotate_gptj` when not neox) and `.../rotary_embedding/common.py`
(`yarn_find_correction_dim/range` with floor/ceil and the clamp, `yarn_linear_ramp_mask` with the +0.001 guard);
deepseek-ai/DeepSeek-V3 `inference/model.py` `precompute_freqs_cis` (the same blend written as
`freqs / factor * (1 - smooth) + freqs * smooth`, `smooth = 1 - ramp`, complex rotation of interleaved pairs);
vLLM `vllm/models/kimi_k3/nvidia/mla.py` (`use_rope=True`, the DSpark path: rope_type `deepseek_yarn`,
`is_neox_style=False`, fp32 cos/sin; `get_rope` passes `original_max_position_embeddings` as the yarn L0).
vLLM always applies the yarn blend; DeepSeek's code only when max_seq_len > L0, which holds for the draft
(1048576 > 32768), so both agree here.

Precision: angles, cos/sin and the rotation run in at least fp32 (`at_least_fp32`: fp64 stays fp64, so the
float64 reference is exact); the result is cast back to the input dtype.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from mstar.models.dspark.config import YarnRopeConfig
from mstar.models.kimi_k3.norm import at_least_fp32


def yarn_correction_dim(num_rotations: float, dim: int, base: float, original_max_position: int) -> float:
    """The (fractional) frequency index whose wavelength fits `num_rotations` turns in `original_max_position`."""
    return dim * math.log(original_max_position / (num_rotations * 2 * math.pi)) / (2 * math.log(base))


def yarn_correction_range(rope: YarnRopeConfig, dim: int) -> tuple[int, int]:
    """(low, high) frequency indices of the extrapolation -> interpolation ramp, clamped to [0, dim - 1]."""
    low = math.floor(yarn_correction_dim(rope.beta_fast, dim, rope.rope_theta, rope.original_max_position_embeddings))
    high = math.ceil(yarn_correction_dim(rope.beta_slow, dim, rope.rope_theta, rope.original_max_position_embeddings))
    return max(low, 0), min(high, dim - 1)


def yarn_inv_freq(rope: YarnRopeConfig, dim: int, dtype: torch.dtype = torch.float32, device=None) -> Tensor:
    """The blended inverse frequencies [dim / 2], computed in `dtype` (fp32 as served, fp64 for the reference)."""
    if dim % 2:
        raise ValueError(f"rotary width {dim} must be even (RoPE rotates pairs)")
    exponents = torch.arange(0, dim, 2, dtype=dtype, device=device) / dim
    extrapolated = 1.0 / (rope.rope_theta**exponents)
    interpolated = extrapolated / rope.factor
    low, high = yarn_correction_range(rope, dim)
    span = (high - low) if high != low else 0.001
    ramp = ((torch.arange(dim // 2, dtype=dtype, device=device) - low) / span).clamp(0, 1)
    return interpolated * ramp + extrapolated * (1 - ramp)


class YarnRotaryEmbedding:
    """Rotates the last `dim` features of q_pe / k_pe by their positions (no parameters).

    Not an nn.Module on purpose: the frequencies must stay in at least fp32 even when the model is cast
    to bf16. They are built once per dtype and device (a dozen eager launches each time otherwise, on the
    serving path's every step). A caller rotating many tensors at the same positions (the GPU draft step: q
    and k of every layer) builds the tables once (`cos_sin`) and rotates with `rotate`.
    """

    def __init__(self, rope: YarnRopeConfig, dim: int):
        if dim % 2:
            raise ValueError(f"qk_rope_head_dim={dim} must be even (RoPE rotates pairs)")
        self.rope = rope
        self.dim = dim
        self.mscale = rope.cos_sin_mscale
        self._inv_freq: dict[tuple[torch.dtype, torch.device], Tensor] = {}

    def cos_sin(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """cos, sin [T, dim / 2] for integer positions [T], in `dtype` (at least fp32)."""
        key = dtype, positions.device
        inv_freq = self._inv_freq.get(key)
        if inv_freq is None:
            inv_freq = yarn_inv_freq(self.rope, self.dim, dtype=dtype, device=positions.device)
            if not (positions.is_cuda and torch.cuda.is_current_stream_capturing()):  # a capture fills it later
                self._inv_freq[key] = inv_freq
        angles = positions.to(dtype)[:, None] * inv_freq[None, :]
        return angles.cos() * self.mscale, angles.sin() * self.mscale

    def __call__(self, x: Tensor, positions: Tensor) -> Tensor:
        """x [T, ..., dim] (row t at positions[t]) -> x rotated, same shape and dtype."""
        if positions.dim() != 1 or positions.shape[0] != x.shape[0]:
            raise ValueError(
                f"positions must be [T] with T = {x.shape[0]} (one per row of x), got shape {tuple(positions.shape)}"
            )
        return self.rotate(x, *self.cos_sin(positions, at_least_fp32(x).dtype))

    def rotate(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """x [T, ..., dim] rotated by the tables cos, sin [T, dim / 2] of its rows' positions (`cos_sin`): what
        a caller that rotates several tensors at the same positions computes once (kernels/rope.py is this
        rotation in one launch)."""
        if x.shape[-1] != self.dim:
            raise ValueError(f"RoPE input has {x.shape[-1]} features in its last dim; expected {self.dim}")
        if cos.shape != (x.shape[0], self.dim // 2) or sin.shape != cos.shape:
            raise ValueError(f"cos and sin must be [{x.shape[0]}, {self.dim // 2}] (a row per row of x), got "
                             f"{tuple(cos.shape)} and {tuple(sin.shape)}")
        xf = at_least_fp32(x)
        view = (x.shape[0],) + (1,) * (x.dim() - 2) + (self.dim // 2,)
        cos, sin = cos.to(xf.dtype).view(view), sin.to(xf.dtype).view(view)
        pairs = xf.unflatten(-1, (self.dim // 2, 2))
        even, odd = pairs[..., 0], pairs[..., 1]
        rotated = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1)
        return rotated.flatten(-2).to(x.dtype)
