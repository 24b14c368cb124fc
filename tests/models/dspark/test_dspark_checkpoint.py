"""DSpark draft config parsing/validation and draft checkpoint save/load."""

from __future__ import annotations

import copy
import json
import math
import re

import pytest
import torch

from mstar.checkpoint.safetensors_io import CheckpointError, CheckpointReader, write_checkpoint
from mstar.models.dspark import (
    EMBED_TOKENS,
    FIXTURE_PATH,
    expected_dspark_tensors,
    load_dspark_checkpoint,
    load_dspark_config,
    parse_dspark_config,
    random_dspark_tensors,
    save_dspark_checkpoint,
)
from mstar.models.kimi_k3.config import ConfigError


def _fixture_raw() -> dict:
    return json.loads(FIXTURE_PATH.read_text())


def _tiny_raw() -> dict:
    """A tiny draft: hidden 64, 2 layers, 4 heads, taps on 3 layers of an 8-layer target, markov rank 16."""
    raw = _fixture_raw()
    raw.update(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=48,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        vocab_size=1280,
        draft_vocab_size=1280,
        num_target_layers=3,
        target_hidden_size=64,
        target_num_hidden_layers=8,
        target_layer_ids=[1, 3, 6],
        mask_token_id=1277,
        bos_token_id=1270,
        eos_token_id=1271,
        pad_token_id=1279,
        markov_rank=16,
    )
    return raw


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


# --- config -----------------------------------------------------------------------------------


def test_fixture_parses_with_the_documented_values():
    cfg = load_dspark_config(FIXTURE_PATH)
    assert cfg.model_type == "k3_dspark" and cfg.architectures == ("K3DSparkModel",)
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads) == (7168, 5, 64)
    assert (cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_head_dim, cfg.v_head_dim) == (1536, 512, 192, 128)
    assert cfg.target_layer_ids == (2, 23, 47, 71, 89)
    assert cfg.context_input_size == 35840 and cfg.confidence_input_size == 7424
    assert cfg.kv_cache_width == 576
    assert cfg.hidden_act == "silu" and cfg.markov_head_type == "vanilla"
    assert cfg.rope.factor == 32.0 and cfg.rope.original_max_position_embeddings == 32768
    assert cfg.rope_theta == 50000.0 and cfg.rope.cos_sin_mscale == 1.0
    assert cfg.yarn_mscale == pytest.approx(1.3466, abs=1e-4)
    assert cfg.softmax_scale == pytest.approx(0.1309, abs=5e-5)
    assert cfg.softmax_scale == pytest.approx(192**-0.5 * (0.1 * math.log(32) + 1) ** 2, rel=1e-12)
    cfg.check_matches_target(target_hidden_size=7168, target_num_layers=93, vocab_size=163840)


def test_fixture_layout_matches_the_published_checkpoint():
    expected = expected_dspark_tensors(load_dspark_config(FIXTURE_PATH))
    assert len(expected) == 68
    assert sum(math.prod(shape) for shape, _ in expected.values()) == 3_562_312_961
    assert {dtype for _, dtype in expected.values()} == {torch.bfloat16}
    assert expected["layers.4.self_attn.q_b_proj.weight"][0] == (12288, 1536)
    assert expected["layers.0.self_attn.kv_b_proj.weight"][0] == (16384, 512)
    assert expected["layers.0.self_attn.o_proj.weight"][0] == (7168, 8192)
    assert expected["confidence_head.proj.bias"][0] == (1,)
    assert "lm_head.weight" not in expected


@pytest.mark.parametrize(
    "what, expected_size, found",
    [("target_hidden_size", 7168, 4096), ("target_num_layers", 93, 61), ("vocab_size", 163840, 129280)],
)
def test_check_matches_target_names_the_key(what, expected_size, found):
    cfg = load_dspark_config(FIXTURE_PATH)
    args = {"target_hidden_size": 7168, "target_num_layers": 93, "vocab_size": 163840}
    args[what] = found
    key = {"target_num_layers": "target_num_hidden_layers"}.get(what, what)
    with pytest.raises(ConfigError, match=key) as e:
        cfg.check_matches_target(**args)
    assert str(found) in str(e.value) and str(expected_size) in str(e.value)


def _set(path: str, value):
    def edit(raw):
        *parents, last = path.split(".")
        d = raw
        for p in parents:
            d = d[p]
        if value is _DELETE:
            del d[last]
        else:
            d[last] = value

    return edit


class _Delete:
    """Marks a key the case removes (a stable repr, so that pytest-xdist's workers collect the same test ids)."""

    def __repr__(self) -> str:
        return "deleted"


