"""The DSpark draft trainer (mstar/training/draft.py) on the tiny random target: the batched training forward
against the inference path, the loss terms, a few optimizer steps, and the command end to end."""

from __future__ import annotations

import json
import math
import random
import shutil

import pytest
import torch
import torch.nn.functional as F
from paths import ROOT

from mstar.models.dspark.config import parse_dspark_config
from mstar.models.dspark.model import K3DSparkModel
from mstar.models.kimi_k3.config import parse_config
from mstar.training import card
from mstar.training import draft as trainer
from mstar.training.continuations import Continuations, generate
from mstar.training.draft import (
    BLOCK_SIZE,
    DraftTrainConfig,
    ServedAcceptance,
    draft_blocks,
    dspark_loss,
    frozen_target,
    greedy_drafts,
    mini_dspark_raw_config,
    new_draft,
    random_anchors,
    sample_batch,
    slot_positions,
    spread_taps,
    train_step,
)
from mstar.training.target import make_optimizer, mini_k3_raw_config

F64 = torch.float64


@pytest.fixture(scope="module")
def target(tiny_dir):
    """The tiny target, frozen, loaded for this module alone (training must not touch the shared fixtures)."""
    return frozen_target(tiny_dir)


@pytest.fixture(scope="module")
def window(tiny_model_fp64):
    """48 random ids and the fp64 target's output on them (taps and logits)."""
    ids = torch.randint(0, 1024, (48,), generator=torch.Generator().manual_seed(5))
    return ids, tiny_model_fp64(ids, tap_layers=(1, 4, 6))


def test_taps_spread_over_the_target_and_the_mini_config_parses():
    assert spread_taps(8) == [1, 4, 6] and spread_taps(6) == [1, 3, 4] and spread_taps(5) == [1, 2, 3]
    with pytest.raises(ValueError, match="too few tappable layers"):
        spread_taps(4)
    target_cfg = parse_config(mini_k3_raw_config())
    cfg = parse_dspark_config(mini_dspark_raw_config(target_cfg))
    cfg.check_matches_target(target_cfg.hidden_size, target_cfg.num_hidden_layers, target_cfg.vocab_size)
    assert cfg.target_layer_ids == (1, 3, 4) and cfg.num_hidden_layers == 2 and cfg.markov_rank == 64
    assert cfg.intermediate_size == 2 * target_cfg.hidden_size and cfg.mask_token_id == 2048 + 253


def test_batched_training_forward_equals_the_inference_path(tiny_dirs, tiny_model_fp64, window, monkeypatch):
    """Every block of one batched, masked forward equals `block_hidden` + lm_head + `markov_logits` run alone on a
    cache holding the whole window (rows at and after the anchor present, so a leak of future context or of a
    neighbouring block shows); greedy drafts and confidence match `propose`."""
    model, target = K3DSparkModel.from_checkpoint(tiny_dirs[1], dtype=F64), tiny_model_fp64
    ids, out = window
    anchors = random_anchors(ids.numel(), 6, torch.Generator().manual_seed(1))
    blocks = draft_blocks(model, target, ids, out.taps, anchors)
    drafts = greedy_drafts(model, blocks.base_logits, ids[anchors])
    cache = model.new_cache()
    model.extend_context(cache, out.taps)
    embed, lm_head = target.model.embed_tokens, target.lm_head
    for n, a in enumerate(anchors.tolist()):
        hidden = model.block_hidden(cache, int(ids[a]), a, BLOCK_SIZE, embed)
        base = lm_head(hidden)
        true_prev = ids[a : a + BLOCK_SIZE]
        assert (blocks.hidden[n] - hidden).abs().max() < 1e-10
        assert (blocks.logits[n] - model.markov_logits(base, true_prev)).abs().max() < 1e-10
        assert torch.equal(blocks.prev_tokens[n], true_prev) and torch.equal(blocks.labels[n], ids[a + 1 : a + 8])
        conf = model.confidence_logits(blocks.hidden[n], true_prev).sigmoid()
        assert (conf - model.confidence(hidden, true_prev)).abs().max() < 1e-12
        proposal = model.propose(cache, int(ids[a]), a, BLOCK_SIZE, embed, lm_head)
        assert torch.equal(drafts[n], proposal.tokens)

    # The comparison is sensitive to the mask: letting every query see everything breaks it.
    def see_everything(anchors, context_len):
        queries = BLOCK_SIZE * anchors.numel()
        return torch.ones(queries, context_len + queries, dtype=torch.bool)

    monkeypatch.setattr(trainer, "block_visibility", see_everything)
    leaky = draft_blocks(model, target, ids, out.taps, anchors)
    assert (leaky.hidden - blocks.hidden).abs().max() > 1e-2


