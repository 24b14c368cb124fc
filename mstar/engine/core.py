"""The engine core: one loop of declare -> admit -> plan -> forward -> commit, then outputs.

Single-threaded by design: `add_request`, `abort_request` and `step` are called from the engine
thread only (the async front end hands requests over through a queue).

A step is launched, then finished. Launching queues all of its device work: drafts, forward, the
choice of each row's token (sampled or verified), the finite check and logprobs, and one copy of
those results to the host (step_results.py, transfer.py); nothing in it waits for the GPU. What the
launch knows is committed there: every row of a prefill chunk or decode row, and a verify block's
anchor row (its drafts are kept or not by verification, on the device). Finishing waits for the
results (the step's only device-to-host synchronization), adds the drafts each verify block kept
(`_settle`), and appends, detokenizes and applies the stop conditions.

Async scheduling (`model_kwargs.async_scheduling`, by default on CUDA devices): `step()` schedules and launches
step N+1 *before* it finishes step N, so the GPU runs N+1 while the host turns N's tokens into
outputs, and plans the step after while N+1 runs. The scheduler declares N+1 assuming every
running request goes on: a request's token that N samples is still in flight (`num_inflight`,
`request.PLACEHOLDER` in the declared ids), and `_plan` has the device copy it from N's chosen
tokens into N+1's input ids. A request that turns out to stop at N (stop id or string, or a
non-finite row) has one extra row in N+1, whose token is dropped; requests whose in-flight tokens
reach max_tokens are not scheduled again. Each `step()` therefore returns the outputs of the step
before the one it launched; seeds, logprobs and stops are those of the synchronous loop.

Speculative steps overlap the same way. When N holds a request's verify block, the host knows its
newest token (the correction or bonus) and how many drafts N keeps only when N finishes, so N+1's
block for the request sits 0..k_N positions past what the host knows (`SeqStep.lag`). Its plan
takes that shift on the device from N's verdict (`BatchPlan.advance`): the anchor token, the KV
slots and context lengths (latent_kv.py), the KDA pending prefix (models/kimi_k3/serving.py), the
draft's positions and its context rows (speculative/proposer.py); admission reserves room for the
furthest. So the draft and target of N+1 are queued while the host still turns N's results into
outputs. Each request's drafts are those of the synchronous loop (with a fixed draft count; a
schedule that changes k with the batch size sees the one extra row of a request stopping at N),
so are its greedy and seeded outputs. N finishes before N+1 is declared (`_needs_verdicts`) where
N+1 might not be verify rows alone (a request waits or prefills: prefill layouts read lengths on the
host) or where N's verdict decides how many drafts fit before max_seq_len. Near max_tokens blocks are
not cut to the tokens left (scheduler.py: a cut block is a step no verify graph takes), so N+1 is
launched there too; a request that N ends has its row of N+1 dropped, as one that N stops does.

Resources freed while a step is in flight (a request finished at N or aborted, while N+1, which
has a row for it, is queued) are safe to hand out at once: only a later launch can reuse a page or
KDA slot, and its kernels (the slot's zeroing at admission included) are queued on the same stream
after N+1's, so they run after N+1 has written what it writes there. The host reads no device
memory of a step except through the step's own result copy. (The CPU runs every op at once, so
there nothing is ever in flight.)

Prefix caching (prefix_cache.py, `prefix_cache.enabled`): the scheduler starts a new request after the
longest cached prefix it can resume from; once a step is finished (its tokens on the host) the engine
publishes the full pages and KDA snapshots of its requests under their content keys, and a request that
ends publishes its last ones before it is released (a failed one does not: its rows may be garbage).
The KDA slot copies this makes travel with the next step to tensor-parallel followers (`slot_copies`).

Prompt logprobs (`SamplingParams.prompt_logprobs`, what evaluation harnesses score prompts with): each
prefill chunk of such a request adds its rows that score a next prompt token to the step's logits rows,
after the sampled ones (`_claim_prompt_rows`: a recompute after preemption claims no position twice, and
the prompt's first token has no row). Their log-softmax at the prompt token, its rank and the best
alternatives are computed on the device and travel in the step's one result copy (step_results.py); the
entries reach the request's first output. Such a request does not resume from the prefix cache (cached
rows have no logits). A step without such rows computes and copies what it did before. On tensor-parallel
ranks the lm_head gathers the whole vocabulary of every logits row, these rows too.

Structured outputs (structured_output.py) overlap too, in the order vLLM uses: a grammar request's mask
in step N+1 needs the token N chooses (its matcher advances on the host), so N+1's launch queues its
forward, then finishes N (the host waits for N's results, appends its tokens and advances the matchers
while the GPU runs N+1's forward), then computes N+1's masks and queues its token choice. With DSpark
the masks of a verify block need its drafts too, read to the host at that point.

What does not overlap (runs synchronously, finishing each step before scheduling the next):
- a verify step whose verdict the next step cannot take on the device (above);
- `async_scheduling=False`.
Tensor-parallel rank 0 overlaps too, but sending a step to the followers copies its input ids (and a
verify step's shifted lengths) to the host (mstar/distributed/control.py), which waits for the step
in flight to end: what overlaps there is the host's work on step N's outputs with step N+1. The torch
mixers (CPU, or a GPU without the kernels) read a plan's shift back too.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import time
from dataclasses import dataclass, replace
from typing import Literal

import torch

from mstar.config import NO_ENV, EngineConfig, Environment, torch_dtype
from mstar.engine.client import EngineStats
from mstar.engine.logits_processing import LogitsProcessing, RowHistory
from mstar.engine.output_text import OutputText
from mstar.engine.outputs import PromptLogprob, RequestOutput, RequestTimes, TokenLogprob
from mstar.engine.params import ParamError, SamplingParams
from mstar.engine.prefix_cache import PrefixCache
from mstar.engine.profiling import StepProfiler
from mstar.engine.request import PLACEHOLDER, Request, Status
from mstar.engine.sampler import Sampler, SamplingBatch, gather_logprobs, request_generator, token_ranks
from mstar.engine.scheduler import Scheduler
from mstar.engine.speculation import Speculation
from mstar.engine.step_results import LaunchedStep, pack, pack_prompt
from mstar.engine.structured_output import GrammarCompiler, apply_token_bitmask
from mstar.models.dspark.model import DraftProposal, K3DSparkModel
from mstar.models.kimi_k3.model import KimiK3ForCausalLM
from mstar.models.kimi_k3.serving import BatchPlan, StepKind
from mstar.models.kimi_k3.tokenizer import KimiTokenizer
from mstar.resources.step import StepDecl
from mstar.resources.transfer import HostCopy, to_device, to_device_lists
from mstar.runner.executor import ModelStep, StepExecutor
from mstar.runner.model_runner import ModelRunner, PoolSizes, StepLimits
from mstar.speculative.proposer import DSparkProposer, VocabHeads
from mstar.speculative.schedule import DraftSchedule
from mstar.speculative.verify import VerifyResult

log = logging.getLogger("mstar.engine")


@dataclass(frozen=True)
class SpeculativeModels:
    """What speculation runs besides its config (model_kwargs.speculative_tokens and speculative_schedule,
    resources.dspark_kv): the DSpark draft and the heads it reads with."""

    draft: K3DSparkModel | None  # None on a tensor-parallel follower: its pools hold verify blocks, rank 0 drafts
    heads: VocabHeads | None = None  # full-vocabulary embed/lm_head for the draft (default: the target's own)
    # the target layers whose taps the draft reads; given on a follower, which has no draft but must
    # capture its decode graphs with rank 0's taps to replay the same steps (default: the draft's)
    tap_layers: tuple[int, ...] = ()

    def taps(self) -> tuple[int, ...]:
        return tuple(self.draft.config.target_layer_ids) if self.draft is not None else self.tap_layers

    @classmethod
    def for_config(cls, config: EngineConfig, device: torch.device | str) -> SpeculativeModels | None:
        """The DSpark draft of `config` (model_kwargs.speculative_draft, in its dtype) on `device`; None when the
        config does not speculate."""
        if not config.speculative:
            return None
        kw = config.model_kwargs
        log.info("loading the DSpark draft %s (k=%d, schedule %s)", kw.speculative_draft, kw.speculative_tokens,
                 dict(kw.speculative_schedule) or "none")
        return cls(K3DSparkModel.from_checkpoint(kw.speculative_draft, dtype=torch_dtype(config.dtype)).to(device))


MAX_DRAFT_GRAPH_BATCH = 16  # larger batches draft eagerly (speculation pays least there, and memory grows with B)


def draft_schedule(config: EngineConfig) -> DraftSchedule | None:
    """Drafts per row by decode batch size; None when the config does not speculate."""
    mk = config.model_kwargs
    return DraftSchedule.from_config(mk.speculative_tokens, mk.speculative_schedule) if config.speculative else None


def build_runner(model: KimiK3ForCausalLM, config: EngineConfig, speculative: SpeculativeModels | None = None, *,
                 env: Environment = NO_ENV, kernels: Literal["auto", "torch"] = "auto") -> ModelRunner:
    """The runner an engine of this config drives: rank 0's EngineCore and every tensor-parallel follower
    build theirs here, so that rank 0's plans address the same pages and slots on every rank."""
    if config.speculative != (speculative is not None):
        raise ValueError(f"model_kwargs.speculative_tokens is {config.model_kwargs.speculative_tokens} but the "
                         f"engine was {'not ' if speculative is None else ''}given the speculative models: "
                         "pass SpeculativeModels exactly when speculative_tokens > 0")
    r, sched, mk, pc = config.resources, config.scheduler, config.model_kwargs, config.prefix_cache
    pools = PoolSizes(r.mla_kv.max_num_pages, r.mla_kv.page_size, r.kda_state.max_slots,
                      max_block=mk.speculative_tokens + 1 if speculative else 0,
                      kda_snapshot_interval=pc.kda_snapshot_interval if pc.enabled else 0)
    limits = StepLimits(config.max_seq_len, sched.max_num_seqs, sched.max_num_batched_tokens, sched.max_prefill_seqs,
                        tap_layers=speculative.taps() if speculative else (), draft_schedule=draft_schedule(config),
                        moe_bf16_above=env.moe_bf16_tokens)
    return ModelRunner(model, pools, limits, kernels=kernels, cuda_graphs=mk.cuda_graphs)


