"""DSpark speculative decoding in the engine: greedy output with speculation equals without, the
draft's context rows are exactly the accepted positions, and the KDA state is never rolled back."""

import random

import pytest
import torch

from mstar.engine.core import EngineConfig, EngineCore, SpeculativeConfig
from mstar.engine.params import SamplingParams
from mstar.engine.scheduler import SchedulerConfig
from mstar.engine.speculation import Speculation
from mstar.models.dspark.model import DraftProposal, K3DSparkModel
from mstar.models.kimi_k3.generate import greedy_generate
from mstar.models.kimi_k3.tokenizer import KimiTokenizer


@pytest.fixture(scope="module")
def tokenizer(tiny_dir):
    return KimiTokenizer.from_dir(tiny_dir)


@pytest.fixture(scope="module")
def draft(tiny_dirs):
    return K3DSparkModel.from_checkpoint(tiny_dirs[1], dtype=torch.float32)


@pytest.fixture(scope="module")
def jobs(tiny_model):
    rng = random.Random()
    out = []
    for n in [1, 3, 9, 16, 17, 40, 90, 150]:
        prompt = [rng.randrange(1000) for _ in range(n)]
        max_tokens = rng.randint(5, 30)
        out.append((prompt, max_tokens, greedy_generate(tiny_model, prompt, max_tokens)))
    return out


def make_engine(model, tokenizer, draft, k, schedule=(), **sched):
    spec = SpeculativeConfig(draft=draft, speculative_tokens=k, schedule=schedule) if k else None
    cfg = EngineConfig(max_seq_len=512, page_size=8, max_num_pages=400, max_kda_slots=9,
                       scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=96, **sched), speculative=spec)
    return EngineCore(model, tokenizer, cfg)


def run(engine, jobs, params=lambda mt: SamplingParams(max_tokens=mt, temperature=0, ignore_eos=True)):
    got = {}
    pending = list(enumerate(jobs))
    steps = 0
    while pending or engine.has_work():
        if pending:
            i, (prompt, max_tokens, _) = pending.pop(0)
            engine.add_request(f"r{i}", prompt, params(max_tokens))
        for out in engine.step():
            got.setdefault(out.request_id, []).extend(out.new_token_ids)
        steps += 1
        assert steps < 3000
    return [got[f"r{i}"] for i in range(len(jobs))], steps


class OracleSpeculation(Speculation):
    """Drafts the reference continuation for a random number of tokens, then a wrong token: so every
    accepted length 0..k occurs, and acceptance, trimming and the pending KDA prefix are exercised."""

    def __init__(self, base: Speculation, references: dict[str, list[int]]):
        super().__init__(base.proposer, base.schedule, base.method)
        self.references = references

    def propose(self, decl, requests):
        super().propose(decl, requests)  # keeps the draft KV plan; the real drafts are replaced
        drafts = {}
        for b, s in enumerate(decl.seqs):
            if s.verify and s.num_drafts:
                full = self.references[s.request_id]
                truth = full[s.num_computed + 1 : s.num_computed + 1 + s.num_drafts]
                good = random.randint(0, s.num_drafts)
                tokens = [t if i < good else (t + 1) % 1000 for i, t in enumerate(truth)]
                vocab = self.proposer.config.vocab_size
                t = torch.tensor(tokens)
                probs = torch.nn.functional.one_hot(t, vocab).float()
                drafts[b] = DraftProposal(tokens=t, probs=probs, logits=probs, base_logits=probs,
                                          hidden=torch.zeros(len(tokens), 1), confidence=None, greedy=True)
        return drafts


@pytest.mark.parametrize("mixed", [True, False])
def test_oracle_drafts_accept_every_length_and_match_reference(tiny_model, tokenizer, draft, jobs, mixed):
    engine = make_engine(tiny_model, tokenizer, draft, k=5, mixed_prefill_decode=mixed)
    engine.spec = OracleSpeculation(engine.spec, {f"r{i}": p + ref for i, (p, _, ref) in enumerate(jobs)})
    outputs, _ = run(engine, jobs)
    assert outputs == [ref for _, _, ref in jobs]
    assert engine.spec.num_accepted > 0 and engine.spec.num_accepted < engine.spec.num_drafted
    assert engine.kv.allocator.num_used == 0 and engine.pool.num_used == 0
    assert engine.spec.proposer.kv.allocator.num_used == 0


def test_real_draft_greedy_equals_speculation_off(tiny_model, tokenizer, draft, jobs):
    on, _ = run(make_engine(tiny_model, tokenizer, draft, k=7, schedule=((4, 7), (8, 3))), jobs)
    off, _ = run(make_engine(tiny_model, tokenizer, draft, k=0), jobs)
    assert on == off == [ref for _, _, ref in jobs]


def test_draft_context_rows_are_the_accepted_positions(tiny_model, tokenizer, draft):
    engine = make_engine(tiny_model, tokenizer, draft, k=4)
    prompt = list(range(5, 45))
    engine.add_request("a", prompt, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
    for _ in range(12):
        engine.step()
    request = engine.requests["a"]
    n = request.num_computed
    assert n > len(prompt)
    ids = torch.tensor((request.prompt_ids + request.output_ids)[:n])
    taps = tiny_model(ids, tap_layers=draft.config.target_layer_ids).taps
    expect = draft.context_kv(taps, torch.arange(n))
    kv = engine.spec.proposer.kv
    pages = torch.tensor(kv.pages["a"])
    for layer, rows in enumerate(expect):
        torch.testing.assert_close(kv.rows(layer, pages, n), rows, rtol=1e-4, atol=1e-4)
    assert kv.lengths["a"] == n == engine.kv.lengths["a"]


def test_sampled_speculation_is_seeded_and_complete(tiny_model, tokenizer, draft, jobs):
    def params(mt):
        return SamplingParams(max_tokens=mt, temperature=0.8, top_p=0.95, seed=11, ignore_eos=True)

    a, _ = run(make_engine(tiny_model, tokenizer, draft, k=3), jobs, params)
    b, _ = run(make_engine(tiny_model, tokenizer, draft, k=3), jobs, params)
    assert a == b
    assert [len(x) for x in a] == [mt for _, mt, _ in jobs]
