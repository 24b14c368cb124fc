"""The residual stream whose closed blocks' AttnRes statistics are computed once (precomputed_stream.py): a forward
pass through it equals the reference's, and its mixes are checked against the order they were stacked for. Without
CUDA the kernels run in Triton's interpreter (fp32)."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from mstar.models.kimi_k3.layer_ops import LayerOps  # noqa: E402
from mstar.models.kimi_k3.model import dense_mixer  # noqa: E402
from mstar.models.kimi_k3.precomputed_stream import PrecomputedStream, sublayer_queries  # noqa: E402


class PrecomputedOps(LayerOps):
    """The reference's ops but for the stream."""

    def residual_stream(self, model, embedding):
        cfg = model.config
        return PrecomputedStream(embedding, cfg.attn_res_block_size, cfg.num_hidden_layers, sublayer_queries(model))


def test_sublayer_queries_follow_the_forward_pass(tiny_model):
    """One mix a layer's FFN input, one a mixer input once a block has closed (every layer after the first), one for
    the output head; each row the fp32 product of its norm and projection weights."""
    model = tiny_model.model
    queries = sublayer_queries(model)
    layers = model.config.num_hidden_layers
    assert len(queries.projections) == queries.weights.shape[0] == 2 * layers
    assert queries.projections[0] is model.layers[0].mlp_res_proj
    assert queries.projections[1] is model.layers[1].self_attention_res_proj
    assert queries.projections[-1] is model.output_attn_res_proj
    layer = model.layers[1]
    assert torch.equal(queries.weights[1], layer.self_attention_res_norm.weight.float()
                       * layer.self_attention_res_proj.weight[0].float())


def test_a_forward_pass_through_closed_stats_equals_the_reference(tiny_model):
    """Every mix through the kernels over closed blocks' stats (prompts long enough to close several blocks): the
    final hidden states equal the reference's to fp32 rounding (the kernels sum in another order: ~2e-6 relative
    after the stack, as without the closed stats)."""
    model = tiny_model.model
    for length in (1, 7, 40):
        ids = torch.randint(0, model.config.vocab_size - 256, (length,))
        with torch.no_grad():
            expect, _ = model(ids, dense_mixer(model, tiny_model.new_state(), False))
            got, _ = model(ids, dense_mixer(model, tiny_model.new_state(), False), ops=PrecomputedOps())
        assert torch.isfinite(got).all()
        assert float((got - expect).norm() / expect.norm()) < 1e-5


def test_a_mix_out_of_order_is_refused(tiny_model):
    model = tiny_model.model
    stream = PrecomputedOps().residual_stream(model, torch.randn(3, model.config.hidden_size))
    stream.maybe_close_block(0)
    layer = model.layers[1]  # the first mix is layer 0's FFN input, not layer 1's mixer input
    with pytest.raises(RuntimeError, match="mix 0 of the forward pass"):
        stream.normed_input(layer.self_attention_res_proj, layer.self_attention_res_norm, layer.input_layernorm)
