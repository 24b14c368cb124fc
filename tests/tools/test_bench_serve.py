"""mstar-bench-serve against a live tiny DSpark server: text prompts, the table, per-level speculation stats."""

from __future__ import annotations

import json
from importlib import resources

from live_server import LiveServer
from paths import ROOT

from mstar.config import load_serve_config
from mstar.serve import build_engine
from mstar.server import build_app
from mstar.tools import bench_serve
from mstar.tools.bench_serve import SpecCounters

CONFIG = ROOT / "configs" / "kimi_k3_tiny_dspark.yaml"
PROMPTS = resources.files("mstar.training").joinpath("heldout_prompts.json")


def test_spec_counters_of_a_level_are_the_difference():
    before = SpecCounters(10, 4, {1: 10, 2: 6}, {1: 3, 2: 1})
    after = SpecCounters(30, 24, {1: 30, 2: 20, 3: 5}, {1: 13, 2: 8, 3: 2})
    level = after.since(before)
    assert (level.verify_rows, level.accepted) == (20, 20)
    assert level.mean_accepted_length == 2.0
    assert level.position_rates() == [0.5, 0.5, 0.4]


def test_sweep_with_text_prompts_reports_acceptance(tiny_dirs, tmp_path, capsys):
    target_dir, draft_dir = tiny_dirs
    cfg = load_serve_config(CONFIG, [f"checkpoint={target_dir}", f"model_kwargs.speculative_draft={draft_dir}",
                                     "max_seq_len=512", "resources.mla_kv.max_num_pages=256",
                                     "resources.dspark_kv.max_num_pages=256"])
    engine = build_engine(cfg)
    live = LiveServer(build_app(engine, served_model_name="kimi_k3_tiny"))
    live.start()
    try:
        bench_serve.main(["--url", live.url, "--concurrency", "1,2", "--requests-per-level", "1", "--output-len", "6",
                          "--prompts", str(PROMPTS), "--out", str(tmp_path), "--name", "sweep"])
    finally:
        live.stop()
        engine.shutdown()
    progress = capsys.readouterr().err
    assert "C=1" in progress and "C=2" in progress and "req" in progress  # a progress bar per level
    assert "C=1 warm-up" in progress and "C=2 warm-up" in progress  # one untimed round of C before each level
    table = (tmp_path / "sweep.md").read_text()
    levels = json.loads((tmp_path / "sweep.json").read_text())["levels"]
    assert [lv["concurrency"] for lv in levels] == [1, 2] and all(lv["mean_accepted_length"] >= 1 for lv in levels)
    assert [lv["requests"] for lv in levels] == [1, 2]  # the warm-up's requests are not counted
    assert f"{len(json.loads(PROMPTS.read_text())['prompts'])} text prompts / 6 out" in table
    rows = [line for line in table.splitlines() if line.startswith("| 1 |") or line.startswith("| 2 |")]
    assert len(rows) == 2
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert len(cells) == 10 and float(cells[8]) >= 1.0  # accepted length: at least the bonus token
        assert all(0.0 <= float(x) <= 1.0 for x in cells[9].split())
        assert float(cells[3]) <= float(cells[5])  # TTFT mean <= p99 (one request: equal)
    assert all(lv["ttft_p50_s"] <= lv["ttft_p99_s"] for lv in levels)


def test_warm_up_prompts_differ_from_the_levels():
    texts = ["a", "b", "c"]
    assert bench_serve.level_prompts(2, 4, 0, 0, texts) == ["a", "b", "c", "a"]
    assert bench_serve.level_prompts(2, 2, 0, 0, texts, warmup=True) == ["c", "b"]
    timed = bench_serve.level_prompts(4, 4, 16, 1000, None)
    warm = bench_serve.level_prompts(4, 4, 16, 1000, None, warmup=True)
    assert timed == bench_serve.level_prompts(4, 4, 16, 1000, None)
    assert not set(map(tuple, warm)) & set(map(tuple, timed))


def test_the_recorded_commit_is_mstar_commit_where_set(monkeypatch):
    from mstar.tools.bench_serve import git_commit

    monkeypatch.setenv("MSTAR_COMMIT", "abc1234")
    assert git_commit() == "abc1234"
    monkeypatch.delenv("MSTAR_COMMIT")
    assert git_commit() != "abc1234"
