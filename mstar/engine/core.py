"""The engine core: one loop of declare -> admit -> plan -> forward -> commit, then outputs.

Single-threaded by design: `add_request`, `abort_request` and `step` are called from the engine
thread only (the async front end hands requests over through a queue).
"""

from __future__ import annotations

import contextlib
import itertools
from dataclasses import dataclass, replace

import torch

from mstar.engine.client import EngineStats
from mstar.engine.cuda_graphs import GraphedServing, StepGraphs, verify_graphs
from mstar.engine.output_text import OutputText
from mstar.engine.outputs import RequestOutput, TokenLogprob
from mstar.engine.params import ParamError, SamplingParams
from mstar.engine.profiling import StepProfiler
from mstar.engine.request import Request, Status
from mstar.engine.sampler import Sampler, SamplingBatch, gather_logprobs, request_generator
from mstar.engine.scheduler import Scheduler, SchedulerConfig
from mstar.engine.speculation import Speculation
from mstar.engine.step import StepDecl
from mstar.models.dspark.model import DraftProposal, K3DSparkModel
from mstar.models.kimi_k3.gpu_ops import default_mixer_ops, install_expert_kernels, install_fused_kernels
from mstar.models.kimi_k3.model import KimiK3ForCausalLM
from mstar.models.kimi_k3.serving import BatchPlan, ServingModel, TorchMixerOps
from mstar.models.kimi_k3.tokenizer import KimiTokenizer
from mstar.resources.latent_kv import PagedLatentKV
from mstar.resources.recurrent_pool import RecurrentStatePool
from mstar.spec.proposer import DSparkProposer, VocabHeads
from mstar.spec.schedule import DraftSchedule


@dataclass(frozen=True)
class SpeculativeConfig:
    draft: K3DSparkModel | None  # None on a tensor-parallel follower: its pools hold verify blocks, rank 0 drafts
    speculative_tokens: int  # k: drafts per verify at the smallest batches
    schedule: tuple[tuple[int, int], ...] = ()  # (max batch size, drafts); empty: k at every size
    verify_method: str = "block"  # rule for sampled requests ("chain" or "block"); greedy ones use greedy
    max_num_pages: int | None = None  # draft KV pages (default: as many as the target's)
    heads: VocabHeads | None = None  # full-vocabulary embed/lm_head for the draft (default: the target's own)
    # the target layers whose taps the draft reads; given on a follower, which has no draft but must
    # capture its decode graphs with rank 0's taps to replay the same steps (default: the draft's)
    tap_layers: tuple[int, ...] = ()

    def taps(self) -> tuple[int, ...]:
        return tuple(self.draft.config.target_layer_ids) if self.draft is not None else self.tap_layers


MAX_GRAPH_BATCH = 64  # larger decode batches run eagerly (launch overhead is amortized over their rows)


@dataclass(frozen=True)
class EngineConfig:
    max_seq_len: int = 4096
    page_size: int = 16
    max_num_pages: int = 1024
    max_kda_slots: int = 65
    scheduler: SchedulerConfig = SchedulerConfig()
    speculative: SpeculativeConfig | None = None
    kernels: str = "auto"  # "auto": GPU kernels where available; "torch": the reference mixers everywhere
    cuda_graphs: bool = False  # decode steps of up to MAX_GRAPH_BATCH rows replay CUDA graphs (CUDA only)