@torch.no_grad()
def test_loss_terms_follow_the_formula(tiny_dirs, tiny_model_fp64, window):
    """0.1 CE + 0.9 sum_k exp(-k/4) L1_k + BCE(c_k, 1 - L1_k / 2), written out slot by slot."""
    model, target = K3DSparkModel.from_checkpoint(tiny_dirs[1], dtype=F64), tiny_model_fp64
    ids, out = window
    anchors = torch.tensor([2, 9, 30])
    blocks = draft_blocks(model, target, ids, out.taps, anchors)
    loss, parts = dspark_loss(model, blocks, out.logits[slot_positions(anchors)])
    ce = l1 = bce = 0.0
    for n, a in enumerate(anchors.tolist()):
        for k in range(BLOCK_SIZE):
            logits = blocks.logits[n, k]
            ce += float(-logits.log_softmax(-1)[ids[a + k + 1]]) / (3 * BLOCK_SIZE)
            dist = float((logits.softmax(-1) - out.logits[a + k].softmax(-1)).abs().sum())
            l1 += math.exp(-k / 4) * dist / 3
            c = float(model.confidence(blocks.hidden[n, k], blocks.prev_tokens[n, k]))
            bce += float(F.binary_cross_entropy(torch.tensor(c, dtype=F64), torch.tensor(1 - dist / 2, dtype=F64)))
    bce /= 3 * BLOCK_SIZE
    assert parts["ce"] == pytest.approx(ce, rel=1e-9) and parts["l1"] == pytest.approx(l1, rel=1e-9)
    assert parts["bce"] == pytest.approx(bce, rel=1e-9)
    assert float(loss) == parts["loss"] == pytest.approx(0.1 * ce + 0.9 * l1 + bce, rel=1e-9)


def test_a_few_steps_on_a_fixed_batch_reduce_the_loss(target):
    model = new_draft(mini_dspark_raw_config(target.config), seed=0)
    cfg = DraftTrainConfig(seq_len=48, batch=2, anchors=8, lr=3e-3)
    stream = torch.randint(0, 1024, (4000,), generator=torch.Generator().manual_seed(2))
    batch = sample_batch(stream, cfg, torch.Generator().manual_seed(3), torch.device("cpu"))
    opt = make_optimizer(model, cfg)
    losses = [train_step(model, target, batch, opt, cfg.grad_clip)["loss"] for _ in range(6)]
    assert losses[-1] < 0.9 * losses[0], losses
    assert all(p.grad is None for p in target.parameters())  # the shared embedding and lm_head stay frozen


def test_command_writes_a_loadable_draft_and_its_report(tiny_dir, target, tmp_path):
    out = tmp_path / "draft"
    flags = ["--steps", "2", "--batch", "1", "--seq-len", "40", "--anchors", "4", "--eval-windows", "2",
             "--engine-tokens", "4"]
    trainer.main([str(tiny_dir), str(out), *flags, "--device", "cpu"])
    model = K3DSparkModel.from_checkpoint(out)
    cfg = model.config
    cfg.check_matches_target(target.config.hidden_size, target.config.num_hidden_layers, target.config.vocab_size)
    assert cfg.target_layer_ids == (1, 4, 6) and cfg.num_hidden_layers == 2
    report = json.loads((out / "training.json").read_text())
    assert report["block_size"] == BLOCK_SIZE and [h["step"] for h in report["history"]] == [0, 1]
    for when in ("before", "after"):
        acc = report["acceptance"][when]
        assert 1 <= acc["mean_accepted_length"] <= BLOCK_SIZE + 1
        assert len(acc["acceptance_per_position"]) == len(acc["prefix_acceptance"]) == BLOCK_SIZE
        assert len(acc["mean_confidence_per_position"]) == BLOCK_SIZE
        assert acc["num_blocks"] == 2 * len(range(1, 40 - BLOCK_SIZE, 4))
    assert report["tokens_per_s"] > 0 and set(report["history"][-1]) >= {"loss", "ce", "l1", "bce"}


