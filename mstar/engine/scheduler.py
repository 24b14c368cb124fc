"""Continuous batching: which requests run in the next step, and with how many tokens each.

Each step the scheduler declares decode rows for running requests (one token each, up to
`max_num_seqs`) and prefill chunks (up to `max_prefill_seqs` prompts and the step's token budget;
prompts are chunked when `chunked_prefill` is on). With `mixed_prefill_decode` both share a step,
except verify rows (DSpark), which never share one with prompt chunks; otherwise a step is either
prefill or decode, the two taking turns while both wait, prefill first.

Admission is all-or-nothing per request and resource (KV pages, a KDA slot). When a decode row
cannot get its page, the most recently arrived running request is preempted: its pages and slot
are released and it waits at the front of the queue to be recomputed (prompt + outputs so far).
Waiting requests are admitted strictly first come, first served.

With prefix caching (prefix_cache.py) a request admitted from the queue (new, or preempted) first
looks up the longest cached prefix of its tokens (unless it asks for prompt_logprobs, which need the
logits of every prompt row); its first chunk then starts after that prefix and
maps the prefix's pages and KDA snapshot in the same atomic admission. A prefill chunk (chunked_prefill)
that crosses a KDA snapshot boundary ends at the last one it crosses (or at the last one inside the
cached pages it shares past its hit: prefix_cache.py), so that the state there is snapshotted.
Preemption publishes the victim's pages before releasing it (its references only; pages that other
requests share stay theirs), so its recompute resumes from them where they are still cached.

Where prefill steps replay CUDA graphs (`step_sizes`, the runner's token buckets), a step is padded up to the
smallest bucket that holds it, and a padding row costs what a real one does. A chunk that would carry the step past
a bucket of at least STEP_SIZE_CUT_MIN tokens by at most a quarter of it is cut to end there (the rest rides in the
next step, whose bucket is small): one step of that bucket and one small one cost less than a step of twice
that size, and the decode rows riding in them get two tokens in that time instead of one.

A request scoring its prompt (prompt_logprobs) gets logits for every prompt row of its chunks, [rows,
vocab] in fp32 and more while they are scored; its chunks (with chunked_prefill) are at most
PROMPT_SCORING_CHUNK tokens, so that one long prompt cannot take gigabytes of device memory in one step.

With async scheduling (core.py) the next step is declared while the last one still runs: a
request's newest token may be in flight (`request.PLACEHOLDER` among the declared token ids), and a
request whose in-flight tokens reach max_tokens (`sampling_done`) is not scheduled again; it only
holds its resources until its last token reaches the host and it finishes. After a verify block in
flight, a request's next rows sit up to that block's draft count further on than the host knows
(`SeqStep.lag`, `Request.unresolved`): admission reserves room for the most, and its drafts count
the block as keeping all of its own; one preempted meanwhile is recomputed only once that block's tokens
have reached the host. Without steps in flight
(synchronous mode) neither case arises and the rules above are all there is.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Protocol

from mstar.config import SchedulerConfig
from mstar.engine.prefix_cache import PrefixCache
from mstar.engine.request import Request, Status
from mstar.resources.step import SeqStep, StepDecl

# Most tokens of a prefill chunk of a request with prompt_logprobs: 1,024 rows of K3's 163,840-token
# vocabulary are 0.67 GB of fp32 logits on every tensor-parallel rank (the lm_head gathers the vocabulary).
PROMPT_SCORING_CHUNK = 1024


class Resource(Protocol):
    def can_admit(self, decl: StepDecl) -> bool: ...
    def admit(self, decl: StepDecl) -> None: ...
    def commit(self, decl: StepDecl) -> None: ...
    def release(self, request_id: str) -> None: ...


# The smallest bucket a chunk is cut to end at: below it a step's fixed cost (the weights read once) outweighs
# what a smaller bucket saves, and two steps could cost more than one padded one.
STEP_SIZE_CUT_MIN = 512


class Scheduler:
    def __init__(self, config: SchedulerConfig, resources: list[Resource],
                 drafts_for: Callable[[int], int] | None = None, *, mixed_prefill_decode: bool = True,
                 prefix: PrefixCache | None = None, max_seq_len: int | None = None,
                 step_sizes: tuple[int, ...] = ()):
        """`drafts_for(decode batch size)` turns decode rows into verify rows of that many drafts;
        `mixed_prefill_decode` is model_kwargs.mixed_prefill_decode; `prefix` the prefix cache (None: off);
        `max_seq_len` the positions a sequence may use (None: unbounded), which drafts never pass;
        `step_sizes` the token counts prefill steps are padded up to (the runner's captured buckets; empty:
        none, steps run at their own size)."""
        self.config = config
        self.step_sizes = tuple(sorted(step_sizes))
        self.max_seq_len = max_seq_len
        self.prefix = prefix
        self.mixed_prefill_decode = mixed_prefill_decode
        self.resources = resources
        self.drafts_for = drafts_for
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in arrival order
        self.num_preemptions = 0
        self._decode_held_back = False  # the last step prefilled while decode rows waited (unmixed: turns)

    # --- queue ------------------------------------------------------------------------------
    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def publish(self, request: Request) -> None:
        """Offer the request's computed pages (and snapshots) to later requests: after each of its steps
        finishes, and before it is released unless it failed."""
        if self.prefix is not None:
            self.prefix.publish(request)

    def reset_prefix_cache(self) -> None:
        if self.prefix is not None:
            self.prefix.reset()

    def release(self, request: Request) -> None:
        """Give back everything `request` holds and drop it from the queues."""
        for r in self.resources:
            r.release(request.request_id)
        if request in self.running:
            self.running.remove(request)
        if request in self.waiting:
            self.waiting.remove(request)

    # --- one step ---------------------------------------------------------------------------
    def schedule(self) -> StepDecl | None:
        """Declare the next step and claim its resources; None when there is nothing to run."""
        while True:
            seqs = self._schedule_once()
            if seqs:
                return StepDecl(tuple(seqs))
            if all(r.sampling_done for r in self.running):
                return None  # nothing to run, or only requests whose last token is in flight
            # Running requests exist but none could be scheduled: free room by preemption.
            self._preempt(self.running[-1])

    def commit(self, decl: StepDecl) -> None:
        for r in self.resources:
            r.commit(decl)

    def _schedule_once(self) -> list[SeqStep]:
        cfg = self.config
        batch = [r for r in self.running if r.is_decoding and not r.sampling_done][: cfg.max_num_seqs]
        budget = cfg.max_num_batched_tokens
        # Verify rows (with speculation every decode row is one, of 0 drafts too) do not share a step with
        # prompt chunks: no captured graph takes that mix, and on a GPU such a step ran eagerly, many times
        # slower than a prefill step and a verify step replayed apart.
        if self.mixed_prefill_decode and not (batch and self.drafts_for is not None):
            seqs = self._schedule_decode(batch)
            return seqs + self._schedule_prefill(budget - sum(s.num_tokens for s in seqs))
        # Unmixed, prompt chunks and decode rows take turns while both wait, prefill first: a stream of
        # arrivals or a long chunked prompt holds running requests back one step at most.
        prefill_turn = not (batch and self._decode_held_back)
        seqs = self._schedule_prefill(budget) if prefill_turn else []
        self._decode_held_back = bool(seqs and batch)
        if not seqs:
            seqs = self._schedule_decode(batch)
        if not seqs and not prefill_turn:
            seqs = self._schedule_prefill(budget)
        return seqs

    def _schedule_decode(self, batch: list[Request]) -> list[SeqStep]:
        while batch:
            drafts = self.drafts_for(len(batch)) if self.drafts_for is not None else None
            seqs = [self._decode_seq(r, drafts) for r in batch]
            if self._admit(seqs):
                return seqs
            victim = self.running[-1]
            self._preempt(victim)
            if victim in batch:
                batch.remove(victim)
        return []

    def _schedule_prefill(self, budget: int) -> list[SeqStep]:
        cfg = self.config
        used = cfg.max_num_batched_tokens - budget  # the decode rows already in the step
        seqs: list[SeqStep] = []
        continuing = [r for r in self.running if not r.is_decoding]
        waiting = [r for r in self.waiting if not r.sampling_done]  # preempted while its last token was in flight
        for request, is_new in [(r, False) for r in continuing] + [(r, True) for r in waiting]:
            if len(seqs) >= cfg.max_prefill_seqs or budget <= 0:
                break
            if is_new and (len(self.running) >= cfg.max_num_seqs or request.unresolved):
                break  # full, or (FCFS) the first waiting one was preempted with a verify block in flight
            # a request scoring its prompt (prompt_logprobs) needs the logits of rows a cached prefix skips
            looks_up = is_new and self.prefix is not None and not request.params.scores_prompt
            prefix, shared = self.prefix.lookup(request) if looks_up else ((), 0)
            start = len(prefix) * self.prefix.page_size if prefix else request.num_computed
            n = request.num_tokens - start
            if n > budget:
                if cfg.chunked_prefill:
                    n = budget
                elif seqs:
                    break  # an unchunked prompt waits for a step of its own
            if cfg.chunked_prefill and request.params.scores_prompt:
                n = min(n, PROMPT_SCORING_CHUNK)
            if cfg.chunked_prefill:
                n = self._to_step_size(used, n)
                if n == 0:
                    break  # the step ends at a bucket: what would follow waits for the next one
            if self.prefix is not None and cfg.chunked_prefill:
                n = self._to_snapshot_boundary(start, n, shared)
            seq = self._seq(request, n, start, prefix)
            if not self._admit([seq]):
                if is_new:
                    break  # FCFS: later arrivals do not overtake a request that does not fit
                continue
            if is_new:
                request.num_computed = start
                if self.prefix is not None:
                    self.prefix.record(request, prefix)
                self.waiting.remove(request)
                self.running.append(request)
                self.running.sort(key=lambda r: r.arrival)
                request.status = Status.RUNNING
            seqs.append(seq)
            budget -= n
            used += n
        return seqs

    # --- helpers ----------------------------------------------------------------------------
    def _to_step_size(self, used: int, n: int) -> int:
        """A chunk of n tokens after `used` tokens of the step, cut to end the step at a bucket of at least
        STEP_SIZE_CUT_MIN tokens that it would pass by at most a quarter of the bucket (module doc); 0 when the step
        already ends at such a bucket."""
        total = used + n
        below = [b for b in self.step_sizes if b >= STEP_SIZE_CUT_MIN and used <= b < total]
        if below and total - below[-1] <= below[-1] // 4:
            return below[-1] - used
        return n

    def _to_snapshot_boundary(self, start: int, n: int, shared: int) -> int:
        """Shorten a chunk of n tokens from `start` to end at a KDA snapshot boundary: the last one within
        the first `shared` tokens (cached pages without a snapshot there yet), else the last it crosses."""
        interval = self.prefix.pool.snapshot_interval
        for end in (min(shared, start + n), start + n):
            boundary = end // interval * interval
            if boundary > start:
                return boundary - start
        return n

    @staticmethod
    def _seq(request: Request, n: int, start: int | None = None, prefix: tuple[bytes, ...] = ()) -> SeqStep:
        start = request.num_computed if start is None else start
        tokens = tuple(request.token_at(i) for i in range(start, start + n))
        return SeqStep(request.request_id, start, tokens, sample=start + n == request.num_tokens, prefix=prefix)

    def _decode_seq(self, request: Request, drafts: int | None) -> SeqStep:
        if drafts is None:
            return self._seq(request, 1)
        # The schedule's full count even near max_tokens: the verify graphs are captured for blocks of k + 1
        # rows, and one block cut to the tokens left made its whole step run eagerly (on a GPU, a step many
        # times slower, and a kernel compile for each new block size). The engine emits up to max_tokens and
        # drops what the block yields beyond (core.py `_append`). Only max_seq_len cuts a block: its rows sit
        # up to `unresolved` positions past num_computed (a verify block in flight keeping all its drafts).
        # A request that processes its logits gets no drafts (logits_processing.py: its token counts hold for
        # one position only); one with a grammar does (structured_output.py masks each row of its block).
        room = drafts
        if self.max_seq_len is not None:
            room = self.max_seq_len - 1 - request.num_computed - request.unresolved
        if request.params.processes_logits:
            room = 0
        anchor = request.token_at(request.num_computed)
        return SeqStep(request.request_id, request.num_computed, (anchor,), sample=True, verify=True,
                       num_drafts=max(0, min(drafts, room)), lag=request.unresolved)

    def _admit(self, seqs: list[SeqStep]) -> bool:
        decl = StepDecl(tuple(seqs))
        if not all(r.can_admit(decl) for r in self.resources):
            return False
        for r in self.resources:
            r.admit(decl)
        return True

    def _preempt(self, request: Request) -> None:
        self.publish(request)
        for r in self.resources:
            r.release(request.request_id)
        self.running.remove(request)
        request.num_computed = 0
        # Its recompute starts from the host's tokens; `unresolved` stays until the verify block in flight
        # reaches the host (core.py `_settle`): until then how many tokens it emits is known only on the device.
        request.status = Status.WAITING
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)
