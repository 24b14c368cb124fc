"""mstar-emulate-rank on the tiny K3 (CPU, fp32, eager): the rank's model is filled completely at the
rank's shapes, the plans address the pools as the engine would, and the report has every step."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from mstar.distributed.loader import rank_module
from mstar.distributed.sharding import ShardingPlan
from mstar.distributed.weight_bytes import rank_weight_bytes
from mstar.models.kimi_k3.config import parse_config
from mstar.models.kimi_k3.kda import GatedHeadNorm
from mstar.models.kimi_k3.norm import RMSNorm
from mstar.models.kimi_k3.serving import StepKind
from mstar.models.kimi_k3.weights import is_expert_weight, packed_names, packed_shapes
from mstar.quant.mxfp4_linear import MXFP4Linear, use_mxfp4_linears
from mstar.tools.emulate_draft import DEFAULT_ACCEPTANCE, implied_speedup, tokens_per_step
from mstar.tools.emulate_rank import (
    Step,
    batch_plan,
    build,
    build_model,
    build_pools,
    check_finite,
    fill_random_,
    first_layers,
    main,
    pages_per_sequence,
    parse_args,
    steps_to_run,
)
from mstar.tools.make_tiny import tiny_k3_raw_config

TP, LAYERS = 2, 4


@pytest.fixture(scope="module")
def tiny_config_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("emulate") / "config.json"
    path.write_text(json.dumps(tiny_k3_raw_config()))
    return path


@pytest.fixture(scope="module")
def config():
    return first_layers(parse_config(tiny_k3_raw_config()), LAYERS)


def test_first_layers_keeps_each_layers_kind(config):
    whole = parse_config(tiny_k3_raw_config())
    assert config.num_hidden_layers == LAYERS
    assert config.layer_kinds == whole.layer_kinds[:LAYERS]
    assert set(config.layer_kinds) == {"kda", "mla"}
    for bad in (0, whole.num_hidden_layers + 1):
        with pytest.raises(ValueError, match="--layers"):
            first_layers(whole, bad)


def test_model_at_the_rank_shapes_with_mxfp4_experts(config):
    plan = ShardingPlan(TP)
    model = build_model(config, plan, torch.float32, torch.device("cpu"), torch.Generator().manual_seed(0))
    expected = {}
    for name, t in rank_module(config, plan).state_dict().items():
        if is_expert_weight(name):
            expected.update(zip(packed_names(name), packed_shapes(tuple(t.shape)), strict=True))
        else:
            expected[name] = tuple(t.shape)
    got = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    assert got == expected
    assert any(isinstance(m, MXFP4Linear) for m in model.modules())
    # what the roofline counts is what the emulation holds
    held = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    assert held == rank_weight_bytes(config, plan, dtype=torch.float32).total


def test_fill_overwrites_every_tensor(config):
    model = rank_module(config, ShardingPlan(TP))
    use_mxfp4_linears(model, {n for n in model.state_dict() if is_expert_weight(n)})
    model.to_empty(device="cpu").requires_grad_(False)
    for t in model.state_dict().values():  # garbage that no rule leaves in place unnoticed
        t.fill_(255 if t.dtype == torch.uint8 else float("nan"))
    fill_random_(model, torch.Generator().manual_seed(0))
    for name, t in model.state_dict().items():
        if t.dtype == torch.uint8:
            if name.endswith("weight_scale"):
                assert int(t.max()) <= 128, name  # the MXFP4 kernel's limit
        else:
            assert bool(torch.isfinite(t).all()), name
    for m in model.modules():
        if isinstance(m, (RMSNorm, GatedHeadNorm)):
            assert bool((m.weight == 1).all())
        if isinstance(m, nn.Linear):
            assert 0 < float(m.weight.std()) < 1


def test_fill_refuses_tensors_without_a_rule():
    with pytest.raises(TypeError, match="no random init"):
        fill_random_(nn.Sequential(nn.Linear(4, 4, bias=True)), torch.Generator())

    class Odd(nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = nn.Parameter(torch.zeros(3))

    with pytest.raises(TypeError, match="scale"):
        fill_random_(nn.Sequential(Odd()), torch.Generator())


@pytest.mark.parametrize("step", [Step("decode", 3, 1, 100), Step("verify", 2, 5, 60), Step("prefill", 1, 40, 0),
                                  Step("prefill", 3, 40, 0)], ids=lambda s: f"{s.name}-{s.batch}")
def test_plan_addresses_pages_and_slots(step):
    page_size = 16
    plan = batch_plan(step, page_size, vocab_slice=50, device=torch.device("cpu"), generator=torch.Generator())
    pages = pages_per_sequence(step, page_size)
    table = plan.kv.page_table
    assert table.shape == (step.batch, pages)
    assert table.min() >= 1  # page 0 is the sink
    assert len(set(table.flatten().tolist())) == table.numel()  # no page shared between sequences
    assert plan.seq_starts == tuple(range(0, step.tokens + 1, step.rows))
    assert plan.num_computed == (step.context,) * step.batch
    assert plan.kv.context_lens.tolist() == [step.context + step.rows] * step.batch
    assert plan.kda_slots.tolist() == list(range(1, step.batch + 1))  # slot 0 is the sink
    slots = plan.kv.slot_mapping.view(step.batch, step.rows)
    for b in range(step.batch):
        for i in range(step.rows):
            position = step.context + i
            assert int(slots[b, i]) == int(table[b, position // page_size]) * page_size + position % page_size
    assert plan.input_ids.shape == (step.tokens,) and plan.input_ids.min() >= 0 and plan.input_ids.max() < 50
    assert (plan.kind is StepKind.DECODE) == (step.kind == "decode")
    assert plan.verify == (step.kind == "verify",) * step.batch
    last_rows = [s - 1 for s in plan.seq_starts[1:]]
    assert plan.sample_rows.tolist() == (last_rows if step.kind == "prefill" else list(range(step.tokens)))


def test_a_mixed_step_plans_its_chunk_then_its_decode_rows():
    """Sequence 0 is the fresh prompt chunk, the others decode one row each after the context; the chunk's last row
    and every decode row are sampled; every sequence has pages and a KDA slot of its own."""
    step, page_size = Step("mixed", 3, 40, 100), 16
    assert (step.name, step.tokens, step.sequences, step.graphs) == ("mixed 40+3", 43, 4, "prefill")
    plan = batch_plan(step, page_size, vocab_slice=50, device=torch.device("cpu"), generator=torch.Generator())
    pages = pages_per_sequence(step, page_size)
    assert pages == 7 and plan.kv.page_table.shape == (4, pages)  # 101 positions of a decode row: 7 pages
    table = plan.kv.page_table
    assert table.min() >= 1 and len(set(table.flatten().tolist())) == table.numel()
    assert plan.seq_starts == (0, 40, 41, 42, 43)
    assert plan.num_computed == (0, 100, 100, 100)
    assert plan.kv.context_lens.tolist() == [40, 101, 101, 101]
    assert plan.kda_slots.tolist() == [1, 2, 3, 4] and plan.slot_ids == (1, 2, 3, 4)
    positions = list(range(40)) + [100] * 3
    sequence = [0] * 40 + [1, 2, 3]
    expected = [int(table[b, p // page_size]) * page_size + p % page_size
                for b, p in zip(sequence, positions, strict=True)]
    assert plan.kv.slot_mapping.tolist() == expected
    assert plan.sample_rows.tolist() == [39, 40, 41, 42]
    assert plan.kind is StepKind.GENERAL and plan.verify == (False,) * 4


def test_a_mixed_step_of_more_decode_rows_than_the_graphs_take_is_refused():
    args = parse_args(["--steps", "mixed", "--mixed-tokens", "128", "--mixed-batch", "64"])
    with pytest.raises(ValueError, match="--mixed-batch: a mixed step holds at most 63 decode rows"):
        steps_to_run(args)
    with pytest.raises(ValueError, match="each --mixed-tokens more than the --mixed-batch decode rows"):
        steps_to_run(parse_args(["--steps", "mixed", "--mixed-tokens", "8", "--mixed-batch", "8"]))
    steps = steps_to_run(parse_args(["--steps", "mixed", "--mixed-tokens", "1024,2048", "--mixed-batch", "8"]))
    assert [(s.name, s.tokens) for s in steps] == [("mixed 1016+8", 1024), ("mixed 2040+8", 2048)]


def test_pools_hold_every_step_with_random_context(config):
    steps = [Step("decode", 3, 1, 100), Step("verify", 2, 5, 60), Step("prefill", 1, 40, 0)]
    kv, pool = build_pools(config, steps, 16, torch.float32, torch.device("cpu"), torch.Generator().manual_seed(0))
    assert kv.cache.shape[1] == 1 + max(s.batch * pages_per_sequence(s, 16) for s in steps)
    assert pool.max_slots == 4 and pool.prefix_x.shape[2] == 5
    assert float(kv.cache.std()) > 0.5 and 0 < float(pool.state.std()) < 0.1 and float(pool.conv.std()) > 0.5
    assert pool.prefix_len == [0] * pool.max_slots


def test_check_finite_names_a_broken_init(config):
    emulation = build(config, ShardingPlan(TP), [Step("decode", 1, 1, 8)], dtype=torch.float32,
                      device=torch.device("cpu"), page_size=16, seed=0)
    with torch.no_grad():
        emulation.serving.model.model.embed_tokens.weight.fill_(float("nan"))
    with pytest.raises(RuntimeError, match="non-finite logits"):
        check_finite(emulation, 8)


def test_verify_steps_have_pending_prefixes_and_decode_steps_none(config):
    steps = [Step("decode", 2, 1, 8), Step("verify", 2, 3, 8)]
    emulation = build(config, ShardingPlan(TP), steps, dtype=torch.float32, device=torch.device("cpu"), page_size=16,
                      seed=0, pending_prefix=2)
    pool = emulation.serving.pool
    verify = emulation.plan_for(steps[1])
    assert pool.prefix_len == [0, 2, 2]  # slots 1 and 2 hold the two sequences; 0 is the sink
    assert torch.isfinite(emulation.serving.forward(verify)[0]).all()  # replays them, then its blocks
    assert emulation.plan_for(steps[0]).kind is StepKind.DECODE and pool.prefix_len == [0, 0, 0]


def test_main_reports_every_step_against_its_floor(tiny_config_path, tmp_path, capsys):
    main(["--config", str(tiny_config_path), "--tp", str(TP), "--layers", str(LAYERS), "--device", "cpu",
          "--dtype", "float32", "--eager", "--context", "40", "--page-size", "16", "--batch", "1,2",
          "--drafts", "2", "--verify-batch", "1", "--prefill", "16", "--prefill-batch", "1,2", "--reps", "1",
          "--warmup", "1", "--profile",
          "--steps", "decode,verify,prefill", "--out", str(tmp_path)])
    report = json.loads((tmp_path / "emulate_rank.json").read_text())
    assert (report["tp"], report["layers"], report["context"]) == (TP, LAYERS, 40)
    assert [(r["step"], r["batch"], r["rows"]) for r in report["rows"]] == [
        ("decode", 1, 1), ("decode", 2, 2), ("verify k=2", 1, 3), ("prefill", 1, 16), ("prefill", 2, 32)]
    assert report["collective_cost"] == {"latency_s": 6e-6, "small_bytes": 64 * 1024, "bytes_per_s": 150e9,
                                         "delay_overhead_ns": 0}  # nothing to subtract off CUDA
    fit = report["h100_fit"]  # the shipped config's pools at the tiny rank's shapes: far inside an H100
    assert fit["fits"] and fit["total"] == fit["weights"] + fit["shipped_pools"] + fit["working"] + fit["reserve"]
    assert report["latent_layout"] == "sharded"  # the default: faster at every batch measured
    config = first_layers(parse_config(tiny_k3_raw_config()), LAYERS)
    moe_layers = sum(config.is_moe_layer(i) for i in range(LAYERS))
    # a mixer and an MLP/MoE all-reduce per layer, the embedding's all-reduce and the lm_head's gather, and the
    # sharded latent layout's all-gather of z and second all-reduce per MoE layer
    calls = 2 * LAYERS + 2 + 2 * moe_layers
    for r in report["rows"]:
        assert r["mode"] == "eager"
        assert r["collectives"]["calls"] == calls and r["collectives"]["modeled_s"] >= 6e-6 * calls
        assert r["kernels"] is None  # counted on CUDA only
        assert r["floor"]["floor_s"] > 0 and r["floor"]["bytes"] > 0 and r["floor"]["flops"] > 0
        assert r["measured_s"] > 0 and r["ratio"] == pytest.approx(r["measured_s"] / r["floor"]["floor_s"])
        assert (r["tokens_per_s"] is not None) == (r["step"] == "decode")
    markdown = (tmp_path / "emulate_rank.md").read_text()
    assert "Profile of one step of each kind" in markdown and "| verify k=2 | 1 | 3 | eager |" in markdown
    for label in ("decode, batch 1, 1 rows", "decode, batch 2, 2 rows", "verify k=2, batch 1, 3 rows",
                  "prefill, batch 2, 32 rows"):  # the first and last step of each kind
        assert f"### {label} (eager): " in markdown, label
    printed = capsys.readouterr().out
    assert printed == markdown and printed.rstrip().splitlines()[-1].startswith("| prefill | 2 | 32 |")
    prefills = [r for r in report["rows"] if r["step"] == "prefill"]
    assert prefills[1]["floor"]["flops"] > 1.9 * prefills[0]["floor"]["flops"]  # two prompts' worth


def test_mixed_steps_are_reported_beside_their_parts_alone(tiny_config_path, tmp_path):
    main(["--config", str(tiny_config_path), "--tp", str(TP), "--layers", str(LAYERS), "--device", "cpu",
          "--dtype", "float32", "--eager", "--context", "40", "--page-size", "16", "--batch", "2",
          "--prefill", "16", "--mixed-tokens", "16,24", "--mixed-batch", "2", "--reps", "1", "--warmup", "1",
          "--steps", "decode,prefill,mixed", "--out", str(tmp_path)])
    report = json.loads((tmp_path / "emulate_rank.json").read_text())
    assert [(r["step"], r["batch"], r["rows"]) for r in report["rows"]][-2:] == [("mixed 14+2", 2, 16),
                                                                                 ("mixed 22+2", 2, 24)]
    alone = {r["step"]: r["measured_s"] for r in report["rows"]}
    first, second = report["mixed"]
    assert (first["tokens"], first["chunk"], first["decode_rows"], second["tokens"]) == (16, 14, 2, 24)
    assert first["t_prefill_s"] == alone["prefill"] and first["t_decode_s"] == alone["decode"]
    assert first["t_separate_s"] == pytest.approx(alone["prefill"] + alone["decode"])
    assert second["t_prefill_s"] is None and second["t_separate_s"] is None  # no 24-token prefill was timed
    for r in report["rows"][-2:]:
        assert r["floor"]["step"] == r["step"] and r["floor"]["tokens"] == r["rows"]
    markdown = (tmp_path / "emulate_rank.md").read_text()
    assert "## Mixed steps: a prompt chunk with decode rows riding in it" in markdown
    assert "| 24 | 22 | 2 | " in markdown


def test_a_prefill_step_of_more_prompts_than_the_graphs_take_is_refused():
    args = parse_args(["--steps", "prefill", "--prefill", "64", "--prefill-batch", "9"])
    with pytest.raises(ValueError, match="--prefill-batch: a prefill step holds at most 8 prompts"):
        steps_to_run(args)


def test_tokens_per_step_follows_the_acceptance_profile():
    assert tokens_per_step(DEFAULT_ACCEPTANCE, 5) == pytest.approx(3.86)  # the mean accepted length reported
    assert tokens_per_step(DEFAULT_ACCEPTANCE, 1) == pytest.approx(1.82)
    with pytest.raises(ValueError, match="k=8"):
        tokens_per_step(DEFAULT_ACCEPTANCE, 8)
    with pytest.raises(ValueError, match="never increase"):
        tokens_per_step((0.5, 0.7), 2)
    assert implied_speedup((0.5, 0.25), 2, t_decode=1.0, t_draft=0.25, t_verify=1.0) == pytest.approx(1.75 / 1.25)


def test_draft_steps_and_the_speculation_summary(tiny_config_path, tiny_dirs, tmp_path, capsys):
    main(["--config", str(tiny_config_path), "--tp", str(TP), "--layers", str(LAYERS), "--device", "cpu",
          "--dtype", "float32", "--eager", "--context", "40", "--page-size", "16", "--batch", "1,2",
          "--steps", "decode,verify,draft", "--drafts", "2", "--verify-batch", "1,2", "--reps", "1", "--warmup", "1",
          "--draft-config", str(tiny_dirs[1] / "config.json"), "--acceptance", "0.8,0.5", "--out", str(tmp_path)])
    report = json.loads((tmp_path / "emulate_rank.json").read_text())
    drafts = [r for r in report["rows"] if r["step"] == "draft k=2"]
    assert [r["batch"] for r in drafts] == [1, 2]
    for r in drafts:
        assert r["collectives"] is None  # the draft runs on rank 0 alone
        assert r["floor"]["bytes"] > 0 and r["floor"]["flops"] > 0 and r["measured_s"] > 0
    times = {(r["step"], r["batch"]): r["measured_s"] for r in report["rows"]}
    assert [(s["drafts"], s["batch"]) for s in report["speculative"]] == [(2, 1), (2, 2)]
    for s in report["speculative"]:
        b = s["batch"]
        assert s["tokens_per_step"] == pytest.approx(2.3)
        assert s["speedup"] == pytest.approx(2.3 * times[("decode", b)] / (times[("draft k=2", b)]
                                                                          + times[("verify k=2", b)]))
    assert "## Speculation at these step times" in capsys.readouterr().out