_DELETE = _Delete()

_BAD_CONFIGS = [
    ("model_type", "deepseek_v3", "model_type"),
    ("architectures", ["DFlashDraftModel"], "architectures"),
    ("hidden_size", _DELETE, "hidden_size"),
    ("kv_lora_rank", _DELETE, "kv_lora_rank"),
    ("target_layer_ids", _DELETE, "target_layer_ids"),
    ("markov_rank", _DELETE, "markov_rank"),
    ("rope_parameters", _DELETE, "rope_parameters"),
    ("num_target_layers", 4, "num_target_layers"),
    ("target_layer_ids", [2, 23, 47, 71, 92], "target_layer_ids"),  # the target's last layer
    ("target_layer_ids", [2, 23, 47, 71, 93], "target_layer_ids"),
    ("target_layer_ids", [-1, 23, 47, 71, 89], "target_layer_ids"),
    ("target_layer_ids", [2, 23, 23, 71, 89], "target_layer_ids"),
    ("target_layer_ids", [2, 23, 47.0, 71, 89], "target_layer_ids"),
    ("markov_head_type", "gated", "markov_head_type"),
    ("rope_parameters.rope_type", "linear", "rope_type"),
    ("rope_parameters.factor", _DELETE, "rope_parameters.factor"),
    ("rope_parameters.rope_theta", 10000.0, "rope_theta"),
    ("num_key_value_heads", 8, "num_key_value_heads"),
    ("hidden_size", "7168", "hidden_size"),
    ("hidden_size", 4096, "target_hidden_size"),
    ("draft_vocab_size", 32000, "draft_vocab_size"),
    ("mask_token_id", 163840, "mask_token_id"),
    ("mla_use_nope", True, "mla_use_nope"),
    ("mla_use_output_gate", True, "mla_use_output_gate"),
    ("hidden_act", "situ", "hidden_act"),
    ("enable_confidence_head", "yes", "enable_confidence_head"),
    ("torch_dtype", "float8", "torch_dtype"),
    ("qk_rope_head_dim", 63, "qk_rope_head_dim"),
    ("rms_norm_eps", 0, "rms_norm_eps"),
]


@pytest.mark.parametrize("path, value, key", _BAD_CONFIGS, ids=[f"{p}={v!r}" for p, v, _ in _BAD_CONFIGS])
def test_every_validation_error_names_its_key(path, value, key):
    raw = _fixture_raw()
    _set(path, value)(raw)
    with pytest.raises(ConfigError, match=re.escape(key)):
        parse_dspark_config(raw)


def test_optional_keys_take_their_defaults():
    raw = _fixture_raw()
    for key in ("num_key_value_heads", "draft_vocab_size", "max_position_embeddings", "rope_theta"):
        del raw[key]
    cfg = parse_dspark_config(raw)
    assert cfg.num_key_value_heads == 64 and cfg.draft_vocab_size == 163840
    assert cfg.max_position_embeddings == 32768 * 32 and cfg.rope_theta == 50000.0


def test_plain_q_proj_when_q_lora_rank_is_null():
    raw = _tiny_raw()
    raw["q_lora_rank"] = None
    names = expected_dspark_tensors(parse_dspark_config(raw))
    assert names["layers.1.self_attn.q_proj.weight"][0] == (4 * 24, 64)
    assert not any("q_a_proj" in n or "q_b_proj" in n for n in names)


# --- checkpoint -------------------------------------------------------------------------------


@pytest.mark.parametrize("max_shard_bytes", [None, 60_000])
def test_tiny_checkpoint_round_trips_bit_identically(tmp_path, max_shard_bytes):
    raw = _tiny_raw()
    cfg = parse_dspark_config(raw)
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ()).item()))
    tensors = random_dspark_tensors(cfg, gen)
    assert set(tensors) == set(expected_dspark_tensors(cfg))
    saved_cfg = save_dspark_checkpoint(tmp_path, raw, tensors, max_shard_bytes=max_shard_bytes)
    assert saved_cfg == cfg
    assert ((tmp_path / "model.safetensors.index.json").exists()) == (max_shard_bytes is not None)

    loaded_cfg, loaded = load_dspark_checkpoint(tmp_path, dtype=torch.bfloat16)
    assert loaded_cfg == cfg
    assert set(loaded) == set(tensors) - {EMBED_TOKENS}
    for name, t in loaded.items():
        assert t.dtype == torch.bfloat16 and t.shape == tensors[name].shape
        assert torch.equal(_bits(t), _bits(tensors[name])), name

    _, as_f32 = load_dspark_checkpoint(tmp_path)  # default: converted to float32, exactly
    for name, t in as_f32.items():
        assert t.dtype == torch.float32
        assert torch.equal(t, tensors[name].float()), name


