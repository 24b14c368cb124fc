"""Kimi-Linear mode of the reference against transformers' `KimiLinearForCausalLM` (fp32, CPU).

A tiny random transformers model is exported under the original Kimi-Linear checkpoint names
(transformers renames and fuses some tensors on load; the export undoes that), written as a
safetensors checkpoint, loaded by mstar, and both models' logits compared.
"""

import json
import os
import sys

import pytest
import torch

from mstar.checkpoint.safetensors_io import write_checkpoint
from mstar.models.kimi_k3.weights import load_model

transformers = pytest.importorskip("transformers")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

TINY_KIMI_LINEAR = {
    "architectures": ["KimiLinearForCausalLM"], "model_type": "kimi_linear",
    "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32,
    "num_hidden_layers": 5, "num_attention_heads": 4, "num_key_value_heads": 4,
    "q_lora_rank": None, "kv_lora_rank": 16, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
    "mla_use_nope": True, "num_experts": 8, "num_experts_per_token": 2, "num_shared_experts": 1,
    "num_expert_group": 1, "topk_group": 1, "moe_renormalize": True, "moe_router_activation_func": "sigmoid",
    "routed_scaling_factor": 2.446, "first_k_dense_replace": 1, "moe_layer_freq": 1,
    "hidden_act": "silu", "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
    "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
    "linear_attn_config": {"head_dim": 16, "num_heads": 4, "short_conv_kernel_size": 4,
                           "kda_layers": [1, 2, 4], "full_attn_layers": [3, 5]},
}


def to_original_names(state: dict[str, torch.Tensor], cfg) -> dict[str, torch.Tensor]:
    """Undo transformers' load-time renames: forget_gate.*, fused conv1d, fused experts, mlp -> block_sparse_moe."""
    width = cfg.linear_head_dim * cfg.linear_num_heads
    inter = cfg.moe_intermediate_size
    out = {}
    for name, t in state.items():
        if ".self_attn.forget_gate." in name:
            out[name.replace(".forget_gate.", ".")] = t
        elif name.endswith(".self_attn.conv1d.weight"):
            stem = name.removesuffix("conv1d.weight")
            for part, w in zip("qkv", t.split(width, dim=0), strict=True):
                out[f"{stem}{part}_conv1d.weight"] = w
        elif name.endswith(".mlp.experts.gate_up_proj"):
            stem = name.removesuffix("mlp.experts.gate_up_proj") + "block_sparse_moe.experts."
            for e in range(t.shape[0]):
                out[f"{stem}{e}.w1.weight"], out[f"{stem}{e}.w3.weight"] = t[e, :inter], t[e, inter:]
        elif name.endswith(".mlp.experts.down_proj"):
            stem = name.removesuffix("mlp.experts.down_proj") + "block_sparse_moe.experts."
            for e in range(t.shape[0]):
                out[f"{stem}{e}.w2.weight"] = t[e]
        elif ".mlp.gate." in name or ".mlp.shared_experts." in name:
            out[name.replace(".mlp.", ".block_sparse_moe.")] = t
        else:
            out[name] = t
    return {k: v.detach().contiguous().clone() for k, v in out.items()}


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    # transformers runs fla's Triton KDA kernels whenever `fla` imports (it does wherever triton is
    # installed); they cannot run on a CPU, so hide fla and let transformers use its pure-torch KDA.
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(sys.modules, "fla", None)
        yield _build_pair(tmp_path_factory)


def _build_pair(tmp_path_factory):
    cfg = transformers.KimiLinearConfig(**TINY_KIMI_LINEAR)
    ref = transformers.KimiLinearForCausalLM(cfg).eval()
    ref.set_attn_implementation("eager")
    with torch.no_grad():  # transformers' init leaves norms at 1 and biases at 0: perturb everything
        for name, p in ref.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn_like(p))
            elif "A_log" in name:
                p.copy_(torch.empty_like(p).uniform_(0.5, 1.5).log())
            elif "dt_bias" in name:
                p.copy_(torch.randn_like(p) * 0.5 - 1)
            elif "conv1d" in name:
                p.copy_(torch.randn_like(p) * 0.5)
            else:
                p.copy_(torch.randn_like(p) * p.shape[-1] ** -0.5)
        for name, b in ref.named_buffers():
            if "e_score_correction_bias" in name:
                b.copy_(torch.randn_like(b) * 0.05)
    d = tmp_path_factory.mktemp("kimi_linear")
    write_checkpoint(d, to_original_names(ref.state_dict(), cfg))
    (d / "config.json").write_text(json.dumps(TINY_KIMI_LINEAR))
    return ref, load_model(d, dtype=torch.float32)


@pytest.mark.parametrize("absorbed", [False, True])
def test_logits_match_transformers(pair, absorbed):
    ref, ours = pair
    assert ours.config.variant == "kimi_linear"
    ids = torch.randint(0, 256, (150,))  # spans several 64-token KDA chunks
    with torch.no_grad():
        expect = ref(input_ids=ids[None], use_cache=False).logits[0]
    got = ours(ids, absorbed=absorbed).logits
    assert float((got - expect).abs().max()) <= 1e-4


def test_incremental_decode_matches_transformers(pair):
    ref, ours = pair
    ids = torch.randint(0, 256, (24,))
    with torch.no_grad():
        expect = ref(input_ids=ids[None], use_cache=False).logits[0]
    first = ours(ids[:16])
    rows, state = [first.logits], first.state
    for t in range(16, 24):
        out = ours(ids[t : t + 1], state, absorbed=True)
        rows.append(out.logits)
        state = out.state
    assert float((torch.cat(rows) - expect).abs().max()) <= 1e-4
