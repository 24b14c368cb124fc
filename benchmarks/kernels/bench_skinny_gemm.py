"""The dense projections of a decode step at one TP8 rank of pruned75: mstar's skinny GEMM against cuBLAS.

    python3 benchmarks/kernels/bench_skinny_gemm.py [--rows 1 8 16 64] [--reps 30] [--sweep] [--budget-s 150]

The projections and their counts per step come from the model: the rank's module (config.py through
sharding.py's ShardingPlan, the sharded latent layout, the default; built on the meta device) walked layer by
layer, with the input projections stacked as gpu_ops stacks them (KDA's q, k, v, f_a, b, g; MLA's q_a, kv_a, g;
a gated MLP's gate and up; a MoE layer's latent up and shared down, by columns). Not GEMVs of this kind, so not
here: MLA's kv_b (absorbed: per-head batched products), the router (its fp32-output GEMM,
kernels/router_topk.py), the routed experts (MXFP4).

Each case: bytes (W once, x in, y out), the floor at 4.3 TB/s, and the time per call of cuBLAS (F.linear) and
of ours (default config, with and without PDL) in a CUDA graph of back-to-back calls that rotate over weight
copies larger than L2 together (as a step's 93 layers do; the smallest matrices are capped at 64 copies),
replayed behind a GPU sleep (bench_moe_mxfp4.time_graphs). `--sweep` also times a list of tile configs per
case (the best is reported; the table in skinny_gemm.py comes from it). Then the PDL measurement: one layer's
chain of dependent projections (x -> KDA inputs -> o_proj -> shared gate/up -> down -> latent down -> up ...)
over rotating copies, captured as one graph: cuBLAS, ours without PDL, ours with PDL, and the table's choice per
shape (`skinny_gemm.linear`, as the backend will call it; not in the run at 0a78fac). Then the step: each
projection's count x its time, cuBLAS against the per-shape choice.

Results go to $OUT/bench_skinny_gemm.json (rewritten after every case, so a run cut short keeps what it
measured); the tables are printed last.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections import Counter
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_moe_mxfp4 import capture, time_graphs  # noqa: E402

from mstar.distributed.loader import rank_module  # noqa: E402
from mstar.distributed.sharding import ShardingPlan  # noqa: E402
from mstar.kernels import skinny_gemm  # noqa: E402
from mstar.kernels.skinny_gemm import SkinnyConfig  # noqa: E402
from mstar.kernels.stacked_linear import padded_rows  # noqa: E402
from mstar.models.kimi_k3.config import KimiK3Config  # noqa: E402
from mstar.models.kimi_k3.kda import KimiDeltaAttention  # noqa: E402
from mstar.models.kimi_k3.mla import GatedMLA  # noqa: E402
from mstar.models.kimi_k3.mlp import GatedMLP  # noqa: E402
from mstar.models.kimi_k3.moe import LatentMoE  # noqa: E402
from mstar.tools.roofline import HBM_BYTES_PER_S, resolve_config  # noqa: E402

BF16 = torch.bfloat16
DEVICE = "cuda"
ROTATE_BYTES = 400e6  # the weight copies of one case together: several times the 60 MB L2
MAX_COPIES = 64
# (shared memory per program: stages x (block_n + block_m) x block_k x 2 B; ctas_per_sm programs must fit in 227 KB)
SWEEP = [SkinnyConfig(64, 256, 4), SkinnyConfig(64, 128, 6), SkinnyConfig(32, 256, 4, ctas_per_sm=2),
         SkinnyConfig(128, 128, 4), SkinnyConfig(32, 128, 6, ctas_per_sm=2), SkinnyConfig(64, 128, 4, ctas_per_sm=2),
         SkinnyConfig(128, 256, 3, warps=8), SkinnyConfig(64, 128, 3, ctas_per_sm=3)]
SWEEP_64_ROWS = [SkinnyConfig(64, 128, 4), SkinnyConfig(128, 128, 3, warps=8), SkinnyConfig(32, 128, 4, ctas_per_sm=2),
                 SkinnyConfig(64, 64, 6, ctas_per_sm=2)]


def decode_projections(config: KimiK3Config, plan: ShardingPlan) -> list[tuple[str, int, int, int]]:
    """(name, N, K, calls per decode step) of every dense projection of rank `plan.rank`, stacked as gpu_ops
    stacks them."""
    model = rank_module(config, plan)
    calls: Counter[tuple[str, int, int]] = Counter()

    def add(name, *linears):  # several: a row stack, padded as StackedLinear pads it
        n = sum(lin.out_features for lin in linears)
        calls[(name, padded_rows(n) if len(linears) > 1 else n, linears[0].in_features)] += 1

    for m in model.modules():
        if isinstance(m, KimiDeltaAttention):
            gate = [m.g_proj] if m.use_full_rank_gate else [m.g_a_proj]
            add("KDA inputs (q k v f_a b g)", m.q_proj, m.k_proj, m.v_proj, m.f_a_proj, m.b_proj, *gate)
            add("KDA f_b", m.f_b_proj)
            if not m.use_full_rank_gate:
                add("KDA g_b", m.g_b_proj)
            add("o_proj", m.o_proj)
        elif isinstance(m, GatedMLA):
            first = [m.q_proj] if m.q_lora_rank is None else [m.q_a_proj]
            add("MLA inputs (q_a kv_a g)", *first, m.kv_a_proj_with_mqa, *([m.g_proj] if m.g_proj is not None else []))
            if m.q_lora_rank is not None:
                add("MLA q_b", m.q_b_proj)
            add("o_proj", m.o_proj)
        elif isinstance(m, LatentMoE):
            if getattr(m, "routed_expert_down_proj", None) is not None:
                shared = m.shared_experts if m.config.num_shared_experts else None
                if shared is not None:  # gpu_ops' moe_inputs: router + latent down + shared gate/up, one GEMM
                    n = padded_rows(m.gate.weight.shape[0] + sum(
                        p.out_features for p in (m.routed_expert_down_proj, shared.gate_proj, shared.up_proj)))
                    calls[("MoE inputs (router, latent down, shared gate/up)", n, m.gate.weight.shape[1])] += 1
                else:
                    add("latent down", m.routed_expert_down_proj)
                if shared is not None and m.config.latent_shards > 1:  # gpu_ops' latent_output: one GEMM
                    up, down = m.routed_expert_up_proj, shared.down_proj
                    calls[("latent up + shared down", up.out_features, up.in_features + down.in_features)] += 1
                else:
                    add("latent up", m.routed_expert_up_proj)
        elif isinstance(m, GatedMLP):
            moe = next((x for x in model.modules() if isinstance(x, LatentMoE)
                        and m is getattr(x, "shared_experts", None)), None)
            if moe is None:
                add("dense MLP gate/up", m.gate_proj, m.up_proj)
                add("dense MLP down", m.down_proj)
            elif moe.config.latent_shards == 1:
                add("shared experts down", m.down_proj)
    lm = model.lm_head.weight
    calls[("lm_head", lm.shape[0], lm.shape[1])] += 1
    return [(name, n, k, c) for (name, n, k), c in calls.items()]


def case_bytes(rows: int, n: int, k: int) -> int:
    return 2 * (n * k + rows * k + rows * n)


class Case:
    """Weight copies of one (N, K), an input of `rows` rows and an output per call."""

    def __init__(self, rows: int, n: int, k: int):
        self.copies = max(2, min(MAX_COPIES, math.ceil(ROTATE_BYTES / (2 * n * k))))
        self.w = [(torch.randn(n, k, device=DEVICE) * k**-0.5).to(BF16) for _ in range(self.copies)]
        self.x = torch.randn(rows, k, device=DEVICE).to(BF16)
        self.out = torch.empty(rows, n, device=DEVICE, dtype=BF16)
        self.expect = self.x.float() @ self.w[0].float().T

    def error(self, fn) -> float:
        self.out.fill_(float("nan"))
        fn(self.x, self.w[0], self.out)
        return float((self.out.double() - self.expect.double()).norm() / self.expect.double().norm())

    def time(self, fn, reps: int) -> float:
        """µs per call, `copies` back-to-back calls per replay."""
        graph = capture(lambda: [fn(self.x, w, self.out) for w in self.w])
        return time_graphs([graph], reps) / self.copies


def cublas(x, w, out):
    torch.matmul(x, w.T, out=out)


def ours(config=None, pdl=None):
    return lambda x, w, out: skinny_gemm.skinny_linear(x, w, config=config, pdl=pdl, out=out)


def attempt(entry: dict, key: str, run) -> None:
    """entry[key] = run(), or entry[key + "_failed"] = the error (a variant that does not compile or fit on this
    GPU or Triton is recorded, not fatal)."""
    try:
        entry[key] = run()
    except Exception as e:
        entry[f"{key}_failed"] = f"{type(e).__name__}: {str(e)[:300]}"


def measure_case(name: str, rows: int, n: int, k: int, calls: int, reps: int, sweep: bool) -> dict:
    case = Case(rows, n, k)
    floor_us = case_bytes(rows, n, k) / HBM_BYTES_PER_S * 1e6
    r = {"name": name, "rows": rows, "n": n, "k": k, "calls_per_step": calls, "bytes": case_bytes(rows, n, k),
         "floor_us": floor_us, "copies": case.copies, "cublas_us": case.time(cublas, reps)}
    attempt(r, "ours_err", lambda: case.error(ours()))
    attempt(r, "ours_us", lambda: case.time(ours(), reps))
    attempt(r, "ours_no_pdl_err", lambda: case.error(ours(pdl=False)))
    attempt(r, "ours_no_pdl_us", lambda: case.time(ours(pdl=False), reps))
    if sweep:
        r["sweep"] = []
        for cfg in SWEEP if rows <= 16 else SWEEP_64_ROWS:
            entry = {"config": cfg.__dict__, "pdl": True}
            attempt(entry, "err", lambda cfg=cfg: case.error(ours(cfg)))
            if "err" in entry:
                attempt(entry, "us", lambda cfg=cfg: case.time(ours(cfg), reps))
            r["sweep"].append(entry)
    default = skinny_gemm.default_config(rows).__dict__
    timed = [{"us": r[key], "config": default, "pdl": key == "ours_us"} for key in ("ours_us", "ours_no_pdl_us")
             if key in r and r[key.replace("_us", "_err")] < 2e-2]
    timed += [e for e in r.get("sweep", []) if "us" in e and e["err"] < 2e-2]
    if timed:
        best = min(timed, key=lambda e: e["us"])
        r["best_us"], r["best_config"], r["best_pdl"] = best["us"], best["config"], best["pdl"]
    return r


def chain_weights(projections, copies: int):
    """One KDA layer's dependent chain, then a MoE's shared expert and latent projections: (N, K) in order,
    each the input width of the next (a wider output passes its first K columns on, as a view)."""
    wanted = ["KDA inputs (q k v f_a b g)", "o_proj", "shared experts gate/up", "shared experts down", "latent down",
              "latent up"]
    shapes = {name: (n, k) for name, n, k, _ in projections}
    order = [shapes[name] for name in wanted if name in shapes]
    return [[(torch.randn(n, k, device=DEVICE) * k**-0.5).to(BF16) for n, k in order] for _ in range(copies)]


def measure_chain(projections, rows: int, reps: int) -> dict:
    copies = 8  # 8 x ~150 MB of distinct weights per replay
    layers = chain_weights(projections, copies)
    x = torch.randn(rows, layers[0][0].shape[1], device=DEVICE).to(BF16)

    def run(linear):
        def go():
            h = x
            for ws in layers:
                for w in ws:
                    h = linear(h[:, : w.shape[1]], w)
            return h
        return go

    variants = {"cublas": lambda h, w: F.linear(h, w),
                "ours_no_pdl": lambda h, w: skinny_gemm.skinny_linear(h, w, pdl=False),
                "ours_pdl": lambda h, w: skinny_gemm.skinny_linear(h, w, pdl=True),
                "table": skinny_gemm.linear}  # per shape the kernel (PDL on) or cuBLAS, as the backend will run
    outs: dict[str, torch.Tensor] = {}
    for name, fn in variants.items():
        attempt(outs, name, run(fn))
    ref = outs["cublas"].double()
    launches = sum(len(ws) for ws in layers)
    byte_count = sum(case_bytes(rows, *w.shape) for ws in layers for w in ws)
    result = {"rows": rows, "launches": launches, "bytes": byte_count,
              "floor_us": byte_count / HBM_BYTES_PER_S * 1e6, "shapes": [list(w.shape) for w in layers[0]]}
    for name, fn in variants.items():
        if name in outs:
            result[f"{name}_rel_to_cublas"] = float((outs[name].double() - ref).norm() / ref.norm())
            attempt(result, f"{name}_us", lambda fn=fn: time_graphs([capture(run(fn))], reps))
    return result


def write(results: dict) -> None:
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "bench_skinny_gemm.json").write_text(json.dumps(results, indent=1))


def table_us(case: dict) -> float:
    """The time of the path `skinny_gemm.measured_choice` picks for this case: its config's sweep time, or cuBLAS."""
    cfg = skinny_gemm.measured_choice(case["rows"], case["n"], case["k"])
    if cfg is None:
        return case["cublas_us"]
    times = [e["us"] for e in case.get("sweep", []) if e["config"] == cfg.__dict__ and "us" in e]
    return times[0] if times else math.nan


