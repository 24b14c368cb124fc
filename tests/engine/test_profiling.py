"""MSTAR_TORCH_PROFILE: a trace of a window of engine steps, and clear errors for a bad value."""

from __future__ import annotations

import json

import pytest
import torch
from engine_run import run_to_completion

from mstar.config import EngineConfig, Environment, ServeConfigError
from mstar.engine.core import EngineCore
from mstar.engine.params import SamplingParams
from mstar.engine.profiling import StepProfiler
from mstar.models.kimi_k3.tokenizer import KimiTokenizer

ENV_VAR = "MSTAR_TORCH_PROFILE"


def test_a_window_of_steps_is_traced(tiny_model, tiny_dir, tmp_path):
    env = Environment.read({ENV_VAR: f"{tmp_path}:2:3"})
    config = EngineConfig(max_seq_len=128, resources={"mla_kv": {"page_size": 16, "max_num_pages": 16},
                                                      "kda_state": {"max_slots": 3}},
                          scheduler={"max_num_seqs": 2, "max_num_batched_tokens": 64})
    engine = EngineCore(tiny_model, KimiTokenizer.from_dir(tiny_dir), config, env=env)
    engine.add_request("a", list(range(5, 25)), SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    run_to_completion(engine)
    trace = tmp_path / "mstar_steps_2-4.json"
    assert engine.profiler.trace_path == trace and engine.profiler.steps_seen == 8  # 1 prefill + 7 decodes
    events = json.loads(trace.read_text())["traceEvents"]
    assert any(e.get("name", "").startswith("aten::") for e in events)


@pytest.mark.parametrize("value", [":1:2", "/tmp/x:a", "/tmp/x:1:2:3", "/tmp/x:-1", "/tmp/x:0:0"])
def test_a_bad_value_says_what_is_expected(value):
    with pytest.raises(ServeConfigError, match=ENV_VAR):
        Environment.read({ENV_VAR: value})


def test_unset_means_off():
    assert Environment.read({}).torch_profile is None
    assert StepProfiler.from_window(Environment.read({ENV_VAR: ""}).torch_profile, torch.device("cpu")) is None
