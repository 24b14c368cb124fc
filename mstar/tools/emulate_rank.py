"""`mstar-emulate-rank`: one tensor-parallel rank of Kimi K3 on one GPU, timed against its roofline floor.

    python -m mstar.tools.emulate_rank --out benchmarks/emulate     (pruned75, rank 0 of TP8, 93 layers)

It builds rank 0's model at the rank's real shapes (`rank_module`: heads / tp, each routed expert's
intermediate width / tp held as MXFP4, the vocabulary-parallel embedding and lm_head) with random
weights made on the device, stands in for the other ranks with a communicator that moves no data (so
no other rank is needed and the numbers are not the model's) but charges every collective its modeled
cost as a GPU-side wait inside the step (`distributed/modeled_comm.py`: by default 6 us per message up
to 64 KiB per rank, plus bytes / 150 GB/s beyond; `--comm-latency-us 0`: free collectives), fills the paged
latent KV cache and the KDA state pool with random context, and times the serving forward that
`EngineCore` runs (`ServingModel.forward` with the GPU mixers and MXFP4 expert kernels):

- decode: B sequences of one new row each after `--context` cached tokens, replayed through the
  decode CUDA graphs (`mstar.runner.cuda_graphs`, captured for `--max-seq-len` tokens as the served
  config's are) unless `--eager` or off CUDA; the time includes `run`'s copies into the graphs' buffers;
- verify: B sequences of k+1 rows (anchor and k drafts) after `--context`, every row sampled, replayed as
  CUDA graphs like decode;
- prefill: B fresh sequences of T tokens each (`--prefill-batch`, default 1), each one's last row sampled,
  replayed through the prefill graph of the smallest token bucket >= B T (`mstar.runner.prefill_graphs`; a
  step past the largest bucket, 8,192 tokens, runs eagerly);
- mixed (opt-in: `--steps ...,mixed`): a step of T tokens (`--mixed-tokens`, the scheduler's budget) holding B
  sequences decoding one row each after `--context` (`--mixed-batch`) and a fresh prompt chunk of the other T - B,
  replayed through the prefill graphs as the engine runs such steps (`mixed_prefill_decode`); the report sets each
  beside a prefill of T tokens and the B decode rows alone where those were measured: the numbers a token budget
  (`max_num_batched_tokens`) is chosen from.
`--eager` runs every step eagerly, for comparison.
Each step prints beside its floor from `mstar-roofline` (the same rank, the same truncated config) and
the ratio measured / floor, with the collectives its run held (count, bytes, modeled time, tallied on
the device by the replayed graph itself) and the kernels it launched (on CUDA, from the profiler). The
header says whether the shipped pruned75 config's pools fit an 80 GB H100 beside this rank's weights.
Timings are medians over `--reps` steps (CUDA events on the GPU) after `--warmup` untimed ones;
repeating a step rewrites the same cache rows and slots, so the context is the same every time. A
verify step never commits, so no slot carries a pending prefix.

Weights are never made on the host (one pruned75 rank holds ~64 GiB): the model is built on the meta
device, moved with `to_empty` and filled in place, every tensor by a rule for the module that owns it
(an unknown module is an error, so nothing stays uninitialised). The values are scaled like
make_tiny's (linear weights N(0, 1/fan_in), unit norms, MXFP4 experts from `random_mxfp4`) so that the
activations stay in range through every layer (one eager decode step must give finite logits) and the
router spreads tokens over the experts about evenly, as the roofline's expert count assumes.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

from mstar.config import NO_ENV, Environment, SchedulerConfig
from mstar.distributed.loader import rank_module
from mstar.distributed.modeled_comm import CollectiveCost, CommTally, ModeledCommunicator
from mstar.distributed.sharding import ShardingPlan
from mstar.distributed.vocab_parallel import VocabParallelEmbedding, VocabParallelLMHead
from mstar.kernels.gpu_delay import delay
from mstar.models.dspark.config import DSparkConfig, load_dspark_config
from mstar.models.dspark.model import K3DSparkModel
from mstar.models.kimi_k3.backend import select_backend
from mstar.models.kimi_k3.config import KimiK3Config
from mstar.models.kimi_k3.kda import GatedHeadNorm, KimiDeltaAttention, ShortConv
from mstar.models.kimi_k3.model import KimiK3ForCausalLM
from mstar.models.kimi_k3.moe import Router
from mstar.models.kimi_k3.norm import RMSNorm
from mstar.models.kimi_k3.serving import BatchPlan, ServingModel, StepKind
from mstar.models.kimi_k3.weights import is_expert_weight
from mstar.quant.mxfp4 import random_mxfp4
from mstar.quant.mxfp4_linear import MXFP4Linear, use_mxfp4_linears
from mstar.resources.latent_kv import LatentKVPlan, PagedLatentKV
from mstar.resources.recurrent_pool import RecurrentStatePool
from mstar.runner.cuda_graphs import DecodeGraphs, StepGraphs, capture_all, decode_buckets
from mstar.runner.model_runner import prefill_graph_seqs
from mstar.runner.prefill_graphs import MAX_PREFILL_TOKENS, PrefillGraphs, prefill_buckets
from mstar.tools.bench_serve import git_commit
from mstar.tools.emulate_draft import (
    DEFAULT_ACCEPTANCE,
    DraftStep,
    build_draft,
    draft_config,
    draft_floor,
    draft_kv,
    implied_speedup,
    tokens_per_step,
)
from mstar.tools.roofline import (
    BF16_FLOPS_PER_S,
    HBM_BYTES_PER_S,
    Floor,
    RankModel,
    _ints,
    decode_floor,
    latent_sharded,
    mixed_floor,
    prefill_floor,
    rank_model,
    resolve_config,
    verify_floor,
)

GIB, GB, MS = 2**30, 1e9, 1e-3
MAX_LEAD_S = 0.25  # the longest wait median_seconds queues ahead of the timed calls
H100_BYTES = 80 * GB  # an H100 SXM's HBM
# CUDA context, NCCL buffers, the allocator's slack: what a served rank holds beyond weights, pools and
# the step's working memory (an estimate, not measured here: one process on one GPU has no NCCL)
RUNTIME_RESERVE_BYTES = 3 * GIB
SHIPPED_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "kimi_k3_pruned75_tp8.yaml"
STEP_KINDS = ("decode", "verify", "prefill", "mixed", "draft")
# the target's steps; "draft" is the DSpark draft's work on rank 0
TARGET_KINDS = ("decode", "verify", "prefill", "mixed")
_T0 = time.perf_counter()


def progress(message: str) -> None:
    print(f"[{time.perf_counter() - _T0:7.1f} s] {message}", file=sys.stderr, flush=True)


# --- the config and the steps -------------------------------------------------------------------


def first_layers(config: KimiK3Config, num_layers: int | None) -> KimiK3Config:
    """`config` cut to its first `num_layers` layers, each keeping its kind (KDA or MLA)."""
    if num_layers is None:
        return config
    if not 1 <= num_layers <= config.num_hidden_layers:
        raise ValueError(f"--layers {num_layers}: the config has 1..{config.num_hidden_layers} layers")
    la = config.linear_attn
    return config.with_overrides(num_hidden_layers=num_layers, linear_attn=replace(
        la, kda_layers=tuple(i for i in la.kda_layers if i < num_layers),
        full_attn_layers=tuple(i for i in la.full_attn_layers if i < num_layers)))


@dataclass(frozen=True)
class Step:
    """One timed step: `batch` sequences of `rows` new rows each after `context` cached tokens; a "mixed" step is
    one fresh prompt chunk of `rows` tokens and `batch` sequences decoding one row each after `context`."""

    kind: str  # "decode", "verify", "prefill", "mixed" or "draft" (rows = the drafts k of each block)
    batch: int
    rows: int
    context: int

    @property
    def name(self) -> str:
        if self.kind == "draft":
            return f"draft k={self.rows}"
        if self.kind == "mixed":
            return f"mixed {self.rows}+{self.batch}"
        return f"verify k={self.rows - 1}" if self.kind == "verify" else self.kind

    @property
    def graphs(self) -> str:
        """The CUDA graphs that replay it: a mixed step's are the prefill graphs, as served."""
        return "prefill" if self.kind == "mixed" else self.name

    @property
    def sequences(self) -> int:
        return self.batch + 1 if self.kind == "mixed" else self.batch

    @property
    def tokens(self) -> int:
        return self.rows + self.batch if self.kind == "mixed" else self.batch * self.rows

    def floor(self, rank: RankModel) -> Floor:
        if self.kind == "decode":
            return decode_floor(rank, self.batch, self.context)
        if self.kind == "verify":
            return verify_floor(rank, self.batch, self.rows - 1, self.context)
        if self.kind == "mixed":
            return mixed_floor(rank, self.rows, self.batch, self.context)
        if self.kind == "draft":
            raise ValueError("a draft step's floor is the draft's (emulate_draft.draft_floor), not the target's")
        return prefill_floor(rank, self.rows, self.batch)