def test_continuation_batches_anchor_in_the_continuation(target):
    """Anchors lie in the continuation with a whole block after them; a continuation the target stopped before
    a block fits (the 57-token one: 6 tokens after its prompt) is never drawn."""
    lengths = [40, 33, 60, 57]
    data = Continuations(sequences=[torch.randint(0, 1000, (n,)) for n in lengths], prompt_lens=[20, 5, 51, 51],
                         temperature=0.0)
    cfg = DraftTrainConfig(seq_len=48, batch=6, anchors=8)
    for ids, anchors in sample_batch(data, cfg, torch.Generator().manual_seed(random.randrange(1 << 30)),
                                     torch.device("cpu")):
        i = lengths.index(ids.numel())
        room = ids.numel() - BLOCK_SIZE - data.prompt_lens[i]
        assert anchors.numel() == min(8, room) and len(set(anchors.tolist())) == anchors.numel()
        assert anchors.min() >= data.prompt_lens[i] and anchors.max() + BLOCK_SIZE < ids.numel()
    with pytest.raises(ValueError, match="no continuation is longer than a block"):
        sample_batch(Continuations(data.sequences[3:], data.prompt_lens[3:], 0.0), cfg, torch.Generator(),
                     torch.device("cpu"))


def test_served_acceptance_walks_blocks_as_serving_does(tiny_dirs, tiny_model_fp64):
    """Blocks drafted one after another by `propose` on a cache of the target's taps, each starting where the
    previous one's accepted drafts end, give the same accepted lengths as the batched walk."""
    model, target = K3DSparkModel.from_checkpoint(tiny_dirs[1], dtype=F64), tiny_model_fp64
    gen = torch.Generator().manual_seed(random.randrange(1 << 30))
    prompts = [torch.randint(0, 1000, (n,), generator=gen).tolist() for n in (5, 9)]
    # continuations partly the draft's own proposals, so that some blocks are accepted in part or whole
    sequences = []
    for p in prompts:
        ids = list(p)
        while len(ids) < len(p) + 30:
            ids.append(int(torch.randint(0, 1000, (1,), generator=gen)))
            cache = model.new_cache()
            model.extend_context(cache, target(torch.tensor(ids[:-1]), tap_layers=model.config.target_layer_ids).taps)
            proposal = model.propose(cache, ids[-1], len(ids) - 1, BLOCK_SIZE, target.model.embed_tokens,
                                     target.lm_head)
            keep = int(torch.randint(0, BLOCK_SIZE + 1, (1,), generator=gen))
            ids += proposal.tokens[:keep].tolist()
        sequences.append(torch.tensor(ids))
    data = Continuations(sequences=sequences, prompt_lens=[len(p) for p in prompts], temperature=0.0)
    report = ServedAcceptance(target, data, model.config.target_layer_ids).evaluate(model)

    accepted = []
    for ids, start in zip(sequences, data.prompt_lens, strict=True):
        taps = target(ids, tap_layers=model.config.target_layer_ids).taps
        a = start
        while a + BLOCK_SIZE < ids.numel():
            cache = model.new_cache()
            model.extend_context(cache, taps[:a])
            drafts = model.propose(cache, int(ids[a]), a, BLOCK_SIZE, target.model.embed_tokens, target.lm_head).tokens
            n = int((drafts == ids[a + 1 : a + 1 + BLOCK_SIZE]).long().cumprod(0).sum())
            accepted.append(n)
            a += n + 1
    assert report["num_blocks"] == len(accepted)
    assert report["mean_accepted_length"] == pytest.approx(1 + sum(accepted) / len(accepted), abs=1e-4)
    assert max(accepted) > 0