class EngineCore:
    def __init__(self, model: KimiK3ForCausalLM, tokenizer: KimiTokenizer, config: EngineConfig):
        cfg = model.config
        self.model_config = cfg
        self.config = config
        self.tokenizer = tokenizer
        capacity = (config.max_num_pages - 1) * config.page_size
        if capacity < config.max_seq_len:
            raise ValueError(f"the KV pool holds {capacity} tokens, less than max_seq_len={config.max_seq_len}: "
                             "raise resources.mla_kv.max_num_pages or lower max_seq_len")
        param = next(model.parameters())
        dtype, device = param.dtype, param.device
        kinds = cfg.layer_kinds
        self.kv = PagedLatentKV(kinds.count("mla"), config.max_num_pages, config.page_size, cfg.kv_cache_width,
                                dtype, device)
        la = cfg.linear_attn
        spec = config.speculative
        self.pool = RecurrentStatePool(kinds.count("kda"), config.max_kda_slots, la.num_heads, la.head_dim,
                                       la.short_conv_kernel_size, torch.promote_types(dtype, torch.float32),
                                       dtype, device, hidden_size=cfg.hidden_size,
                                       max_block=spec.speculative_tokens + 1 if spec else 0)
        ops = TorchMixerOps()
        if config.kernels == "auto":
            ops = default_mixer_ops(device)
            install_expert_kernels(model)
            install_fused_kernels(model)
        self.serving = ServingModel(model, self.kv, self.pool, ops)
        self.spec: Speculation | None = None
        resources = [self.kv, self.pool]
        if spec is not None and spec.draft is not None:
            proposer = DSparkProposer(spec.draft, model, num_pages=spec.max_num_pages or config.max_num_pages,
                                      page_size=config.page_size, heads=spec.heads)
            schedule = DraftSchedule.from_config(spec.speculative_tokens, spec.schedule)
            self.spec = Speculation(proposer, schedule, spec.verify_method)
            resources.append(proposer)
        self.scheduler = Scheduler(config.scheduler, resources,
                                   drafts_for=self.spec.schedule.drafts_for if self.spec else None)
        self.graphs: list[StepGraphs] = []
        if config.cuda_graphs and device.type == "cuda":
            self.graphs = self._capture_graphs()
            self.serving = GraphedServing(self.serving, self.graphs)
        self.sampler = Sampler()
        self.device = device
        self.requests: dict[str, Request] = {}
        self._arrivals = itertools.count()
        self._pending_outputs: list[RequestOutput] = []
        self._poisoned: list[Request] = []
        self.model_stop_ids = frozenset(tokenizer.stop_ids) | {cfg.eos_token_id}
        self.profiler = StepProfiler.from_env(device)

    def _capture_graphs(self) -> list[StepGraphs]:
        """Decode steps, and with speculation the verify blocks of every draft count the schedule uses,
        captured for batch sizes up to MAX_GRAPH_BATCH (a TP follower captures what rank 0 does)."""
        config, spec = self.config, self.config.speculative
        shape = {"max_batch": min(config.scheduler.max_num_seqs, MAX_GRAPH_BATCH), "max_seq_len": config.max_seq_len,
                 "tap_layers": spec.taps() if spec else ()}
        graphs = [StepGraphs(self.serving, **shape)]
        if spec is not None:
            graphs += verify_graphs(self.serving, DraftSchedule.from_config(spec.speculative_tokens, spec.schedule),
                                    **shape)
        for g in graphs:
            g.capture()
        return graphs

    # --- requests ---------------------------------------------------------------------------
    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        vocab, limit = self.model_config.vocab_size, self.config.max_seq_len
        if not prompt_ids:
            raise ParamError("prompt is empty: give at least one token")
        bad = [t for t in prompt_ids if not 0 <= t < vocab]
        if bad:
            raise ParamError(f"prompt token ids {bad[:5]} are outside the vocabulary 0..{vocab - 1}")
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
        )
        self.requests[request_id] = request
        self.scheduler.add(request)

    def abort_request(self, request_id: str) -> None:
        request = self.requests.get(request_id)
        if request is not None and not request.finished:
            self._finish(request, "abort")

    def has_work(self) -> bool:
        return self.scheduler.has_work() or bool(self._pending_outputs)

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
        )

    # --- one step ---------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        decl = self.scheduler.schedule()
        if decl is not None:
            with self.profiler.step() if self.profiler else contextlib.nullcontext():
                self._run(decl)
        return self.drain_outputs()

    def _run(self, decl: StepDecl) -> None:
        """One scheduled step: draft, forward, choose tokens, commit."""
        drafts = self.spec.propose(decl, self.requests) if self.spec else {}
        plan = self._plan(decl, drafts)
        logits, taps = self.serving.forward(plan, self.spec.tap_layers if self.spec else ())
        new_tokens, decl = self._choose_tokens(decl, drafts, logits)
        self.scheduler.commit(decl)
        if self.spec:
            self.spec.write_context(decl, taps, plan.seq_starts)
        for s in decl.seqs:
            self.requests[s.request_id].num_computed = s.committed_end
        for request, tokens, logprobs in new_tokens:
            self._append(request, tokens, logprobs)
        for request in self._poisoned:
            self._fail(request, "the model produced non-finite logits (NaN or inf) for this request")
        self._poisoned.clear()

    def drain_outputs(self) -> list[RequestOutput]:
        outputs, self._pending_outputs = self._pending_outputs, []
        return outputs

    def _plan(self, decl: StepDecl, drafts: dict[int, DraftProposal]) -> BatchPlan:
        """Rows of all requests concatenated; verify rows feed their anchor then their drafts."""
        starts, tokens, sample_rows = [0], [], []
        for b, s in enumerate(decl.seqs):
            tokens += s.token_ids
            if b in drafts:
                tokens += drafts[b].tokens.tolist()
            starts.append(starts[-1] + s.num_tokens)
            if s.verify:
                sample_rows += range(starts[b], starts[b + 1])
            elif s.sample:
                sample_rows.append(starts[b + 1] - 1)
        return BatchPlan(
            input_ids=torch.tensor(tokens, dtype=torch.long, device=self.device),
            seq_starts=tuple(starts),
            num_computed=tuple(s.num_computed for s in decl.seqs),
            kv=self.kv.plan(decl),
            kda_slots=self.pool.plan(decl),
            slot_ids=tuple(self.pool.slots[s.request_id] for s in decl.seqs),
            sample_rows=torch.tensor(sample_rows, dtype=torch.long, device=self.device),
            verify=tuple(s.verify for s in decl.seqs),
            decode=all(s.num_tokens == 1 and not s.verify for s in decl.seqs) and not self.pool.has_pending(decl),
        )

    def _choose_tokens(self, decl: StepDecl, drafts: dict[int, DraftProposal], logits: torch.Tensor
                       ) -> tuple[list[tuple[Request, list[int], list[TokenLogprob] | None]], StepDecl]:
        """Sample ordinary rows, verify speculative ones; return the new tokens per request and the
        step with each verify row's accepted length (what commit keeps)."""
        sampled: list[tuple[int, torch.Tensor]] = []  # (seq index, logits row)
        verifying: list[tuple[int, torch.Tensor]] = []  # (seq index, [1 + drafts, V] rows)
        finite = torch.isfinite(logits).all(-1).tolist()
        seqs = list(decl.seqs)
        row = 0
        for b, s in enumerate(decl.seqs):
            n = s.num_tokens if s.verify else int(s.sample)
            if not all(finite[row : row + n]):
                # Never sample garbage: this request ends with an error; the others go on.
                self._poisoned.append(self.requests[s.request_id])
                seqs[b] = replace(s, accepted=0) if s.verify else s
            elif s.verify:
                verifying.append((b, logits[row : row + n]))
            elif s.sample:
                sampled.append((b, logits[row]))
            row += n
        chosen: dict[int, list[int]] = {}
        if sampled:
            requests = [self.requests[decl.seqs[b].request_id] for b, _ in sampled]
            batch = SamplingBatch.build([r.params for r in requests], [r.generator for r in requests], self.device)
            picked = self.sampler.sample(torch.stack([x for _, x in sampled]), batch).token_ids.tolist()
            chosen.update({b: [t] for (b, _), t in zip(sampled, picked, strict=True)})
        if verifying:
            vseqs = [decl.seqs[b] for b, _ in verifying]
            results = self.spec.verify(vseqs, [self.requests[s.request_id] for s in vseqs],
                                       [x for _, x in verifying], [drafts.get(b) for b, _ in verifying])
            for (b, _), v in zip(verifying, results, strict=True):
                chosen[b] = v.tokens
                seqs[b] = replace(decl.seqs[b], accepted=v.num_accepted + 1)
        rows = dict(sampled) | {b: x for b, x in verifying}
        out = []
        for b, tokens in sorted(chosen.items()):
            request = self.requests[decl.seqs[b].request_id]
            k = request.params.logprobs
            logprobs = None
            if k is not None:
                block = rows[b] if rows[b].dim() == 2 else rows[b][None]
                got = gather_logprobs(block[: len(tokens)].float(), torch.tensor(tokens, device=block.device), k)
                logprobs = got.token_logprobs([k] * len(tokens))
            out.append((request, tokens, logprobs))
        return out, StepDecl(tuple(seqs))

    def _append(self, request: Request, tokens: list[int], logprobs: list[TokenLogprob] | None) -> None:
        """Emit new tokens up to the first stop; what follows a stop is dropped."""
        text, kept, reason, stop_reason = "", 0, None, None
        for token in tokens:
            request.output_ids.append(token)
            text += request.text.push(token)
            kept += 1
            if token in request.stop_ids:
                reason, stop_reason = "stop", token
            elif request.text.stopped_by is not None:
                reason, stop_reason = "stop", request.text.stopped_by
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
            prompt_token_ids=list(request.prompt_ids) if first else None,
        ))

    def _finish(self, request: Request, reason: str, stop_reason: int | str | None = None) -> None:
        request.status = Status.FINISHED
        request.finish_reason = reason
        request.stop_reason = stop_reason
        self.scheduler.release(request)
        del self.requests[request.request_id]
        self._emit(request, [], request.text.finish() if reason != "abort" else "", None, finished=True)

    def fail_all(self, message: str) -> None:
        """Finish every request with an error (the step raised): nothing waits forever."""
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