def step_summary(cases: list[dict], rows: int) -> dict:
    """Per decode step at `rows` rows: each projection's calls x its time: cuBLAS, ours (best config), the faster
    of the two per shape, and the measured table's choice (skinny_gemm.H200_TABLE)."""
    mine = [c for c in cases if c["rows"] == rows]
    byte_count = sum(c["bytes"] * c["calls_per_step"] for c in mine)
    cub = sum(c["cublas_us"] * c["calls_per_step"] for c in mine)
    ours_t = sum(c.get("best_us", math.nan) * c["calls_per_step"] for c in mine)
    faster = sum(min(c.get("best_us", math.inf), c["cublas_us"]) * c["calls_per_step"] for c in mine)
    table = sum(table_us(c) * c["calls_per_step"] for c in mine)
    floor = byte_count / HBM_BYTES_PER_S * 1e6
    return {"rows": rows, "bytes": byte_count, "floor_us": floor, "cublas_us": cub, "ours_us": ours_t,
            "faster_us": faster, "table_us": table, "table_bw_fraction": floor / table}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 16, 64])
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--sweep", action="store_true", help="also time the SWEEP tile configs per case")
    parser.add_argument("--budget-s", type=float, default=1e9, help="stop starting new cases after this long")
    parser.add_argument("--only", metavar="TEXT", help="time only the projections whose name holds TEXT (e.g. "
                        "'MoE inputs'; the step summaries then cover those alone)")
    parser.add_argument("--tables", metavar="JSON", help="print the tables of a recorded run (no GPU): the step "
                        "summaries recomputed with the current H200_TABLE")
    args = parser.parse_args()
    if args.tables:
        results = json.loads(Path(args.tables).read_text())
        measured = sorted({c["rows"] for c in results["cases"]})
        results["steps"] = [step_summary(results["cases"], rows) for rows in measured]
        print_tables(results)
        return
    if not torch.cuda.is_available():
        sys.exit("bench_skinny_gemm: needs a CUDA GPU")
    began = time.monotonic()
    config = resolve_config("kimi_k3_pruned75_config.json")
    projections = decode_projections(config, ShardingPlan(8, 0, 1, latent_sharded=True))
    if args.only:
        projections = [p for p in projections if args.only in p[0]]
        if not projections:
            sys.exit(f"bench_skinny_gemm: no projection's name holds {args.only!r}")
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
               "triton": __import__("triton").__version__, "projections": projections, "cases": [], "chain": []}
    print(f"{results['device']}, torch {results['torch']}, triton {results['triton']}", file=sys.stderr)
    for rows in args.rows:
        for rows_chain in ([rows] if rows in (1, 16) and not args.only else []):  # the chain needs all
            results["chain"].append(measure_chain(projections, rows_chain, args.reps))
            write(results)
        for name, n, k, calls in projections:
            if time.monotonic() - began > args.budget_s:
                break
            results["cases"].append(measure_case(name, rows, n, k, calls, args.reps, args.sweep))
            write(results)
            c = results["cases"][-1]
            print(f"{name} {n}x{k} M={rows}: cublas {c['cublas_us']:.2f} ours {_get(c, 'ours_us'):.2f} "
                  f"(no pdl {_get(c, 'ours_no_pdl_us'):.2f}, best {_get(c, 'best_us'):.2f}) "
                  f"floor {c['floor_us']:.2f} us", file=sys.stderr)
    results["steps"] = [step_summary(results["cases"], rows) for rows in args.rows]
    write(results)
    print_tables(results)


