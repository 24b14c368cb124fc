"""`mstar-bench-serve`: a closed-loop serving sweep over HTTP, like any OpenAI client would drive it.

For each concurrency C it keeps C streaming requests in flight until 8*C (by default) have finished,
each with a random prompt of `--input-len` token ids (or, with `--prompts FILE`, the file's text
prompts in turn) and `--output-len` generated tokens (`ignore_eos`), and reports output tok/s, TTFT
(mean, p50, p99) and inter-token latency (mean, p99). When the server speculates, each level also reports
the mean accepted length and the acceptance rate of each draft position, from the difference of the
server's cumulative /metrics counters before and after the level. A progress bar (stderr) counts
each level's finished requests. Each level first runs `--warmup` untimed rounds of C requests (other
prompts), so that what a server does once per batch shape (a Triton kernel's first compile for an eager
step's sizes, say) is not charged to the first level that meets it.
Writes a markdown table (and a PNG plot when matplotlib is installed) under `--out`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families
from tqdm import tqdm


@dataclass
class RequestTiming:
    ttft: float
    itls: list[float]
    output_tokens: int
    latency: float


@dataclass
class SpecCounters:
    """The server's cumulative speculation counters (mstar_spec_* in /metrics)."""

    verify_rows: float = 0.0
    accepted: float = 0.0
    drafted_by_position: dict[int, float] | None = None
    accepted_by_position: dict[int, float] | None = None

    def since(self, before: SpecCounters) -> SpecCounters:
        def minus(a, b):
            return {k: v - (b or {}).get(k, 0.0) for k, v in (a or {}).items()}

        return SpecCounters(self.verify_rows - before.verify_rows, self.accepted - before.accepted,
                            minus(self.drafted_by_position, before.drafted_by_position),
                            minus(self.accepted_by_position, before.accepted_by_position))

    @property
    def mean_accepted_length(self) -> float:
        return (self.accepted + self.verify_rows) / self.verify_rows if self.verify_rows else float("nan")

    def position_rates(self) -> list[float]:
        drafted, accepted = self.drafted_by_position or {}, self.accepted_by_position or {}
        return [accepted.get(p, 0.0) / drafted[p] for p in sorted(drafted) if drafted[p]]


def read_spec_counters(url: str) -> SpecCounters:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    out = SpecCounters(drafted_by_position={}, accepted_by_position={})
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "mstar_spec_decode_num_drafts_total":
                out.verify_rows = sample.value
            elif sample.name == "mstar_spec_decode_num_accepted_tokens_total":
                out.accepted = sample.value
            elif sample.name == "mstar_spec_decode_num_drafts_per_pos_total":
                out.drafted_by_position[int(sample.labels["position"])] = sample.value
            elif sample.name == "mstar_spec_decode_num_accepted_tokens_per_pos_total":
                out.accepted_by_position[int(sample.labels["position"])] = sample.value
    return out


@dataclass
class LevelResult:
    concurrency: int
    requests: int
    duration: float
    output_tokens: int
    ttft_mean: float
    ttft_p50: float
    ttft_p99: float
    itl_mean: float
    itl_p99: float
    spec: SpecCounters | None = None  # this level's speculation, when the server drafted

    @property
    def output_tok_s(self) -> float:
        return self.output_tokens / self.duration


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))]


async def one_request(client: httpx.AsyncClient, url: str, model: str, prompt: list[int] | str, output_len: int,
                      extra: dict) -> RequestTiming:
    body = {"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0, "stream": True,
            "ignore_eos": True, "return_token_ids": True, **extra}
    start = time.perf_counter()
    arrivals: list[float] = []
    tokens = 0
    async with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"HTTP {resp.status_code}: {(await resp.aread()).decode()[:300]}")
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices", []):
                n = len(choice.get("token_ids") or []) or (1 if choice.get("text") else 0)
                if n:
                    tokens += n
                    arrivals.append(time.perf_counter())
    end = time.perf_counter()
    if not arrivals:
        raise RuntimeError("the stream carried no tokens")
    itls = [b - a for a, b in zip(arrivals, arrivals[1:], strict=False)]
    return RequestTiming(ttft=arrivals[0] - start, itls=itls, output_tokens=tokens, latency=end - start)


