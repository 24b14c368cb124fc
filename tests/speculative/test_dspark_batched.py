"""All verify rows of a step drafted in one batched draft forward (`Speculation.propose` ->
`DSparkProposer.propose` -> `K3DSparkModel.propose_blocks`) give each request the proposal it would get alone
(`K3DSparkModel.propose` on its own context): greedy tokens identical, seeded sampled drafts identical,
distributions equal within fp32 rounding, whatever mix of context lengths, draft counts and sampling settings
shares the batch.
"""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from engine_run import run_to_completion

from mstar.config import EngineConfig
from mstar.engine.core import EngineCore, SpeculativeModels
from mstar.engine.params import SamplingParams
from mstar.engine.speculation import Speculation
from mstar.models.dspark.model import BlockBatch, DraftCache, K3DSparkModel
from mstar.models.kimi_k3.tokenizer import KimiTokenizer
from mstar.resources.step import SeqStep, StepDecl
from mstar.speculative.proposer import DSparkProposer
from mstar.speculative.schedule import DraftSchedule

PAGE_SIZE = 4
# The paged variants run the paged path's Triton kernels on these CPU tensors through the interpreter; on a CUDA
# machine (no interpreter) tests/speculative/test_gpu_draft_graphs.py covers that path on the GPU instead.
INTERPRETER_ONLY = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU tensors through Triton's interpreter")
PAGED_VARIANTS = pytest.mark.parametrize("paged", [False, pytest.param(True, marks=INTERPRETER_ONLY)],
                                         ids=["gathered-context", "paged-kernel"])
GREEDY = SamplingParams(temperature=0)
NUCLEUS = SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=3)
PLAIN = SamplingParams(temperature=1.2, seed=4)


@pytest.fixture(scope="module")
def draft(tiny_dirs) -> K3DSparkModel:
    """The tiny draft in fp32, norms moved off 1 so that every norm shows in the comparisons."""
    model = K3DSparkModel.from_checkpoint(tiny_dirs[1], dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn_like(p))
    return model


def filled_proposer(draft, target, lengths: dict[str, int]) -> DSparkProposer:
    """A proposer whose paged draft KV holds `lengths[r]` context rows of request r, written by a prefill step.
    Every other row of the pool is NaN, as a page a request with NaN logits wrote and freed could be: rows past
    a request's length must not reach its drafts."""
    proposer = DSparkProposer(draft, target, num_pages=64, page_size=PAGE_SIZE)
    proposer.kv.cache.fill_(float("nan"))
    decl = StepDecl(tuple(SeqStep(r, 0, (1,) * n, sample=True) for r, n in lengths.items()))
    proposer.admit(decl)
    plan = proposer.kv.plan(decl)
    taps = torch.randn(decl.num_tokens, draft.config.context_input_size)
    proposer.write_context(decl, plan, taps)
    proposer.commit(decl)
    return proposer


def own_cache(proposer: DSparkProposer, request_id: str) -> DraftCache:
    """The request's context rows alone, as `K3DSparkModel.propose` takes them."""
    n, pages = proposer.kv.lengths[request_id], torch.tensor(proposer.kv.pages[request_id])
    return DraftCache([proposer.kv.rows(layer, pages, n) for layer in range(proposer.config.num_hidden_layers)])


def generator_of(params: SamplingParams) -> torch.Generator | None:
    return None if params.seed is None else torch.Generator().manual_seed(params.seed)


def alone(proposer, s: SeqStep, params: SamplingParams, generator: torch.Generator | None):
    """What verify row s's block gives when drafted by itself."""
    return proposer.draft.propose(
        own_cache(proposer, s.request_id), s.token_ids[0], s.num_computed, s.num_drafts, proposer.heads.embed,
        proposer.heads.lm_head, temperature=params.temperature, top_k=params.top_k or None,
        top_p=params.top_p if params.top_p < 1 else None, min_p=params.min_p or None, generator=generator,
    )


