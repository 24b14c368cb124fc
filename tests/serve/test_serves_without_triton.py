"""The serving path loads and answers without triton (or fla-core), as in the README's base install.

The README test (test_readme_install.py) proves the same on a fresh venv, but takes minutes and runs only in
CI; this one blocks the GPU-only packages in a subprocess of the test venv, builds the engine from the mini
config (DSpark on, the default) and generates, so a top-level `import triton` on the serving path fails here
in seconds. Kernel modules import triton at their top; the serving path reaches them only on a GPU.
"""

from __future__ import annotations

import subprocess
import sys

from paths import ROOT

BLOCKED = ("triton", "fla")

SCRIPT = f"""
import asyncio, importlib.abc, sys

class Blocked(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {BLOCKED!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}} (blocked by the test)")
        return None

sys.meta_path.insert(0, Blocked())
from mstar.config import load_serve_config
from mstar.engine.params import SamplingParams
from mstar.serve import build_engine

engine = build_engine(load_serve_config("configs/kimi_k3_mini.yaml", ["device=cpu"]))

async def generate():
    prompt = engine.tokenizer.encode("def fib(n):")
    tokens = []
    async for out in engine.generate("r0", prompt, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)):
        tokens += out.new_token_ids
    return tokens

try:
    tokens = asyncio.run(generate())
finally:
    engine.shutdown()
print("tokens", len(tokens))
assert not [m for m in sys.modules if m.split(".")[0] in {BLOCKED!r}]
"""


def test_mini_config_serves_without_triton_or_fla():
    done = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"the serving path needs a GPU-only package:\n{done.stderr[-4000:]}"
    assert "tokens 8" in done.stdout, done.stdout