def level_prompts(concurrency: int, num_requests: int, input_len: int, vocab: int,
                  texts: list[str] | None, warmup: bool = False) -> list[list[int] | str]:
    """The file's text prompts in turn, or random token-id prompts of `input_len`; the warm-up's are the file's
    from its end, or other random ones."""
    if texts:
        order = texts[::-1] if warmup else texts
        return [order[i % len(order)] for i in range(num_requests)]
    rng = random.Random(f"warm-up {concurrency}" if warmup else concurrency)  # not -C: an int seeds as its abs
    return [[rng.randrange(vocab) for _ in range(input_len)] for _ in range(num_requests)]


async def run_level(url: str, model: str, concurrency: int, prompts: list[list[int] | str], output_len: int,
                    extra: dict, desc: str = "") -> LevelResult:
    results: list[RequestTiming] = []
    queue = list(prompts)
    limits = httpx.Limits(max_connections=concurrency + 4)
    progress = tqdm(total=len(prompts), desc=desc or f"C={concurrency}", unit="req", file=sys.stderr, leave=False)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        async def worker():
            while queue:
                prompt = queue.pop()
                results.append(await one_request(client, url, model, prompt, output_len, extra))
                progress.update(1)

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        duration = time.perf_counter() - start
    progress.close()
    ttfts = [r.ttft for r in results]
    itls = [x for r in results for x in r.itls]
    return LevelResult(concurrency, len(results), duration, sum(r.output_tokens for r in results),
                       statistics.fmean(ttfts), percentile(ttfts, 50), percentile(ttfts, 99),
                       statistics.fmean(itls) if itls else float("nan"), percentile(itls, 99))


def markdown(results: list[LevelResult], header: str) -> str:
    spec = any(r.spec for r in results)
    columns = "| C | requests | output tok/s | TTFT mean ms | TTFT p50 ms | TTFT p99 ms | ITL mean ms | ITL p99 ms |"
    if spec:
        columns += " accepted length | acceptance by draft position |"
    lines = [header, "", columns, "|---" * (columns.count("|") - 1) + "|"]
    for r in results:
        row = (f"| {r.concurrency} | {r.requests} | {r.output_tok_s:.1f} | {r.ttft_mean * 1e3:.1f} | "
               f"{r.ttft_p50 * 1e3:.1f} | {r.ttft_p99 * 1e3:.1f} | {r.itl_mean * 1e3:.2f} | {r.itl_p99 * 1e3:.2f} |")
        if spec:
            rates = " ".join(f"{x:.2f}" for x in r.spec.position_rates()) if r.spec else "—"
            length = f"{r.spec.mean_accepted_length:.2f}" if r.spec else "—"
            row += f" {length} | {rates} |"
        lines.append(row)
    return "\n".join(lines) + "\n"


