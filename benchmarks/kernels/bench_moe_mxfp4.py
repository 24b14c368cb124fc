"""The routed-expert step of one TP8 rank of pruned75 on the GPU: mstar's Triton MXFP4 MoE beside the peer,
vLLM's MoE GEMMs (humming-kernels, whenever importable: the `bench` extra), against the byte and FLOP floors
(and torch's bf16 grouped GEMM on pre-dequantized weights).

    python benchmarks/kernels/bench_moe_mxfp4.py [--tokens 1 2 4 ... 8192] [--tune [--tune-axes down ...]] [--reps 200]
                                                 [--no-humming]

Shapes: E = 224 experts, top-16, H_lat = 3584, I = 384 (K3 pruned75, one rank of TP8); bf16 z, random
canonical MXFP4 weights (`random_mxfp4`), random top-16 routing with renormalised positive weights.

What is timed: the whole step (alignment, gate/up GEMM + SiTU, down GEMM, combine) captured in one
CUDA graph, replayed with CUDA events around each replay; the median is reported. 'mstar' is the
default dispatch (`default_config`: up to DIRECT_MAX_PAIRS pairs it skips the alignment); 'aligned'
forces the alignment pipeline (`default_config(..., align=True)`), for comparison. Per-launch times
are differences between graphs of the first 1, 2, ... launches (the first includes the graph's own
launch). The CPU queues all replays behind a long GPU sleep, so the events time GPU work, not
Python's launch pace. Each replay
reads one of SETS weight copies in turn (different memory, same routing): between two reads of the
same copy at least (SETS - 1) x 35 MB of other weights pass through the 50 MB L2, so weights come
from HBM, as they do in a model whose 92 MoE layers are far larger than L2.

Floor: the fewest HBM bytes of the step over the measured copy bandwidth (4.26 TB/s):
    bytes = distinct experts touched x (3 H I / 2 packed + 3 H I / 32 scale bytes)   [2,193,408 per expert]
          + T H x 2 (z, bf16) + T k x (8 + 4) (ids int64, weights fp32) + T H x 4 (output, fp32)
e.g. one token touches 16 experts: 35.1 MB -> 8.2 us.

--tune runs a coordinate search over tile configs per token count (each candidate checked against
the reference) and prints the best as a config table to paste into `default_config`.
humming ('HummingStep') runs as vLLM runs it, on the same weight copies (converted to its layout once),
inputs and routing: an alignment per GEMM at the block_m its heuristics pick for T*k rows (mstar's alignment
kernel, padding rows set to humming's sentinel T*k, plus one count of padded rows), the gate/up GEMM (indexed,
top-k), SiTU fused into humming's process_input kernel (HUMMING_SITU), the down GEMM, and the weighted sum of
the k rows (mstar's combine kernel); its output is checked against the same reference. FLOP floor: 6 H I
FLOPs per pair at 750 TFLOP/s; 'x floor' divides by the larger floor.
The table is printed last; full results go to $OUT/bench_moe_mxfp4.json when $OUT is set.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import time
import traceback
from dataclasses import asdict

import torch

from mstar.kernels import moe_mxfp4 as moe
from mstar.quant.mxfp4 import dequantize_mxfp4, random_mxfp4
from mstar.quant.mxfp4_words import from_word_layout, to_word_layout

E, K, H, I = 224, 16, 3584, 384
SETS = 4  # weight copies replays rotate over
SLEEP_CYCLES = 20_000_000  # ~10 ms of GPU sleep ahead of each batch of replays
BATCH = 50  # replays queued behind one sleep
DEVICE = "cuda"
TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 1024, 4096, 8192)
FLOP_PER_S = 750e12  # bf16 dense tensor-core rate of the H200 used for the FLOP floor
# SiTU for humming's fused activation (a = gate, b = up; fp32 in, as its process_input kernel computes).
HUMMING_SITU = (f"({moe.SITU_BETA}f * tanhf(a / {moe.SITU_BETA}f) / (1.0f + __expf(-a)))"
                f" * ({moe.SITU_LINEAR_BETA}f * tanhf(b / {moe.SITU_LINEAR_BETA}f))")


# ----------------------------------------------------------------------------------------------
# Inputs
# ----------------------------------------------------------------------------------------------


def make_weights(gen: torch.Generator) -> moe.StackedExperts:
    """Random canonical MXFP4 experts, drawn 32 experts at a time to bound the temporaries, their codes in the
    kernels' word layout (as `stack_experts` leaves them)."""
    parts = {"w13": [], "w2": []}
    for start in range(0, E, 32):
        n = min(32, E - start)
        parts["w13"].append(random_mxfp4(n * 2 * I, H, gen))
        parts["w2"].append(random_mxfp4(n * H, I, gen))
    w13_packed = to_word_layout(torch.cat([p for p, _ in parts["w13"]])).view(E, 2 * I, H // 2)
    w13_scale = torch.cat([s for _, s in parts["w13"]]).view(E, 2 * I, H // 32)
    w2_packed = to_word_layout(torch.cat([p for p, _ in parts["w2"]])).view(E, H, I // 2)
    w2_scale = torch.cat([s for _, s in parts["w2"]]).view(E, H, I // 32)
    return moe.StackedExperts(w13_packed, w13_scale, w2_packed, w2_scale)


def permuted(stacked: moe.StackedExperts, gen: torch.Generator) -> moe.StackedExperts:
    """Another weight copy (new memory): the experts of `stacked` in a random order."""
    perm = torch.randperm(E, generator=gen, device=stacked.w13_packed.device)
    return moe.StackedExperts(*(t.index_select(0, perm).contiguous() for t in stacked))


def dequantized(stacked: moe.StackedExperts) -> tuple[torch.Tensor, torch.Tensor]:
    """bf16 [E, 2I, H] and [E, H, I] for the torch baseline (exact: MXFP4 values are bf16 numbers)."""
    w13 = torch.empty(E, 2 * I, H, dtype=torch.bfloat16, device=stacked.w13_packed.device)
    w2 = torch.empty(E, H, I, dtype=torch.bfloat16, device=stacked.w13_packed.device)
    for e in range(E):
        w13[e] = dequantize_mxfp4(from_word_layout(stacked.w13_packed[e]), stacked.w13_scale[e], torch.bfloat16)
        w2[e] = dequantize_mxfp4(from_word_layout(stacked.w2_packed[e]), stacked.w2_scale[e], torch.bfloat16)
    return w13, w2


def make_inputs(num_tokens: int, gen: torch.Generator):
    z = torch.randn(num_tokens, H, generator=gen, device=DEVICE).to(torch.bfloat16)
    scores = torch.rand(num_tokens, E, generator=gen, device=DEVICE)
    ids = scores.topk(K, dim=1).indices
    weights = torch.rand(num_tokens, K, generator=gen, device=DEVICE) + 0.1
    return z, ids, weights / weights.sum(dim=1, keepdim=True)


# ----------------------------------------------------------------------------------------------
# Timing
# ----------------------------------------------------------------------------------------------


def capture(fn) -> torch.cuda.CUDAGraph:
    fn()  # compile / warm up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def time_graphs(graphs: list[torch.cuda.CUDAGraph], reps: int) -> float:
    """Median µs of one replay, rotating over `graphs` (one per weight copy)."""
    for g in graphs:
        g.replay()
    torch.cuda.synchronize()
    times = []
    for start in range(0, reps, BATCH):
        n = min(BATCH, reps - start)
        begin = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
        end = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
        torch.cuda._sleep(SLEEP_CYCLES)
        for r in range(n):
            begin[r].record()
            graphs[(start + r) % len(graphs)].replay()
            end[r].record()
        torch.cuda.synchronize()
        times += [b.elapsed_time(e) * 1e3 for b, e in zip(begin, end, strict=True)]
    return statistics.median(times)


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    if not torch.isfinite(out).all():
        return float("inf")
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


# ----------------------------------------------------------------------------------------------
# mstar
# ----------------------------------------------------------------------------------------------


class MstarStep:
    """One config at one token count: a workspace, an output and one captured graph per weight copy."""

    def __init__(self, sets, z, ids, weights, config: moe.MoEConfig):
        self.config = moe.fit_config(config, H, I)
        self.sets, self.z, self.ids, self.weights = sets, z, ids, weights
        self.ws = moe.MoEWorkspace.allocate(z.shape[0], K, E, H, I, self.config, DEVICE)
        self.out = torch.empty(z.shape[0], H, device=DEVICE)

    def run(self, stacked):
        return moe.moe_mxfp4(self.z, self.ids, self.weights, *stacked, config=self.config, out=self.out,
                             workspace=self.ws)

    def check(self, ref: torch.Tensor) -> float:
        self.out.fill_(float("nan"))
        self.ws.hidden_act.fill_(float("nan"))
        self.run(self.sets[0])
        return relative_error(self.out, ref)

    def time(self, reps: int, stages: int | None = None) -> float:
        graphs = [capture(lambda s=s: self.run_stages(s, stages)) for s in self.sets]
        return time_graphs(graphs, reps)

    def stage_names(self) -> list[str]:
        """The launches in order; "align" holds the K order too where both run (moe_mxfp4._launch_prologue)."""
        first = ["align"] if self.config.align else ["order"] if self.ws.z_ordered is not None else []
        return first + ["gate_up", "down"]

    def run_stages(self, stacked, stages: int | None):
        """The first `stages` launches of the pipeline (all: None), through the launchers moe_mxfp4
        uses, for a time breakdown."""
        if stages is None:
            return self.run(stacked)
        cfg, ws, ids = self.config, self.ws, self.ids
        launches = []
        if cfg.align or ws.z_ordered is not None:
            launches.append(lambda: moe._launch_prologue(self.z, ids, E, self.out, cfg, ws))
        launches.append(lambda: moe._launch_gate_up(self.z, ids, stacked.w13_packed, stacked.w13_scale, self.out,
                                                    cfg, ws, moe.SITU_BETA, moe.SITU_LINEAR_BETA))
        for launch in launches[:stages]:
            launch()

    def breakdown(self, reps: int, total_us: float) -> dict[str, float]:
        """µs per stage: graphs of the first 1, 2, ... launches, differenced (the last is total - rest)."""
        names = self.stage_names()
        prefix = [self.time(reps, n) for n in range(1, len(names))] + [total_us]
        return {name: t - (prefix[i - 1] if i else 0.0) for i, (name, t) in enumerate(zip(names, prefix, strict=True))}


# ----------------------------------------------------------------------------------------------
# torch baseline: bf16 grouped GEMM on pre-dequantized weights
# ----------------------------------------------------------------------------------------------


def torch_grouped_step(z, ids, weights, w13, w2):
    """Sort pairs by expert, torch._grouped_mm for w13 and w2, SiTU and the weighted sum, all on device."""
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(E, dtype=torch.int32, device=z.device).scatter_add_(
        0, flat, torch.ones_like(flat, dtype=torch.int32))
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    token = order // K
    gate_up = torch._grouped_mm(z[token], w13.transpose(1, 2), offs=offs)
    h = moe.situ_reference(gate_up[:, :I], gate_up[:, I:], moe.SITU_BETA, moe.SITU_LINEAR_BETA)
    y = torch._grouped_mm(h, w2.transpose(1, 2), offs=offs)
    out = torch.zeros(z.shape[0], H, dtype=torch.float32, device=z.device)
    return out.index_add_(0, token, y.float() * weights.reshape(-1)[order, None])


def time_torch(bf16_sets, z, ids, weights, ref, reps) -> tuple[float | None, float | None]:
    try:
        err = relative_error(torch_grouped_step(z, ids, weights, *bf16_sets[0]), ref)
        graphs = [capture(lambda s=s: torch_grouped_step(z, ids, weights, *s)) for s in bf16_sets]
        return time_graphs(graphs, reps), err
    except Exception as exc:  # noqa: BLE001 - the baseline is optional; report why it is missing
        print(f"  torch baseline unavailable: {type(exc).__name__}: {exc}", file=sys.stderr)
        return None, None


# ----------------------------------------------------------------------------------------------
# The peer: vLLM's MoE GEMMs (humming-kernels), on the same weights, inputs and routing
# ----------------------------------------------------------------------------------------------


def humming_available() -> bool:
    return importlib.util.find_spec("humming") is not None


def humming_layers(stacked: moe.StackedExperts):
    """(gate/up, down) humming layers holding one weight copy, converted to humming's layout once (from the
    checkpoint's packing, which humming reads)."""
    from humming.layer import HummingLayer

    layers = []
    for (packed, scale), (n, k) in (((stacked.w13_packed, stacked.w13_scale), (2 * I, H)),
                                    ((stacked.w2_packed, stacked.w2_scale), (H, I))):
        layer = HummingLayer(shape_n=n, shape_k=k, weight_config={"quant_method": "mxfp4"}, num_experts=E,
                             torch_dtype=torch.bfloat16).to(DEVICE)
        layer.load_from_tensors({"weight": from_word_layout(packed), "weight_scale": scale})
        layer.transform()
        layers.append(layer)
    return layers


class HummingStep:
    """The MoE as vLLM runs it on humming: alignment per GEMM (its tuned block_m; mstar's alignment kernel,
    padding rows set to the sentinel T*k), gate/up GEMM (indexed, top-k), SiTU by humming's process_input,
    down GEMM (indexed), then the weighted sum of the k rows (mstar's combine kernel)."""

    def __init__(self, layer_sets, z, ids, weights):
        from humming.tune import get_heuristics_config

        self.layer_sets, self.z, self.ids, self.weights = layer_sets, z, ids, weights
        self.pairs = ids.numel()
        self.tuning = [get_heuristics_config(layer.humming_config, shape_m=self.pairs, gemm_type="indexed",
                                             device=torch.cuda.current_device()) for layer in layer_sets[0]]
        self.block_m = [t["block_shape"][0] for t in self.tuning]
        self.align = {}
        for bm in set(self.block_m):
            blocks = moe.max_row_blocks(self.pairs, E, bm)
            i32 = {"dtype": torch.int32, "device": DEVICE}
            self.align[bm] = (torch.empty(blocks * bm, **i32), torch.empty(blocks, **i32),
                              torch.empty(blocks, **i32), torch.empty((), **i32))
        self.out = torch.empty(z.shape[0], H, device=DEVICE)

    def _aligned(self, bm):
        sorted_ids, block_expert, block_rows, padded = self.align[bm]
        sorted_ids.fill_(self.pairs)  # humming skips rows holding T*k
        moe._align(self.ids, E, sorted_ids, bm, blocks=(block_expert, block_rows))
        torch.mul((block_rows > 0).sum(dtype=torch.int32), bm, out=padded)
        return {"sorted_ids": sorted_ids, "expert_ids": block_expert, "num_tokens_padded": padded}

    def run(self, layers):
        from humming.forward import may_process_input

        gate_up_layer, down_layer = layers
        routes = {bm: self._aligned(bm) for bm in self.align}
        gate_up = gate_up_layer(self.z, **routes[self.block_m[0]], top_k=K, compute_config={"gemm_type": "indexed"},
                                tuning_config=self.tuning[0])
        h, _, _ = may_process_input(down_layer.humming_config, gate_up, activation_type="binary_split",
                                    activation_impl=HUMMING_SITU)
        y = down_layer(h, **routes[self.block_m[1]], top_k=1, compute_config={"gemm_type": "indexed"},
                       tuning_config=self.tuning[1])
        moe.combine_expert_rows(y, self.ids, self.weights, self.out)
        return self.out

    def check(self, ref: torch.Tensor) -> float:
        self.out.fill_(float("nan"))
        self.run(self.layer_sets[0])
        return relative_error(self.out, ref)

    def time(self, reps: int) -> float:
        graphs = [capture(lambda s=s: self.run(s)) for s in self.layer_sets]
        return time_graphs(graphs, reps)


def time_humming(layer_sets, z, ids, weights, ref, reps) -> dict:
    """{'humming_us', 'humming_err', 'humming_block_m'}, or {'humming_error': why} if it failed."""
    try:
        step = HummingStep(layer_sets, z, ids, weights)
        err = step.check(ref)
        return {"humming_us": step.time(reps), "humming_err": err, "humming_block_m": step.block_m}
    except Exception as exc:  # noqa: BLE001 - the peer is optional; report why it is missing
        traceback.print_exc()
        return {"humming_error": f"{type(exc).__name__}: {str(exc)[:300]}"}


# ----------------------------------------------------------------------------------------------
# Tuning
# ----------------------------------------------------------------------------------------------

BLOCK_MS = (16, 32, 64, 128)
GATE_UP_TILES = (moe.GemmTile(32, 256), moe.GemmTile(32, 128), moe.GemmTile(64, 128), moe.GemmTile(64, 256),
                 moe.GemmTile(32, 512), moe.GemmTile(16, 256), moe.GemmTile(64, 128, num_warps=8),
                 moe.GemmTile(64, 256, num_warps=8, num_stages=2), moe.GemmTile(32, 256, split_k=2),
                 moe.GemmTile(64, 128, split_k=2), moe.GemmTile(32, 128, split_k=4), moe.GemmTile(32, 256, split_k=7))
GATE_UP_TILES += (moe.GemmTile(64, 128, num_stages=4), moe.GemmTile(64, 128, split_k=2, num_stages=4),
                  moe.GemmTile(64, 128, split_k=4, num_stages=4), moe.GemmTile(64, 128, split_k=7))
# Deeper pipelines, since the gate/up wgmma stays in flight (0937c2d):
GATE_UP_TILES += (moe.GemmTile(64, 128, split_k=2, num_stages=6), moe.GemmTile(64, 128, num_stages=6),
                  moe.GemmTile(64, 256, num_stages=4), moe.GemmTile(64, 128, split_k=4, num_stages=6))
# Large-T tiles with the activations as the A operand (swap_ab=False): dots 128 and 256 wide over 8 warps
GATE_UP_TILES += (moe.GemmTile(64, 128, num_warps=8, num_stages=4), moe.GemmTile(128, 128, num_warps=8, num_stages=2))
DOWN_TILES = (moe.GemmTile(128, 128), moe.GemmTile(64, 128), moe.GemmTile(256, 128, num_warps=8),
              moe.GemmTile(128, 128, num_warps=8), moe.GemmTile(128, 128, num_stages=2), moe.GemmTile(32, 128),
              moe.GemmTile(64, 128, split_k=3), moe.GemmTile(128, 128, split_k=3),
              *(moe.GemmTile(128, 128, tiles=t) for t in (2, 4, 7, 14)),
              moe.GemmTile(128, 128, tiles=4, num_stages=4), moe.GemmTile(64, 128, tiles=4),
              moe.GemmTile(64, 128, tiles=7), moe.GemmTile(128, 128, split_k=3, tiles=7),
              moe.GemmTile(128, 128, num_stages=4), moe.GemmTile(64, 128, num_stages=4),
              moe.GemmTile(256, 128, num_warps=8, tiles=2), moe.GemmTile(128, 128, num_warps=8, tiles=4))
TUNE_AXES = ("align", "block_m", "gate_up", "down", "swap_ab", "combine", "decode")


def tune(sets, z, ids, weights, ref, reps, seconds: float, fields=TUNE_AXES) -> tuple[moe.MoEConfig, float, list]:
    """Coordinate search from the default config over `fields` (of TUNE_AXES, in the order given); it stops after
    `seconds` (what it has tried by then decides). Returns the best config, its time and every (config, us) tried."""
    deadline = time.time() + seconds
    rows = z.shape[0] * K / E
    best = moe.fit_config(moe.default_config(z.shape[0], K, E), H, I)
    best_us = MstarStep(sets, z, ids, weights, best).time(reps)
    timed = [(asdict(best), best_us)]
    axes = [
        ("align", (True, False)),
        ("block_m", [bm for bm in BLOCK_MS if bm <= max(16, 4 * rows)]),
        ("gate_up", GATE_UP_TILES),
        ("down", DOWN_TILES),
        ("swap_ab", (True, False)),
        ("combine", ("atomic", "reduce")),
        ("decode", ("subnormal", "select")),
    ]
    axes = [(field, dict(axes)[field]) for field in fields]
    tried = {best}
    for field, values in axes:
        for value in values:
            try:
                candidate = moe.fit_config(moe.MoEConfig(**{**best.__dict__, field: value}), H, I)
            except ValueError:  # e.g. align=False with combine="reduce"
                continue
            if candidate in tried or time.time() > deadline:
                continue
            tried.add(candidate)
            try:
                step = MstarStep(sets, z, ids, weights, candidate)
                err = step.check(ref)
                us = step.time(reps) if err < 1e-2 else float("inf")
            except Exception as exc:  # noqa: BLE001 - a candidate that does not compile is skipped
                print(f"    {candidate}: {type(exc).__name__}: {str(exc)[:120]}", file=sys.stderr)
                continue
            print(f"    {us:8.1f} us  err {err:.1e}  {candidate}", file=sys.stderr)
            timed.append((asdict(candidate), us))
            if us < best_us:
                best, best_us = candidate, us
    return best, best_us, timed


# ----------------------------------------------------------------------------------------------
# Main
# ----------------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS))
    parser.add_argument("--reps", type=int, default=200)
    parser.add_argument("--tune", action="store_true", help="search tile configs per token count")
    parser.add_argument("--tune-seconds", type=float, default=600.0, help="time limit of each token count's search")
    parser.add_argument("--tune-axes", nargs="+", default=list(TUNE_AXES), choices=TUNE_AXES,
                        help="the config fields --tune searches, in this order")
    parser.add_argument("--no-torch", action="store_true", help="skip the torch grouped-GEMM baseline")
    parser.add_argument("--no-humming", action="store_true", help="skip the peer even if humming is importable")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_moe_mxfp4: needs a CUDA GPU")
    if not moe.supported("cuda"):
        sys.exit(f"bench_moe_mxfp4: compute capability {torch.cuda.get_device_capability()} < 8.0")

    t0 = time.time()
    props = torch.cuda.get_device_properties(0)
    print(f"{props.name}, {props.multi_processor_count} SMs; torch {torch.__version__}")
    gen = torch.Generator(device=DEVICE)
    print(f"seed = {gen.seed()}")
    sets = [make_weights(gen)]
    sets += [permuted(sets[0], gen) for _ in range(SETS - 1)]
    bf16_sets = [] if args.no_torch else [dequantized(s) for s in sets]
    humming_sets = []
    if humming_available() and not args.no_humming:
        try:
            humming_sets = [humming_layers(s) for s in sets]
        except Exception:  # noqa: BLE001 - the peer is optional; report why it is missing
            traceback.print_exc()
    print(f"humming: {'on' if humming_sets else 'not importable or failed to load'}")
    print(f"weights ready ({time.time() - t0:.0f} s)")

    results = []
    for num_tokens in args.tokens:
        z, ids, weights = make_inputs(num_tokens, gen)
        distinct = int(ids.unique().numel())
        floor_bytes = moe.bytes_floor(num_tokens, K, distinct, H, I)
        floor_us = floor_bytes / moe.HBM_BYTES_PER_S * 1e6
        flop_floor_us = num_tokens * K * 6 * H * I / FLOP_PER_S * 1e6  # 2 FLOPs x (H 2I + I H) per pair
        ref = moe.moe_mxfp4_reference(z, ids, weights, *sets[0])

        step = MstarStep(sets, z, ids, weights, moe.default_config(num_tokens, K, E))
        err = step.check(ref)
        us = step.time(args.reps)
        row = {"tokens": num_tokens, "experts": distinct, "floor_bytes": floor_bytes, "floor_us": floor_us,
               "us": us, "rel_err": err, "stages_us": step.breakdown(args.reps, us), "config": asdict(step.config),
               "flop_floor_us": flop_floor_us}
        if not step.config.align:
            aligned = MstarStep(sets, z, ids, weights, moe.default_config(num_tokens, K, E, align=True))
            row["aligned_err"] = aligned.check(ref)
            row["aligned_us"] = aligned.time(args.reps)
            row["aligned_stages_us"] = aligned.breakdown(args.reps, row["aligned_us"])
        if bf16_sets:
            row["torch_us"], row["torch_err"] = time_torch(bf16_sets, z, ids, weights, ref, args.reps)
        if humming_sets:
            row.update(time_humming(humming_sets, z, ids, weights, ref, args.reps))
        if args.tune:
            tuned, tuned_us, timed = tune(sets, z, ids, weights, ref, args.reps, args.tune_seconds, args.tune_axes)
            row["tuned_us"], row["tuned_config"], row["tune_timed"] = tuned_us, asdict(tuned), timed
        results.append(row)
        print(f"T={num_tokens}: {us:.1f} us (floor {floor_us:.1f}), humming {row.get('humming_us')}, err {err:.1e} "
              f"({time.time() - t0:.0f} s)")
        if os.environ.get("OUT"):  # after every token count, so that a run cut short keeps what it measured
            with open(os.path.join(os.environ["OUT"], "bench_moe_mxfp4.json"), "w") as f:
                json.dump({"device": props.name, "torch": torch.__version__, "results": results}, f, indent=1)
    print_table(results, args.tune)


def print_table(results: list[dict], tuned: bool) -> None:
    def cell(value, fmt="{:.1f}"):
        return "n/a" if value is None else fmt.format(value)

    def stages(times: dict[str, float]) -> str:
        return "/".join(f"{times[name]:.1f}" if name in times else "-"
                        for name in ("align", "order", "gate_up", "down"))

    print()
    print(f"MXFP4 routed experts, one TP8 rank of pruned75 (E={E}, top-{K}, H_lat={H}, I={I}); CUDA graph, median; "
          f"floors at {moe.HBM_BYTES_PER_S / 1e12:.2f} TB/s and {FLOP_PER_S / 1e12:.0f} TFLOP/s")
    head = ["T", "experts", "byte floor us", "FLOP floor us", "mstar us", "x floor", "humming us", "mstar/humming",
            "humming x floor", "align/order/gate-up/down us", "rel err", "humming err", "aligned us", "torch bf16 us"]
    if tuned:
        head += ["tuned us", "tuned/humming"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for r in results:
        floor = max(r["floor_us"], r["flop_floor_us"])
        hum = r.get("humming_us")
        cells = [str(r["tokens"]), str(r["experts"]), cell(r["floor_us"]), cell(r["flop_floor_us"]), cell(r["us"]),
                 cell(r["us"] / floor, "{:.2f}x"), cell(hum), cell(hum and r["us"] / hum, "{:.2f}"),
                 cell(hum and hum / floor, "{:.2f}x"), stages(r["stages_us"]), cell(r["rel_err"], "{:.1e}"),
                 cell(r.get("humming_err"), "{:.1e}"), cell(r.get("aligned_us", r["us"])), cell(r.get("torch_us"))]
        if tuned:
            cells += [cell(r["tuned_us"]), cell(hum and r["tuned_us"] / hum, "{:.2f}")]
        print("| " + " | ".join(cells) + " |")
    for r in results:
        if "humming_error" in r:
            print(f"humming failed at T={r['tokens']}: {r['humming_error']}")
    if tuned:
        print("\ntuned configs:")
        for r in results:
            print(f"  T={r['tokens']}: {r['tuned_config']}")


if __name__ == "__main__":
    main()
