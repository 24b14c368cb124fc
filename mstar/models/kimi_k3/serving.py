"""The Kimi K3 forward over a batch of ragged requests, with their state in the engine's pools.

It runs the reference stack (`KimiK3Model.forward`) with batched token mixers: MLA layers read and
write the paged latent cache and attend in absorbed form; KDA layers take their recurrent state and
conv window from the `RecurrentStatePool` and write them back. Everything else in a layer (norms,
AttnRes, MoE, MLP) is token-wise and runs on all rows of the step at once.

The mixers here are the torch (CPU) implementations, one sequence at a time through the reference
layers; `TorchMixerOps` is the seam where GPU kernels plug in (gpu_ops.GpuMixerOps), and the model's
token-wise parts take a `LayerOps` table (layer_ops.py): which of them a serving model runs is its
backend, chosen in backend.py.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace

import torch

from mstar.resources.latent_kv import LatentKVPlan, PagedLatentKV
from mstar.resources.recurrent_pool import RecurrentStatePool
from mstar.resources.transfer import to_device

from .kda import KDAState, KimiDeltaAttention
from .layer_ops import REFERENCE_OPS, LayerOps
from .mla import GatedMLA, MLACache
from .model import KimiK3ForCausalLM


class StepKind(enum.Enum):
    """How a step's rows reach the token mixers, fixed when the step is planned (engine/core.py for the steps
    it plans, runner/ for a graph's bucket)."""

    # Planned on the host, any mix: prefill chunks, decode rows, verify blocks, pending KDA prefixes. The
    # backend derives what its kernels need from the plan's host values (step_metadata.build_metadata).
    GENERAL = "general"
    # One row per sequence, none verifying, no KDA slot with a pending prefix: the KDA state is read and
    # written in place by slot, with no host-side logic (what a decode graph replays).
    DECODE = "decode"
    # Short blocks whose KDA layout (a BlockLayout) and row offsets are staged on the device (`staged`): a
    # verify graph's bucket.
    STAGED_BLOCKS = "staged blocks"
    # A prefill graph's bucket: its lengths exist only on the device (`staged`, with a PrefillLayout); its
    # max_query_len sizes the kernels, and no mixer reads seq_starts.
    STAGED_PREFILL = "staged prefill"


@dataclass(frozen=True)
class StagedLayout:
    """A staged kind's step metadata on the device, built by the backend's capture builders
    (gpu_ops.GpuMixerOps.capture_prefill_layout) and restaged by runner/ before each replay: the row offsets the MLA
    multi-row kernel takes, the KDA layout (a kda_fla.BlockLayout or PrefillLayout), and (STAGED_PREFILL) the
    most rows any sequence may have, which sizes the kernels. A captured verify step stages no layout but each
    block's pending KDA prefix (`pending` [B]): its blocks are all alike, and the step derives their layout on
    the device from these and the plan's kda_slots (kda_fla.BlockLayout.equal_blocks), inside the graph."""

    cu_seqlens: torch.Tensor
    kda_layout: object | None
    max_query_len: int | None = None
    pending: torch.Tensor | None = None


@dataclass(frozen=True)
class BatchPlan:
    """The planned addressing of one step: rows of all requests concatenated in declaration order."""

    input_ids: torch.Tensor  # [N]
    seq_starts: tuple[int, ...]  # B+1 row offsets (cu_seqlens)
    num_computed: tuple[int, ...]  # [B] tokens already cached before this step
    kv: LatentKVPlan
    kda_slots: torch.Tensor  # [B]
    sample_rows: torch.Tensor  # [S] rows whose logits the step computes (sampled, or prompt rows scored)
    verify: tuple[bool, ...] = ()  # [B] speculative rows: their KDA block stays pending
    kind: StepKind = StepKind.GENERAL
    # kda_slots as host ints, so that no layer has to read them back from the device (a sync each)
    slot_ids: tuple[int, ...] = ()
    # The staged kinds' device buffers, which a captured step reads instead of making them from host values
    staged: StagedLayout | None = None
    # Planned while a verify step is in flight (async scheduling): sequence b's rows sit advance[b] positions
    # after num_computed[b] and its KDA slot's pending prefix is advance[b] rows longer than the pool's
    # prefix_len says, advance[b] (<= max_advance[b]) being what that step keeps, on the device only. The
    # kv plan already holds the shifted slots and lengths; None: num_computed and prefix_len are exact.
    advance: torch.Tensor | None = None
    max_advance: tuple[int, ...] = ()

    def host_slots(self) -> tuple[int, ...]:
        """The KDA slots on the host (`slot_ids`; hand-built plans without them read the tensor)."""
        return self.slot_ids or tuple(self.kda_slots.tolist())

    def pending_bounds(self, pool: RecurrentStatePool) -> tuple[list[int], torch.Tensor | None]:
        """Each sequence's pending KDA prefix: (rows on the host, exact where `advance` is None, else the most
        there can be; the exact rows on the device when they are known only there, else None)."""
        known = [pool.prefix_len[slot] for slot in self.host_slots()]
        if self.advance is None:
            return known, None
        bounds = [n + a for n, a in zip(known, self.max_advance, strict=True)]
        return bounds, to_device(known, torch.long, self.advance.device) + self.advance

    def settled(self) -> BatchPlan:
        """The plan with `advance` read into num_computed (a host read: it waits for the step in flight), for
        the paths that take lengths from the host: the torch mixers, a tensor-parallel follower."""
        if self.advance is None:
            return self
        extra = self.advance.tolist()
        return replace(self, num_computed=tuple(n + a for n, a in zip(self.num_computed, extra, strict=True)),
                       advance=None, max_advance=())

    def settled_pending(self, pool: RecurrentStatePool) -> list[int]:
        """Each sequence's exact pending KDA prefix on the host (reading `advance`, like `settled`)."""
        known, exact = self.pending_bounds(pool)
        return known if exact is None else exact.tolist()