def plot(results: list[LevelResult], path: Path, title: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    c = [r.concurrency for r in results]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    axes[0].plot(c, [r.output_tok_s for r in results], "o-")
    axes[0].set_ylabel("output tok/s")
    axes[1].plot(c, [r.ttft_mean * 1e3 for r in results], "o-", label="mean")
    axes[1].plot(c, [r.ttft_p50 * 1e3 for r in results], "s--", label="p50")
    axes[1].plot(c, [r.ttft_p99 * 1e3 for r in results], "^:", label="p99")
    axes[1].set_ylabel("TTFT ms")
    axes[1].legend()
    axes[2].plot(c, [r.itl_mean * 1e3 for r in results], "o-", label="mean")
    axes[2].plot(c, [r.itl_p99 * 1e3 for r in results], "s--", label="p99")
    axes[2].set_ylabel("ITL ms")
    axes[2].legend()
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency")
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def level_record(r: LevelResult) -> dict:
    """One level as plain numbers, for tools that compare sweeps (mstar-spec-schedule)."""
    out = {"concurrency": r.concurrency, "requests": r.requests, "output_tok_s": r.output_tok_s,
           "ttft_mean_s": r.ttft_mean, "ttft_p50_s": r.ttft_p50, "ttft_p99_s": r.ttft_p99,
           "itl_mean_s": r.itl_mean, "itl_p99_s": r.itl_p99}
    if r.spec:
        out.update(mean_accepted_length=r.spec.mean_accepted_length, acceptance_by_position=r.spec.position_rates())
    return out


def load_prompts(path: Path) -> list[str]:
    doc = json.loads(path.read_text())
    texts = doc["prompts"] if isinstance(doc, dict) else doc
    if not texts or not all(isinstance(t, str) and t for t in texts):
        raise SystemExit(f"{path}: expected a non-empty list of non-empty strings (or {{\"prompts\": [...]}})")
    return texts


def git_commit() -> str:
    """The commit results are recorded under: MSTAR_COMMIT where set (a copy of the tree whose repository
    metadata lags, as a lent GPU machine's does), else git's HEAD, else "unknown"."""
    if os.environ.get("MSTAR_COMMIT"):
        return os.environ["MSTAR_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="mstar-bench-serve", description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--concurrency", default="1,2,4,8,16,32,64", help="comma-separated levels")
    p.add_argument("--requests-per-level", type=int, default=8, help="requests = this x C")
    p.add_argument("--input-len", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=512)
    p.add_argument("--out", type=Path, default=Path("benchmarks"))
    p.add_argument("--name", default="sweep", help="file stem for the table and plot")
    p.add_argument("--label", default="", help="what was served (config, machine), for the table header")
    p.add_argument("--prompts", type=Path, help="JSON file with text prompts ({\"prompts\": [...]} or a list); "
                   "replaces the random token-id prompts and --input-len")
    p.add_argument("--warmup", type=int, default=1, help="untimed rounds of C requests before each level")
    args = p.parse_args(argv)
    models = httpx.get(f"{args.url}/v1/models", timeout=30).json()["data"]
    model = models[0]["id"]
    vocab = 1000  # prompt ids are drawn from the low ids, which every K3 tokenizer has as BPE ranks
    texts = load_prompts(args.prompts) if args.prompts else None
    results = []
    for c in [int(x) for x in args.concurrency.split(",")]:
        if args.warmup > 0:
            warm = level_prompts(c, args.warmup * c, args.input_len, vocab, texts, warmup=True)
            asyncio.run(run_level(args.url, model, c, warm, args.output_len, {}, f"C={c} warm-up"))
        before = read_spec_counters(args.url)
        prompts = level_prompts(c, args.requests_per_level * c, args.input_len, vocab, texts)
        r = asyncio.run(run_level(args.url, model, c, prompts, args.output_len, {}))
        spec = read_spec_counters(args.url).since(before)
        r.spec = spec if spec.verify_rows else None
        accepted = f", accepted length {r.spec.mean_accepted_length:.2f}" if r.spec else ""
        print(f"C={c}: {r.output_tok_s:.1f} output tok/s, TTFT mean {r.ttft_mean * 1e3:.0f} ms, "
              f"ITL mean {r.itl_mean * 1e3:.1f} ms{accepted}", file=sys.stderr, flush=True)
        results.append(r)
    args.out.mkdir(parents=True, exist_ok=True)
    shape = f"{len(texts)} text prompts" if texts else f"{args.input_len} in"
    header = (f"## {args.name}: {args.label or model} — {shape} / {args.output_len} out, "
              f"{args.requests_per_level}·C requests per level after {args.warmup} warm-up round(s) of C "
              f"(commit {git_commit()})\n\n"
              f"Command: `mstar-bench-serve {' '.join(argv if argv is not None else sys.argv[1:])}`")
    table = markdown(results, header)
    (args.out / f"{args.name}.md").write_text(table)
    (args.out / f"{args.name}.json").write_text(json.dumps(
        {"label": args.label or model, "commit": git_commit(), "levels": [level_record(r) for r in results]},
        indent=1) + "\n")
    if plot(results, args.out / f"{args.name}.png", f"{args.label or model}"):
        print(f"wrote {args.out / (args.name + '.png')}", file=sys.stderr)
    print(table)


if __name__ == "__main__":
    main()