class EngineCore:
    def __init__(self, model: KimiK3ForCausalLM, tokenizer: KimiTokenizer, config: EngineConfig,
                 speculative: SpeculativeModels | None = None, *, env: Environment = NO_ENV,
                 kernels: Literal["auto", "torch"] = "auto"):
        """`config` is validated (a ServeConfig is one, as it is); `speculative` is given exactly when
        config.speculative; `env` holds the environment knobs, read once by whoever starts the engine.
        `kernels`: "auto" runs the GPU kernels where available, "torch" the reference mixers everywhere."""
        cfg = model.config
        self.model_config = cfg
        self.config = config
        self.tokenizer = tokenizer
        self.runner = build_runner(model, config, speculative, env=env, kernels=kernels)
        # what runs each step: the runner, or a wrapper of it (tensor-parallel rank 0, fault injection)
        self.executor: StepExecutor = self.runner
        self.kv, self.pool = self.runner.kv, self.runner.pool
        mk = config.model_kwargs
        self.spec: Speculation | None = None
        resources = [self.kv, self.pool]
        page_pools = [self.kv]
        if speculative is not None and speculative.draft is not None:
            proposer = DSparkProposer(speculative.draft, model, num_pages=config.dspark_kv_pages,
                                      page_size=config.resources.mla_kv.page_size, heads=speculative.heads)
            schedule = self.runner.limits.draft_schedule
            self.spec = Speculation(proposer, schedule)
            resources.append(proposer)
            page_pools.append(proposer.kv)  # the draft's context rows are cached with the target's pages
            if mk.cuda_graphs and proposer.paged:
                from mstar.runner.cuda_graphs import decode_buckets

                # small batches only: a bucket's graph keeps [B, k, vocab] fp32 logits and probabilities
                proposer.capture_graphs(schedule, decode_buckets(min(config.scheduler.max_num_seqs,
                                                                     MAX_DRAFT_GRAPH_BATCH)), config.max_seq_len)
        self.prefix = PrefixCache(page_pools, self.pool) if config.prefix_cache.enabled else None
        self.scheduler = Scheduler(config.scheduler, resources,
                                   drafts_for=self.spec.schedule.drafts_for if self.spec else None,
                                   mixed_prefill_decode=mk.mixed_prefill_decode, prefix=self.prefix,
                                   max_seq_len=config.max_seq_len, step_sizes=self.runner.prefill_step_sizes)
        self.sampler = Sampler()
        self.device = self.runner.device
        self.requests: dict[str, Request] = {}
        self._arrivals = itertools.count()
        self._pending_outputs: list[RequestOutput] = []
        # Async scheduling (module doc); `_in_flight` is the step launched and not yet finished.
        self._overlap = mk.async_scheduling if mk.async_scheduling is not None else self.device.type == "cuda"
        self._in_flight: LaunchedStep | None = None
        self._launches = itertools.count()
        # An id outside the model's vocabulary is never sampled, so it stops nothing (a test model cut to a
        # small tokenizer keeps the checkpoint's EOS id); the grammar engine refuses such ids.
        self.model_stop_ids = frozenset(t for t in (*tokenizer.stop_ids, cfg.eos_token_id) if t < cfg.vocab_size)
        self.grammars = GrammarCompiler(tokenizer.encoding, cfg.vocab_size, tuple(sorted(self.model_stop_ids)))
        self.profiler = StepProfiler.from_window(env.torch_profile, self.device)

    # --- requests ---------------------------------------------------------------------------
    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        vocab, limit = self.model_config.vocab_size, self.config.max_seq_len
        if not prompt_ids:
            raise ParamError("prompt is empty: give at least one token")
        bad = [t for t in prompt_ids if not 0 <= t < vocab]
        if bad:
            raise ParamError(f"prompt token ids {bad[:5]} are outside the vocabulary 0..{vocab - 1}")
        bad = [t for t, _ in params.logit_bias if not 0 <= t < vocab]
        if bad:
            raise ParamError(f"logit_bias names token ids {bad[:5]}, outside the vocabulary 0..{vocab - 1}")
        if params.grammar is not None:
            self.grammars.check(params.grammar)
        if len(prompt_ids) + params.max_tokens > limit:
            raise ParamError(f"the prompt ({len(prompt_ids)} tokens) plus max_tokens ({params.max_tokens}) exceeds "
                             f"the maximum sequence length {limit}; shorten the prompt or lower max_tokens")

    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> None:
        if request_id in self.requests:
            raise ParamError(f"request id {request_id!r} is already in use")
        self.validate(prompt_ids, params)
        stop_ids = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self.model_stop_ids)
        request = Request(
            request_id=request_id,
            prompt_ids=list(prompt_ids),
            params=params,
            arrival=next(self._arrivals),
            stop_ids=stop_ids,
            text=OutputText(self.tokenizer, params.stop, params.include_stop_str_in_output),
            generator=request_generator(params.seed, self.device) if params.seed is not None else None,
            matcher=self.grammars.matcher(params.grammar) if params.grammar is not None else None,
            queued_at=time.perf_counter(),
        )
        self.requests[request_id] = request
        self.scheduler.add(request)

    def abort_request(self, request_id: str) -> None:
        request = self.requests.get(request_id)
        if request is not None and not request.finished:
            self._finish(request, "abort")

    def has_work(self) -> bool:
        return self.scheduler.has_work() or self._in_flight is not None or bool(self._pending_outputs)

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix; running requests keep what they hold (vLLM's reset_prefix_cache)."""
        self.scheduler.reset_prefix_cache()

    def stats(self) -> EngineStats:
        spec = self.spec
        return EngineStats(
            running=len(self.scheduler.running),
            waiting=len(self.scheduler.waiting),
            kv_pages_used=self.kv.allocator.num_used,
            kv_pages_total=self.kv.allocator.capacity,
            kda_slots_used=self.pool.num_used,
            kda_slots_total=self.pool.capacity,
            spec_verify_rows=spec.num_rows if spec else 0,
            spec_draft_tokens=spec.num_drafted if spec else 0,
            spec_accepted_tokens=spec.num_accepted if spec else 0,
            spec_drafted_by_position=tuple(spec.drafted_by_position) if spec else (),
            spec_accepted_by_position=tuple(spec.accepted_by_position) if spec else (),
            num_preemptions=self.scheduler.num_preemptions,
            prefix_cache_queries=self.prefix.num_queries if self.prefix else 0,
            prefix_cache_hits=self.prefix.num_hits if self.prefix else 0,
            model_steps=tuple((shape, mode, n) for (shape, mode), n in sorted(self.runner.steps_run.items())),
        )

    # --- one step ---------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one step and return the outputs ready now. With async scheduling that is: launch step
        N+1, then finish step N (whose outputs these are); otherwise launch a step and finish it."""
        if self._needs_verdicts():
            previous, self._in_flight = self._in_flight, None
            self._finish_step(previous)
        decl = self.scheduler.schedule()
        if decl is None and self._in_flight is None:
            return self.drain_outputs()
        # The profiler counts model steps: a call that only finishes the step in flight is not one.
        with self.profiler.step() if self.profiler and decl is not None else contextlib.nullcontext():
            launched = self._launch(decl) if decl is not None else None
            previous, self._in_flight = self._in_flight, None
            if previous is not None:
                self._finish_step(previous)
            if launched is not None:
                if self._overlap:
                    self._in_flight = launched
                else:
                    self._finish_step(launched)
        return self.drain_outputs()

    def _needs_verdicts(self) -> bool:
        """Whether the step in flight must finish before the next one is declared: some verify block of it
        has a verdict (the drafts it keeps) that the next step would take on the device, and that step might
        not be one of verify rows alone (a waiting or prefilling request: prefill layouts read lengths on the
        host), or a request's drafts in it might depend on the verdict (near max_seq_len the room left cuts
        them). Near max_tokens the next step is launched as elsewhere: blocks are not cut to the tokens left
        (scheduler.py), and a request that N ends has its row of N+1 dropped, as one that N stops does."""
        step = self._in_flight
        if step is None:
            return False
        unresolved = [r for r in step.token_row if r.unresolved and r.last_launch == step.number and not r.finished]
        if not unresolved:
            return False
        scheduler = self.scheduler
        if scheduler.waiting or any(not r.is_decoding for r in scheduler.running):
            return True
        most, limit = self.spec.schedule.max_drafts, self.scheduler.max_seq_len
        return limit is not None and any(r.num_computed + r.unresolved + most >= limit for r in unresolved)

    def drain_outputs(self) -> list[RequestOutput]:
        outputs, self._pending_outputs = self._pending_outputs, []
        return outputs

    def _launch(self, decl: StepDecl) -> LaunchedStep:
        """Queue a step's device work: drafts, forward, token choice, and the copy of its results; commit
        what is known at launch (every row of a step without verify rows, a verify block's anchor row)."""
        requests = tuple(self.requests[s.request_id] for s in decl.seqs)
        now = time.perf_counter()
        for request in requests:
            if request.scheduled_at is None:
                request.scheduled_at = now
        prompt_rows = self._claim_prompt_rows(decl, requests)
        plan = self._plan(decl, requests, prompt_rows)
        drafts = self.spec.propose(decl, self.requests, plan.input_ids, plan.advance) if self.spec else {}
        if drafts:  # each block's drafts follow its anchor
            self._insert_drafts(decl, plan.input_ids, drafts)
        logits, taps = self.executor.execute(ModelStep(decl, plan, self.spec.tap_layers if self.spec else (),
                                                       slot_copies=tuple(self.pool.take_copies())))
        number, rows = next(self._launches), self._logits_rows(decl)
        # Committed before the tokens are chosen: a grammar's mask may finish the step in flight first
        # (`_choose_tokens`), whose verdicts must then see this step as the later launch (`_settle`).
        self._commit_launched(decl, requests, taps)
        for b, request in enumerate(requests):
            if rows[b][1]:
                request.num_inflight += 1
                request.last_launch = number
            if decl.seqs[b].verify:
                request.unresolved = decl.seqs[b].num_drafts
        return self._choose_tokens(number, decl, requests, drafts, plan, logits, rows, prompt_rows)

    def _insert_drafts(self, decl: StepDecl, input_ids: torch.Tensor, drafts: dict[int, DraftProposal]) -> None:
        """Put each block's drafts after its anchor in the step's input ids."""
        if decl.block_drafts:  # equal blocks, all drafting: [B, 1 + k] rows
            tokens = drafts[0].tokens if len(drafts) == 1 else torch.stack([drafts[b].tokens for b in sorted(drafts)])
            input_ids.view(len(drafts), decl.rows_each)[:, 1:].copy_(tokens)
            return
        rows = [decl.seq_starts[b] + 1 + i for b in sorted(drafts) for i in range(decl.seqs[b].num_drafts)]
        values = torch.cat([drafts[b].tokens.to(self.device) for b in sorted(drafts)])
        input_ids.index_copy_(0, to_device(rows, torch.long, self.device), values)

    def _commit_launched(self, decl: StepDecl, requests: tuple[Request, ...], taps: torch.Tensor | None) -> None:
        """Commit what the step's launch already knows: every row, but of a verify block only its anchor (the
        drafts it keeps are added when its results arrive, `_settle`); the draft's context rows of every row."""
        known = StepDecl(tuple(replace(s, accepted=1) if s.verify else s for s in decl.seqs))
        self.scheduler.commit(known)
        if self.spec:
            self.spec.write_context(decl, taps)
        for s, request in zip(known.seqs, requests, strict=True):
            request.num_computed = s.committed_end

    def _finish_step(self, step: LaunchedStep) -> None:
        """Wait for a step's results; settle its verify blocks (what verification kept), then append each
        request's new tokens, stopping where a stop condition says.

        Requests that finished since the launch (a stop in the step before, an abort) are skipped:
        their rows ran, but nothing of them is reported and what they held is already released."""
        results, prompt_results = step.fetch()
        new_tokens: list[tuple[Request, list[int], list[TokenLogprob] | None]] = []
        poisoned: list[Request] = []
        prompt_at = 0  # where sequence b's rows start in the prompt block
        for b, (s, request) in enumerate(zip(step.decl.seqs, step.requests, strict=True)):
            position, m = step.prompt_rows[b] if step.prompt_rows else (0, 0)
            if m:
                scored = prompt_results[prompt_at : prompt_at + m]
                prompt_at += m
                if not all(r.finite for r in scored):
                    poisoned.append(request)
                    continue
                self._add_prompt_logprobs(request, position, [r.entry for r in scored])
            first, n = step.rows[b]
            if not n:
                continue
            rows = results[first : first + n]
            if request in step.token_row:
                request.num_inflight -= 1
            finite = all(r.finite for r in rows)
            if s.verify:
                accepted = rows[0].accepted if finite else 0
                if finite and not request.finished:  # a row of a request that ended meanwhile is dropped
                    # drafts past max_tokens (blocks are not cut to the tokens left) are not the draft's record
                    useful = min(s.num_drafts, request.params.max_tokens - len(request.output_ids) - 1)
                    self.spec.record(useful, min(accepted, useful))
                self._settle(step, b, accepted)
                rows = rows[: accepted + 1]
            if not finite:
                # Never sample garbage: this request ends with an error; the others go on.
                poisoned.append(request)
                continue
            k = request.params.logprobs
            new_tokens.append((request, [r.token for r in rows], [r.token_logprob(k) for r in rows]
                               if k is not None else None))
        for request, tokens, logprobs in new_tokens:
            if not request.finished:
                self._append(request, tokens, logprobs)
        for request in step.requests:
            if not request.finished:
                self.scheduler.publish(request)
        for request in poisoned:
            self._fail(request, "the model produced non-finite logits (NaN or inf) for this request")

    @staticmethod
    def _add_prompt_logprobs(request: Request, position: int, entries: list[PromptLogprob]) -> None:
        """Record the entries of prompt positions `position`.. (steps finish in launch order, and each
        prompt position is launched once: `_claim_prompt_rows`), cut to the alternatives it asked for."""
        if position != len(request.prompt_logprobs):
            raise RuntimeError(f"request {request.request_id}: prompt logprobs of position {position} arrived "
                               f"after {len(request.prompt_logprobs)} of them; they must arrive in order")
        k = request.params.prompt_logprobs
        request.prompt_logprobs += [replace(e, top=e.top[:k]) for e in entries]

    def _settle(self, step: LaunchedStep, b: int, accepted: int) -> None:
        """Sequence b of `step` is a verify block that kept `accepted` drafts: its request's length grows by
        them. Its resources take the verdict too, unless a later step with a row of the request was launched
        since: that step took the verdict on the device (its plan's `advance`) and set the resources up for
        its own rows; its own settling then gives them their lengths. A request that finished or was
        preempted since the launch holds nothing of this step any more."""
        s, request = step.decl.seqs[b], step.requests[b]
        if request.finished or request.num_preemptions != step.preemptions[b]:
            if request.last_launch == step.number:
                request.unresolved = 0  # a request preempted since may be recomputed now (scheduler.py)
            return
        request.num_computed += accepted
        if request.last_launch == step.number:
            start = request.num_computed - accepted - 1
            self.scheduler.commit(StepDecl((replace(s, num_computed=start, lag=0, accepted=accepted + 1),)))
            request.unresolved = 0

    @staticmethod
    def _claim_prompt_rows(decl: StepDecl, requests: tuple[Request, ...]) -> tuple[tuple[int, int], ...]:
        """Per sequence: (first prompt position, rows) whose logits this step computes for prompt_logprobs:
        the positions of its chunk that score a next prompt token and that no earlier launch computed (a
        preempted request recomputes its prompt, but its entries are already on their way). Empty: none."""
        claimed = []
        for s, request in zip(decl.seqs, requests, strict=True):
            if not request.params.scores_prompt or s.verify:
                claimed.append((0, 0))
                continue
            first = max(s.num_computed, request.prompt_rows_launched)
            end = min(s.num_computed + len(s.token_ids), len(request.prompt_ids) - 1)
            claimed.append((first, max(0, end - first)))
            request.prompt_rows_launched = max(request.prompt_rows_launched, end)
        return tuple(claimed) if any(n for _, n in claimed) else ()

    def _plan(self, decl: StepDecl, requests: tuple[Request, ...], prompt_rows: tuple[tuple[int, int], ...]
              ) -> BatchPlan:
        """Rows of all requests concatenated; verify rows feed their anchor then their drafts (filled in by
        the launch). Values that exist only on the device are taken there, so planning never waits for the
        GPU: the tokens the step in flight samples, and (`BatchPlan.advance`) how far a request's rows sit
        past what the host knows when the step in flight holds its verify block. The logits rows are the
        sampled ones, then the `prompt_rows` of each sequence."""
        starts, tokens, sample_rows = decl.seq_starts, [], []
        in_flight_rows, in_flight_src = [], []  # rows fed a token the step in flight samples, and where it is
        lagging, lagging_src = [], []  # sequences after a verify block in flight, and where its verdict is
        for b, (s, request) in enumerate(zip(decl.seqs, requests, strict=True)):
            tokens += s.token_ids
            if s.token_ids[-1] == PLACEHOLDER:  # only a sequence's newest token can be in flight
                tokens[-1] = 0
                in_flight_rows.append(len(tokens) - 1)
                in_flight_src.append(self._in_flight.token_row[request])
            if s.lag:
                lagging.append(b)
                lagging_src.append(self._in_flight.token_row[request])
            tokens += [0] * s.num_drafts
            if s.verify:
                sample_rows += range(starts[b], starts[b + 1])
            elif s.sample:
                sample_rows.append(starts[b + 1] - 1)
        for b, (position, n) in enumerate(prompt_rows):
            row = starts[b] + position - decl.seqs[b].num_computed
            sample_rows += range(row, row + n)
        input_ids, in_flight_src_t, in_flight_rows_t, lagging_src_t, lagging_t, sample_rows_t = to_device_lists(
            [tokens, in_flight_src, in_flight_rows, lagging_src, lagging, sample_rows], torch.long, self.device)
        # Where sequence b takes entry b of the step in flight, for every b, at one column of equal rows, the
        # gathers are views (steady decode or verify steps).
        in_order = list(range(len(decl.seqs)))
        fed = {len(s.token_ids) for s in decl.seqs}
        if (in_flight_src == in_order and decl.rows_each and len(fed) == 1
                and len(self._in_flight.newest) == len(in_order)):
            input_ids.view(len(in_order), decl.rows_each)[:, fed.pop() - 1].copy_(self._in_flight.newest)
        elif in_flight_rows:
            input_ids.index_copy_(0, in_flight_rows_t, self._in_flight.newest[in_flight_src_t])
        advance = None
        if lagging_src == in_order and len(self._in_flight.accepted) == len(in_order):
            advance = self._in_flight.accepted  # read only: the plan's consumers never write it
        elif lagging:
            advance = torch.zeros(len(decl.seqs), dtype=torch.long, device=self.device)
            advance.index_copy_(0, lagging_t, self._in_flight.accepted[lagging_src_t])
        return BatchPlan(
            input_ids=input_ids,
            seq_starts=starts,
            num_computed=tuple(s.num_computed for s in decl.seqs),
            kv=self.kv.plan(decl, advance),
            kda_slots=self.pool.plan(decl),
            slot_ids=tuple(self.pool.slots[s.request_id] for s in decl.seqs),
            sample_rows=sample_rows_t,
            verify=tuple(s.verify for s in decl.seqs),
            kind=StepKind.DECODE if all(s.num_tokens == 1 and not s.verify for s in decl.seqs)
            and not self.pool.has_pending(decl) else StepKind.GENERAL,
            advance=advance,
            max_advance=tuple(s.lag for s in decl.seqs) if lagging else (),
        )

    @staticmethod
    def _logits_rows(decl: StepDecl) -> list[tuple[int, int]]:
        """Per sequence: (first logits row, rows): a verify block's every row, a sampled row, or none."""
        rows, row = [], 0
        for s in decl.seqs:
            n = s.num_tokens if s.verify else int(s.sample)
            rows.append((row, n))
            row += n
        return rows

    def _choose_tokens(self, number: int, decl: StepDecl, requests: tuple[Request, ...],
                       drafts: dict[int, DraftProposal], plan: BatchPlan, logits: torch.Tensor,
                       rows: list[tuple[int, int]], prompt_rows: tuple[tuple[int, int], ...]) -> LaunchedStep:
        """Queue the choice of every logits row's token (sampled, or verified against the drafts), the
        finite check and the logprobs, and the prompt rows' logprobs, packed for one copy to the host
        (step_results.py). Nothing here reads a device value (rows with non-finite logits are sampled too,
        and the host drops them), except where a grammar needs the host: the step in flight is finished
        first, and a verify block's drafts are read."""
        sampled = [b for b, s in enumerate(decl.seqs) if rows[b][1] and not s.verify]
        verifying = [b for b, s in enumerate(decl.seqs) if rows[b][1] and s.verify]
        row = sum(n for _, n in rows)
        device = logits.device
        prompt_block = self._score_prompt(requests, prompt_rows, logits[row:]) if prompt_rows else None
        logits = logits[:row]
        tokens = accepted = finite = None  # each row's token, its block's accepted count, its logits finite
        equal_blocks = None  # the verification, where its equal blocks are all the rows

        def zeros() -> torch.Tensor:  # a row's token and accepted count where nothing chose them
            return torch.zeros(row, dtype=torch.long, device=device)

        raw_logits = logits  # logprobs are the raw ones; tokens are chosen from the processed logits
        processing = LogitsProcessing.build(self._histories(decl, requests, plan, rows, sampled + verifying),
                                            plan.input_ids, device)
        if processing is not None:
            logits = processing.apply(logits)
        if any(requests[b].matcher is not None for b in sampled + verifying) and self._in_flight is not None:
            # The masks need the tokens the step in flight chooses: the host finishes it now, while the GPU runs
            # this step's forward (queued above), as vLLM overlaps its bitmask with the forward.
            previous, self._in_flight = self._in_flight, None
            self._finish_step(previous)
        # A request that stopped in the step just finished has a row here whose token is dropped: no mask.
        constrained = [b for b in sampled + verifying if requests[b].matcher is not None and not requests[b].finished]
        if constrained:
            # every row of a verify block gets the mask after the drafts before it (structured_output.py). Its
            # drafts are read to the host here, after the forward was queued: the GPU runs it meanwhile.
            blocks = [(requests[b].matcher, drafts[b].tokens.tolist() if b in drafts else []) for b in constrained]
            at = [first + i for first, n in (rows[b] for b in constrained) for i in range(n)]
            logits = apply_token_bitmask(logits, to_device(at, torch.long, device),
                                         self.grammars.bitmask(blocks, device))
        if sampled:
            batch = SamplingBatch.build([requests[b].params for b in sampled], [requests[b].generator for b in sampled],
                                        device)
            if verifying:
                at = to_device([rows[b][0] for b in sampled], torch.long, device)
                tokens = zeros()
                tokens[at] = self.sampler.choose(logits[at], batch)
            else:  # every logits row is a sampled one
                tokens = self.sampler.choose(logits, batch)
        if verifying:
            result = self.spec.verify([decl.seqs[b] for b in verifying], [requests[b] for b in verifying],
                                      logits, [rows[b][0] for b in verifying], [drafts.get(b) for b in verifying])
            width = result.tokens.shape[1]
            if not sampled and all(rows[b][1] == width for b in verifying):  # equal blocks: all the rows, in order
                equal_blocks = result
                tokens = result.tokens.reshape(-1)
                accepted = result.num_accepted.repeat_interleave(width)
                if result.finite is not None and logits is raw_logits:  # checked on the raw logits, as below
                    finite = result.finite.reshape(-1)
            else:
                tokens = zeros() if tokens is None else tokens
                accepted = zeros()
                at, block, source = [], [], []  # each verify row: its logits row, its block, its place in the blocks
                for i, b in enumerate(verifying):
                    first, n = rows[b]
                    at += range(first, first + n)
                    block += [i] * n
                    source += range(i * width, i * width + n)
                at_t, source_t, block_t = to_device_lists([at, source, block], torch.long, device)
                tokens[at_t] = result.tokens.reshape(-1)[source_t]
                accepted[at_t] = result.num_accepted[block_t]
        tokens = zeros() if tokens is None else tokens  # no rows chosen
        asked = [requests[b].params.logprobs for b in sampled + verifying if requests[b].params.logprobs is not None]
        # Verify rows past the emitted tokens hold -1: their logprobs are computed at token 0 and dropped.
        logprobs = gather_logprobs(raw_logits.float(), tokens.clamp_min(0), max(asked)) if asked else None
        accepted = zeros() if accepted is None else accepted
        finite = torch.isfinite(raw_logits).all(-1) if finite is None else finite
        packed = pack(finite, tokens, accepted, logprobs)
        if prompt_block is not None:
            packed = torch.cat([packed.flatten(), prompt_block.flatten()])
        results = HostCopy(packed)
        chosen = [b for b in range(len(decl.seqs)) if rows[b][1]]
        newest, kept = self._newest(rows, chosen, tokens, accepted, equal_blocks)
        return LaunchedStep(number, decl, requests, tuple(r.num_preemptions for r in requests), tuple(rows), results,
                            newest=newest, accepted=kept,
                            token_row={requests[b]: i for i, b in enumerate(chosen)},
                            prompt_rows=prompt_rows,
                            prompt_width=prompt_block.shape[-1] if prompt_block is not None else 0)

    @staticmethod
    def _newest(rows: list[tuple[int, int]], chosen: list[int], tokens: torch.Tensor, accepted: torch.Tensor,
                equal_blocks: VerifyResult | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Per chosen sequence, on the device: its newest token (a sampled one, or its block's correction or bonus)
        and the drafts its block kept; read off the verification where its equal blocks are all the rows."""
        if equal_blocks is not None:
            kept = equal_blocks.num_accepted
            return equal_blocks.tokens.gather(1, kept[:, None]).view(-1), kept
        first = to_device([rows[b][0] for b in chosen], torch.long, tokens.device)
        kept = accepted[first]
        return tokens[first + kept], kept

    def _score_prompt(self, requests: tuple[Request, ...], prompt_rows: tuple[tuple[int, int], ...],
                      logits: torch.Tensor) -> torch.Tensor:
        """The prompt rows' results (step_results.pack_prompt): log-softmax of their raw logits at the prompt's
        next token, its rank, and the best alternatives (as many as the most any of them asked for)."""
        targets, most = [], 0
        for (position, n), request in zip(prompt_rows, requests, strict=True):
            if n:
                targets += request.prompt_ids[position + 1 : position + 1 + n]
                most = max(most, request.params.prompt_logprobs)
        raw = logits.float()
        target_ids = to_device(targets, torch.long, raw.device)
        scored = gather_logprobs(raw, target_ids, most)
        return pack_prompt(torch.isfinite(raw).all(-1), scored, token_ranks(raw, target_ids))

    @staticmethod
    def _histories(decl: StepDecl, requests: tuple[Request, ...], plan: BatchPlan, rows: list[tuple[int, int]],
                   chosen: list[int]) -> list[RowHistory]:
        """The chosen rows whose requests process their logits; a newest output token that the step in
        flight samples is the one this step feeds, at its row of `plan.input_ids`."""
        histories = []
        for b in chosen:
            request, s = requests[b], decl.seqs[b]
            if request.params.processes_logits:
                inflight = plan.seq_starts[b] + len(s.token_ids) - 1 if s.token_ids[-1] == PLACEHOLDER else None
                histories.append(RowHistory(rows[b][0], request.params, request.prompt_ids, request.output_ids,
                                            inflight, request.stop_ids))
        return histories

    def _append(self, request: Request, tokens: list[int], logprobs: list[TokenLogprob] | None) -> None:
        """Emit new tokens up to the first stop; what follows a stop is dropped."""
        text, kept, reason, stop_reason = "", 0, None, None
        if request.first_token_at is None and tokens:
            request.first_token_at = time.perf_counter()
        for token in tokens:
            request.output_ids.append(token)
            stoppable = len(request.output_ids) >= request.params.min_tokens  # vLLM: no stop before min_tokens
            text += request.text.push(token, check_stops=stoppable)
            kept += 1
            if request.matcher is not None:
                request.matcher.consume_token(token)
            if stoppable and token in request.stop_ids:
                reason, stop_reason = "stop", token
            elif request.text.stopped_by is not None:
                reason, stop_reason = "stop", request.text.stopped_by
            elif request.matcher is not None and request.matcher.is_stopped():
                reason = "stop"  # the grammar is complete
            elif len(request.output_ids) >= request.params.max_tokens:
                reason = "length"
            if reason is not None:
                break
        self._emit(request, tokens[:kept], text, logprobs[:kept] if logprobs is not None else None)
        if reason is not None:
            self._finish(request, reason, stop_reason)

    def _emit(self, request: Request, tokens: list[int], text: str, logprobs: list[TokenLogprob] | None,
              *, finished: bool = False) -> None:
        first = not request.prompt_reported
        request.prompt_reported = True
        self._pending_outputs.append(RequestOutput(
            request_id=request.request_id,
            new_token_ids=tokens,
            text=text,
            logprobs=logprobs,
            finished=finished,
            finish_reason=request.finish_reason if finished else None,
            stop_reason=request.stop_reason if finished else None,
            num_prompt_tokens=len(request.prompt_ids),
            num_output_tokens=len(request.output_ids),
            num_cached_tokens=request.num_cached_tokens,
            prompt_token_ids=list(request.prompt_ids) if first else None,
            prompt_logprobs=list(request.prompt_logprobs) if first and request.params.scores_prompt
            else None,
            times=RequestTimes(request.queued_at, request.scheduled_at, request.first_token_at, time.perf_counter())
            if finished else None,
        ))

    def _finish(self, request: Request, reason: str, stop_reason: int | str | None = None) -> None:
        request.status = Status.FINISHED
        request.finish_reason = reason
        request.stop_reason = stop_reason
        self.scheduler.publish(request)
        self.scheduler.release(request)
        del self.requests[request.request_id]
        self._emit(request, [], request.text.finish() if reason != "abort" else "", None, finished=True)

    def fail_all(self, message: str) -> None:
        """Finish every request with an error (the step raised): nothing waits forever."""
        self._in_flight = None  # its requests are among those failed here
        for request in list(self.requests.values()):
            self._fail(request, message)

    def _fail(self, request: Request, message: str) -> None:
        if request.finished:
            return
        request.status = Status.FINISHED
        request.finish_reason = "error"
        self.scheduler.release(request)
        del self.requests[request.request_id]
        self._pending_outputs.append(RequestOutput(
            request.request_id, [], "", finished=True, finish_reason="error",
            num_prompt_tokens=len(request.prompt_ids), num_output_tokens=len(request.output_ids), error=message))
