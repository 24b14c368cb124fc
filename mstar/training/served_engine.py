"""The draft's acceptance through the engine, as the serving benchmark and CI measure it: the held-out prompts
(heldout_prompts.json) served greedily with DSpark at k drafts, a fixed number of new tokens each, several
requests in flight, the engine's own counters read at the end.

The trainer's served walk (draft.py `ServedAcceptance`) drafts offline over longer continuations and reads
higher; this is the figure users see (benchmarks/mini_pair/ and tests/training/test_mini_pair.py use it).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mstar.config import EngineConfig
from mstar.engine.core import EngineCore, SpeculativeModels
from mstar.engine.params import SamplingParams
from mstar.models.dspark.model import K3DSparkModel
from mstar.models.kimi_k3.model import KimiK3ForCausalLM
from mstar.models.kimi_k3.tokenizer import KimiTokenizer

NEW_TOKENS = 48  # the serving benchmark's OUTPUT_LEN
IN_FLIGHT = 8


def serve_prompts(target: KimiK3ForCausalLM, tokenizer: KimiTokenizer, prompts: Sequence[Sequence[int]],
                  draft: K3DSparkModel | None, k: int, new_tokens: int = NEW_TOKENS,
                  in_flight: int = IN_FLIGHT) -> tuple[list[list[int]], EngineCore]:
    """Each prompt's greedy `new_tokens` (end-of-turn ids do not stop them) through an engine of `in_flight`
    sequences, with `draft` at k drafts (k = 0: no speculation), eager; and the engine, for its counters."""
    longest = max(len(p) for p in prompts) + new_tokens
    config = EngineConfig(max_seq_len=longest,
                          resources={"mla_kv": {"page_size": 16, "max_num_pages": (in_flight + 1) * -(-longest // 16)},
                                     "kda_state": {"max_slots": in_flight + 1}},
                          scheduler={"max_num_seqs": in_flight, "max_num_batched_tokens": 512},
                          model_kwargs={"speculative_tokens": k, "cuda_graphs": False})
    engine = EngineCore(target, tokenizer, config, SpeculativeModels(draft) if k else None)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), list(prompt), SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True))
    tokens: list[list[int]] = [[] for _ in prompts]
    with torch.no_grad():
        while engine.has_work():
            for out in engine.step():
                if out.error:
                    raise RuntimeError(f"serving held-out prompt {out.request_id} failed: {out.error}")
                tokens[int(out.request_id)].extend(out.new_token_ids)
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
