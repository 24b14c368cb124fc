"""Batched token sampling: per-row temperature / top-k / top-p / min-p, seeded draws, raw logprobs.

Processing order for a sampled (temperature > 0) row, each stage a pure function below:

    1. temperature scaling      (logits - row max) / T
    2. top-k                    keep the k best
    3. top-p (nucleus)          keep the smallest best-first set whose mass >= top_p (of the top-k renormalised)
    4. min-p                    drop tokens with prob < min_p * max prob
    5. exponential race         argmax(p / q), q ~ Exp(1) drawn per row

This is the order of vLLM's V0 sampler, so the same parameters give the same distribution as there.
Only min-p's place relative to top-p matters. Min-p compares each token with the best one, a ratio that
masking other tokens and renormalising do not change, so it commutes with top-k. Top-p measures mass,
so it depends on what came before it: with min-p last, top-p measures the distribution before min-p trims
the tail (vLLM V1 applies min-p first, which can make top-p keep fewer tokens).
Greedy rows (temperature below `GREEDY_TEMPERATURE`, 1e-5, as in vLLM: stored as 0 in the batch) ignore
all of this and take the argmax of the raw logits (ties: lowest id). Scaling never turns finite logits
into ±inf, whatever the temperature (kernels/temperature.py).

Ties at a filter boundary are kept (kernels/sampling_masks.py, the masks of stages 2-4).

Seeded sampling: a request with a seed owns a `torch.Generator` (`request_generator`); each of its sampled
tokens consumes exactly one draw of V exponentials from that generator, made for its row alone. The
race needs nothing from other rows, so a seeded request's tokens depend only on its seed and its own
logits, not on which requests share the batch or where its row sits. (On CPU this holds bit for bit;
GPU kernels may pick a different reduction strategy for a different batch shape, which can only matter
when two candidates are within rounding of each other.) Unseeded rows share the engine's generator.

`sample` keeps everything on the device: the per-row parameters are tensors (copied up without a stream
synchronization, transfer.py), which rows are greedy or seeded is host metadata fixed when the batch is
built, and nothing reads a device value back. The caller's read of the result is the only sync (the
engine packs it with the rest of the step's results, step_results.py), so the tensor work can be graph-captured
(`choose_tokens` and `gather_logprobs` are the capturable part; `Sampler.draw_noise` fills the noise).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from mstar.engine.outputs import TokenLogprob
from mstar.engine.params import SamplingParams
from mstar.kernels.sampling_masks import min_p_mask, top_k_mask, top_p_mask
from mstar.kernels.temperature import scale_by_temperature_finite
from mstar.resources.transfer import to_device, to_device_lists

_SEED_MASK = (1 << 64) - 1
_TINY = torch.finfo(torch.float32).tiny  # noise floor: keeps -log(q) finite, so masked tokens stay -inf


def request_generator(seed: int, device: torch.device | str) -> torch.Generator:
    """The generator a seeded request owns for its whole life (any int seed; wrapped to 64 bits)."""
    generator = torch.Generator(device=device)
    generator.manual_seed(seed & _SEED_MASK)
    return generator


# ----------------------------------------------------------------------------------------------------
# Processing stages: pure functions over [B, V] fp32 logits and [B] per-row parameters. The masks
# (True where a token is dropped) are kernels/sampling_masks.py, which the DSpark draft uses too.


def scale_by_temperature(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """(logits - row max) / T per row, never overflowing to ±inf (kernels/temperature.py); greedy rows
    (T == 0) are only shifted (their argmax is taken from the raw logits)."""
    safe = torch.where(temperature > 0, temperature, torch.ones_like(temperature))
    return scale_by_temperature_finite(logits, safe.unsqueeze(-1))


# ----------------------------------------------------------------------------------------------------


@dataclass
class SamplingBatch:
    """Per-row sampling parameters of one step, as device tensors, plus host metadata fixed at build."""

    temperature: torch.Tensor  # [B] fp32, 0 = greedy
    top_k: torch.Tensor  # [B] long, 0 = off
    top_p: torch.Tensor  # [B] fp32, 1 = off
    min_p: torch.Tensor  # [B] fp32, 0 = off
    generators: tuple[torch.Generator | None, ...]  # per row: the request's own generator, or None (shared)
    greedy: tuple[bool, ...]  # per row, host side: which rows skip the random draw
    max_logprobs: int | None  # most top alternatives any row asked for; None: no row asked for logprobs
    max_top_k: int | None = None  # largest nonzero top_k, None when no row uses top-k
    use_top_p: bool = False
    use_min_p: bool = False

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
        device: torch.device | str,
    ) -> SamplingBatch:
        """One row per request. A request with a seed must come with its generator (`request_generator`)."""
        if len(params) != len(generators):
            raise ValueError(f"SamplingBatch.build: {len(params)} params but {len(generators)} generators; "
                             "pass one generator (or None) per request")
        for row, (p, g) in enumerate(zip(params, generators, strict=True)):
            if p.seed is not None and g is None:
                raise ValueError(f"SamplingBatch.build: row {row} has seed={p.seed} but no generator; "
                                 "create one with request_generator(seed, device) and keep it with the request")
        sampled = [p for p in params if not p.greedy]
        top_ks = [p.top_k for p in sampled if p.top_k > 0]
        requested = [p.logprobs for p in params if p.logprobs is not None]
        # Greedy rows carry temperature 0 (also those below GREEDY_TEMPERATURE), the mark every stage reads. The
        # fp32 parameters round from the Python floats on the host, as a cast on the device would round them.
        temperature, top_p, min_p = to_device_lists([[0.0 if p.greedy else p.temperature for p in params],
                                                     [p.top_p for p in params], [p.min_p for p in params]],
                                                    torch.float32, device)
        return cls(
            temperature=temperature,
            top_k=to_device([p.top_k for p in params], torch.long, device),
            top_p=top_p,
            min_p=min_p,
            generators=tuple(generators),
            greedy=tuple(p.greedy for p in params),
            max_logprobs=max(requested) if requested else None,
            max_top_k=max(top_ks) if top_ks else None,
            use_top_p=any(p.top_p < 1 for p in sampled),
            use_min_p=any(p.min_p > 0 for p in sampled),
        )

    @property
    def size(self) -> int:
        return len(self.greedy)

    @property
    def all_greedy(self) -> bool:
        return all(self.greedy)


@dataclass
class SampleResult:
    token_ids: torch.Tensor  # [B] long
    logprobs: torch.Tensor  # [B] fp32: raw log-softmax at the chosen token
    top_ids: torch.Tensor | None = None  # [B, max_logprobs] long, best first
    top_logprobs: torch.Tensor | None = None  # [B, max_logprobs] fp32

    def token_logprobs(self, requested: Sequence[int | None]) -> list[TokenLogprob | None]:
        """Host-side per-row logprob records (one sync); `requested[i]` is row i's `SamplingParams.logprobs`."""
        ids, lps = self.token_ids.tolist(), self.logprobs.tolist()
        top_ids = self.top_ids.tolist() if self.top_ids is not None else None
        top_lps = self.top_logprobs.tolist() if self.top_logprobs is not None else None
        out: list[TokenLogprob | None] = []
        for row, k in enumerate(requested):
            if k is None:
                out.append(None)
                continue
            top = tuple(zip(top_ids[row][:k], top_lps[row][:k], strict=True)) if k and top_ids else ()
            out.append(TokenLogprob(token_id=ids[row], logprob=lps[row], top=top))
        return out


