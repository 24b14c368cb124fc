"""One rank's model runner: the resources a step reads and writes, the kernel backend, the CUDA graphs.

The runner owns the paged latent KV (MLA layers), the KDA state pool, the serving model built with the
fastest kernels the device supports, and the graphs captured of its steps. It decides nothing: the
engine (engine/core.py) declares and plans each step, asks the pools to admit it, and hands it to
`execute`, which replays a captured graph where one takes the step and runs it eagerly otherwise.

A tensor-parallel follower builds a runner alone (distributed/worker.py) from rank 0's sizes, so rank 0's
plans address the same pages and slots there, and both take the same branch (graph or eager) for the
same plan: their collectives stay in step.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass

import torch

from mstar.models.kimi_k3.backend import select_backend
from mstar.models.kimi_k3.model import KimiK3ForCausalLM
from mstar.models.kimi_k3.serving import BatchPlan, ServingModel
from mstar.resources.latent_kv import PagedLatentKV
from mstar.resources.recurrent_pool import RecurrentStatePool
from mstar.runner.executor import ModelStep, StepOutput
from mstar.speculative.schedule import DraftSchedule

log = logging.getLogger(__name__)

MAX_GRAPH_BATCH = 64  # larger decode batches run eagerly (launch overhead is amortized over their rows)


@dataclass(frozen=True)
class PoolSizes:
    """The per-request state the runner holds: latent KV pages and KDA slots (page 0 and slot 0 are sinks;
    the config's validation checks that the pages hold a max_seq_len request besides the sink)."""

    max_num_pages: int
    page_size: int
    max_kda_slots: int
    max_block: int = 0  # rows of a speculative verify block (k + 1) whose inputs a KDA slot keeps; 0: none
    kda_snapshot_interval: int = 0  # prefix caching: KDA state snapshots every this many tokens; 0: none


@dataclass(frozen=True)
class StepLimits:
    """The largest steps the scheduler declares, which size the captured graphs and the expert kernels."""

    max_seq_len: int
    max_num_seqs: int  # decode (and verify) rows per step
    max_num_batched_tokens: int  # the token budget of a step
    max_prefill_seqs: int  # prompt chunks per step
    tap_layers: tuple[int, ...] = ()  # the layers the draft reads (speculation on)
    draft_schedule: DraftSchedule | None = None  # drafts per decode batch size (speculation on)
    # steps of more tokens run the routed experts as bf16 grouped GEMMs (MSTAR_MOE_BF16_TOKENS); None: never
    moe_bf16_above: int | None = None


def prefill_graph_seqs(max_num_seqs: int, max_prefill_seqs: int) -> int:
    """Sequences a captured prefill step holds: a mixed step's decode rows besides its prompt chunks (up to
    max_num_seqs in all, as many as a decode graph takes); an empty sequence costs the kernels next to nothing."""
    return max(max_prefill_seqs, min(max_num_seqs, MAX_GRAPH_BATCH))


def step_shape(plan: BatchPlan) -> str:
    """What a step holds, for counting: "decode" (one row a sequence), "verify" (verify blocks, maybe with
    decode rows), "prefill" (prompt chunks, maybe with decode rows) or "prefill+verify"."""
    starts, verify = plan.seq_starts, plan.verify or (False,) * (len(plan.seq_starts) - 1)
    prefill = any(not v and end - start > 1 for v, start, end in zip(verify, starts[:-1], starts[1:], strict=True))
    return {(False, False): "decode", (False, True): "verify", (True, False): "prefill",
            (True, True): "prefill+verify"}[prefill, any(verify)]


class ModelRunner:
    """Executes planned steps on one rank (a `StepExecutor`). `kernels`: "auto" takes the GPU kernels where
    the device supports them, "torch" the reference path everywhere; `cuda_graphs` captures the decode,
    verify and prefill steps at startup (CUDA only; a model that cannot be captured is refused, naming why)."""

    def __init__(self, model: KimiK3ForCausalLM, pools: PoolSizes, limits: StepLimits, *, kernels: str = "auto",
                 cuda_graphs: bool = False):
        cfg = model.config
        param = next(model.parameters())
        dtype, device = param.dtype, param.device
        kinds, la = cfg.layer_kinds, cfg.linear_attn
        self.device = device
        self.limits = limits
        self.kv = PagedLatentKV(kinds.count("mla"), pools.max_num_pages, pools.page_size, cfg.kv_cache_width,
                                dtype, device)
        self.pool = RecurrentStatePool(kinds.count("kda"), pools.max_kda_slots, la.num_heads, la.head_dim,
                                       la.short_conv_kernel_size, torch.promote_types(dtype, torch.float32),
                                       dtype, device, hidden_size=cfg.hidden_size, max_block=pools.max_block,
                                       snapshot_interval=pools.kda_snapshot_interval)
        self.backend = select_backend(model, kernels, limits.max_num_batched_tokens,
                                      bf16_above_tokens=limits.moe_bf16_above)
        self.serving = ServingModel(model, self.kv, self.pool, self.backend.mixers, self.backend.layers)
        self.graphs: list = []  # StepGraphs, in the order `forward` tries them
        if cuda_graphs and device.type == "cuda":
            self.graphs = self._capture_graphs()
        # (step shape, "graph" or "eager") -> steps run: with graphs on, an eager step is a slow one
        self.steps_run: Counter[tuple[str, str]] = Counter()

    @property
    def model(self) -> KimiK3ForCausalLM:
        return self.serving.model

    @property
    def prefill_step_sizes(self) -> tuple[int, ...]:
        """The token counts a prefill step is padded up to: the captured prefill graphs' buckets (none without)."""
        return next((graphs.buckets for graphs in self.graphs if graphs.kind == "prefill"), ())

    def _capture_graphs(self) -> list:
        """Decode steps and, with speculation, the verify blocks of every draft count the schedule uses, for
        batch sizes up to MAX_GRAPH_BATCH; prefill steps by token count up to the token budget
        (runner/prefill_graphs.py). All share one memory pool; a TP follower captures what rank 0 does."""
        from mstar.runner.cuda_graphs import DecodeGraphs, StepGraphs, capture_all, verify_graphs
        from mstar.runner.prefill_graphs import PrefillGraphs

        limits = self.limits
        shape = {"max_batch": min(limits.max_num_seqs, MAX_GRAPH_BATCH), "max_seq_len": limits.max_seq_len,
                 "tap_layers": limits.tap_layers}
        graphs: list[StepGraphs] = [DecodeGraphs(self.serving, **shape)]
        if limits.draft_schedule is not None:
            graphs += verify_graphs(self.serving, limits.draft_schedule, **shape)
        # last: `forward` replays the first set that takes a step, and a decode step fits a prefill graph too
        graphs.append(PrefillGraphs(self.serving, max_tokens=limits.max_num_batched_tokens,
                                    max_seqs=prefill_graph_seqs(limits.max_num_seqs, limits.max_prefill_seqs),
                                    max_seq_len=limits.max_seq_len, tap_layers=limits.tap_layers))
        capture_all(graphs)
        return graphs

    def forward(self, plan: BatchPlan, tap_layers: tuple[int, ...] = ()) -> StepOutput:
        """`ServingModel.forward(plan, tap_layers)`: by replay where a captured graph takes the plan (the first
        set that does), eagerly otherwise."""
        for graphs in self.graphs:
            if tuple(tap_layers) == graphs.tap_layers and graphs.can_run(plan):
                self.steps_run[step_shape(plan), "graph"] += 1
                return StepOutput(*graphs.run(plan))
        self._count_eager(plan)
        return StepOutput(*self.serving.forward(plan, tap_layers))

    def _count_eager(self, plan: BatchPlan) -> None:
        """Count an eager step; with graphs captured, log the first of each shape (what no graph takes)."""
        key = step_shape(plan), "eager"
        if self.graphs and not self.steps_run[key]:
            log.info("a %s step of %d sequences and %d rows ran eagerly: no captured graph takes it (later "
                     "ones are counted in mstar_model_steps{mode=\"eager\"})", key[0], len(plan.seq_starts) - 1,
                     plan.input_ids.shape[0])
        self.steps_run[key] += 1

    def execute(self, step: ModelStep) -> StepOutput:
        return self.forward(step.plan, step.tap_layers)