def test_command_self_distills_from_a_draft_with_its_learning_curve(tiny_dirs, target, tokenizer, tmp_path):
    """--init starts from a checkpoint, --train-data trains on continuations, and the served acceptance is
    recorded before, every --served-eval-every steps, and after."""
    gen = torch.Generator().manual_seed(random.randrange(1 << 30))
    prompts = [torch.randint(0, 1000, (6,), generator=gen).tolist() for _ in range(3)]
    generate(target, tokenizer, prompts, [30] * 3, 0.0, 0, log=lambda _: None).save(tmp_path / "c.pt")
    out = tmp_path / "draft"
    flags = ["--steps", "3", "--batch", "1", "--seq-len", "40", "--anchors", "4", "--eval-windows", "1",
             "--served-tokens", "12", "--engine-tokens", "4", "--served-eval-every", "2",
             "--train-data", str(tmp_path / "c.pt"),
             "--served-data", str(tmp_path / "held_out.pt"),
             "--init", str(tiny_dirs[1])]
    trainer.main([str(tiny_dirs[0]), str(out), *flags, "--device", "cpu"])
    report = json.loads((out / "training.json").read_text())
    assert report["init"] == str(tiny_dirs[1]) and report["train_data"]["sequences"] == 3
    served = report["served_acceptance"]
    assert [c["step"] for c in served["curve"]] == [2, 3]
    assert served["curve"][-1]["mean_accepted_length"] == served["after"]["mean_accepted_length"]
    assert 1 <= served["before"]["mean_accepted_length"] <= BLOCK_SIZE + 1
    assert served["before"]["num_blocks"] > 0 and report["tokens_seen"] == report["history"][-1]["tokens"] > 0
    for engine in report["engine_acceptance"].values():  # the 24 prompts through the engine at k = 7
        assert 1 <= engine["mean_accepted_length"] <= BLOCK_SIZE + 1 and engine["verify_rows"] >= 24
        assert len(engine["accepted_by_position"]) == BLOCK_SIZE
    held_out = Continuations.load(tmp_path / "held_out.pt")  # cached for the next run
    new_tokens = [s.numel() - n for s, n in zip(held_out.sequences, held_out.prompt_lens, strict=True)]
    assert len(new_tokens) == 24 and max(new_tokens) == 12 and min(new_tokens) >= 1
    text = card.draft_card(out, tiny_dirs[0], report, curve_plotted=False)
    assert "| 2 |" in text and "| 3 |" in text and "continuation tokens" in text and str(tiny_dirs[1]) in text


def test_the_shipped_pairs_cards_regenerate(tmp_path):
    """`python -m mstar.training.card` on copies of models/: the shipped draft was trained in stages (corpus
    windows, then self-distillation from that draft, twice), and its card tells each and carries the served
    figures and their learning curve across the stages that measured it."""
    target, draft = (shutil.copytree(ROOT / "models" / name, tmp_path / name)
                     for name in ("kimi_k3_mini", "kimi_k3_mini_dspark"))
    card.main([str(target), str(draft)])
    report = json.loads((draft / "training.json").read_text())
    text = (draft / "README.md").read_text()
    distilled = "the target's continuations of training-stream prompts"
    assert [run["train_data"]["source"] for run in card.stages(report)] == ["corpus windows", distilled, distilled]
    assert "Stage 1:" in text and "Stage 3:" in text and "from random weights" in text
    curve = card.served_curve(report)
    assert [c["stage"] for c in curve[:2]] == [2, 2] and curve[-1]["stage"] == 3
    assert all(a["tokens"] < b["tokens"] for a, b in zip(curve, curve[1:], strict=False))
    served = report["served_acceptance"]["after"]["mean_accepted_length"]
    corpus = report["acceptance"]["after"]["mean_accepted_length"]
    assert f"**{served:.2f}** after" in text and f"**{corpus:.2f}** after" in text
    engine = report["engine_acceptance"]["after"]["mean_accepted_length"]
    assert f"**{engine:.2f}** after; verify rows" in text
    assert f"Mean accepted length {engine:.2f} tokens per verify" in (target / "README.md").read_text()