def filter_logits(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Temperature, then top-k, top-p, min-p (stages the batch does not use are skipped); dropped = -inf."""
    x = scale_by_temperature(logits, batch.temperature)
    if batch.max_top_k is not None:
        x = x.masked_fill(top_k_mask(x, batch.top_k, batch.max_top_k), float("-inf"))
    if batch.use_top_p:
        x = x.masked_fill(top_p_mask(x, batch.top_p), float("-inf"))
    if batch.use_min_p:
        x = x.masked_fill(min_p_mask(x, batch.min_p), float("-inf"))
    return x


def choose_tokens(logits: torch.Tensor, batch: SamplingBatch, noise: torch.Tensor | None) -> torch.Tensor:
    """[B] token ids: greedy rows take the raw argmax, the others win the exponential race against `noise`.

    argmax(p / q) is computed as argmax(log p - log q) with log p = filtered logit - logsumexp; the
    logsumexp is the same for the whole row, so it drops out and no softmax is needed.
    """
    greedy_ids = logits.argmax(dim=-1)  # first maximum: ties go to the lowest id
    if batch.all_greedy:
        return greedy_ids
    if noise is None:
        raise ValueError("choose_tokens: the batch has sampled rows, so pass noise (Sampler.draw_noise)")
    raced = (filter_logits(logits, batch) - noise.log()).argmax(dim=-1)
    return torch.where(batch.temperature > 0, raced, greedy_ids)


def gather_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, max_logprobs: int | None) -> SampleResult:
    """Log-softmax of the raw logits at the chosen tokens, and the best `max_logprobs` alternatives."""
    lse = logits.logsumexp(dim=-1, keepdim=True)
    chosen = logits.gather(-1, token_ids.unsqueeze(-1)) - lse
    result = SampleResult(token_ids=token_ids, logprobs=chosen.squeeze(-1))
    if max_logprobs is not None:
        best = logits.topk(min(max_logprobs, logits.shape[-1]), dim=-1)  # sorted: best first
        result.top_ids = best.indices
        result.top_logprobs = best.values - lse
    return result


def token_ranks(logits: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """[R] long: how many tokens of each row score at least as high as `token_ids` there (1: the best;
    vLLM's rank, ties counted against the token)."""
    return (logits >= logits.gather(-1, token_ids.unsqueeze(-1))).sum(-1)


class Sampler:
    """Samples one token per row. `generator` is the engine's shared generator for unseeded rows
    (None: torch's default generator of the logits' device)."""

    def __init__(self, generator: torch.Generator | None = None) -> None:
        self.generator = generator

    def draw_noise(self, batch: SamplingBatch, vocab_size: int, device: torch.device) -> torch.Tensor:
        """[B, V] Exp(1) noise: unseeded rows from the shared generator, each seeded row from its own.

        The shared draw covers the whole buffer in one call (a fixed shape, friendly to graph capture);
        seeded rows then overwrite their row with exactly V draws of their own generator, so their
        generator's state advances the same way wherever the row sits. Greedy rows draw nothing.
        """
        noise = torch.empty(batch.size, vocab_size, dtype=torch.float32, device=device)
        seeded = [(row, g) for row, g in enumerate(batch.generators) if g is not None and not batch.greedy[row]]
        shared_rows = sum(not greedy for greedy in batch.greedy) - len(seeded)
        if shared_rows:
            noise.exponential_(generator=self.generator)
        else:
            noise.fill_(1.0)
        for row, generator in seeded:
            noise[row].exponential_(generator=generator)
        return noise.clamp_min_(_TINY)

    def sample(self, logits: torch.Tensor, batch: SamplingBatch) -> SampleResult:
        """Sample [B, V] logits (any float dtype; computed in fp32) under `batch`; no host syncs."""
        return gather_logprobs(logits.float(), self.choose(logits, batch), batch.max_logprobs)

    def choose(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """`sample`'s [B] token ids alone (for a caller that gathers logprobs itself, or none)."""
        if logits.dim() != 2 or logits.shape[0] != batch.size:
            raise ValueError(f"Sampler.sample: logits must be [B, V] with B = {batch.size} rows of the batch, "
                             f"got shape {tuple(logits.shape)}")
        if logits.device != batch.temperature.device:
            raise ValueError(f"Sampler.sample: logits are on {logits.device} but the batch on "
                             f"{batch.temperature.device}; build the SamplingBatch on the logits' device")
        raw = logits.float()
        noise = None if batch.all_greedy else self.draw_noise(batch, raw.shape[-1], raw.device)
        return choose_tokens(raw, batch, noise)