def steps_to_run(args: argparse.Namespace) -> list[Step]:
    steps: list[Step] = []
    if "decode" in args.steps:
        steps += [Step("decode", b, 1, args.context) for b in args.batch]
    if "verify" in args.steps:
        steps += [Step("verify", b, k + 1, args.context) for k in args.drafts for b in args.verify_batch]
    if "prefill" in args.steps:
        steps += [Step("prefill", b, t, 0) for t in args.prefill for b in args.prefill_batch]
    if "mixed" in args.steps:
        steps += [Step("mixed", b, t - b, args.context) for t in args.mixed_tokens for b in args.mixed_batch]
    if "draft" in args.steps:
        steps += [Step("draft", b, k, args.context) for k in args.drafts for b in args.verify_batch]
    if not steps:
        raise ValueError("no steps to run: --steps and the batch/draft/prefill lists leave nothing")
    if min(min(s.batch, s.rows) for s in steps) < 1:
        raise ValueError("batch sizes, draft counts + 1 and prefill lengths must be >= 1, and each --mixed-tokens "
                         "more than the --mixed-batch decode rows")
    sched = SchedulerConfig()
    most = sched.max_prefill_seqs
    if any(s.kind == "prefill" and s.batch > most for s in steps):
        raise ValueError(f"--prefill-batch: a prefill step holds at most {most} prompts (the scheduler's "
                         "max_prefill_seqs, which the prefill graphs are captured for)")
    riders = prefill_graph_seqs(sched.max_num_seqs, sched.max_prefill_seqs) - 1
    if any(s.kind == "mixed" and s.batch > riders for s in steps):
        raise ValueError(f"--mixed-batch: a mixed step holds at most {riders} decode rows beside its chunk (the "
                         "sequences the prefill graphs are captured for, less the chunk's)")
    return steps


# --- the model ----------------------------------------------------------------------------------


def build_model(config: KimiK3Config, plan: ShardingPlan, dtype: torch.dtype, device: torch.device,
                generator: torch.Generator, comm: ModeledCommunicator | None = None) -> KimiK3ForCausalLM:
    """Rank `plan.rank`'s model with random weights made on `device`, routed experts held as MXFP4
    (as `load_rank_model` holds them from the real checkpoint); collectives through `comm` (None: the
    null communicator, every collective free)."""
    model = rank_module(config, plan, comm)  # meta device
    use_mxfp4_linears(model, {name for name in model.state_dict() if is_expert_weight(name)})
    model.to(dtype)  # still on meta: float tensors only, the MXFP4 bytes stay uint8
    model.to_empty(device=device)
    model.requires_grad_(False)
    fill_random_(model, generator)
    return model.eval()


@torch.no_grad()
def fill_random_(model: nn.Module, generator: torch.Generator) -> None:
    """Overwrite every parameter and buffer of `model` in place, by the type of the module that owns it."""
    for name, module in model.named_modules():
        own = {n for n, _ in (*module.named_parameters(recurse=False), *module.named_buffers(recurse=False))}
        if not own:
            continue
        filled = _fill_module(module, generator)
        if filled != own:
            raise TypeError(f"emulate_rank: no random init for {name or 'the model'} ({type(module).__name__}) "
                            f"tensors {sorted(own - filled)}: add a rule to _fill_module")


