"""An EngineCore run to completion, the way tests drive one: requests added all at once or a few per step,
steps until the engine has no work left, every output kept in order."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from mstar.config import EngineConfig
from mstar.engine.core import EngineCore, SpeculativeModels
from mstar.engine.outputs import RequestOutput
from mstar.engine.params import SamplingParams

Job = tuple[str, list[int], SamplingParams]  # (request id, prompt ids, params): `add_request`'s arguments


MODES = ("sync", "async", "dspark")


def mode_engine(model, tokenizer, mode: str, draft=None) -> EngineCore:
    """A 256-token engine of 8 sequences in one of MODES: the synchronous loop, async scheduling, or DSpark
    with `draft` at 3 drafts (eager: these are CPU tests)."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    spec = SpeculativeModels(draft) if mode == "dspark" else None
    cfg = EngineConfig(max_seq_len=256, resources={"mla_kv": {"page_size": 16, "max_num_pages": 128},
                                                   "kda_state": {"max_slots": 9}},
                       scheduler={"max_num_seqs": 8, "max_num_batched_tokens": 128},
                       model_kwargs={"async_scheduling": mode == "async", "cuda_graphs": False,
                                     "speculative_tokens": 3 if spec else 0})
    return EngineCore(model, tokenizer, cfg, spec)


def greedy(max_tokens: int) -> SamplingParams:
    """Greedy, exactly `max_tokens` tokens (the end-of-turn id does not stop it)."""
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)


def numbered(jobs: Iterable[Sequence], params: Callable[[int], SamplingParams] = greedy) -> list[Job]:
    """Requests "r0", "r1", ... of `jobs` whose items start (prompt, max_tokens, ...)."""
    return [(f"r{i}", list(job[0]), params(job[1])) for i, job in enumerate(jobs)]


@dataclass
class EngineRun:
    outputs: dict[str, list[RequestOutput]]  # per request id, its outputs in order
    steps: int

    def tokens(self, request_id: str) -> list[int]:
        return [t for out in self.outputs.get(request_id, ()) for t in out.new_token_ids]

    def tokens_per_request(self) -> dict[str, list[int]]:
        return {rid: self.tokens(rid) for rid in self.outputs}

    def numbered_tokens(self, n: int) -> list[list[int]]:
        """The tokens of "r0" .. "r{n-1}" (the requests of `numbered`)."""
        return [self.tokens(f"r{i}") for i in range(n)]

    def finish_reasons(self) -> dict[str, str | None]:
        return {rid: outs[-1].finish_reason for rid, outs in self.outputs.items() if outs[-1].finished}

    def errors(self) -> list[str]:
        return [out.error for outs in self.outputs.values() for out in outs if out.error]


def run_to_completion(engine, jobs: Iterable[Job] = (), *, per_step: int | None = None,
                      before_step: Callable[[int], None] | None = None, after_step: Callable[[], None] | None = None,
                      allow_errors: bool = False, max_steps: int = 5000) -> EngineRun:
    """Add `jobs` (all now, or `per_step` of them before each step), then step until the engine has no work.

    `before_step(n)` runs before step n (0, 1, ...: to abort or add requests), `after_step()` after each step.
    Asserts that no request gets an output after its last one, that no output carries an error (unless
    `allow_errors`) and that the run ends within `max_steps` steps.
    """
    pending = list(jobs)
    if per_step is None:
        per_step = len(pending)
    outputs: dict[str, list[RequestOutput]] = {}
    steps = 0
    while pending or engine.has_work():
        for _ in range(per_step):
            if pending:
                engine.add_request(*pending.pop(0))
        if before_step is not None:
            before_step(steps)
        for out in engine.step():
            earlier = outputs.setdefault(out.request_id, [])
            assert not (earlier and earlier[-1].finished), f"{out.request_id}: an output after its last one"
            assert allow_errors or out.error is None, f"{out.request_id}: {out.error}"
            earlier.append(out)
        if after_step is not None:
            after_step()
        steps += 1
        assert steps < max_steps, f"the engine made no progress in {max_steps} steps"
    return EngineRun(outputs, steps)
