import copy
import json
from importlib import resources

import pytest

from mstar.models.kimi_k3.config import ConfigError, load_config, parse_config

FIXTURES = resources.files("mstar.models.kimi_k3").joinpath("fixtures")


def raw_full():
    return json.loads(FIXTURES.joinpath("kimi_k3_config.json").read_text())


def test_full_k3_layer_kinds_and_keys():
    cfg = parse_config(raw_full())
    assert cfg.variant == "kimi_k3" and cfg.weight_prefix == "language_model."
    kinds = cfg.layer_kinds
    assert kinds.count("kda") == 69 and kinds.count("mla") == 24
    assert [i for i, k in enumerate(kinds) if k == "mla"] == [*range(3, 92, 4), 92]
    assert not cfg.is_moe_layer(0) and all(cfg.is_moe_layer(i) for i in range(1, 93))
    assert cfg.num_experts == 896 and cfg.num_experts_per_token == 16 and cfg.routed_expert_hidden_size == 3584
    assert cfg.kv_cache_width == 576 and abs(cfg.mla_softmax_scale - 192**-0.5) < 1e-15
    assert cfg.linear_attn.gate_lower_bound == -5.0 and cfg.linear_attn.use_full_rank_gate
    assert cfg.quantization is not None and cfg.quantization.format == "mxfp4-pack-quantized"
    assert cfg.quantization.group_size == 32 and len(cfg.quantization.ignore) == 6
    assert cfg.activation_situ_beta == 4.0 and cfg.activation_situ_linear_beta == 25.0
    assert cfg.attn_res_block_size == 12 and cfg.rms_norm_eps == 1e-5


def test_pruned75_has_224_experts():
    cfg = load_config(FIXTURES.joinpath("kimi_k3_pruned75_config.json"))
    assert cfg.num_experts == 224 and cfg.num_experts_per_token == 16


def test_config_is_immutable():
    cfg = parse_config(raw_full())
    with pytest.raises(AttributeError):
        cfg.hidden_size = 1


def test_bare_kimi_linear_text_config():
    raw = raw_full()["text_config"]
    for k in ("attn_res_block_size", "routed_expert_hidden_size", "latent_moe_use_norm",
              "activation_situ_beta", "activation_situ_linear_beta"):
        raw.pop(k)
    raw["hidden_act"] = "silu"
    raw["mla_use_output_gate"] = False
    raw["linear_attn_config"].pop("gate_lower_bound")
    cfg = parse_config(raw)
    assert cfg.variant == "kimi_linear" and cfg.weight_prefix == ""
    assert cfg.attn_res_block_size is None and cfg.linear_attn.gate_lower_bound is None


@pytest.mark.parametrize(
    "edit, key",
    [
        (lambda r: r.pop("model_type"), "model_type"),
        (lambda r: r["text_config"].pop("hidden_size"), "text_config.hidden_size"),
        (lambda r: r["text_config"].pop("attn_res_block_size"), "text_config.attn_res_block_size"),
        (lambda r: r["text_config"]["linear_attn_config"].pop("kda_layers"), "linear_attn_config.kda_layers"),
        (lambda r: r["text_config"].update(hidden_size="7168"), "text_config.hidden_size"),
        (lambda r: r["text_config"].update(num_hidden_layers=0), "text_config.num_hidden_layers"),
        (lambda r: r["text_config"].update(mla_use_output_gate=1), "text_config.mla_use_output_gate"),
    ],
)
def test_missing_or_mistyped_keys_are_named(edit, key):
    raw = raw_full()
    edit(raw)
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        parse_config(raw)


def test_unknown_model_type_is_named():
    raw = raw_full()
    raw["model_type"] = "llama"
    with pytest.raises(ConfigError, match="model_type='llama'"):
        parse_config(raw)
    raw = raw_full()
    raw["text_config"]["model_type"] = "deepseek_v3"
    with pytest.raises(ConfigError, match="text_config.model_type"):
        parse_config(raw)


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda t: t["linear_attn_config"]["kda_layers"].append(4), "in both"),
        (lambda t: t["linear_attn_config"]["kda_layers"].remove(1), r"missing \[1\]"),
        (lambda t: t["linear_attn_config"]["full_attn_layers"].append(94), "1-based"),
        (lambda t: t.update(num_experts_per_token=1000), "num_experts_per_token=1000"),
        (lambda t: t.update(num_expert_group=3), "num_expert_group=3"),
        (lambda t: t.update(num_key_value_heads=8), "num_key_value_heads=8"),
        (lambda t: t.update(hidden_act="silu"), "hidden_act"),
        (lambda t: t.update(topk_method="greedy"), "topk_method"),
        (lambda t: t["quantization_config"]["config_groups"]["group_0"]["weights"].update(group_size=16),
         "group_size"),
    ],
)
def test_contradictory_values_are_named(edit, message):
    raw = raw_full()
    edit(raw["text_config"])
    with pytest.raises(ConfigError, match=message):
        parse_config(raw)


def test_last_layer_must_be_mla_for_k3():
    raw = raw_full()
    la = raw["text_config"]["linear_attn_config"]
    la["full_attn_layers"].remove(93)
    la["kda_layers"].append(93)
    with pytest.raises(ConfigError, match="last layer"):
        parse_config(raw)


def test_load_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="no config.json"):
        load_config(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_config(tmp_path)


def test_with_overrides_revalidates():
    cfg = parse_config(raw_full())
    assert cfg.with_overrides(num_experts=224).num_experts == 224
    with pytest.raises(ConfigError):
        cfg.with_overrides(num_experts=8)  # fewer than the 16 per token
    assert copy.deepcopy(cfg) == cfg
