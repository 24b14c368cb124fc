"""The draft's acceptance through the engine, as the serving benchmark and CI measure it: the held-out prompts
(heldout_prompts.json) served greedily with DSpark at k drafts, a fixed number of new tokens each, several
requests in flight, the engine's own counters read at the end.

The trainer's served walk (draft.py `ServedAcceptance`) drafts offline over longer continuations and reads
higher; this is the figure users see (benchmarks/mini_pair/ and tests/training/test_mini_pair.py use it).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mstar.engine.core import EngineCore
from mstar.models.dspark.model import K3DSparkModel
from mstar.models.kimi_k3.model import KimiK3ForCausalLM
from mstar.models.kimi_k3.tokenizer import KimiTokenizer
from mstar.training.continuations import continue_prompts, offline_engine

NEW_TOKENS = 48  # the serving benchmark's OUTPUT_LEN
IN_FLIGHT = 8


def serve_prompts(target: KimiK3ForCausalLM, tokenizer: KimiTokenizer, prompts: Sequence[Sequence[int]],
                  draft: K3DSparkModel | None, k: int, new_tokens: int = NEW_TOKENS,
                  in_flight: int = IN_FLIGHT) -> tuple[list[list[int]], EngineCore]:
    """Each prompt's greedy `new_tokens` (end-of-turn ids do not stop them) through an engine of `in_flight`
    sequences, with `draft` at k drafts (k = 0: no speculation), eager; and the engine, for its counters."""
    engine = offline_engine(target, tokenizer, max(len(p) for p in prompts) + new_tokens, max_batch=in_flight,
                            draft=draft if k else None, k=k)
    with torch.no_grad():
        tokens = continue_prompts(engine, prompts, [new_tokens] * len(prompts), temperature=0.0, seed=0,
                                  log=lambda _: None, ignore_eos=True)
    return tokens, engine


def engine_acceptance(target: KimiK3ForCausalLM, tokenizer: KimiTokenizer, prompts: Sequence[Sequence[int]],
                      draft: K3DSparkModel, k: int, new_tokens: int = NEW_TOKENS) -> dict:
    """The mean accepted length per verify row (accepted drafts + 1) and the fraction of verify rows whose draft i
    was accepted, as the engine counts them."""
    _, engine = serve_prompts(target, tokenizer, prompts, draft, k, new_tokens)
    stats = engine.stats()
    return dict(
        method=f"the {len(prompts)} held-out prompts served by the engine, {new_tokens} greedy tokens each, "
        f"{IN_FLIGHT} in flight, k = {k}",
        mean_accepted_length=round(stats.spec_mean_accepted_length, 4),
        verify_rows=stats.spec_verify_rows,
        accepted_by_position=[round(a / max(d, 1), 4) for a, d in
                              zip(stats.spec_accepted_by_position, stats.spec_drafted_by_position, strict=True)],
    )
