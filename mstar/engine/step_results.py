"""What one step sends back to the host: everything per logits row, packed into one tensor, one copy.

The host needs, for every row whose logits the step computed: whether the logits were finite (a
request with NaN or inf logits ends with an error), the token chosen there (sampled; or, in a
verify block, the accepted draft, correction or bonus token at that position, -1 past it), the
block's accepted draft count, and the logprobs when a request asked for them. Fetched separately
each would be a device-to-host synchronization; `pack` puts them in the columns of one tensor (long
without logprobs; float64 with them: token ids < 2^53 and fp32 logprobs are exact in float64) so that a
step costs one copy and one wait (`transfer.HostCopy`).

Columns: finite, token, accepted, then with logprobs: the chosen token's logprob, the
`max_logprobs` best ids and their logprobs.

Prompt rows (`SamplingParams.prompt_logprobs`: rows of a prefill chunk whose logits score the prompt's
next token) follow in a block of their own, flattened after the first into the same tensor: finite,
the prompt token, its logprob, its rank, then the best ids and their logprobs. A step without them
copies exactly what it did before.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from mstar.engine.outputs import PromptLogprob, TokenLogprob
from mstar.engine.request import Request
from mstar.engine.sampler import SampleResult
from mstar.resources.step import StepDecl
from mstar.resources.transfer import HostCopy


def pack(finite: torch.Tensor, tokens: torch.Tensor, accepted: torch.Tensor,
         logprobs: SampleResult | None = None) -> torch.Tensor:
    """[R, 3] long, or [R, 3 + 1 + 2K] float64 with logprobs: the per-row results of a step (module doc)."""
    columns = [finite.unsqueeze(-1), tokens.unsqueeze(-1), accepted.unsqueeze(-1)]
    if logprobs is None:  # flags and ids alone: torch.cat promotes them to long in its one launch (no casts)
        return torch.cat(columns, dim=-1)
    columns += [logprobs.logprobs.unsqueeze(-1), logprobs.top_ids, logprobs.top_logprobs]
    return torch.cat([c.to(torch.float64) for c in columns], dim=-1)


def pack_prompt(finite: torch.Tensor, scored: SampleResult, ranks: torch.Tensor) -> torch.Tensor:
    """[M, 4 + 2K] float64: the prompt rows' results (module doc); `scored` holds the prompt tokens and the
    best K alternatives."""
    columns = [finite.unsqueeze(-1), scored.token_ids.unsqueeze(-1), scored.logprobs.unsqueeze(-1),
               ranks.unsqueeze(-1), scored.top_ids, scored.top_logprobs]
    return torch.cat([c.to(torch.float64) for c in columns], dim=-1)


@dataclass(frozen=True)
class RowResult:
    finite: bool
    token: int
    accepted: int
    logprob: float | None = None
    top: tuple[tuple[int, float], ...] = ()  # the best alternatives, best first (max_logprobs of them)

    def token_logprob(self, k: int) -> TokenLogprob:
        """The record a request that asked for `k` alternatives gets."""
        return TokenLogprob(token_id=self.token, logprob=self.logprob, top=self.top[:k])


@dataclass(frozen=True)
class PromptRowResult:
    finite: bool
    entry: PromptLogprob  # with the step's most alternatives; a request keeps as many as it asked for


def unpack_prompt(host: torch.Tensor) -> list[PromptRowResult]:
    """The rows of a `pack_prompt`ed tensor that has reached the host."""
    k = (host.shape[-1] - 4) // 2
    out = []
    for row in host.tolist():
        top = tuple(zip((int(t) for t in row[4 : 4 + k]), row[4 + k :], strict=True))
        out.append(PromptRowResult(bool(row[0]), PromptLogprob(int(row[1]), row[2], int(row[3]), top)))
    return out


def unpack(host: torch.Tensor) -> list[RowResult]:
    """The rows of a `pack`ed tensor that has reached the host."""
    out = []
    k = (host.shape[-1] - 4) // 2  # alternatives per row when logprobs are packed
    for row in host.tolist():
        finite, token, accepted = bool(row[0]), int(row[1]), int(row[2])
        if len(row) == 3:
            out.append(RowResult(finite, token, accepted))
            continue
        top = tuple(zip((int(t) for t in row[4 : 4 + k]), row[4 + k :], strict=True))
        out.append(RowResult(finite, token, accepted, row[3], top))
    return out


@dataclass
class LaunchedStep:
    """A step whose device work is queued: what the host needs to finish it when its results arrive, and
    what the next step, planned before that, takes from it on the device."""

    number: int  # launch order
    decl: StepDecl
    requests: tuple[Request, ...]  # per sequence of `decl`
    preemptions: tuple[int, ...]  # each request's num_preemptions at launch (a later one voids its commit)
    rows: tuple[tuple[int, int], ...]  # per sequence: (first logits row, logits rows)
    # The results on their way to the host: the `pack`ed rows, then (flattened after them) the
    # `pack_prompt`ed ones when the step has prompt rows, of `prompt_width` columns
    results: HostCopy
    # Per sequence with logits rows, in `token_row` order, on the device: its newest token (the sampled one,
    # or a verify block's correction or bonus) and the drafts its verify block kept (0 for sampled rows).
    newest: torch.Tensor
    accepted: torch.Tensor
    token_row: dict[Request, int] = field(default_factory=dict)  # where a request's entries of those are
    # per sequence: (first prompt position, prompt rows), its rows in that order in the prompt block
    prompt_rows: tuple[tuple[int, int], ...] = ()
    prompt_width: int = 0

    def fetch(self) -> tuple[list[RowResult], list[PromptRowResult]]:
        """The step's results on the host, its sampled rows and its prompt rows: its one device-to-host wait."""
        host = self.results.wait()
        num_prompt = sum(n for _, n in self.prompt_rows)
        if not num_prompt:
            return unpack(host), []
        num_rows = sum(n for _, n in self.rows)
        split = host.numel() - num_prompt * self.prompt_width
        rows = host[:split].view(num_rows, -1) if num_rows else host[:0].view(0, 3)
        return unpack(rows), unpack_prompt(host[split:].view(num_prompt, self.prompt_width))
