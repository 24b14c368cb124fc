"""The decode step's short conv (kda_fla.decode_conv, one row per sequence, q/k/v at once) against the
ragged conv of prefill (kda_fla.varlen_short_conv), on CPU."""

import pytest
import torch

from mstar.kernels.kda_fla import decode_conv, varlen_short_conv
from mstar.models.kimi_k3.config import parse_config
from mstar.models.kimi_k3.kda import KimiDeltaAttention
from mstar.tools.make_tiny import k3_fixture


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
def test_decode_conv_equals_the_ragged_conv(dtype, tol):
    raw = k3_fixture()
    t = raw["text_config"]
    t.update(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4)
    t["linear_attn_config"].update(head_dim=16, num_heads=4, kda_layers=[1], full_attn_layers=[2])
    attn = KimiDeltaAttention(parse_config(raw), 0).to(dtype)
    with torch.no_grad():
        for conv in (attn.q_conv1d, attn.k_conv1d, attn.v_conv1d):
            conv.weight.normal_()
        B, width, hist = 5, 64, attn.q_conv1d.weight.shape[-1] - 1
        x = torch.randn(B, 64, dtype=dtype)
        windows = torch.randn(B, 3, hist, width, dtype=dtype)
        out, new = decode_conv(attn, x, windows)
        for i, (proj, conv) in enumerate(((attn.q_proj, attn.q_conv1d), (attn.k_proj, attn.k_conv1d),
                                          (attn.v_proj, attn.v_conv1d))):
            expect, expect_win = varlen_short_conv(proj(x), conv.weight, windows[:, i], [1] * B)
            err = (out[:, i].float() - expect.float()).abs().max() / expect.float().abs().max()
            assert err < tol, (i, float(err))
            assert torch.equal(new[:, i], expect_win.to(new.dtype))