class TorchMixerOps:
    """The CPU path: each sequence runs through the reference layer with its pooled state (lengths from the
    host: a plan's `advance` is read back, which on a GPU waits for the step in flight)."""

    def step_metadata(self, plan: BatchPlan, pool: RecurrentStatePool) -> object | None:
        """What the mixers need of the step besides the plan, built once per step (the GPU backend's:
        step_metadata.py); the torch path reads the plan itself."""
        return None

    def kda(self, attn: KimiDeltaAttention, layer: int, x: torch.Tensor, plan: BatchPlan,
            pool: RecurrentStatePool, meta: object | None = None) -> torch.Tensor:
        """Replay each slot's accepted pending prefix from its checkpoint, then run the new rows:
        folded into the state, or (verify rows) kept as the next pending prefix."""
        y = torch.empty_like(x)
        pending_rows = plan.settled_pending(pool)
        for b, slot in enumerate(plan.host_slots()):
            rows = slice(plan.seq_starts[b], plan.seq_starts[b + 1])
            state = KDAState(recurrent=pool.state[layer, slot], conv=pool.conv[layer, slot])
            pending = pending_rows[b]
            if pending:
                _, state = attn(pool.prefix_x[layer, slot, :pending], state)
            if plan.verify and plan.verify[b]:
                y[rows], _ = attn(x[rows], state)
                pool.prefix_x[layer, slot, : x[rows].shape[0]] = x[rows]
            else:
                y[rows], state = attn(x[rows], state)
            pool.state[layer, slot] = state.recurrent
            pool.conv[layer, slot] = state.conv
        return y

    def mla(self, attn: GatedMLA, layer: int, x: torch.Tensor, plan: BatchPlan, kv: PagedLatentKV,
            meta: object | None = None) -> torch.Tensor:
        y = torch.empty_like(x)
        rank = attn.kv_lora_rank
        for b, cached in enumerate(plan.settled().num_computed):
            rows = slice(plan.seq_starts[b], plan.seq_starts[b + 1])
            cache = MLACache.from_rows(kv.rows(layer, plan.kv.page_table[b], cached).to(x.dtype), rank)
            y[rows], new = attn(x[rows], cache, absorbed=True)
            kv.write(layer, plan.kv.slot_mapping[rows], new.rows()[cached:])
        return y


class ServingModel:
    """The served forward of `model` over the engine's pools: its token mixers through `ops`, its token-wise
    parts through `layer_ops` (the reference's own unless a backend gives kernels; backend.py). The model
    is only read."""

    def __init__(self, model: KimiK3ForCausalLM, kv: PagedLatentKV, pool: RecurrentStatePool,
                 ops: TorchMixerOps | None = None, layer_ops: LayerOps = REFERENCE_OPS):
        self.model = model
        self.config = model.config
        self.kv = kv
        self.pool = pool
        self.ops = ops or TorchMixerOps()
        self.layer_ops = layer_ops
        kinds = self.config.layer_kinds
        # Each layer's index into its pool: KDA layers into the state pool, MLA layers into the cache.
        self.pool_index = [kinds[:i].count(kind) for i, kind in enumerate(kinds)]

    @torch.no_grad()
    def forward(self, plan: BatchPlan, tap_layers: tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits [S, vocab] of the sampled rows and, when asked, the DSpark taps of every row
        ([N, len(tap_layers) * hidden]); caches and states advance by the step's rows."""
        meta = self.ops.step_metadata(plan, self.pool)

        def mix(layer_idx: int, x: torch.Tensor) -> torch.Tensor:
            attn = self.model.model.layers[layer_idx].self_attn
            index = self.pool_index[layer_idx]
            if isinstance(attn, KimiDeltaAttention):
                return self.ops.kda(attn, index, x, plan, self.pool, meta)
            return self.ops.mla(attn, index, x, plan, self.kv, meta)

        hidden, taps = self.model.model(plan.input_ids, mix, tap_layers, self.layer_ops)
        return self.model.lm_head(hidden[plan.sample_rows]), torch.cat(taps, dim=-1) if taps else None