def assert_same_proposal(got, want):
    """Same tokens, same distributions within fp32 rounding. A top-p cut may keep a token on one side and not
    the other when its cumulative mass sits at p within rounding: such a token must be the smallest kept
    one of its row, and the rows then agree elsewhere (renormalized by a mass below the tolerance)."""
    assert torch.equal(got.tokens, want.tokens)
    one_sided = (got.probs == 0) != (want.probs == 0)
    for probs in (got.probs, want.probs):
        kept = probs.masked_fill(probs == 0, float("inf"))
        boundary = probs == kept.amin(-1, keepdim=True)
        assert bool((boundary | ~one_sided | (probs == 0)).all()), "a token kept on one side only is not at the cut"
    torch.testing.assert_close(got.probs.masked_fill(one_sided, 0), want.probs.masked_fill(one_sided, 0),
                               rtol=1e-5, atol=1e-5)


# request id -> (context length, anchor token, drafts, sampling): a 1-token context next to long ones, k from 1
# to 7, greedy and seeded top-k/top-p sampling interleaved
MIXED = {
    "short": (1, 5, 3, GREEDY),
    "nucleus": (23, 900, 5, NUCLEUS),
    "mid": (9, 77, 7, GREEDY),
    "plain": (40, 12, 2, PLAIN),
    "single": (17, 301, 1, GREEDY),
}
BATCHES = {
    "mixed": MIXED,
    "greedy": {r: (n, a, k, GREEDY) for r, (n, a, k, _) in MIXED.items()},
    "sampled": {r: (n, a, k, NUCLEUS if i % 2 else PLAIN) for i, (r, (n, a, k, _)) in enumerate(MIXED.items())},
}


def verify_step(batch) -> tuple[StepDecl, dict]:
    """A step with a verify row per request of `batch` and, between them, a prefill row that drafts nothing."""
    seqs = [SeqStep(r, n, (a,), sample=True, verify=True, num_drafts=k) for r, (n, a, k, _) in batch.items()]
    seqs.insert(2, SeqStep("prefill", 0, (1, 2, 3), sample=True))
    requests = {r: SimpleNamespace(params=p, generator=generator_of(p)) for r, (_, _, _, p) in batch.items()}
    return StepDecl(tuple(seqs)), requests


def input_ids_of(decl: StepDecl) -> torch.Tensor:
    """The step's input ids as the engine plans them before drafting: each sequence's tokens, 0 for its drafts."""
    return torch.tensor([t for s in decl.seqs for t in s.token_ids + (0,) * s.num_drafts])


def batched_and_alone(draft, target, batch, paged=False):
    proposer = filled_proposer(draft, target, {r: n for r, (n, _, _, _) in batch.items()})
    proposer.paged = paged  # the GPU path (paged MLA kernel over the draft KV), here under Triton's interpreter
    decl, requests = verify_step(batch)
    proposer.admit(decl)
    speculation = Speculation(proposer, DraftSchedule.from_config(7))
    drafts = speculation.propose(decl, requests, input_ids_of(decl), None)
    want = {b: alone(proposer, s, batch[s.request_id][3], generator_of(batch[s.request_id][3]))
            for b, s in enumerate(decl.seqs) if s.verify}
    return decl, drafts, want


@PAGED_VARIANTS
@pytest.mark.parametrize("mix", list(BATCHES))
def test_batched_proposals_equal_proposals_alone(draft, tiny_model, mix, paged):
    decl, drafts, want = batched_and_alone(draft, tiny_model, BATCHES[mix], paged)
    assert set(drafts) == set(want) == {0, 1, 3, 4, 5}  # row 2 is the prefill row
    for b, proposal in drafts.items():
        assert proposal.tokens.shape == (decl.seqs[b].num_drafts,)
        assert_same_proposal(proposal, want[b])


def test_the_comparison_sees_a_leaky_mask(draft, tiny_model, monkeypatch):
    """Letting every block see every context row and every block slot changes the proposals: the test above
    would notice a mask that let a block attend to another request's rows or to padding."""
    def see_everything(blocks):
        return torch.ones(len(blocks.num_drafts), 1, blocks.context_len + max(blocks.num_drafts), dtype=torch.bool)

    monkeypatch.setattr(BlockBatch, "visibility", see_everything)
    _, drafts, want = batched_and_alone(draft, tiny_model, BATCHES["sampled"])
    leaked = [b for b in drafts if not torch.allclose(drafts[b].probs, want[b].probs, rtol=1e-3, atol=1e-3)]
    assert leaked == list(drafts)


