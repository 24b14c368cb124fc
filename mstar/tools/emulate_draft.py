"""The DSpark draft's share of a speculative step at real dimensions, and what speculation buys.

`mstar-emulate-rank --steps ...,draft` (emulate_rank.py) times, besides the target's decode and verify
steps, the draft's work per speculative step as rank 0 serves it (mstar/engine/speculation.py): the
Inferact-layout draft (5 MLA layers over target taps, SwiGLU, Markov head; the config in
models/dspark/fixtures) with whole-vocabulary embed/lm_head heads of its own (worker.py says why
rank 0 holds them), random bf16 weights, on the same GPU. One draft step is

- `write_context`: the draft context rows of the previous step's verify blocks (all k + 1 rows per
  sequence, from the target's taps, written at its launch before verification) into the draft's paged KV;
- `propose`: B blocks of k drafts after `--context` cached rows, one batched forward, greedy.

As served: on a GPU the paged MLA kernel runs the blocks' attention (models/dspark/paged.py) and the
greedy proposal replays a CUDA graph (speculative/draft_graphs.py); write_context runs eagerly. Off a
GPU (tests) the reference's gathered-context path runs.

With an acceptance profile p_i = P(draft i accepted) (all drafts before it accepted too), a verify
step of k drafts emits on average 1 + p_1 + ... + p_k tokens (the bonus token included), and
speculation's implied speedup over plain decode at batch B is

    speedup = (1 + sum_i<=k p_i) * t_decode(B) / (t_draft(k, B) + t_verify(k, B)).

The default profile is the one reported for a DSpark draft on Hopper (vLLM's DSpark PR: 0.82, 0.67,
0.55, 0.45, 0.37 for k = 1..5, mean accepted length 3.86 at k = 5), extended by 0.30 and 0.25 for
k = 6 and 7.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources

import torch
from torch import nn

from mstar.models.dspark import paged
from mstar.models.dspark.config import DSparkConfig, parse_dspark_config
from mstar.models.dspark.model import BlockBatch, DraftSampling, K3DSparkModel
from mstar.models.kimi_k3.norm import RMSNorm
from mstar.resources.latent_kv import PagedLatentKV
from mstar.speculative.draft_graphs import DraftGraphs
from mstar.speculative.proposer import PagedContext
from mstar.tools.roofline import Floor

DEFAULT_ACCEPTANCE = (0.82, 0.67, 0.55, 0.45, 0.37, 0.30, 0.25)


def tokens_per_step(acceptance: tuple[float, ...], drafts: int) -> float:
    """Expected tokens a verify step of `drafts` drafts emits: 1 + P(draft 1 accepted) + ... ."""
    if drafts > len(acceptance):
        raise ValueError(f"the acceptance profile has {len(acceptance)} rates; k={drafts} needs {drafts}")
    rising = any(b > a for a, b in zip(acceptance[:-1], acceptance[1:], strict=True))
    if rising or any(not 0 <= a <= 1 for a in acceptance):
        raise ValueError(f"acceptance rates {acceptance} must be probabilities that never increase with i")
    return 1 + sum(acceptance[:drafts])


def implied_speedup(acceptance: tuple[float, ...], drafts: int, t_decode: float, t_draft: float,
                    t_verify: float) -> float:
    return tokens_per_step(acceptance, drafts) * t_decode / (t_draft + t_verify)


def draft_config() -> DSparkConfig:
    """The Inferact Kimi-K3-DSpark draft's config (bundled fixture)."""
    path = resources.files("mstar.models.dspark").joinpath("fixtures", "kimi_k3_dspark_config.json")
    return parse_dspark_config(json.loads(path.read_text()))


@torch.no_grad()
def build_draft(cfg: DSparkConfig, dtype: torch.dtype, device: torch.device,
                generator: torch.Generator) -> tuple[K3DSparkModel, nn.Embedding, nn.Linear]:
    """The draft and its whole-vocabulary heads with random weights made on `device` (never on the host):
    linear weights N(0, 1/fan_in), unit norms, so that its activations stay in range."""
    with torch.device("meta"):
        draft = K3DSparkModel(cfg)
        embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
    modules = [draft, embed, lm_head]
    for m in modules:
        m.to(dtype).to_empty(device=device).requires_grad_(False)
    for m in (mod for top in modules for mod in top.modules()):
        if isinstance(m, RMSNorm):
            m.weight.fill_(1.0)
        elif isinstance(m, nn.Linear):
            m.weight.normal_(0.0, m.weight.shape[1] ** -0.5, generator=generator)
            if m.bias is not None:
                m.bias.zero_()
        elif isinstance(m, nn.Embedding):
            m.weight.normal_(0.0, 1.0 if m is embed else 0.02, generator=generator)
        elif any(True for _ in m.parameters(recurse=False)):
            raise TypeError(f"emulate_draft: no random init for {type(m).__name__}")
    return draft.eval(), embed, lm_head


