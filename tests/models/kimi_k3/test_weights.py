"""K3 checkpoint I/O: round trips, MXFP4 experts decided per tensor, and the promised errors."""

import json
import shutil

import pytest
import torch

from mstar.checkpoint.safetensors_io import CheckpointError, CheckpointReader, write_checkpoint
from mstar.models.kimi_k3.config import parse_config
from mstar.models.kimi_k3.weights import checkpoint_tensors, expected_checkpoint_shapes, load_model, save_checkpoint
from mstar.quant.mxfp4 import dequantize_mxfp4
from mstar.tools.make_tiny import real_dims_raw_config


def read_all(path):
    with CheckpointReader(path) as r:
        return {n: r.get(n) for n in r.names()}


def copy_with(src, dst, edit):
    """Copy the checkpoint at `src` to `dst` with its tensors changed by `edit(dict)`."""
    tensors = read_all(src)
    edit(tensors)
    dst.mkdir()
    write_checkpoint(dst, tensors)
    shutil.copy(src / "config.json", dst / "config.json")
    return dst


def test_layout_is_the_real_one(tiny_dir):
    assert (tiny_dir / "model.safetensors.index.json").exists()
    index = json.loads((tiny_dir / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    t = read_all(tiny_dir)
    p = "language_model.model.layers."
    assert t[p + "1.block_sparse_moe.experts.0.w1.weight_packed"].dtype == torch.uint8
    assert t[p + "1.block_sparse_moe.experts.0.w1.weight_scale"].shape == (64, 2)
    assert t[p + "0.self_attn.A_log"].dtype == torch.float32 and t[p + "0.self_attn.A_log"].shape == (128,)
    assert t[p + "0.self_attn.q_conv1d.weight"].dtype == torch.float32
    assert t[p + "1.block_sparse_moe.gate.e_score_correction_bias"].dtype == torch.float32
    assert t[p + "0.mlp.gate_proj.weight"].dtype == torch.bfloat16
    assert t["language_model.lm_head.weight"].dtype == torch.bfloat16
    assert not any(n.endswith("experts.0.w1.weight") for n in t)


def test_save_load_round_trip_is_bit_identical(tiny_dir, tiny_model, tmp_path):
    raw = json.loads((tiny_dir / "config.json").read_text())
    save_checkpoint(tmp_path / "again", raw, checkpoint_tensors(tiny_model, quantize_experts=True))
    a, b = read_all(tiny_dir), read_all(tmp_path / "again")
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name


def test_experts_stay_packed_and_dequantize_exactly(tiny_dir, tiny_model):
    t = read_all(tiny_dir)
    stem = "language_model.model.layers.2.block_sparse_moe.experts.5.w2"
    w2 = tiny_model.model.layers[2].block_sparse_moe.experts[5].w2
    assert torch.equal(w2.weight_packed, t[stem + ".weight_packed"])
    assert torch.equal(w2.weight_scale, t[stem + ".weight_scale"])
    w = dequantize_mxfp4(t[stem + ".weight_packed"], t[stem + ".weight_scale"])
    assert torch.equal(w2.dequantized(torch.float32), w)


def test_dense_expert_tensors_are_accepted_per_tensor(tiny_dir, tiny_model, tmp_path):
    stem = "language_model.model.layers.1.block_sparse_moe.experts.3.w3"

    def densify(t):
        w = dequantize_mxfp4(t.pop(stem + ".weight_packed"), t.pop(stem + ".weight_scale"))
        t[stem + ".weight"] = w.to(torch.bfloat16)

    m = load_model(copy_with(tiny_dir, tmp_path / "mixed", densify))
    ids = torch.randint(0, m.config.vocab_size, (9,))
    torch.testing.assert_close(m(ids).logits, tiny_model(ids).logits, rtol=0, atol=0)


@pytest.mark.parametrize(
    "edit, pattern",
    [
        (lambda t: t.pop("language_model.model.layers.3.self_attn.kv_b_proj.weight"),
         r"missing.*layers\.3\.self_attn\.kv_b_proj\.weight"),
        (lambda t: t.update({"language_model.model.layers.3.self_attn.bogus": torch.zeros(2)}),
         r"unexpected.*layers\.3\.self_attn\.bogus"),
        (lambda t: t.update({"language_model.model.norm.weight": torch.zeros(7)}),
         r"model\.norm\.weight.*\(128,\).*\(7,\)"),
    ],
)
def test_bad_checkpoints_name_the_tensor(tiny_dir, tmp_path, edit, pattern):
    bad = copy_with(tiny_dir, tmp_path / "bad", edit)
    with pytest.raises(CheckpointError, match=pattern):
        load_model(bad)


def test_a_log_padding_must_be_zero(tiny_dir, tmp_path):
    def poison(t):
        t["language_model.model.layers.0.self_attn.A_log"][100] = 1.0

    with pytest.raises(CheckpointError, match="A_log.*zero padding"):
        load_model(copy_with(tiny_dir, tmp_path / "bad", poison))


def test_vision_tensors_are_skipped(tiny_dir, tiny_model, tmp_path):
    def add_vision(t):
        t["vision_tower.encoder.weight"] = torch.ones(3)
        t["mm_projector.proj.weight"] = torch.ones(2, 2)

    m = load_model(copy_with(tiny_dir, tmp_path / "vision", add_vision))
    ids = torch.randint(0, m.config.vocab_size, (5,))
    assert torch.equal(m(ids).logits, tiny_model(ids).logits)


def test_real_dims_rank_shard_shapes():
    cfg = parse_config(real_dims_raw_config(num_layers=5, num_experts=224, tp_size=8, tp_rank=0))
    packed = {f"model.layers.{l}.block_sparse_moe.experts.{e}.{w}.weight"
              for l in range(1, 5) for e in range(224) for w in ("w1", "w2", "w3")}
    s = expected_checkpoint_shapes(cfg, packed)
    p = "language_model.model.layers."
    assert cfg.layer_kinds == ("kda", "kda", "kda", "mla", "mla")
    assert s[p + "0.self_attn.q_proj.weight"] == (1536, 7168)  # 12 of 96 heads
    assert s[p + "0.self_attn.A_log"] == (128,)
    assert s[p + "3.self_attn.q_b_proj.weight"] == (12 * 192, 1536)
    assert s[p + "3.self_attn.kv_a_proj_with_mqa.weight"] == (576, 7168)
    assert s[p + "1.block_sparse_moe.experts.223.w1.weight_packed"] == (384, 1792)
    assert s[p + "1.block_sparse_moe.experts.223.w2.weight_scale"] == (3584, 12)
    assert s[p + "1.block_sparse_moe.shared_experts.gate_proj.weight"] == (768, 7168)
    assert s[p + "0.mlp.gate_proj.weight"] == (4224, 7168)
    assert s["language_model.lm_head.weight"] == (20480, 7168)