def test_batched_proposals_check_their_arguments(draft, tiny_model):
    batch = dict(list(MIXED.items())[:2])
    proposer = filled_proposer(draft, tiny_model, {r: n for r, (n, _, _, _) in batch.items()})
    decl, _ = verify_step({**batch, "nucleus": (23, draft.config.vocab_size, 5, NUCLEUS)})
    proposer.admit(decl)
    anchors, starts = torch.tensor([s.token_ids[0] for s in decl.seqs[:2]]), torch.tensor([23, 1])
    with pytest.raises(ValueError, match="anchor_token"):
        proposer.propose(decl, proposer.kv.plan(decl), [0, 1], anchors, starts, [GREEDY, NUCLEUS], [None, None])
    ahead = StepDecl(tuple(replace(s, num_computed=s.num_computed + 1) if s.verify else s for s in decl.seqs))
    with pytest.raises(ValueError, match="anchor_pos"):  # a position whose context rows were never committed
        proposer.propose(ahead, proposer.kv.plan(decl), [0, 1], anchors, starts, [GREEDY, NUCLEUS], [None, None])
    with pytest.raises(ValueError, match="one anchor and one start per block"):
        BlockBatch(torch.tensor([1, 2]), torch.tensor([3]), (2, 2), [], 3)
    with pytest.raises(ValueError, match="sampled draft is one block"):
        draft.markov_sample(torch.randn(2, 3, draft.config.vocab_size), torch.tensor([1, 2]), temperature=1.0)


@PAGED_VARIANTS
def test_engine_drafts_equal_drafts_alone(draft, tiny_model, tiny_dir, paged):
    """In a real speculative run (staggered prompts, the schedule changing k as the batch grows), each step's
    batched drafts equal every request's drafts alone, its generator replayed from the same state; with the
    paged kernel too, whose block rows are written into the draft KV and later overwritten by the committed
    rows."""
    cfg = EngineConfig(max_seq_len=256, resources={"mla_kv": {"page_size": PAGE_SIZE, "max_num_pages": 200},
                                                   "kda_state": {"max_slots": 6}},
                       scheduler={"max_num_seqs": 5, "max_num_batched_tokens": 64},
                       model_kwargs={"speculative_tokens": 5, "speculative_schedule": {2: 5, 4: 3, 5: 0}})
    engine = EngineCore(tiny_model, KimiTokenizer.from_dir(tiny_dir), cfg, SpeculativeModels(draft))
    engine.spec.proposer.paged = paged
    real_propose = engine.spec.propose
    checked = []

    def check(decl, requests, input_ids, advance):
        replays = {}  # each sampled request's generator, copied before the batched draft draws from it
        for s in decl.seqs:
            generator = requests[s.request_id].generator
            if s.verify and generator is not None:
                replays[s.request_id] = torch.Generator(generator.device)
                replays[s.request_id].set_state(generator.get_state())
        drafts = real_propose(decl, requests, input_ids, advance)
        for b, proposal in drafts.items():
            s = decl.seqs[b]
            want = alone(engine.spec.proposer, s, requests[s.request_id].params, replays.get(s.request_id))
            assert_same_proposal(proposal, want)
            checked.append((len(drafts), s.num_drafts, requests[s.request_id].params.greedy))
        return drafts

    engine.spec.propose = check
    prompts = [list(range(3, 3 + n)) for n in (2, 11, 30, 5, 19)]
    jobs = [(f"r{i}", prompt, SamplingParams(max_tokens=14, temperature=0, ignore_eos=True) if i % 2 == 0 else
             SamplingParams(max_tokens=14, temperature=0.9, top_p=0.9, seed=i, ignore_eos=True))
            for i, prompt in enumerate(prompts)]
    run_to_completion(engine, jobs, per_step=1, max_steps=205)
    batch_sizes = {n for n, _, _ in checked}
    assert max(batch_sizes) >= 4 and {k for _, k, _ in checked} >= {3, 5}
    assert {greedy for _, _, greedy in checked} == {True, False}