def _fill_module(module: nn.Module, gen: torch.Generator) -> set[str]:
    """Fill the tensors `module` owns itself (not its children's); the names filled."""
    if isinstance(module, MXFP4Linear):
        # random_mxfp4 scales each weight to rms ~ 1/sqrt(in_features): scale bytes ~120, below the
        # kernel's limit of 128 (moe_mxfp4.stack_experts checks it)
        packed, scale = random_mxfp4(module.out_features, module.in_features, gen)
        module.weight_packed.copy_(packed)
        module.weight_scale.copy_(scale)
        return {"weight_packed", "weight_scale"}
    if isinstance(module, (RMSNorm, GatedHeadNorm)):
        module.weight.fill_(1.0)
        return {"weight"}
    if isinstance(module, (nn.Linear, VocabParallelLMHead, Router)):  # weights [out, in]; the AttnRes queries too
        module.weight.normal_(0.0, module.weight.shape[1] ** -0.5, generator=gen)
        if isinstance(module, Router):
            module.e_score_correction_bias.zero_()  # random router weights already spread tokens evenly
            return {"weight", "e_score_correction_bias"}
        return {"weight"}
    if isinstance(module, (nn.Embedding, VocabParallelEmbedding)):
        module.weight.normal_(0.0, 1.0, generator=gen)
        return {"weight"}
    if isinstance(module, ShortConv):  # nn.Conv1d's default for a depthwise kernel
        bound = module.weight.shape[-1] ** -0.5
        module.weight.uniform_(-bound, bound, generator=gen)
        return {"weight"}
    if isinstance(module, KimiDeltaAttention):
        # fla's init: exp(A_log) ~ U(1, 16); dt log-uniform in [1e-3, 1e-1], stored as softplus^-1(dt)
        module.A_log.uniform_(1.0, 16.0, generator=gen).log_()
        dt = torch.empty_like(module.dt_bias, dtype=torch.float32)
        dt.uniform_(math.log(1e-3), math.log(1e-1), generator=gen).exp_()
        module.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))
        return {"A_log", "dt_bias"}
    return set()


