"""The engine core: one loop of declare -> admit -> plan -> forward -> commit, then outputs.

Single-threaded by design: `add_request`, `abort_request` and `step` are called from the engine
thread only (the async front end hands requests over through a queue).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from mstar.engine.client import EngineStats
from mstar.engine.output_text import OutputText
from mstar.engine.outputs import RequestOutput, TokenLogprob
from mstar.engine.params import ParamError, SamplingParams
from mstar.engine.request import Request, Status
from mstar.engine.sampler import Sampler, SamplingBatch, request_generator
from mstar.engine.scheduler import Scheduler, SchedulerConfig
from mstar.engine.step import StepDecl
from mstar.models.kimi_k3.model import KimiK3ForCausalLM
from mstar.models.kimi_k3.serving import BatchPlan, ServingModel
from mstar.models.kimi_k3.tokenizer import KimiTokenizer
from mstar.resources.latent_kv import PagedLatentKV
from mstar.resources.recurrent_pool import RecurrentStatePool


@dataclass(frozen=True)
class EngineConfig:
    max_seq_len: int = 4096
    page_size: int = 16
    max_num_pages: int = 1024
    max_kda_slots: int = 65
    scheduler: SchedulerConfig = SchedulerConfig()


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
        self.pool = RecurrentStatePool(kinds.count("kda"), config.max_kda_slots, la.num_heads, la.head_dim,
                                       la.short_conv_kernel_size, torch.promote_types(dtype, torch.float32),
                                       dtype, device)
        self.serving = ServingModel(model, self.kv, self.pool)
        self.scheduler = Scheduler(config.scheduler, [self.kv, self.pool])
        self.sampler = Sampler()
        self.device = device
        self.requests: dict[str, Request] = {}
        self._arrivals = itertools.count()
        self._pending_outputs: list[RequestOutput] = []
        self.model_stop_ids = frozenset(tokenizer.stop_ids) | {cfg.eos_token_id}

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
        return EngineStats(
            running=len(self.scheduler.running),
            waiting=len(self.scheduler.waiting),
            kv_pages_used=self.kv.allocator.num_used,
            kv_pages_total=self.kv.allocator.capacity,
            kda_slots_used=self.pool.num_used,
            kda_slots_total=self.pool.capacity,
        )

    # --- one step ---------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        decl = self.scheduler.schedule()
        if decl is not None:
            logits = self.serving.forward(self._plan(decl))
            self.scheduler.commit(decl)
            self._record(decl, logits)
        return self.drain_outputs()

    def drain_outputs(self) -> list[RequestOutput]:
        outputs, self._pending_outputs = self._pending_outputs, []
        return outputs

    def _plan(self, decl: StepDecl) -> BatchPlan:
        starts = [0]
        for s in decl.seqs:
            starts.append(starts[-1] + s.num_tokens)
        tokens = [t for s in decl.seqs for t in s.token_ids]
        sample_rows = [starts[b + 1] - 1 for b, s in enumerate(decl.seqs) if s.sample]
        return BatchPlan(
            input_ids=torch.tensor(tokens, dtype=torch.long, device=self.device),
            seq_starts=tuple(starts),
            num_computed=tuple(s.num_computed for s in decl.seqs),
            kv=self.kv.plan(decl),
            kda_slots=self.pool.plan(decl),
            sample_rows=torch.tensor(sample_rows, dtype=torch.long, device=self.device),
        )

    def _record(self, decl: StepDecl, logits: torch.Tensor) -> None:
        sampled = [self.requests[s.request_id] for s in decl.seqs if s.sample]
        for s in decl.seqs:
            self.requests[s.request_id].num_computed = s.end
        if not sampled:
            return
        batch = SamplingBatch.build([r.params for r in sampled], [r.generator for r in sampled], self.device)
        result = self.sampler.sample(logits, batch)
        tokens = result.token_ids.tolist()
        requested = [r.params.logprobs for r in sampled]
        logprobs = result.token_logprobs(requested) if any(k is not None for k in requested) else None
        for i, request in enumerate(sampled):
            self._append(request, tokens[i], logprobs[i] if logprobs else None)

    def _append(self, request: Request, token: int, logprob: TokenLogprob | None) -> None:
        request.output_ids.append(token)
        text = request.text.push(token)
        reason, stop_reason = None, None
        if token in request.stop_ids:
            reason, stop_reason = "stop", token
        elif request.text.stopped_by is not None:
            reason, stop_reason = "stop", request.text.stopped_by
        elif len(request.output_ids) >= request.params.max_tokens:
            reason = "length"
        self._emit(request, [token], text, [logprob] if logprob is not None else None)
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
            request.status = Status.FINISHED
            request.finish_reason = "error"
            self.scheduler.release(request)
            del self.requests[request.request_id]
            out = RequestOutput(request.request_id, [], "", finished=True, finish_reason="error",
                                num_prompt_tokens=len(request.prompt_ids),
                                num_output_tokens=len(request.output_ids), error=message)
            self._pending_outputs.append(out)
