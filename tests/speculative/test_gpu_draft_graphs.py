"""The draft's GPU path on the GPU: the paged kernel's proposals equal the reference's gathered-context path
(bf16 bounds), and a CUDA-graph replay of the greedy step equals the eager paged step, bucket padding
included (CUDA only; the interpreter covers the paged path on the CPU in test_dspark_batched.py)."""

from __future__ import annotations

import pytest
import torch

from mstar.models.dspark import paged
from mstar.models.dspark.model import BlockBatch, DraftSampling, K3DSparkModel
from mstar.resources.latent_kv import PagedLatentKV
from mstar.speculative.context_graphs import ContextGraphs
from mstar.speculative.draft_graphs import DraftGraphs
from mstar.speculative.proposer import PagedContext

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
PAGE = 16


@pytest.fixture(scope="module")
def draft_and_heads(tiny_dirs):
    draft = K3DSparkModel.from_checkpoint(tiny_dirs[1], dtype=torch.bfloat16).cuda()
    cfg = draft.config
    embed = torch.nn.Embedding(cfg.vocab_size, cfg.hidden_size).cuda().bfloat16()
    lm_head = torch.nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False).cuda().bfloat16()
    assert paged.kernel_fits(draft, torch.device("cuda"))
    return draft, embed.requires_grad_(False), lm_head.requires_grad_(False)


def blocks_of(contexts, k, kv):
    """Blocks after `contexts` rows each, on their own shuffled pages, with their rows' slots."""
    n_pages = [-(-(c + k) // PAGE) for c in contexts]
    order = 1 + torch.randperm(sum(n_pages))  # page 0: the sink
    table = torch.zeros(len(contexts), max(n_pages), dtype=torch.long)
    taken = 0
    for b, n in enumerate(n_pages):
        table[b, :n] = order[taken : taken + n]
        taken += n
    table = table.cuda()
    starts = torch.tensor(contexts, device="cuda")
    pos = starts[:, None] + torch.arange(k, device="cuda")
    row_slots = table.gather(1, pos // PAGE) * PAGE + pos % PAGE
    anchors = torch.randint(0, 1000, (len(contexts),), device="cuda")
    return anchors, starts, table, row_slots


def test_graph_replay_equals_eager_and_reference(draft_and_heads):
    draft, embed, lm_head = draft_and_heads
    cfg, k = draft.config, 4
    kv = PagedLatentKV(cfg.num_hidden_layers, 64, PAGE, cfg.kv_lora_rank + cfg.qk_rope_head_dim, torch.bfloat16,
                       "cuda")
    kv.cache.normal_()
    graphs = DraftGraphs(draft, embed, lm_head, kv.cache, drafts=k, buckets=(2, 4), max_seq_len=512)
    graphs.capture()
    contexts = [37, 5, 100]  # three blocks in the 4-bucket: one padding block
    anchors, starts, table, row_slots = blocks_of(contexts, k, kv)
    greedy = [DraftSampling()] * len(contexts)
    reference_hidden = draft.blocks_hidden(
        BlockBatch(anchors, starts, (k,) * 3, PagedContext(kv, table, starts, max(contexts)), max(contexts)), embed)
    blocks = paged.PagedBlocks.build(anchors, starts, (k,) * 3, table, row_slots, PAGE)
    eager_hidden = paged.paged_blocks_hidden(draft, kv.cache, blocks, embed)
    replayed = graphs.run(anchors, starts, table, row_slots)
    replayed_hidden = graphs.graphs[4][1][:3]  # the 4-bucket graph's hidden states, its proposals' source
    torch.cuda.synchronize()
    assert len(replayed) == 3
    def rel(a, b):
        return float((a.float() - b.float()).norm() / b.float().norm())

    # the same kernels at the bucket's shape (GEMM tiles may differ); bf16: the paged kernel against the gathered
    # reference
    assert rel(replayed_hidden, eager_hidden) < 1e-2 and rel(replayed_hidden, reference_hidden) < 3e-2
    for got in replayed:
        assert torch.isfinite(got.probs).all() and got.tokens.shape == (k,)
    assert not graphs.can_run((k, k - 1), greedy[:2]) and not graphs.can_run((k,), [DraftSampling(1.0)])


def test_context_write_replay_equals_the_eager_write(draft_and_heads):
    """A captured context write (ContextGraphs) stores the rows the eager write stores, in the step's slots only:
    the padding rows of its bucket go to the sink page, every other page keeps what it held."""
    draft = draft_and_heads[0]
    cfg = draft.config
    width = cfg.kv_lora_rank + cfg.qk_rope_head_dim
    kvs = [PagedLatentKV(cfg.num_hidden_layers, 16, PAGE, width, torch.bfloat16, "cuda") for _ in range(2)]
    for kv in kvs:
        kv.cache.fill_(float("nan"))  # poisoned: only written rows may change

    def write(kv):
        return lambda taps, positions, slots: [kv.write(layer, slots, rows) for layer, rows in
                                               enumerate(paged.paged_context_kv(draft, taps, positions))]

    graphs = ContextGraphs(write(kvs[0]), buckets=(8, 24), tap_width=cfg.context_input_size, dtype=torch.bfloat16,
                           page_size=PAGE, device=torch.device("cuda"))
    graphs.capture()
    n = 13  # the 24-row bucket: 11 padding rows
    taps = torch.randn(n, cfg.context_input_size, device="cuda", dtype=torch.bfloat16)
    positions = torch.randint(0, 200, (n,), device="cuda")
    slots = PAGE + torch.randperm(15 * PAGE, device="cuda")[:n]  # pages 1..15, never the sink
    assert graphs.run(taps, positions, slots) and not graphs.run(torch.zeros(25, cfg.context_input_size), positions,
                                                                   slots)
    write(kvs[1])(taps, positions, slots)
    torch.cuda.synchronize()
    replayed, eager = (kv.cache.view(cfg.num_hidden_layers, -1, width) for kv in kvs)
    assert torch.isfinite(replayed[:, slots]).all()
    assert torch.allclose(replayed[:, slots].float(), eager[:, slots].float(), atol=2e-2, rtol=2e-2)
    untouched = torch.ones(replayed.shape[1], dtype=torch.bool, device="cuda")
    untouched[slots] = False
    untouched[: PAGE] = False  # the sink page takes the padding rows
    assert replayed[:, untouched].isnan().all()
