"""Changes to a request's logits before its token is chosen: min_tokens, logit_bias and the penalties.

Applied, in vLLM's order, to the logits rows of the requests that ask for any of them (greedy rows
too: a greedy request with a penalty takes the argmax of the penalized logits); other rows are not
touched, so a batch without them runs exactly as before. Logprobs stay those of the raw logits
(OpenAI's and vLLM's default).

    1. min_tokens             the request's stop ids get -inf while it has fewer than min_tokens tokens
    2. logit_bias             bias[token] added to the token's logit
    3. repetition_penalty     a token of the prompt or the output: logit / p if logit > 0, else logit * p
    4. frequency_penalty      logit - f * (times the token occurs in the output)
       presence_penalty       logit - p * (1 if the token occurs in the output)

Everything stays on the device: the per-row values and token lists go up with `to_device` (no
stream synchronization), the output tokens of a step still in flight (async scheduling) are taken
from the device tensor the engine gives (`inflight`), and nothing is read back.

Speculative decoding: a request that processes its logits is not drafted for (scheduler.py), since
each draft position would need its own token counts; its verify row is its one sampled row.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from mstar.engine.params import SamplingParams
from mstar.resources.transfer import to_device

# ----------------------------------------------------------------------------------------------------
# The definitions, as pure functions over [R, V] fp32 logits and [R] per-row values.


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: torch.Tensor) -> torch.Tensor:
    """Tokens `seen` (prompt or output) are divided by the penalty if positive, multiplied if not."""
    p = penalty.unsqueeze(-1)
    penalized = torch.where(logits > 0, logits / p, logits * p)
    return torch.where(seen, penalized, logits)


def apply_frequency_presence(logits: torch.Tensor, counts: torch.Tensor, frequency: torch.Tensor,
                             presence: torch.Tensor) -> torch.Tensor:
    """`counts[r, t]`: occurrences of token t in row r's output so far."""
    logits = logits - frequency.unsqueeze(-1) * counts
    return logits - presence.unsqueeze(-1) * (counts > 0).to(logits.dtype)


# ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RowHistory:
    """What one logits row's processing needs to know about its request, from the host."""

    row: int  # the row in the step's logits
    params: SamplingParams
    prompt_ids: Sequence[int]
    output_ids: Sequence[int]  # the output tokens on the host
    inflight: int | None  # where its newest output token (still in flight) is in `inflight`; None: none
    stop_ids: frozenset[int]


def _pairs(rows: list[int], ids: list[int], device) -> tuple[torch.Tensor, torch.Tensor]:
    return to_device(rows, torch.long, device), to_device(ids, torch.long, device)


@dataclass
class LogitsProcessing:
    """One step's processing, as device tensors: the rows it changes and what happens to each."""

    rows: torch.Tensor  # [R] logits rows
    masked: tuple[torch.Tensor, torch.Tensor] | None  # (row, token) pairs set to -inf (min_tokens)
    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # (row, token, bias)
    seen: tuple[torch.Tensor, torch.Tensor] | None  # (row, token) of prompt and output, for repetition_penalty
    output: tuple[torch.Tensor, torch.Tensor] | None  # (row, token), one pair per output token
    repetition: torch.Tensor  # [R]
    frequency: torch.Tensor  # [R]
    presence: torch.Tensor  # [R]

    @classmethod
    def build(cls, histories: Sequence[RowHistory], inflight: torch.Tensor | None,
              device: torch.device | str) -> LogitsProcessing | None:
        """None when no row processes its logits. `inflight[h.inflight]` is the token of a step in flight."""
        histories = [h for h in histories if h.params.processes_logits]
        if not histories:
            return None
        masked_rows, masked_ids, bias_rows, bias_ids, biases = [], [], [], [], []
        seen_rows, seen_ids, out_rows, out_ids, late_rows, late_at = [], [], [], [], [], []
        for r, h in enumerate(histories):
            p = h.params
            generated = len(h.output_ids) + (h.inflight is not None)
            if generated < p.min_tokens:
                masked_rows += [r] * len(h.stop_ids)
                masked_ids += sorted(h.stop_ids)
            for token, value in p.logit_bias:
                bias_rows.append(r)
                bias_ids.append(token)
                biases.append(value)
            if p.repetition_penalty != 1:
                seen_rows += [r] * len(h.prompt_ids)
                seen_ids += h.prompt_ids
            if p.penalized:
                out_rows += [r] * len(h.output_ids)
                out_ids += h.output_ids
                if h.inflight is not None:
                    late_rows.append(r)
                    late_at.append(h.inflight)
        output = None
        if out_rows or late_rows:
            rows_t, ids_t = _pairs(out_rows, out_ids, device)
            if late_rows:
                late_r, late_i = _pairs(late_rows, late_at, device)
                rows_t, ids_t = torch.cat([rows_t, late_r]), torch.cat([ids_t, inflight[late_i]])
            output = (rows_t, ids_t)
        seen = None
        if seen_rows or output is not None:
            # The output tokens count for repetition_penalty too; rows with p == 1 are unchanged by it.
            seen = _pairs(seen_rows, seen_ids, device)
            if output is not None:
                seen = (torch.cat([seen[0], output[0]]), torch.cat([seen[1], output[1]]))
        values = to_device([[p.repetition_penalty, p.frequency_penalty, p.presence_penalty]
                            for p in (h.params for h in histories)], torch.float32, device)
        return cls(
            rows=to_device([h.row for h in histories], torch.long, device),
            masked=_pairs(masked_rows, masked_ids, device) if masked_rows else None,
            bias=(*_pairs(bias_rows, bias_ids, device), to_device(biases, torch.float32, device)) if biases else None,
            seen=seen if any(h.params.repetition_penalty != 1 for h in histories) else None,
            output=output,
            repetition=values[:, 0],
            frequency=values[:, 1],
            presence=values[:, 2],
        )

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """[N, V] logits -> fp32 logits with the processed rows changed (a new tensor; `logits` is kept)."""
        logits = logits.float()
        x = logits[self.rows]
        shape = x.shape
        if self.masked is not None:
            x = x.index_put(self.masked, x.new_full((), float("-inf")))
        if self.bias is not None:
            x = x.index_put(self.bias[:2], self.bias[2], accumulate=True)
        if self.seen is not None:
            seen = torch.zeros(shape, dtype=torch.bool, device=x.device).index_put(
                self.seen, torch.ones((), dtype=torch.bool, device=x.device))
            x = apply_repetition_penalty(x, seen, self.repetition)
        if self.output is not None:
            counts = torch.zeros(shape, dtype=torch.float32, device=x.device).index_put(
                self.output, torch.ones_like(self.output[1], dtype=torch.float32), accumulate=True)
            x = apply_frequency_presence(x, counts, self.frequency, self.presence)
        return logits.index_copy(0, self.rows, x)
