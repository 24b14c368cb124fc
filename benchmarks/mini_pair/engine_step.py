"""The engine step of a served config, timed alone: what a request at C = 1 waits for between tokens, without HTTP.

Builds the engine a serve YAML describes (the model, its DSpark draft, CUDA graphs, async scheduling: as
mstar-serve would), runs one greedy request on a held-out prompt with a long max_tokens, and after a warm-up
times `EngineCore.step()` over several windows of steady steps (the median window is the figure: one window
varies by up to 30% on the lent GPU hosts). Reports ms per step, tokens per step and ms per token, and with
--profile the host functions that hold a step (cProfile over one more window, cumulative time).

    python benchmarks/mini_pair/engine_step.py --config configs/kimi_k3_mini.yaml \
        --set device=cuda dtype=bfloat16 model_kwargs.cuda_graphs=true --drafts 0 7 [--profile]

To compare two trees in one call, run it from each (PYTHONPATH=the tree) alternately: host speed differs by up to
~1.8x between lent machines, so only step times from one machine compare.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import time
from pathlib import Path

import torch

from mstar.config import load_serve_config, resolve_device, torch_dtype
from mstar.engine.core import EngineCore, SpeculativeModels
from mstar.engine.params import SamplingParams
from mstar.models.kimi_k3.tokenizer import KimiTokenizer
from mstar.models.kimi_k3.weights import load_model

HELDOUT = Path(__file__).resolve().parents[2] / "mstar" / "training" / "heldout_prompts.json"


def build(config: str, overrides: list[str], drafts: int) -> EngineCore:
    cfg = load_serve_config(config, [*overrides, f"model_kwargs.speculative_tokens={drafts}",
                                     "model_kwargs.speculative_schedule={}"])
    device = resolve_device(cfg)
    model = load_model(cfg.checkpoint, dtype=torch_dtype(cfg.dtype), device=device)
    return EngineCore(model, KimiTokenizer.from_dir(cfg.checkpoint), cfg, SpeculativeModels.for_config(cfg, device))


def _sync(engine: EngineCore) -> None:
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)


def time_steps(engine: EngineCore, prompt: str, warmup: int, steps: int, windows: int,
               profile: bool) -> dict:
    """Windows of `steps` steady steps of one request (restarted whenever it ends): ms per step and tokens."""
    ids = engine.tokenizer.encode(prompt)
    room = engine.config.max_seq_len - len(ids) - 1
    params = SamplingParams(max_tokens=room, temperature=0, ignore_eos=True)
    serial = iter(range(10**9))

    def run(n: int) -> int:
        tokens = 0
        for _ in range(n):
            if not engine.has_work():
                engine.add_request(f"r{next(serial)}", ids, params)
                engine.step()  # the prefill: not a steady step, so it is not counted
            tokens += sum(len(out.new_token_ids) for out in engine.step())
        return tokens

    run(warmup)
    _sync(engine)
    results = []
    for _ in range(windows):
        start = time.perf_counter()
        tokens = run(steps)
        _sync(engine)
        results.append(((time.perf_counter() - start) * 1e3 / steps, tokens / steps))
    out = {"ms_per_step": [round(ms, 4) for ms, _ in results], "tokens_per_step": [round(t, 3) for _, t in results]}
    ms, per_step = statistics.median(m for m, _ in results), statistics.median(t for _, t in results)
    out.update(median_ms=round(ms, 4), median_tokens=round(per_step, 3), ms_per_token=round(ms / per_step, 4))
    if profile:
        prof = cProfile.Profile()
        prof.enable()
        run(steps)
        _sync(engine)
        prof.disable()
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(45)
        out["profile"] = text.getvalue()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/kimi_k3_mini.yaml")
    parser.add_argument("--set", nargs="*", default=[], help="config overrides, as mstar-serve takes them")
    parser.add_argument("--drafts", nargs="+", type=int, default=[0, 7], help="k values (0: no speculation)")
    parser.add_argument("--prompt", type=int, default=0, help="index of the held-out prompt")
    parser.add_argument("--warmup", type=int, default=30)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--windows", type=int, default=6)
    parser.add_argument("--profile", action="store_true", help="cProfile one more window (host functions)")
    parser.add_argument("--label", default="", help="a name for this tree in the output (e.g. base, head)")
    parser.add_argument("--json", help="append the results to this JSON-lines file")
    args = parser.parse_args()
    prompt = json.loads(HELDOUT.read_text())["prompts"][args.prompt]
    for k in args.drafts:
        engine = build(args.config, args.set, k)
        res = time_steps(engine, prompt, args.warmup, args.steps, args.windows, args.profile)
        res.update(label=args.label, drafts=k, config=args.config, overrides=args.set)
        profile = res.pop("profile", None)
        print(f"{args.label or 'tree'} k={k}: {res['median_ms']:.3f} ms/step (windows {res['ms_per_step']}), "
              f"{res['median_tokens']:.2f} tokens/step, {res['ms_per_token']:.3f} ms/token", flush=True)
        if profile:
            print(profile, flush=True)
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps(res) + "\n")
        del engine
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
