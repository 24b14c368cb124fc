"""mstar-spec-schedule: the best draft count per concurrency, merged into schedule buckets."""

from __future__ import annotations

import json

import pytest

from mstar.tools import spec_schedule


def write_sweep(directory, k, rates, accepted=None):
    levels = [{"concurrency": c, "output_tok_s": r, **({"mean_accepted_length": accepted} if accepted else {})}
              for c, r in rates.items()]
    (directory / f"k{k}.json").write_text(json.dumps({"levels": levels}))


def test_schedule_picks_the_fastest_k_and_merges_runs(tmp_path):
    write_sweep(tmp_path, 0, {1: 10, 2: 19, 4: 36, 8: 70, 16: 120})
    write_sweep(tmp_path, 2, {1: 18, 2: 30, 4: 50, 8: 69, 16: 100}, accepted=2.1)
    write_sweep(tmp_path, 7, {1: 25, 2: 33, 4: 45, 8: 60, 16: 80}, accepted=3.4)
    spec_schedule.main([str(tmp_path), "--title", "t"])
    text = (tmp_path / "schedule.md").read_text()
    assert "`{2: 7, 4: 2, 16: 0}`" in text
    assert "| 1 | 10.0 | 18.0 | 25.0 | 7 | 2.50x | 3.40 |" in text


def test_schedule_needs_the_baseline(tmp_path):
    write_sweep(tmp_path, 2, {1: 18})
    with pytest.raises(SystemExit, match="k0.json"):
        spec_schedule.main([str(tmp_path)])


def test_schedule_from_an_emulation_report(tmp_path):
    """Implied rates: batch / t_decode without drafts, batch x tokens per step / (t_draft + t_verify) with."""
    rows = [{"drafts": k, "batch": b, "t_decode_s": 0.01 * b ** 0.5, "t_draft_s": 0.002 * k, "t_verify_s": t_verify,
             "tokens_per_step": 1 + 0.7 * k, "speedup": 0.0}
            for (k, b, t_verify) in [(3, 1, 0.012), (7, 1, 0.015), (3, 16, 0.2), (7, 16, 0.3)]]
    path = tmp_path / "emulate_rank.json"
    path.write_text(json.dumps({"speculative": rows}))
    spec_schedule.main(["--emulation", str(path)])
    text = (tmp_path / "schedule.md").read_text()
    # batch 1: k=7 gives 1 x 5.9 / 0.029 = 203 tok/s (k=3: 3.1 / 0.018 = 172) against 1 / 0.01 = 100;
    # batch 16: no drafts (16 / 0.04 = 400) beats k=7 (16 x 5.9 / 0.314 = 301) and k=3 (241)
    assert "`{1: 7, 16: 0}`" in text
    assert "| 1 | 100.0 | 172.2 | 203.4 | 7 | 2.03x | 5.90 |" in text
    assert "| 16 | 400.0 | 240.8 | 300.6 | 0 | 1.00x |" in text
    with pytest.raises(SystemExit, match="no speculative rows"):
        path.write_text(json.dumps({"speculative": []}))
        spec_schedule.main(["--emulation", str(path)])