def test_random_tensors_are_well_scaled():
    cfg = parse_dspark_config(_tiny_raw())
    t = random_dspark_tensors(cfg, torch.Generator().manual_seed(int(torch.randint(0, 2**31, ()).item())),
                              dtype=torch.float32)
    assert torch.equal(t["layers.0.input_layernorm.weight"], torch.ones(64))
    w = t["layers.0.mlp.down_proj.weight"]  # fan_in 128
    assert w.std().item() == pytest.approx(128**-0.5, rel=0.1)
    w1, w2 = t["markov_head.markov_w1.weight"], t["markov_head.markov_w2.weight"]
    assert (w1[:64] @ w2.T).std().item() == pytest.approx(0.5, rel=0.25)


def _save_tiny(tmp_path, edit):
    raw = _tiny_raw()
    cfg = parse_dspark_config(raw)
    tensors = random_dspark_tensors(cfg, torch.Generator().manual_seed(0))
    save_dspark_checkpoint(tmp_path, raw, tensors)
    tensors = edit(dict(tensors))
    # Write the broken layout behind the saver's back, as a bad download or conversion would.
    write_checkpoint(tmp_path, tensors)


def test_missing_tensor_is_named(tmp_path):
    name = "layers.1.self_attn.kv_b_proj.weight"
    _save_tiny(tmp_path, lambda t: {k: v for k, v in t.items() if k != name})
    with pytest.raises(CheckpointError, match=r"1 missing: " + re.escape(name)):
        load_dspark_checkpoint(tmp_path)


def test_extra_tensor_is_named(tmp_path):
    _save_tiny(tmp_path, lambda t: {**t, "lm_head.weight": torch.zeros(1280, 64, dtype=torch.bfloat16)})
    with pytest.raises(CheckpointError, match=r"1 unexpected: lm_head\.weight"):
        load_dspark_checkpoint(tmp_path)


def test_misshaped_tensor_is_named_with_both_shapes(tmp_path):
    name = "context_proj.weight"
    _save_tiny(tmp_path, lambda t: {**t, name: torch.zeros(64, 128, dtype=torch.bfloat16)})
    with pytest.raises(CheckpointError) as e:
        load_dspark_checkpoint(tmp_path)
    assert f"{name} (expected (64, 192), found (64, 128))" in str(e.value)


def test_save_rejects_a_bad_layout_too(tmp_path):
    raw = _tiny_raw()
    tensors = random_dspark_tensors(parse_dspark_config(raw), torch.Generator().manual_seed(1))
    del tensors["final_norm.weight"]
    with pytest.raises(CheckpointError, match=r"final_norm\.weight"):
        save_dspark_checkpoint(tmp_path, raw, tensors)


def test_embed_tokens_is_skipped_unread_and_optional(tmp_path, monkeypatch):
    raw = _tiny_raw()
    cfg = parse_dspark_config(raw)
    tensors = random_dspark_tensors(cfg, torch.Generator().manual_seed(2))
    save_dspark_checkpoint(tmp_path / "with", raw, tensors)
    without = {k: v for k, v in tensors.items() if k != EMBED_TOKENS}
    save_dspark_checkpoint(tmp_path / "without", raw, without)

    real_get = CheckpointReader.get

    def guarded_get(self, name):
        assert name != EMBED_TOKENS, "embed_tokens must not be read"
        return real_get(self, name)

    monkeypatch.setattr(CheckpointReader, "get", guarded_get)
    for sub in ("with", "without"):
        _, loaded = load_dspark_checkpoint(tmp_path / sub)
        assert EMBED_TOKENS not in loaded and len(loaded) == len(without)

    # A present embed_tokens is still shape-checked (from the header).
    bad = copy.copy(tensors)
    bad[EMBED_TOKENS] = torch.zeros(1280, 32, dtype=torch.bfloat16)
    write_checkpoint(tmp_path / "with", bad)
    with pytest.raises(CheckpointError, match=re.escape(f"{EMBED_TOKENS} (expected (1280, 64), found (1280, 32))")):
        load_dspark_checkpoint(tmp_path / "with")


def test_quantized_tensor_is_refused(tmp_path):
    name = "final_norm.weight"
    _save_tiny(tmp_path, lambda t: {**t, name: torch.zeros(64, dtype=torch.uint8)})
    with pytest.raises(CheckpointError, match=re.escape(name)):
        load_dspark_checkpoint(tmp_path)
