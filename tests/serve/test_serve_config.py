"""Serve config: shipped YAMLs parse, every error names its key, overrides, paths, round trip."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from paths import ROOT

from mstar.config import (
    EngineConfig,
    ServeConfig,
    ServeConfigError,
    check_expert_parallel,
    check_paths,
    known_keys,
    load_serve_config,
    parse_serve_config,
    resolve_device,
)
from mstar.speculative.schedule import DraftSchedule

CONFIGS = ROOT / "configs"
SHIPPED = sorted(CONFIGS.glob("*.yaml"))


def minimal(**extra) -> dict:
    return {"model": "kimi_k3", "checkpoint": "ckpt", **extra}


def write_yaml(tmp_path: Path, raw: dict, name: str = "serve.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(raw))
    return path


# --- shipped configs ----------------------------------------------------------------------------


def test_the_named_configs_ship():
    names = {p.name for p in SHIPPED}
    for name in ("kimi_k3_tiny.yaml", "kimi_k3_tiny_tp2.yaml", "kimi_k3_tiny_ep2.yaml", "kimi_k3_tiny_dspark.yaml",
                 "kimi_k3_pruned75_tp8.yaml", "kimi_k3_pruned75_tp8_dspark_sched.yaml"):
        assert name in names


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_every_shipped_config_parses(path):
    cfg = load_serve_config(path)
    assert cfg.model == "kimi_k3"
    assert cfg.checkpoint.is_absolute()
    # No one's machine in the configs: every path lies under the repository.
    repo = CONFIGS.parent
    assert cfg.checkpoint.is_relative_to(repo)
    if cfg.model_kwargs.speculative_draft is not None:
        assert cfg.model_kwargs.speculative_draft.is_relative_to(repo)
    assert "/home/" not in path.read_text() and "/Users/" not in path.read_text()


def test_tiny_configs_point_at_the_tiny_checkpoints():
    tiny = load_serve_config(CONFIGS / "kimi_k3_tiny.yaml")
    assert tiny.checkpoint == CONFIGS.parent / "checkpoints" / "kimi_k3_tiny"
    assert tiny.served_model_name == "kimi_k3_tiny"
    assert (tiny.tp_size, tiny.dtype, tiny.device, tiny.max_seq_len) == (1, "float32", "auto", 2048)
    assert tiny.resources.kda_state.max_slots == 65 and tiny.scheduler.max_num_seqs == 64
    assert load_serve_config(CONFIGS / "kimi_k3_tiny_tp2.yaml").tp_size == 2
    assert load_serve_config(CONFIGS / "kimi_k3_tiny_tp2.yaml").model_kwargs.moe_ep_size == 1
    ep2 = load_serve_config(CONFIGS / "kimi_k3_tiny_ep2.yaml")
    assert (ep2.tp_size, ep2.model_kwargs.moe_ep_size) == (2, 2)
    assert ep2.checkpoint == tiny.checkpoint
    spec = load_serve_config(CONFIGS / "kimi_k3_tiny_dspark.yaml")
    assert spec.model_kwargs.speculative_tokens == 7
    assert spec.model_kwargs.speculative_draft == CONFIGS.parent / "checkpoints" / "kimi_k3_tiny_dspark"
    assert spec.model_kwargs.speculative_schedule == ((16, 7), (32, 4), (64, 0))


def test_pruned75_configs():
    base = load_serve_config(CONFIGS / "kimi_k3_pruned75_tp8.yaml")
    assert (base.tp_size, base.dtype, base.device) == (8, "bfloat16", "cuda")
    assert (base.resources.mla_kv.max_num_pages, base.resources.mla_kv.page_size) == (1792, 64)
    assert base.resources.kda_state.max_slots == 97 and not base.speculative  # 64 requests, 32 snapshots
    spec = load_serve_config(CONFIGS / "kimi_k3_pruned75_tp8_dspark_sched.yaml")
    assert spec.speculative and spec.resources.dspark_kv is not None and spec.resources.kda_state.max_slots == 97
    assert dict(spec.model_kwargs.speculative_schedule) == {16: 7, 32: 4, 64: 0}


def test_full_k3_two_node_configs():
    # Two 8-GPU nodes: 16 ranks, one expert-parallel group per node (docs/multi_node.md).
    for name in ("kimi_k3_tp16_ep2.yaml", "kimi_k3_tp16_ep2_dspark_sched.yaml"):
        cfg = load_serve_config(CONFIGS / name)
        assert (cfg.tp_size, cfg.model_kwargs.moe_ep_size, cfg.dtype, cfg.device) == (16, 2, "bfloat16", "cuda")
        assert cfg.checkpoint == CONFIGS.parent / "models" / "Kimi-K3"
        assert cfg.resources.kda_state.max_slots == 97 and cfg.scheduler.max_num_seqs == 64  # 32 snapshots
    spec = load_serve_config(CONFIGS / "kimi_k3_tp16_ep2_dspark_sched.yaml")
    assert spec.speculative and spec.resources.dspark_kv is not None
    assert dict(spec.model_kwargs.speculative_schedule) == {16: 7, 32: 4, 64: 0}


# --- defaults and helpers -----------------------------------------------------------------------


def test_defaults_fill_everything_but_model_and_checkpoint(tmp_path):
    cfg = parse_serve_config(minimal(), base_dir=tmp_path)
    assert cfg.checkpoint == tmp_path / "ckpt" and cfg.served_model_name == "ckpt"
    assert cfg.scheduler.max_prefill_seqs == 8
    assert cfg.resources.dspark_kv is None and cfg.model_kwargs.speculative_schedule == ()
    # A section left empty in YAML (`scheduler:` with every key commented out) takes its defaults.
    assert parse_serve_config(minimal(scheduler=None), base_dir=tmp_path) == cfg
    for key in ("model", "checkpoint"):
        raw = minimal()
        del raw[key]
        with pytest.raises(ServeConfigError, match=f"'{key}'"):
            parse_serve_config(raw)


def test_draft_schedule_lookup():
    cfg = parse_serve_config(minimal(model_kwargs={
        "speculative_tokens": 7, "speculative_draft": "d", "speculative_schedule": {64: 0, 16: 7, 32: 4}}))
    mk = cfg.model_kwargs
    assert mk.speculative_schedule == ((16, 7), (32, 4), (64, 0))  # sorted by bucket
    # The one schedule lookup is the engine's (speculative/schedule.py), built from these keys.
    schedule = DraftSchedule.from_config(mk.speculative_tokens, mk.speculative_schedule)
    assert [schedule.drafts_for(n) for n in (1, 16, 17, 32, 33, 64)] == [7, 7, 4, 4, 0, 0]
    assert schedule.max_drafts == 7
    # Speculation on without a dspark_kv section: the draft pool matches the target's.
    assert cfg.resources.dspark_kv.max_num_pages == cfg.resources.mla_kv.max_num_pages


def test_zero_speculative_tokens_turn_speculation_off_whatever_the_schedule():
    cfg = parse_serve_config(minimal(model_kwargs={"speculative_tokens": 0, "speculative_schedule": {16: 1, 64: 0}}))
    assert not cfg.speculative and cfg.model_kwargs.speculative_schedule == ()
    assert cfg.resources.dspark_kv is None
    # The schedule is still a schedule: its buckets must be integers >= 1.
    with pytest.raises(ServeConfigError, match="'model_kwargs.speculative_schedule': bucket 0 must be >= 1"):
        parse_serve_config(minimal(model_kwargs={"speculative_schedule": {0: 0}}))


def test_the_mini_configs_comment_turns_speculation_off():
    """configs/kimi_k3_mini.yaml says `model_kwargs.speculative_tokens=0` serves without speculation."""
    mini = CONFIGS / "kimi_k3_mini.yaml"
    assert "model_kwargs.speculative_tokens=0" in mini.read_text()
    assert load_serve_config(mini).speculative
    off = load_serve_config(mini, ["model_kwargs.speculative_tokens=0"])
    assert not off.speculative and off.model_kwargs.speculative_schedule == ()
    check_paths(off)  # only the target checkpoint is needed


def test_the_kv_pools_keep_page_zero_as_the_sink():
    # 1024 tokens of 16-token pages: 64 pages of tokens and the sink.
    raw = minimal(max_seq_len=1024, resources={"mla_kv": {"page_size": 16, "max_num_pages": 65}})
    assert parse_serve_config(raw).resources.mla_kv.max_num_pages == 65
    raw["resources"]["mla_kv"]["max_num_pages"] = 64
    with pytest.raises(ServeConfigError, match="page 0 the sink.*at least 65 pages"):
        parse_serve_config(raw)
    spec = minimal(max_seq_len=1024, resources={"mla_kv": {"page_size": 16, "max_num_pages": 65},
                                                "dspark_kv": {"max_num_pages": 64}},
                   model_kwargs={"speculative_tokens": 1, "speculative_draft": "d"})
    with pytest.raises(ServeConfigError, match="'resources.dspark_kv.max_num_pages'"):
        parse_serve_config(spec)


def test_the_engine_takes_the_serve_config_as_it_is():
    cfg = parse_serve_config(minimal())
    assert isinstance(cfg, EngineConfig)
    # The engine's part of the schema alone has the serve config's defaults.
    engine = EngineConfig()
    assert (engine.max_seq_len, engine.resources, engine.scheduler) == (cfg.max_seq_len, cfg.resources, cfg.scheduler)
    assert engine.model_kwargs == cfg.model_kwargs
    assert engine.with_overrides("scheduler.max_num_seqs=8").scheduler.max_num_seqs == 8
    with pytest.raises(ValueError, match="'resources.kda_state.max_slots'"):
        EngineConfig(scheduler={"max_num_seqs": 65})


def test_resolve_device(monkeypatch):
    import torch

    cfg = parse_serve_config(minimal())
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device(cfg) == "cpu"
    with pytest.raises(ServeConfigError, match="'device'"):
        resolve_device(cfg.with_overrides("device=cuda"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_device(cfg) == "cuda"
    assert resolve_device(cfg.with_overrides("device=cpu")) == "cpu"


def test_check_paths_names_the_missing_checkpoint(tmp_path):
    (tmp_path / "kimi_k3_tiny").mkdir()
    cfg = parse_serve_config(minimal(checkpoint="kimi_k3_tiny"), base_dir=tmp_path)
    check_paths(cfg)
    spec = cfg.with_overrides("model_kwargs.speculative_tokens=2", f"model_kwargs.speculative_draft={tmp_path}/nope")
    with pytest.raises(ServeConfigError, match="model_kwargs.speculative_draft"):
        check_paths(spec)
    with pytest.raises(ServeConfigError, match="'checkpoint'.*mstar-make-tiny"):
        check_paths(cfg.with_overrides(f"checkpoint={tmp_path}/kimi_k3_tiny_missing"))


# --- validation errors name their key -----------------------------------------------------------

BAD = [
    # (raw changes, key the message must name, words it must contain)
    ({"model": "llama"}, "model", "'kimi_k3'"),
    ({"checkpoint": 5}, "checkpoint", "path"),
    ({"tp_size": 0}, "tp_size", ">= 1"),
    ({"tp_size": "2"}, "tp_size", "integer"),
    ({"tp_size": True}, "tp_size", "integer"),
    ({"max_seq_len": 0}, "max_seq_len", ">= 1"),
    ({"max_seq_len": 2048.0}, "max_seq_len", "integer"),
    ({"dtype": "fp32"}, "dtype", "'float32'"),
    ({"device": "gpu"}, "device", "'auto'"),
    ({"served_model_name": 3}, "served_model_name", "string"),
    ({"resources": []}, "resources", "mapping"),
    ({"resources": {"mla_kv": {"page_size": 0}}}, "resources.mla_kv.page_size", ">= 1"),
    ({"resources": {"mla_kv": {"page_size": 16, "max_num_pages": 10}}, "max_seq_len": 1024},
     "resources.mla_kv.max_num_pages", "65 pages"),
    ({"resources": {"dspark_kv": {"max_num_pages": 1}}}, "resources.dspark_kv.max_num_pages", "max_seq_len"),
    ({"resources": {"kda_state": {"max_slots": 64}}}, "resources.kda_state.max_slots", "sink"),
    ({"scheduler": {"max_num_seqs": 0}}, "scheduler.max_num_seqs", ">= 1"),
    ({"scheduler": {"max_waiting": 0}}, "scheduler.max_waiting", ">= 1"),
    ({"scheduler": {"chunked_prefill": "yes please"}}, "scheduler.chunked_prefill", "true or false"),
    ({"scheduler": {"max_num_batched_tokens": 32}}, "scheduler.max_num_batched_tokens", "max_num_seqs"),
    ({"scheduler": {"chunked_prefill": False, "max_num_batched_tokens": 4096}},
     "scheduler.max_num_batched_tokens", "chunked_prefill"),
    ({"model_kwargs": {"speculative_tokens": -1}}, "model_kwargs.speculative_tokens", ">= 0"),
    ({"model_kwargs": {"speculative_tokens": 3}}, "model_kwargs.speculative_draft", "DSpark"),
    ({"model_kwargs": {"speculative_tokens": 3, "speculative_draft": "d", "speculative_schedule": {16: 4, 64: 0}}},
     "model_kwargs.speculative_schedule", "0..'model_kwargs.speculative_tokens' (3)"),
    ({"model_kwargs": {"speculative_tokens": 3, "speculative_draft": "d", "speculative_schedule": {16: 3}}},
     "model_kwargs.speculative_schedule", "cover 'scheduler.max_num_seqs'"),
    ({"model_kwargs": {"speculative_schedule": {0: 0, 64: 0}}}, "model_kwargs.speculative_schedule", ">= 1"),
    ({"model_kwargs": {"speculative_schedule": {"16": 0}}}, "model_kwargs.speculative_schedule", "integer"),
    ({"model_kwargs": {"speculative_schedule": [7, 4]}}, "model_kwargs.speculative_schedule", "e.g."),
    ({"model_kwargs": {"speculative_tokens": 7, "speculative_draft": "d"},
      "scheduler": {"max_num_batched_tokens": 256}}, "scheduler.max_num_batched_tokens", "7 drafts"),
    ({"model_kwargs": {"cuda_graphs": 1}}, "model_kwargs.cuda_graphs", "true or false"),
    ({"model_kwargs": {"speculative_draft": 7}}, "model_kwargs.speculative_draft", "path"),
    ({"model_kwargs": {"moe_ep_size": 0}}, "model_kwargs.moe_ep_size", ">= 1"),
    ({"model_kwargs": {"moe_ep_size": 2}}, "model_kwargs.moe_ep_size", "divide 'tp_size' (1)"),
    ({"tp_size": 4, "model_kwargs": {"moe_ep_size": 3}}, "model_kwargs.moe_ep_size", "divide 'tp_size' (4)"),
    ({"model_kwargs": {"moe_ep_size": 2.0}}, "model_kwargs.moe_ep_size", "integer"),
    ({"max_seq_len": None}, "max_seq_len", "null"),
    ({"prefix_cache": {"kda_snapshot_interval": 100}}, "prefix_cache.kda_snapshot_interval", "multiple of"),
    ({"prefix_cache": {"enabled": "on"}}, "prefix_cache.enabled", "true or false"),
]


@pytest.mark.parametrize("changes,key,words", BAD, ids=[f"{i}:{b[1]}" for i, b in enumerate(BAD)])
def test_each_error_names_its_key(changes, key, words):
    with pytest.raises(ServeConfigError) as err:
        parse_serve_config(minimal(**changes))
    message = str(err.value)
    assert f"'{key}'" in message, message
    assert words in message, message


@pytest.mark.parametrize("raw,unknown,suggestion", [
    (minimal(tp=2), "tp", None),
    (minimal(tp_sise=2), "tp_sise", "tp_size"),
    (minimal(max_num_seqs=8), "max_num_seqs", "scheduler.max_num_seqs"),
    (minimal(scheduler={"max_num_seq": 8}), "scheduler.max_num_seq", "scheduler.max_num_seqs"),
    (minimal(resources={"mla_kv": {"pagesize": 8}}), "resources.mla_kv.pagesize", "resources.mla_kv.page_size"),
    (minimal(model_kwargs={"speculative_token": 2}), "model_kwargs.speculative_token",
     "model_kwargs.speculative_tokens"),
])
def test_unknown_keys_name_the_closest_known_key(raw, unknown, suggestion):
    with pytest.raises(ServeConfigError) as err:
        parse_serve_config(raw)
    message = str(err.value)
    assert f"unknown key '{unknown}'" in message, message
    if suggestion:
        assert f"did you mean '{suggestion}'" in message, message


def test_file_errors_name_the_file(tmp_path):
    path = write_yaml(tmp_path, minimal(tp_size=0))
    with pytest.raises(ServeConfigError, match=f"{path}.*'tp_size'"):
        load_serve_config(path)
    with pytest.raises(ServeConfigError, match="no serve config"):
        load_serve_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [unclosed\n")
    with pytest.raises(ServeConfigError, match="not valid YAML"):
        load_serve_config(bad)
    listing = tmp_path / "list.yaml"
    listing.write_text("- model\n")
    with pytest.raises(ServeConfigError, match="mapping"):
        load_serve_config(listing)


# --- overrides ----------------------------------------------------------------------------------


def test_overrides_apply_before_validation(tmp_path):
    path = write_yaml(tmp_path, minimal())
    cfg = load_serve_config(path, [
        "scheduler.max_num_seqs=8",
        "resources.kda_state.max_slots=9",
        "dtype=float64",
        "model_kwargs.speculative_tokens=7",
        "model_kwargs.speculative_draft=draft",
        "model_kwargs.speculative_schedule={16: 7, 64: 0}",
        "model_kwargs.cuda_graphs=false",
        "resources.dspark_kv.max_num_pages=300",
    ])
    assert cfg.scheduler.max_num_seqs == 8 and cfg.resources.kda_state.max_slots == 9
    assert cfg.dtype == "float64" and cfg.model_kwargs.cuda_graphs is False
    assert cfg.model_kwargs.speculative_schedule == ((16, 7), (64, 0))
    assert cfg.resources.dspark_kv.max_num_pages == 300
    # An override's relative path is relative to where the command was typed, not to the YAML.
    assert cfg.model_kwargs.speculative_draft == Path.cwd() / "draft"
    # Overrides are validated with everything else: this one would leave no sink slot.
    with pytest.raises(ServeConfigError, match="'resources.kda_state.max_slots'"):
        load_serve_config(path, ["scheduler.max_num_seqs=65"])
    # Setting a value back to null works.
    assert load_serve_config(path, ["model_kwargs.speculative_draft=null"]).model_kwargs.speculative_draft is None


@pytest.mark.parametrize("override,words", [
    ("scheduler.max_num_seq=8", "unknown key 'scheduler.max_num_seq' (did you mean 'scheduler.max_num_seqs'?)"),
    ("sched.max_num_seqs=8", "unknown key 'sched'"),
    ("max_num_seqs=8", "did you mean 'scheduler.max_num_seqs'"),
    ("tp_size.x=1", "'tp_size' is a single value"),
    ("model_kwargs.speculative_schedule.16=3", "'model_kwargs.speculative_schedule' is a single value"),
    ("scheduler.max_num_seqs", "key.sub=value"),
    ("=3", "key.sub=value"),
    ("dtype=[unclosed", "'dtype' is not valid YAML"),
])
def test_bad_overrides_are_rejected_by_name(tmp_path, override, words):
    path = write_yaml(tmp_path, minimal())
    with pytest.raises(ServeConfigError) as err:
        load_serve_config(path, [override])
    assert words in str(err.value), str(err.value)
    assert repr(override) in str(err.value)


def test_override_type_errors_name_the_key(tmp_path):
    path = write_yaml(tmp_path, minimal())
    with pytest.raises(ServeConfigError, match="'scheduler.max_num_seqs' must be an integer"):
        load_serve_config(path, ["scheduler.max_num_seqs=eight"])


# --- paths --------------------------------------------------------------------------------------


def test_relative_paths_resolve_against_the_yaml_folder(tmp_path, monkeypatch):
    folder = tmp_path / "a" / "configs"
    folder.mkdir(parents=True)
    path = write_yaml(folder, minimal(checkpoint="../ckpts/model_x", model_kwargs={
        "speculative_tokens": 1, "speculative_draft": "drafts/d", "speculative_schedule": {64: 1}}))
    monkeypatch.chdir(tmp_path)  # the working directory must not matter
    cfg = load_serve_config(path)
    assert cfg.checkpoint == tmp_path / "a" / "ckpts" / "model_x"
    assert cfg.model_kwargs.speculative_draft == folder / "drafts" / "d"
    assert cfg.served_model_name == "model_x"
    absolute = tmp_path / "elsewhere"
    assert load_serve_config(write_yaml(folder, minimal(checkpoint=str(absolute)), "abs.yaml")).checkpoint == absolute


def test_served_model_name_can_be_set(tmp_path):
    cfg = parse_serve_config(minimal(served_model_name="kimi-k3"))
    assert cfg.served_model_name == "kimi-k3"


# --- round trip ---------------------------------------------------------------------------------


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_to_dict_round_trips(path, tmp_path):
    cfg = load_serve_config(path)
    plain = cfg.to_dict()
    assert parse_serve_config(plain) == cfg
    # Plain enough for YAML, and back through a file it is the same config.
    again = load_serve_config(write_yaml(tmp_path, plain))
    assert again == cfg and hash(again) == hash(cfg)
    assert set(plain) == {k for k in known_keys() if "." not in k}


def test_config_is_immutable():
    cfg = parse_serve_config(minimal())
    with pytest.raises(AttributeError):
        cfg.tp_size = 2  # type: ignore[misc]
    with pytest.raises(AttributeError):
        cfg.scheduler.max_num_seqs = 2  # type: ignore[misc]
    assert isinstance(cfg, ServeConfig) and cfg.with_overrides("tp_size=2").tp_size == 2 and cfg.tp_size == 1


def test_moe_ep_size_must_divide_the_checkpoints_experts():
    cfg = parse_serve_config(minimal(tp_size=4, model_kwargs={"moe_ep_size": 4}))
    check_expert_parallel(cfg, 16)
    with pytest.raises(ServeConfigError) as err:
        check_expert_parallel(cfg, 18)
    assert "'model_kwargs.moe_ep_size' (4)" in str(err.value) and "num_experts (18)" in str(err.value)


def test_latent_moe_layout_defaults_to_sharded_and_names_a_bad_value(tmp_path):
    assert parse_serve_config(minimal(), base_dir=tmp_path).model_kwargs.latent_moe_layout == "sharded"
    raw = minimal(model_kwargs={"latent_moe_layout": "replicated"})
    assert parse_serve_config(raw, base_dir=tmp_path).model_kwargs.latent_moe_layout == "replicated"
    with pytest.raises(ServeConfigError, match="'model_kwargs.latent_moe_layout'"):
        parse_serve_config(minimal(model_kwargs={"latent_moe_layout": "diagonal"}), base_dir=tmp_path)
