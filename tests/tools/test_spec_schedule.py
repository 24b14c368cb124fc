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
