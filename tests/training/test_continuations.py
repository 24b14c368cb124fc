"""The target's own continuations (mstar/training/continuations.py): batched through the engine, they are the
reference's greedy tokens; sampled ones follow their seed; the cache file round-trips."""

from __future__ import annotations

import random

import pytest
import torch
from greedy_ties import assert_greedy_matches

from mstar.models.kimi_k3.generate import greedy_generate
from mstar.training.continuations import Continuations, generate, training_prompts


def random_prompts(count: int) -> list[list[int]]:
    rng = random.Random()
    return [[rng.randrange(1000) for _ in range(rng.randint(3, 12))] for _ in range(count)]


def test_greedy_continuations_are_the_references_and_the_file_round_trips(tiny_model, tokenizer, tmp_path):
    prompts = random_prompts(5)
    new = [random.randint(4, 12) for _ in prompts]
    data = generate(tiny_model, tokenizer, prompts, new, temperature=0.0, seed=0, log=lambda _: None)
    assert data.prompt_lens == [len(p) for p in prompts]
    jobs = [(p, n, greedy_generate(tiny_model, p, n, stop_ids=tokenizer.stop_ids))
            for p, n in zip(prompts, new, strict=True)]
    for seq, p in zip(data.sequences, prompts, strict=True):
        assert seq[: len(p)].tolist() == p
    assert_greedy_matches(tiny_model, jobs, [s[len(p):].tolist() for s, p in zip(data.sequences, prompts, strict=True)],
                          max_tied=1)
    data.save(tmp_path / "c.pt")
    back = Continuations.load(tmp_path / "c.pt")
    assert back.prompt_lens == data.prompt_lens and back.temperature == 0.0
    assert all(torch.equal(a, b) for a, b in zip(back.sequences, data.sequences, strict=True))
    lens = zip(data.sequences, data.prompt_lens, strict=True)
    assert back.num_continuation_tokens() == sum(s.numel() - p for s, p in lens)
    both = Continuations.load_all([tmp_path / "c.pt", tmp_path / "c.pt"])
    assert both.prompt_lens == 2 * data.prompt_lens and len(both.sequences) == 2 * len(data.sequences)
    Continuations(sequences=data.sequences, prompt_lens=data.prompt_lens, temperature=0.7).save(tmp_path / "t.pt")
    with pytest.raises(ValueError, match="mix temperatures"):
        Continuations.load_all([tmp_path / "c.pt", tmp_path / "t.pt"])


def test_sampled_continuations_follow_the_seed(tiny_model, tokenizer):
    prompts = random_prompts(4)
    quiet = dict(log=lambda _: None)
    whole = generate(tiny_model, tokenizer, prompts, [10] * 4, temperature=0.7, seed=3, **quiet)
    again = generate(tiny_model, tokenizer, prompts, [10] * 4, temperature=0.7, seed=3, **quiet)
    assert all(torch.equal(a, b) for a, b in zip(whole.sequences, again.sequences, strict=True))
    other = generate(tiny_model, tokenizer, prompts, [10] * 4, temperature=0.7, seed=4, **quiet)
    assert any(not torch.equal(a, b) for a, b in zip(whole.sequences, other.sequences, strict=True))


def test_training_prompts_are_windows_of_the_stream():
    stream = torch.randperm(5000)
    prompts = training_prompts(stream, 20, 5, 9, torch.Generator().manual_seed(random.randrange(1 << 30)))
    assert len(prompts) == 20 and all(5 <= len(p) <= 9 for p in prompts)
    for p in prompts:  # stream values are distinct, so a window is where its first value sits
        start = int((stream == p[0]).nonzero())
        assert stream[start : start + len(p)].tolist() == p