@dataclass
class DraftStep:
    """One speculative step's draft work for `batch` sequences of `drafts` drafts after `context` rows."""

    draft: K3DSparkModel
    embed: nn.Embedding
    lm_head: nn.Linear
    kv: PagedLatentKV
    batch: int
    drafts: int
    context: int
    committed: int  # context rows written per sequence (the previous verify block's k + 1 rows)
    generator: torch.Generator

    def __post_init__(self):
        page = self.kv.page_size
        pages = -(-(self.context + self.drafts + 1) // page)
        device = self.kv.cache.device
        self.page_table = 1 + torch.arange(self.batch * pages, device=device).view(self.batch, pages)
        positions = torch.arange(self.context - self.committed, self.context, device=device)
        self.positions = positions.repeat(self.batch)
        rows = self.page_table[:, positions // page] * page + positions % page
        self.slots = rows.flatten()
        cfg = self.draft.config
        self.taps = torch.randn(self.batch * self.committed, cfg.context_input_size, generator=self.generator,
                                device=device, dtype=self.draft.dtype)
        self.starts = torch.full((self.batch,), self.context, dtype=torch.long, device=device)
        self.anchors = torch.randint(0, cfg.vocab_size, (self.batch,), generator=self.generator, device=device)
        self.greedy = [DraftSampling()] * self.batch
        block = torch.arange(self.context, self.context + self.drafts, device=device)
        self.row_slots = self.page_table[:, block // page] * page + block % page  # [B, k]: the block's rows
        self.graphs = None
        if device.type == "cuda" and paged.kernel_fits(self.draft, device):
            self.graphs = DraftGraphs(self.draft, self.embed, self.lm_head, self.kv.cache, drafts=self.drafts,
                                      buckets=(self.batch,), max_seq_len=self.page_table.shape[1] * page)
            self.graphs.capture()

    @property
    def mode(self) -> str:
        return "graph" if self.graphs is not None else "eager"

    def __call__(self) -> torch.Tensor:
        # write_context, as the proposer runs it: the paged path's kernels where the graphs run
        context_kv = paged.paged_context_kv if self.graphs is not None else K3DSparkModel.context_kv
        for layer, rows in enumerate(context_kv(self.draft, self.taps, self.positions)):
            self.kv.write(layer, self.slots, rows)
        if self.graphs is not None:
            proposals = self.graphs.run(self.anchors, self.starts, self.page_table, self.row_slots)
        else:
            blocks = BlockBatch(anchors=self.anchors, starts=self.starts, num_drafts=(self.drafts,) * self.batch,
                                context=PagedContext(self.kv, self.page_table, self.starts, self.context),
                                context_len=self.context)
            proposals = self.draft.propose_blocks(blocks, self.embed, self.lm_head, self.greedy)
        return torch.stack([p.tokens for p in proposals])


def draft_kv(cfg: DSparkConfig, batch: int, drafts: int, context: int, page_size: int, dtype: torch.dtype,
             device: torch.device, generator: torch.Generator) -> PagedLatentKV:
    """The draft's paged KV for `batch` sequences, filled with random unit-scale rows (none reads zeros)."""
    pages = 1 + batch * -(-(context + drafts + 1) // page_size)  # page 0: the sink
    kv = PagedLatentKV(cfg.num_hidden_layers, pages, page_size, cfg.kv_lora_rank + cfg.qk_rope_head_dim, dtype,
                       device)
    kv.cache.normal_(0.0, 1.0, generator=generator)
    return kv


def draft_floor(step: DraftStep, name: str) -> Floor:
    """What one draft step must move and compute at best: every draft weight and the lm_head read once (the
    embedding: the block's rows), the context rows read and the committed ones written, the block GEMMs,
    the context projections of the committed rows and the absorbed attention over the context."""
    cfg, draft = step.draft.config, step.draft
    size = draft.dtype.itemsize
    weights = sum(p.numel() for p in draft.parameters()) + step.lm_head.weight.numel()
    rows = step.batch * step.drafts
    width = cfg.kv_lora_rank + cfg.qk_rope_head_dim
    kv_rows = step.batch * (step.context + step.committed)
    context_weights = draft.context_proj.weight.numel() + sum(
        layer.self_attn.kv_a_proj_with_mqa.weight.numel() for layer in draft.layers)
    attention = 2 * rows * cfg.num_attention_heads * (width + cfg.kv_lora_rank) * (step.context + step.drafts)
    return Floor(step=name, batch=step.batch, tokens=rows, context=step.context,
                 weight_bytes=(weights + rows * cfg.hidden_size) * size, expert_bytes=0.0,
                 kv_bytes=kv_rows * width * cfg.num_hidden_layers * size, kda_bytes=0.0,
                 gemm_flops=2.0 * (weights * rows + context_weights * step.batch * step.committed),
                 mla_flops=float(attention * cfg.num_hidden_layers), kda_flops=0.0)