def _get(entry: dict, key: str) -> float:
    return entry.get(key, math.nan)


def print_tables(results: dict) -> None:
    print("\n| projection | N | K | calls/step | M | MB | floor µs | cuBLAS µs | ours µs | ours no-PDL µs | best µs "
          "| best/floor | cuBLAS/ours |")
    print("|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|")
    for c in results["cases"]:
        best = _get(c, "best_us")
        print(f"| {c['name']} | {c['n']} | {c['k']} | {c['calls_per_step']} | {c['rows']} | {c['bytes'] / 1e6:.1f} "
              f"| {c['floor_us']:.2f} | {c['cublas_us']:.2f} | {_get(c, 'ours_us'):.2f} "
              f"| {_get(c, 'ours_no_pdl_us'):.2f} | {best:.2f} | {best / c['floor_us']:.2f} "
              f"| {c['cublas_us'] / best:.2f} |")
    print("\n| chain M | launches | floor µs | cuBLAS µs | ours no-PDL µs | ours PDL µs | table's choice µs |")
    print("|--:|--:|--:|--:|--:|--:|--:|")
    for c in results["chain"]:
        print(f"| {c['rows']} | {c['launches']} | {c['floor_us']:.1f} | {_get(c, 'cublas_us'):.1f} "
              f"| {_get(c, 'ours_no_pdl_us'):.1f} | {_get(c, 'ours_pdl_us'):.1f} | {_get(c, 'table_us'):.1f} |")
    print("\n| step M | GB | floor µs | cuBLAS µs | ours (best config) µs | faster of the two µs | table's choice µs "
          "| floor/table |")
    print("|--:|--:|--:|--:|--:|--:|--:|--:|")
    for s in results.get("steps", []):
        print(f"| {s['rows']} | {s['bytes'] / 1e9:.2f} | {s['floor_us']:.0f} | {s['cublas_us']:.0f} "
              f"| {s['ours_us']:.0f} | {s['faster_us']:.0f} | {s['table_us']:.0f} | {s['table_bw_fraction']:.2f} |")


if __name__ == "__main__":
    main()