def tensor_bytes(tensors: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


# --- the pools and the plans --------------------------------------------------------------------


def pages_per_sequence(step: Step, page_size: int) -> int:
    """Pages of the step's longest sequence (a mixed step: its chunk or a decode row's context)."""
    if step.kind == "mixed":
        return max(-(-step.rows // page_size), -(-(step.context + 1) // page_size))
    return -(-(step.context + step.rows) // page_size)


def build_pools(config: KimiK3Config, steps: list[Step], page_size: int, dtype: torch.dtype, device: torch.device,
                generator: torch.Generator) -> tuple[PagedLatentKV, RecurrentStatePool]:
    """Pools as EngineCore makes them for a rank of `config`, large enough for the largest step, filled
    with random context: no step reads zeros (a cached latent row is unit-scale after its norm; the KDA
    state is small)."""
    kinds, la = config.layer_kinds, config.linear_attn
    num_pages = 1 + max(s.sequences * pages_per_sequence(s, page_size) for s in steps)  # page 0: the sink
    kv = PagedLatentKV(kinds.count("mla"), num_pages, page_size, config.kv_cache_width, dtype, device)
    pool = RecurrentStatePool(kinds.count("kda"), 1 + max(s.sequences for s in steps), la.num_heads, la.head_dim,
                              la.short_conv_kernel_size, torch.promote_types(dtype, torch.float32), dtype, device,
                              hidden_size=config.hidden_size,
                              max_block=max((s.rows for s in steps if s.kind == "verify"), default=0))
    kv.cache.normal_(0.0, 1.0, generator=generator)
    pool.state.normal_(0.0, 0.01, generator=generator)
    pool.conv.normal_(0.0, 1.0, generator=generator)
    pool.prefix_x.normal_(0.0, 1.0, generator=generator)
    return kv, pool


def batch_plan(step: Step, page_size: int, vocab_slice: int, device: torch.device,
               generator: torch.Generator) -> BatchPlan:
    """The plan the engine would make for `step`, without a scheduler: sequence b holds its own run of
    pages from page 1 on and KDA slot b + 1 (page 0 and slot 0 are the padding sinks). Token ids are
    drawn from `vocab_slice` (rank 0's embedding rows), so each token reads a real row. A mixed step's sequence 0
    is its prompt chunk (nothing cached), the others its decode rows."""
    seqs, pages = step.sequences, pages_per_sequence(step, page_size)
    table = 1 + torch.arange(seqs * pages).view(seqs, pages)
    if step.kind == "mixed":
        cached, rows = [0] + [step.context] * step.batch, [step.rows] + [1] * step.batch
    else:
        cached, rows = [step.context] * seqs, [step.rows] * seqs
    slots = [int(table[b, p // page_size]) * page_size + p % page_size
             for b in range(seqs) for p in range(cached[b], cached[b] + rows[b])]
    starts = tuple(sum(rows[:b]) for b in range(seqs + 1))
    verify = step.kind == "verify"
    sample = range(step.tokens) if verify or step.kind == "decode" else [s - 1 for s in starts[1:]]
    return BatchPlan(
        input_ids=torch.randint(0, vocab_slice, (step.tokens,), generator=generator, device=device),
        seq_starts=starts,
        num_computed=tuple(cached),
        kv=LatentKVPlan(table.to(device), torch.tensor(slots, device=device),
                        torch.tensor([c + r for c, r in zip(cached, rows, strict=True)], device=device)),
        kda_slots=torch.arange(1, seqs + 1, device=device),
        slot_ids=tuple(range(1, seqs + 1)),
        sample_rows=torch.tensor(list(sample), dtype=torch.long, device=device),
        verify=(verify,) * seqs,
        kind=StepKind.DECODE if step.kind == "decode" else StepKind.GENERAL,
    )


# --- timing -------------------------------------------------------------------------------------


def median_seconds(fn: Callable[[], object], reps: int, device: torch.device) -> float:
    """Median time of `fn` over `reps` calls: on the GPU, CUDA events around calls queued back to back behind a
    wait long enough for the host to queue them all, so the events time the GPU's work alone, as in the
    overlapped serving loop (whose host queues a step's launches while the GPU runs the step before; an eager
    step's launch overhead, which the draft's context write has, is hidden there too). perf_counter on the CPU."""
    if device.type != "cuda":
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)
    synchronize(device)
    t0 = time.perf_counter()
    fn()  # what the host spends queueing one call
    host = time.perf_counter() - t0
    synchronize(device)
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    lead = min(2 * host * reps + 1e-3, MAX_LEAD_S)  # eager prefill steps (--eager) stay partly host-bound
    delay(round(lead * 1e9), 0, torch.zeros(3, dtype=torch.int64, device=device))
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize(device)
    return statistics.median(start.elapsed_time(end) * MS for start, end in events)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass(frozen=True)
class Result:
    step: Step
    mode: str  # "graph" or "eager"
    floor: Floor
    seconds: float
    comm: CommTally | None = None  # the collectives of one run (None: free, the null communicator)
    kernels: int | None = None  # kernels one run launched (CUDA only)

    @property
    def ratio(self) -> float:
        return self.seconds / self.floor.floor_s

    @property
    def tokens_per_s(self) -> float | None:
        return self.step.batch / self.seconds if self.step.kind == "decode" else None

    def as_dict(self) -> dict[str, Any]:
        comm = None if self.comm is None else {"calls": self.comm.calls, "bytes": self.comm.bytes,
                                               "modeled_s": self.comm.seconds}
        return {"step": self.step.name, "batch": self.step.batch, "rows": self.step.tokens,
                "context": self.step.context, "mode": self.mode, "measured_s": self.seconds, "ratio": self.ratio,
                "tokens_per_s": self.tokens_per_s, "collectives": comm, "kernels": self.kernels,
                "floor": self.floor.as_dict()}


# --- one emulation ------------------------------------------------------------------------------


@dataclass
class Emulation:
    """One rank's model, pools and serving forward, ready to time."""

    config: KimiK3Config
    plan: ShardingPlan
    serving: ServingModel
    device: torch.device
    generator: torch.Generator
    page_size: int
    expert_kernel_layers: int
    pending_prefix: int = 0  # accepted rows of the previous verify block each verify sequence replays first
    comm: ModeledCommunicator | None = None  # None: collectives are free (the null communicator)
    # the DSpark draft and its heads, built at the first draft step (after every target step: target_peak)
    draft: tuple[K3DSparkModel, nn.Embedding, nn.Linear] | None = None
    target_peak: int | None = None  # peak device memory of the target's steps alone (CUDA)
    draft_config: DSparkConfig = field(default_factory=draft_config)  # the Inferact draft's unless told

    @property
    def vocab_slice(self) -> int:
        return self.config.vocab_size // self.plan.tp_size

    def plan_for(self, step: Step) -> BatchPlan:
        """The step's plan; a verify step's sequences get `pending_prefix` rows pending in their KDA slots
        (as served verify steps have), every other step none (a decode step may have none)."""
        pool = self.serving.pool
        pending = min(self.pending_prefix, step.rows) if step.kind == "verify" else 0
        pool.prefix_len = [0] + [pending] * step.sequences + [0] * (pool.max_slots - 1 - step.sequences)
        return batch_plan(step, self.page_size, self.vocab_slice, self.device, self.generator)

    def weight_bytes(self) -> int:
        model = self.serving.model
        return tensor_bytes([*model.parameters(), *model.buffers()])

    def pool_bytes(self) -> int:
        kv, pool = self.serving.kv, self.serving.pool
        return tensor_bytes([kv.cache, pool.state, pool.conv, pool.prefix_x])


def build(config: KimiK3Config, plan: ShardingPlan, steps: list[Step], *, dtype: torch.dtype,
          device: torch.device, page_size: int, seed: int, pending_prefix: int = 0,
          comm_cost: CollectiveCost | None = None, moe_bf16_tokens: int = NO_ENV.moe_bf16_tokens) -> Emulation:
    generator = torch.Generator(device=device).manual_seed(seed)
    progress(f"building rank {plan.rank} of tp={plan.tp_size} ep={plan.ep_size}: {config.num_hidden_layers} layers, "
             f"random {str(dtype).removeprefix('torch.')} weights on {device}")
    comm = ModeledCommunicator(plan.tp_size, plan.rank, comm_cost, device) if comm_cost is not None else None
    model = build_model(config, plan, dtype, device, generator, comm)
    prefill_tokens = [s.tokens for s in steps if s.graphs == "prefill"]
    # the engine's backend: the bf16 expert path for steps above MSTAR_MOE_BF16_TOKENS (its scratch warmed here)
    backend = select_backend(model, "auto", max(prefill_tokens, default=None), bf16_above_tokens=moe_bf16_tokens)
    if device.type == "cuda":  # stacking freed each expert's own buffers (~42 GiB for pruned75): return them
        torch.cuda.empty_cache()
    kernels = backend.expert_layers
    progress(f"weights built; MXFP4 expert kernels on {kernels} MoE layers; fused small kernels: {backend.fused}")
    target_steps = [s for s in steps if s.kind in TARGET_KINDS]
    kv, pool = build_pools(model.config, target_steps, page_size, dtype, device, generator)  # the rank's heads
    serving = ServingModel(model, kv, pool, backend.mixers, backend.layers)
    emulation = Emulation(config, plan, serving, device, generator, page_size, kernels, pending_prefix, comm)
    synchronize(device)
    progress(f"weights {emulation.weight_bytes() / GIB:.2f} GiB, pools {emulation.pool_bytes() / GIB:.2f} GiB "
             f"({kv.cache.shape[1]} pages of {page_size}, {pool.max_slots} KDA slots)")
    check_finite(emulation, target_steps[0].context if target_steps else 1)
    return emulation


def check_finite(emulation: Emulation, context: int) -> None:
    """One eager decode step of one sequence: random weights must still give finite logits."""
    logits, _ = emulation.serving.forward(emulation.plan_for(Step("decode", 1, 1, context)))
    if not bool(torch.isfinite(logits).all()):
        raise RuntimeError("emulate_rank: the random model gives non-finite logits on one decode step; "
                           "the random init (fill_random_) no longer keeps activations in range")


def capture_step_graphs(serving: ServingModel, steps: list[Step], graph_seq_len: int) -> dict[str, StepGraphs]:
    """CUDA graphs of the steps, as the engine captures them, by step name: decode and verify steps over
    the batch buckets their sizes run in, prefill steps over the token buckets theirs run in; all in one
    memory pool. Prefill steps past the largest bucket get none (they run eagerly)."""

    def used(all_buckets: tuple[int, ...], sizes: list[int]) -> tuple[int, ...]:
        return tuple(sorted({next(b for b in all_buckets if b >= n) for n in sizes}))

    by_name: dict[str, list[Step]] = {}
    for step in steps:
        if step.kind == "draft":
            continue  # the draft runs eagerly, as served
        if step.graphs != "prefill" or step.tokens <= MAX_PREFILL_TOKENS:
            by_name.setdefault(step.graphs, []).append(step)
    graphs: dict[str, StepGraphs] = {}
    for name, group in by_name.items():
        if name == "prefill":
            tokens = [s.tokens for s in group]
            # as many sequences as the engine's prefill graphs take (the scheduler's defaults)
            sched = SchedulerConfig()
            graphs[name] = PrefillGraphs(serving, max_tokens=max(tokens),
                                         max_seqs=prefill_graph_seqs(sched.max_num_seqs, sched.max_prefill_seqs),
                                         max_seq_len=graph_seq_len, buckets=used(prefill_buckets(max(tokens)), tokens))
        else:
            rows, batches = group[0].rows, [s.batch for s in group]
            buckets = used(decode_buckets(max(batches)), batches) if rows > 1 else None
            graphs[name] = DecodeGraphs(serving, max_batch=max(batches), max_seq_len=graph_seq_len, rows=rows,
                                        buckets=buckets)
        note = " (each bucket's warm-up autotunes fla's chunk_kda: minutes)" if name == "prefill" else ""
        progress(f"capturing {graphs[name].kind} CUDA graphs for {graphs[name].buckets} {graphs[name].unit}{note}")
    capture_all(list(graphs.values()))
    return graphs


def measure(emulation: Emulation, steps: list[Step], rank: RankModel, *, reps: int, warmup: int,
            graph_seq_len: int | None) -> tuple[list[Result], dict[str, Callable[[], object]]]:
    """Time every step, through CUDA graphs captured for `graph_seq_len` tokens where one takes it (None:
    all eager); also return, for the profile, the first and last step of each kind as run, by label."""
    serving, device = emulation.serving, emulation.device
    graphs = capture_step_graphs(serving, steps, graph_seq_len) if graph_seq_len is not None else {}
    results, fns = [], {}
    for step in steps:
        if step.kind == "draft":
            result, fn = measure_draft(emulation, step, reps=reps, warmup=warmup)
            results.append(result)
            fns[f"{step.name}, batch {step.batch}, {step.tokens} rows ({result.mode})"] = fn
            continue
        plan = emulation.plan_for(step)
        step_graphs = graphs.get(step.graphs)
        if step_graphs is not None and step_graphs.can_run(plan):
            mode, fn = "graph", (lambda plan=plan, g=step_graphs: g.run(plan))
        else:
            mode, fn = "eager", (lambda plan=plan: serving.forward(plan))
        slow = step.graphs == "prefill" and device.type == "cuda" and mode == "eager"
        note = " (the first call at a new length autotunes fla's chunk_kda: minutes)" if slow else ""
        progress(f"{step.name} batch {step.batch} ({step.tokens} rows, {mode}): warming up{note}")
        for _ in range(warmup):
            fn()
        comm = one_run_collectives(emulation, fn)
        kernels = count_kernels(fn) if device.type == "cuda" else None
        seconds = median_seconds(fn, reps, device)
        results.append(Result(step, mode, step.floor(rank), seconds, comm, kernels))
        held = f"; {comm.calls} collectives, {comm.seconds / MS:.3f} ms modeled" if comm is not None else ""
        progress(f"{step.name} batch {step.batch}: {seconds / MS:.3f} ms ({results[-1].ratio:.2f}x the floor{held})")
        same_kind = [other for other in steps if other.kind == step.kind]
        if step in (same_kind[0], same_kind[-1]):
            fns[f"{step.name}, batch {step.batch}, {step.tokens} rows ({mode})"] = fn
    return results, fns


def measure_draft(emulation: Emulation, step: Step, *, reps: int, warmup: int) -> tuple[Result, Callable[[], object]]:
    """The draft's work of one speculative step (emulate_draft.py), as served: the context rows of the
    previous step's verify blocks (all k + 1 rows of each, written before its verification) and B blocks of k
    drafts. Also returns the step, for the profile (every draft step is profiled)."""
    if emulation.draft is None:
        if emulation.device.type == "cuda":
            emulation.target_peak = torch.cuda.max_memory_allocated(emulation.device)
        progress("building the DSpark draft (Inferact layout) and its whole-vocabulary heads, random weights")
        dtype = next(emulation.serving.model.parameters()).dtype
        emulation.draft = build_draft(emulation.draft_config, dtype, emulation.device, emulation.generator)
    draft, embed, lm_head = emulation.draft
    committed = step.rows + 1  # the engine writes a block's rows at launch, before it knows which it keeps
    kv = draft_kv(draft.config, step.batch, step.rows, step.context, emulation.page_size, draft.dtype,
                  emulation.device, emulation.generator)
    fn = DraftStep(draft, embed, lm_head, kv, step.batch, step.rows, step.context, committed, emulation.generator)
    progress(f"{step.name} batch {step.batch} ({fn.mode}): warming up")
    for _ in range(warmup):
        fn()
    kernels = count_kernels(fn) if emulation.device.type == "cuda" else None
    seconds = median_seconds(fn, reps, emulation.device)
    result = Result(step, fn.mode, draft_floor(fn, step.name), seconds, None, kernels)
    progress(f"{step.name} batch {step.batch}: {seconds / MS:.3f} ms ({result.ratio:.2f}x the draft's floor)")
    return result, fn


def one_run_collectives(emulation: Emulation, fn: Callable[[], object]) -> CommTally | None:
    """The collectives one run of `fn` holds, as the device tallied them (None: they are free)."""
    if emulation.comm is None:
        return None
    synchronize(emulation.device)
    emulation.comm.reset()
    fn()
    return emulation.comm.tally()


def count_kernels(fn: Callable[[], object]) -> int:
    """How many kernels one run of `fn` launches on the GPU (a graph replay's kernels each count)."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(e.count for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA)


def kernel_sequence(prof: profile) -> str:
    """One line per GPU kernel in launch order: start (µs from the first), duration (µs), name. What a
    layer launches, and between which kernels the GPU idles, reads off it."""
    kernels = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                     key=lambda e: e.time_range.start)
    if not kernels:
        return ""
    t0 = kernels[0].time_range.start
    return "".join(f"{e.time_range.start - t0:10.1f} {e.time_range.end - e.time_range.start:8.2f} {e.name}\n"
                   for e in kernels)


def profile_steps(fns: dict[str, Callable[[], object]], device: torch.device, top: int = 25,
                  sequence_dir: Path | None = None) -> str:
    """Markdown: the kernels of one run of each labelled step, by total time; with `sequence_dir`, each
    step's kernels in launch order too (`kernel_sequence`), one text file per step."""
    cuda = device.type == "cuda"
    sections = []
    for label, fn in fns.items():
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with profile(activities=activities) as prof:
            fn()
            synchronize(device)
        if sequence_dir is not None and cuda:
            sequence_dir.mkdir(parents=True, exist_ok=True)
            name = "".join(c if c.isalnum() else "_" for c in label).strip("_")
            (sequence_dir / f"{name}.kernels.txt").write_text(kernel_sequence(prof))
        # kernels on the GPU; torch operators (self time) on the CPU
        events = [e for e in prof.key_averages()
                  if not cuda or e.device_type == torch.autograd.DeviceType.CUDA]
        total = (lambda e: e.self_device_time_total) if cuda else (lambda e: e.self_cpu_time_total)
        events = [e for e in events if total(e) > 0]
        step_us = sum(total(e) for e in events)
        events.sort(key=total, reverse=True)
        what = "CUDA kernels" if cuda else "torch operators (CPU self time)"
        if not events:
            sections.append(f"### {label}: the profiler recorded no {what}")
            continue
        lines = [f"### {label}: {len(events)} distinct {what}, {step_us / 1e3:.3f} ms in all",
                 "", "| name | calls | total µs | mean µs | share |", "|---|--:|--:|--:|--:|"]
        for e in events[:top]:
            name = e.key if len(e.key) <= 100 else e.key[:97] + "..."
            lines.append(f"| `{name.replace('|', '/')}` | {e.count} | {total(e):,.1f} | {total(e) / e.count:,.2f} "
                         f"| {total(e) / step_us:.1%} |")
        sections.append("\n".join(lines))
    return "## Profile of one step of each kind\n\n" + "\n\n".join(sections)


# --- the report ---------------------------------------------------------------------------------


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else (platform.processor() or "cpu")


def markdown_table(results: list[Result], num_layers: int) -> str:
    lines = ["| step | batch | rows | mode | floor GB | floor GFLOP | floor ms | bound | measured ms | measured/floor "
             "| collectives | comm MB | comm ms (modeled) | kernels | kernels/layer | tok/s |",
             "|---|--:|--:|---|--:|--:|--:|---|--:|--:|--:|--:|--:|--:|--:|--:|"]
    for r in results:
        f = r.floor
        tok_s = f"{r.tokens_per_s:,.0f}" if r.tokens_per_s is not None else ""
        comm = (f"{r.comm.calls} | {r.comm.bytes / 1e6:.4g} | {r.comm.seconds / MS:.4g}" if r.comm is not None
                else "free | | ")
        kernels = f"{r.kernels:,} | {r.kernels / num_layers:.1f}" if r.kernels is not None else " | "
        lines.append(f"| {r.step.name} | {r.step.batch} | {r.step.tokens} | {r.mode} | {f.bytes / GB:.4g} "
                     f"| {f.flops / 1e9:.4g} | {f.floor_s / MS:.4g} | {f.bound} | {r.seconds / MS:.4g} "
                     f"| {r.ratio:,.2f} | {comm} | {kernels} | {tok_s} |")
    return "\n".join(lines)


def speculative_rows(results: list[Result], acceptance: tuple[float, ...]) -> list[dict[str, Any]]:
    """For every (k, batch) with a decode, a verify and a draft step measured: the expected tokens per verify
    step under `acceptance` and the implied speedup of speculation over plain decode (emulate_draft.py)."""
    by = {(r.step.kind, r.step.rows if r.step.kind != "verify" else r.step.rows - 1, r.step.batch): r.seconds
          for r in results}
    rows = []
    for (kind, k, batch), t_draft in sorted(by.items()):
        t_verify, t_decode = by.get(("verify", k, batch)), by.get(("decode", 1, batch))
        if kind != "draft" or t_verify is None or t_decode is None or k > len(acceptance):
            continue
        rows.append({"drafts": k, "batch": batch, "t_decode_s": t_decode, "t_draft_s": t_draft, "t_verify_s": t_verify,
                     "tokens_per_step": tokens_per_step(acceptance, k),
                     "speedup": implied_speedup(acceptance, k, t_decode, t_draft, t_verify)})
    return rows


def speculative_table(rows: list[dict[str, Any]], acceptance: tuple[float, ...]) -> str:
    if not rows:
        return ""
    lines = [f"## Speculation at these step times (acceptance profile {', '.join(f'{a:g}' for a in acceptance)})",
             "", "| k | batch | decode ms | draft ms | verify ms | tokens/step | implied speedup |",
             "|--:|--:|--:|--:|--:|--:|--:|"]
    for r in rows:
        lines.append(f"| {r['drafts']} | {r['batch']} | {r['t_decode_s'] / MS:.3f} | {r['t_draft_s'] / MS:.3f} "
                     f"| {r['t_verify_s'] / MS:.3f} | {r['tokens_per_step']:.2f} | {r['speedup']:.2f}x |")
    return "\n".join(lines)


def mixed_rows(results: list[Result]) -> list[dict[str, Any]]:
    """For every mixed step: its time beside a prefill of as many tokens (one prompt) and the same decode rows
    stepped alone, where those were measured (None where not). The decode rows' inter-token latency becomes the
    mixed step's time; riding in it spares them a step of their own."""
    alone = {(r.step.kind, r.step.tokens, r.step.batch): r.seconds for r in results}
    rows = []
    for r in results:
        if r.step.kind != "mixed":
            continue
        prefill, decode = alone.get(("prefill", r.step.tokens, 1)), alone.get(("decode", r.step.batch, r.step.batch))
        separate = prefill + decode if prefill is not None and decode is not None else None
        rows.append({"tokens": r.step.tokens, "chunk": r.step.rows, "decode_rows": r.step.batch,
                     "t_mixed_s": r.seconds, "t_prefill_s": prefill, "t_decode_s": decode, "t_separate_s": separate})
    return rows


def mixed_table(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return ""

    def ms(seconds: float | None) -> str:
        return "" if seconds is None else f"{seconds / MS:.3f}"

    lines = ["## Mixed steps: a prompt chunk with decode rows riding in it", "",
             "| step tokens | chunk | decode rows | mixed ms | prefill of the step's tokens ms | decode rows alone ms "
             "| both as two steps ms | mixed / two steps |",
             "|--:|--:|--:|--:|--:|--:|--:|--:|"]
    for r in rows:
        share = "" if r["t_separate_s"] is None else f"{r['t_mixed_s'] / r['t_separate_s']:.2f}"
        lines.append(f"| {r['tokens']} | {r['chunk']} | {r['decode_rows']} | {ms(r['t_mixed_s'])} "
                     f"| {ms(r['t_prefill_s'])} | {ms(r['t_decode_s'])} | {ms(r['t_separate_s'])} | {share} |")
    return "\n".join(lines)


def shipped_pool_bytes(config: KimiK3Config, shipped: Path = SHIPPED_CONFIG) -> int:
    """Bytes of the pools the shipped pruned75 TP8 config makes on one rank of `config` (the rank's heads)."""
    import yaml

    resources = yaml.safe_load(shipped.read_text())["resources"]
    kinds, la = config.layer_kinds, config.linear_attn
    mla, kda = resources["mla_kv"], resources["kda_state"]
    kv = PagedLatentKV(kinds.count("mla"), mla["max_num_pages"], mla["page_size"], config.kv_cache_width,
                       torch.bfloat16, "meta")
    pool = RecurrentStatePool(kinds.count("kda"), kda["max_slots"], la.num_heads, la.head_dim,
                              la.short_conv_kernel_size, torch.float32, torch.bfloat16, "meta",
                              hidden_size=config.hidden_size)
    return tensor_bytes([kv.cache, pool.state, pool.conv, pool.prefix_x])


def h100_fit(weight_bytes: int, pool_bytes: int, peak_bytes: int | None, shipped_pools: int) -> dict[str, Any]:
    """Whether a served rank (weights, the shipped config's pools, the step's working memory as measured
    here, a runtime reserve) fits an 80 GB H100."""
    working = max(0, peak_bytes - weight_bytes - pool_bytes) if peak_bytes is not None else 0
    need = weight_bytes + shipped_pools + working + RUNTIME_RESERVE_BYTES
    return {"weights": weight_bytes, "shipped_pools": shipped_pools, "working": working,
            "reserve": RUNTIME_RESERVE_BYTES, "total": need, "h100_bytes": H100_BYTES, "fits": need <= H100_BYTES}


def _floats(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(x) for x in text.split(",") if x)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated numbers, e.g. 0.8,0.6") from None


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="mstar-emulate-rank", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="kimi_k3_pruned75_config.json",
                   help="a config.json, a checkpoint directory or a bundled fixture name")
    p.add_argument("--tp", type=int, default=8, help="tensor-parallel ranks (rank 0 is emulated)")
    p.add_argument("--ep", type=int, default=1, help="expert-parallel groups")
    p.add_argument("--latent-layout", choices=("sharded", "replicated"), default="sharded",
                   help="the latent MoE's down/up projections split over the ranks (faster at every batch measured: "
                        "benchmarks/emulate_rank) or whole on each (sharding.py)")
    p.add_argument("--layers", type=int, default=None, help="only the first N layers (default: all)")
    p.add_argument("--steps", default="decode,verify,prefill,draft",
                   help="which of decode,verify,prefill,mixed,draft to time (draft: the DSpark draft's work per verify "
                        "step; mixed: a prompt chunk with decode rows riding in it)")
    p.add_argument("--draft-config", type=Path, default=None,
                   help="the draft's config.json (default: the Inferact Kimi-K3-DSpark layout, bundled)")
    p.add_argument("--context", type=int, default=1024, help="tokens cached per sequence (decode, verify)")
    p.add_argument("--batch", type=_ints, default=[1, 8, 16, 32, 64], help="decode batch sizes")
    p.add_argument("--drafts", type=_ints, default=[4, 7], help="drafts k of the verify steps (k+1 rows each)")
    p.add_argument("--verify-batch", type=_ints, default=[1, 16], help="batch sizes of the verify steps")
    p.add_argument("--prefill", type=_ints, default=[1024, 8192], help="prompt lengths of the prefill steps")
    p.add_argument("--prefill-batch", type=_ints, default=[1],
                   help="prompts of each length in one prefill step (the scheduler's max_prefill_seqs takes up to 8)")
    p.add_argument("--mixed-tokens", type=_ints, default=[1024, 2048, 4096, 8192],
                   help="tokens of the mixed steps: the scheduler's budget (max_num_batched_tokens), a prompt chunk of "
                        "that many less the decode rows, which ride in it")
    p.add_argument("--mixed-batch", type=_ints, default=[8, 32],
                   help="decode rows (after --context cached tokens each) riding in each mixed step")
    p.add_argument("--page-size", type=int, default=64, help="tokens per KV page (configs/*pruned75*: 64)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    p.add_argument("--reps", type=int, default=20, help="timed steps per row (the median is reported)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps before each row")
    p.add_argument("--eager", action="store_true", help="run every step eagerly (no CUDA graphs)")
    p.add_argument("--max-seq-len", type=int, default=32768,
                   help="the graphs' capacity, which fixes the decode MLA split count (the served config's)")
    p.add_argument("--comm-latency-us", type=float, default=6.0,
                   help="modeled cost of every collective up to --comm-small-kib per rank (0: collectives are free)")
    p.add_argument("--comm-small-kib", type=float, default=64.0, help="message size the latency term covers")
    p.add_argument("--comm-gb-per-s", type=float, default=150.0,
                   help="an all-reduce's rate for the message bytes beyond it (an all-gather's output bytes pass at "
                        "twice it: half the link traffic)")
    p.add_argument("--acceptance", type=_floats, default=DEFAULT_ACCEPTANCE,
                   help="P(draft i accepted) for i = 1.. (the speculation summary of draft steps)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--pending-prefix", type=int, default=2,
                   help="accepted rows each verify sequence replays from its checkpoint first (served DSpark "
                        "steps have ~1-3; the floor does not count them)")
    p.add_argument("--profile", action="store_true",
                   help="also profile one run of the first and last step of each kind: top kernels by time "
                        "(with --out, each step's kernels in launch order too, under OUT/kernels/)")
    p.add_argument("--out", type=Path, default=None, help="write emulate_rank.md and emulate_rank.json here")
    args = p.parse_args(argv)
    args.steps = [s for s in args.steps.split(",") if s]
    unknown = sorted(set(args.steps) - set(STEP_KINDS))
    if unknown:
        p.error(f"--steps: unknown {unknown}; choose from {','.join(STEP_KINDS)}")
    if args.reps < 1 or args.warmup < 0:
        p.error("--reps must be >= 1 and --warmup >= 0")
    return args


def run(args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    """Build, time and report: (the JSON report, the markdown)."""
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    graph_seq_len = args.max_seq_len if device.type == "cuda" and not args.eager else None
    try:
        if graph_seq_len is not None and graph_seq_len <= args.context:
            raise ValueError(f"--max-seq-len {graph_seq_len} leaves the decode graphs no room for a row after "
                             f"--context {args.context}")
        config = first_layers(resolve_config(args.config), args.layers)
        plan = ShardingPlan(args.tp, 0, args.ep, latent_sharded(args.latent_layout, config))
        steps = steps_to_run(args)
        rank = rank_model(config, plan, dtype)
        comm_cost = None if args.comm_latency_us == 0 else CollectiveCost(
            args.comm_latency_us * 1e-6, round(args.comm_small_kib * 1024), args.comm_gb_per_s * 1e9)
    except ValueError as e:
        raise SystemExit(f"mstar-emulate-rank: {e}") from None
    emulation = build(config, plan, steps, dtype=dtype, device=device, page_size=args.page_size, seed=args.seed,
                      pending_prefix=args.pending_prefix, comm_cost=comm_cost,
                      moe_bf16_tokens=Environment.read().moe_bf16_tokens)
    if args.draft_config is not None:
        emulation.draft_config = load_dspark_config(args.draft_config)
    results, profiled = measure(emulation, steps, rank, reps=args.reps, warmup=args.warmup,
                                graph_seq_len=graph_seq_len)
    speculative = speculative_rows(results, args.acceptance)
    mixed = mixed_rows(results)
    profile_md = profile_steps(profiled, device, sequence_dir=args.out / "kernels" if args.out else None) \
        if args.profile else ""

    header = {
        "config": args.config, "tp": args.tp, "ep": args.ep, "latent_layout": args.latent_layout, "rank": 0,
        "layers": config.num_hidden_layers,
        "context": args.context, "pending_prefix": args.pending_prefix, "page_size": args.page_size,
        "dtype": args.dtype, "device": device_name(device),
        "graph_max_seq_len": graph_seq_len, "torch": torch.__version__, "commit": git_commit(), "reps": args.reps,
        "warmup": args.warmup,
        "weight_bytes": emulation.weight_bytes(), "pool_bytes": emulation.pool_bytes(),
        "expert_kernel_layers": emulation.expert_kernel_layers,
        # the target's steps alone (before the draft, if any, was built)
        "peak_memory_bytes": (emulation.target_peak or torch.cuda.max_memory_allocated(device))
        if device.type == "cuda" else None,
        "peak_memory_with_draft_bytes": torch.cuda.max_memory_allocated(device)
        if device.type == "cuda" and emulation.draft is not None else None,
        "hbm_bytes_per_s": HBM_BYTES_PER_S, "bf16_flops_per_s": BF16_FLOPS_PER_S,
        "collective_cost": None if comm_cost is None else {"latency_s": comm_cost.latency_s,
                                                            "small_bytes": comm_cost.small_bytes,
                                                            "bytes_per_s": comm_cost.bytes_per_s,
                                                            # measured, subtracted from each wait's spin
                                                            "delay_overhead_ns": emulation.comm.delay_overhead_ns},
    }
    header["h100_fit"] = h100_fit(header["weight_bytes"], header["pool_bytes"], header["peak_memory_bytes"],
                                  shipped_pool_bytes(emulation.serving.model.config))
    layout = f", latent MoE projections {args.latent_layout}"
    title = (f"# mstar-emulate-rank: {args.config}, rank 0 of tp={args.tp} ep={args.ep}{layout}, "
             f"{config.num_hidden_layers} layers\n\n"
             f"{header['device']}, torch {header['torch']}, commit {header['commit']}; {args.dtype}, context "
             f"{args.context} ({args.pending_prefix} pending rows per verify sequence), page size {args.page_size}; "
             f"median of {args.reps} steps; CUDA graphs "
             f"{f'captured for {graph_seq_len} tokens' if graph_seq_len else 'off'}. Weights "
             f"{header['weight_bytes'] / GIB:.2f} GiB, pools {header['pool_bytes'] / GIB:.2f} GiB; "
             f"{comm_note(comm_cost)} Floors: mstar-roofline at {HBM_BYTES_PER_S / 1e12:.1f} TB/s "
             f"and {BF16_FLOPS_PER_S / 1e12:.0f} TFLOP/s.\n\n{fit_note(header)}")
    # the table last, so that it ends what the tool prints
    table = markdown_table(results, config.num_hidden_layers)
    spec_md = speculative_table(speculative, args.acceptance)
    markdown = "\n\n".join(part for part in (title, profile_md, spec_md, mixed_table(mixed), table) if part) + "\n"
    return header | {"rows": [r.as_dict() for r in results], "acceptance": list(args.acceptance),
                     "speculative": speculative, "mixed": mixed}, markdown


def comm_note(cost: CollectiveCost | None) -> str:
    if cost is None:
        return "collectives are free (null communicator, --comm-latency-us 0)."
    return (f"every collective waits its modeled cost on the GPU ({cost.latency_s * 1e6:g} us up to "
            f"{cost.small_bytes / 1024:g} KiB per rank, then {cost.bytes_per_s / 1e9:g} GB/s of an all-reduce's "
            "message, twice that of an all-gather's output: half the link traffic).")


def fit_note(header: dict[str, Any]) -> str:
    fit = header["h100_fit"]
    peak = header["peak_memory_bytes"]
    return (f"Memory: peak {peak / GIB:.2f} GiB here" if peak is not None else "Memory:") + (
        f". A served rank with the shipped pools ({SHIPPED_CONFIG.name}: {fit['shipped_pools'] / GIB:.2f} GiB) "
        f"needs weights {fit['weights'] / GIB:.2f} + pools {fit['shipped_pools'] / GIB:.2f} + working memory "
        f"{fit['working'] / GIB:.2f} (measured here) + {fit['reserve'] / GIB:.0f} GiB reserve = "
        f"{fit['total'] / GIB:.2f} GiB: {'fits' if fit['fits'] else 'does NOT fit'} an 80 GB H100 "
        f"({fit['h100_bytes'] / GIB:.1f} GiB).")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    report, markdown = run(args)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "emulate_rank.md").write_text(markdown)
        (args.out / "emulate_rank.json").write_text(json.dumps(report, indent=1) + "\n")
        progress(f"wrote {args.out / 'emulate_rank.md'} and emulate_rank.json")
    print(markdown, end="")


if __name__ == "__main__":
    main()
