"""MSTAR_TORCH_PROFILE: a trace of a window of engine steps, and clear errors for a bad value."""

from __future__ import annotations

import json

import pytest
import torch

from mstar.engine.core import EngineConfig, EngineCore
from mstar.engine.params import SamplingParams
from mstar.engine.profiling import ENV_VAR, StepProfiler
from mstar.engine.scheduler import SchedulerConfig
from mstar.models.kimi_k3.tokenizer import KimiTokenizer


def test_a_window_of_steps_is_traced(tiny_model, tiny_dir, tmp_path, monkeypatch):
    monkeypatch.setenv(ENV_VAR, f"{tmp_path}:2:3")
    engine = EngineCore(tiny_model, KimiTokenizer.from_dir(tiny_dir),
                        EngineConfig(max_seq_len=128, page_size=16, max_num_pages=16, max_kda_slots=3,
                                     scheduler=SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64)))
    engine.add_request("a", list(range(5, 25)), SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    while engine.has_work():
        engine.step()
    trace = tmp_path / "mstar_steps_2-4.json"
    assert engine.profiler.trace_path == trace and engine.profiler.steps_seen == 8  # 1 prefill + 7 decodes
    events = json.loads(trace.read_text())["traceEvents"]
    assert any(e.get("name", "").startswith("aten::") for e in events)


@pytest.mark.parametrize("value", [":1:2", "/tmp/x:a", "/tmp/x:1:2:3", "/tmp/x:-1", "/tmp/x:0:0"])
def test_a_bad_value_says_what_is_expected(value, monkeypatch):
    monkeypatch.setenv(ENV_VAR, value)
    with pytest.raises(ValueError, match=ENV_VAR):
        StepProfiler.from_env(torch.device("cpu"))


def test_unset_means_off(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    assert StepProfiler.from_env(torch.device("cpu")) is None
