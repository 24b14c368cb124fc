"""The roofline calculator (mstar/tools/roofline.py): its byte counts against the tensors a step
really touches, hand-checked FLOPs, and the CLI on pruned75 at TP8."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from mstar.distributed.sharding import ShardingPlan
from mstar.distributed.weight_bytes import WeightBytes
from mstar.models.kimi_k3.config import load_config
from mstar.models.kimi_k3.weights import load_model
from mstar.resources.latent_kv import PagedLatentKV
from mstar.resources.recurrent_pool import RecurrentStatePool
from mstar.resources.step import SeqStep, StepDecl
from mstar.tools.roofline import (
    decode_floor,
    expected_distinct_experts,
    main,
    mixed_floor,
    prefill_floor,
    rank_model,
    verify_floor,
)


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def step_tensors_bytes(model, batch: int, context: int) -> dict[str, int]:
    """Bytes of the tensors one decode step of `batch` requests at `context` reads and writes, taken
    from the loaded model and from pools built as EngineCore builds them."""
    cfg = model.config
    dtype = model.model.embed_tokens.weight.dtype
    ids = torch.arange(batch) % cfg.vocab_size
    tensors = model.state_dict()
    weights = sum(nbytes(t) for n, t in tensors.items() if ".experts." not in n and n != "model.embed_tokens.weight")
    weights += nbytes(model.model.embed_tokens.weight[ids])
    experts = sum(nbytes(t) for n, t in tensors.items() if ".experts." in n)  # the packed pairs, all touched

    page_size, kinds, la = 16, cfg.layer_kinds, cfg.linear_attn
    kv = PagedLatentKV(kinds.count("mla"), batch * (context // page_size + 1) + 1, page_size, cfg.kv_cache_width,
                       dtype)
    pool = RecurrentStatePool(kinds.count("kda"), batch + 1, la.num_heads, la.head_dim, la.short_conv_kernel_size,
                              torch.promote_types(dtype, torch.float32), dtype, hidden_size=cfg.hidden_size)
    decl = StepDecl(tuple(SeqStep(f"r{b}", context, (int(ids[b]),), sample=True) for b in range(batch)))
    kv.admit(decl)
    pool.admit(decl)
    plan, slots = kv.plan(decl), pool.plan(decl).tolist()
    mla, kda = range(kinds.count("mla")), range(kinds.count("kda"))
    kv_bytes = sum(nbytes(kv.rows(layer, plan.page_table[b], context)) for layer in mla for b in range(batch))
    kv_bytes += sum(nbytes(kv.cache[layer].view(-1, kv.width)[plan.slot_mapping]) for layer in mla)  # new rows
    state = 2 * sum(nbytes(pool.state[layer, s]) + nbytes(pool.conv[layer, s]) for layer in kda
                    for s in slots)  # read, then written back
    return {"weights": weights, "experts": experts, "kv": kv_bytes, "kda": state}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_bytes_equal_the_tensors_a_step_touches(tiny_dir, tiny_model, dtype):
    model = tiny_model if dtype == torch.float32 else load_model(tiny_dir, dtype=dtype)
    cfg = model.config
    batch, context = 64, 40  # 64 tokens x top-4 of 16 experts: all but 1e-8 of them touched
    assert batch * cfg.num_experts_per_token > 10 * cfg.num_experts
    floor = decode_floor(rank_model(load_config(tiny_dir), ShardingPlan(1), dtype), batch, context)
    real = step_tensors_bytes(model, batch, context)
    assert floor.weight_bytes == real["weights"]
    assert floor.expert_bytes == pytest.approx(real["experts"], rel=1e-6)
    assert floor.kv_bytes == real["kv"]
    assert floor.kda_bytes == real["kda"]


def test_expected_distinct_experts():
    assert expected_distinct_experts(16, 16, 4, tokens=1) == pytest.approx(4)  # one token: its k experts
    assert expected_distinct_experts(8, 16, 4, tokens=1) == pytest.approx(2)  # half held (EP 2): half of them
    assert expected_distinct_experts(16, 16, 4, tokens=2) == pytest.approx(16 - 16 * 0.75**2)
    counts = [expected_distinct_experts(224, 224, 16, tokens=n) for n in (1, 8, 64, 512)]
    assert counts == sorted(counts) and counts[-1] == pytest.approx(224, rel=1e-12)


def test_gemm_flops_are_two_per_weight_per_row(tiny_dir):
    """A rank whose only weights are one [out, in] matrix and the vocabulary tables: 2 * out * in per
    row, the lm_head on the sampled rows, the embedding (a gather) none."""
    rank = rank_model(load_config(tiny_dir), ShardingPlan(1))
    out, inputs, size = 96, 128, rank.itemsize
    vocab = rank.config.vocab_size * rank.config.hidden_size * size
    one = replace(rank, weights=WeightBytes(experts=0, other=2 * vocab + out * inputs * size, expert_weights=0,
                                            embedding=vocab, lm_head=vocab))
    head = 2 * rank.config.vocab_size * rank.config.hidden_size
    assert decode_floor(one, 3, 10).gemm_flops == 3 * (2 * out * inputs + head)
    assert verify_floor(one, 3, 4, 10).gemm_flops == 15 * (2 * out * inputs + head)  # every row sampled
    assert prefill_floor(one, 100, batch=2).gemm_flops == 200 * 2 * out * inputs + 2 * head  # the last rows only


@pytest.mark.parametrize("ep", [1, 2])
def test_only_the_active_experts_count(tiny_dir, ep):
    """Per token and MoE layer, top_k experts of 3 * latent * intermediate weights, of which this rank
    holds 1/ep (EP) or 1/tp of each (TP)."""
    config = load_config(tiny_dir)
    rank = rank_model(config, ShardingPlan(2, 0, ep))
    without = replace(rank, weights=replace(rank.weights, expert_weights=0))
    moe_layers = config.num_hidden_layers - config.first_k_dense_replace
    per_token = 2 * config.num_experts_per_token * moe_layers * 3 * config.moe_input_size * config.moe_intermediate_size
    tokens = 5
    extra = decode_floor(rank, tokens, 10).gemm_flops - decode_floor(without, tokens, 10).gemm_flops
    assert extra == pytest.approx(tokens * per_token / 2)


@pytest.mark.parametrize("tp", [2, 4])
def test_sharded_latent_layout_reads_a_slice_of_the_latent_projections(tiny_dir, tp):
    """The latent_sharded layout's decode floor reads (tp - 1) / tp fewer bytes of routed_expert_down/up_proj
    (2 x hidden x latent per MoE layer, bf16) and nothing else changes."""
    config = load_config(tiny_dir)
    whole, sharded = (decode_floor(rank_model(config, ShardingPlan(tp, 0, 1, latent)), 1, 10)
                      for latent in (False, True))
    moe_layers = sum(config.is_moe_layer(i) for i in range(config.num_hidden_layers))
    projections = moe_layers * 2 * config.hidden_size * config.routed_expert_hidden_size * 2
    assert whole.bytes - sharded.bytes == pytest.approx(projections * (tp - 1) / tp)


def test_attention_grows_quadratically_in_prefill_and_linearly_in_context(tiny_dir):
    rank = rank_model(load_config(tiny_dir), ShardingPlan(1))
    t = 1000
    short, long = prefill_floor(rank, t), prefill_floor(rank, 2 * t)
    assert long.mla_flops / short.mla_flops == pytest.approx((2 * t) * (2 * t + 1) / (t * (t + 1)))  # causal T(T+1)/2
    assert long.kda_flops == 2 * short.kda_flops
    near, far = decode_floor(rank, 4, 1000), decode_floor(rank, 4, 3000)
    assert far.mla_flops / near.mla_flops == pytest.approx(3001 / 1001)  # each new row attends to L + 1 rows
    assert far.kv_bytes > near.kv_bytes and far.gemm_flops == near.gemm_flops


def test_a_mixed_step_reads_the_weights_once_and_does_both_parts_work(tiny_dir):
    """A prompt chunk with decode rows riding in it: the chunk's and the rows' cache traffic and FLOPs, but the
    weights once, and the experts that all its tokens touch together (fewer than the two parts' sum)."""
    rank = rank_model(load_config(tiny_dir), ShardingPlan(2))
    chunk, rows, context = 300, 8, 500
    mixed, prefill, decode = mixed_floor(rank, chunk, rows, context), prefill_floor(rank, chunk), decode_floor(
        rank, rows, context)
    assert (mixed.step, mixed.batch, mixed.tokens, mixed.context) == ("mixed 300+8", 9, 308, 500)
    assert mixed.flops == pytest.approx(prefill.flops + decode.flops)
    assert mixed.kv_bytes == prefill.kv_bytes + decode.kv_bytes
    assert mixed.kda_bytes == prefill.kda_bytes + decode.kda_bytes
    assert prefill.weight_bytes <= mixed.weight_bytes < prefill.weight_bytes + decode.weight_bytes
    experts = prefill.expert_bytes, decode.expert_bytes
    assert max(experts) <= mixed.expert_bytes < sum(experts)
    assert mixed.bytes < prefill.bytes + decode.bytes


def test_cli_prints_the_pruned75_tp8_table_and_json(capsys):
    main(["kimi_k3_pruned75_config.json", "--tp", "8"])
    table = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    assert table[0].startswith("| step | batch | tokens | weights GB | experts GB | KV GB | KDA state GB")
    steps = [line.split("|")[1].strip() for line in table[1:]]
    assert steps == ["decode"] * 5 + ["verify k=4"] * 2 + ["verify k=7"] * 2 + ["prefill"] * 2
    main(["kimi_k3_pruned75_config.json", "--tp", "8", "--batch", "1,64", "--drafts", "4", "--prefill", "8192",
          "--json"])
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert [(r["step"], r["batch"], r["tokens"]) for r in rows] == [
        ("decode", 1, 1), ("decode", 64, 64), ("verify k=4", 1, 5), ("verify k=4", 16, 80), ("prefill", 1, 8192)]
    assert rows[0]["bound"] == "bytes" and rows[-1]["bound"] == "FLOPs"
    for r in rows:
        assert r["floor_s"] == max(r["byte_floor_s"], r["flop_floor_s"]) > 0


def test_cli_names_an_unknown_config():
    with pytest.raises(SystemExit, match="neither a path nor a bundled fixture"):
        main(["no_such_config.json"])
