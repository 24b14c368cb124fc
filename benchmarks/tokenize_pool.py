"""Where tokenization should run (server/tokenize_pool.py): for prompts of growing size, the encode time in
a thread and through a one-worker process pool, and the longest pause each causes an event loop that
ticks every millisecond meanwhile (what /health and other clients' streams would see).

    PYTHONPATH=. python benchmarks/tokenize_pool.py [--tokenizer models/kimi_k3_mini]

Each size is run --repeats times per way; the table gives the median time and the worst pause.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time

from mstar.models.kimi_k3.tokenizer import KimiTokenizer
from mstar.server.tokenize_pool import TokenizePool

SIZES = (1_000, 16_000, 64_000, 256_000, 1_000_000, 8_000_000)
WORDS = ["def", "x", "=", "[1,", "2]", "hello", "world", "naïve", "日本語", "print(x)", "\n", "    ", "😀", "42"]


async def _measure(pool: TokenizePool, text: str, keep: int) -> tuple[float, float]:
    """(seconds the encode took, the event loop's longest pause meanwhile)."""
    task = asyncio.ensure_future(pool.encode([text], keep=keep))
    start = time.perf_counter()
    worst = 0.0
    while not task.done():
        tick = time.perf_counter()
        await asyncio.sleep(0.001)
        worst = max(worst, time.perf_counter() - tick - 0.001)
    await task
    return time.perf_counter() - start, worst


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizer", default="models/kimi_k3_mini")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--keep", type=int, default=1024, help="truncate_prompt_tokens: the ids that come back")
    args = ap.parse_args()
    tokenizer = KimiTokenizer.from_dir(args.tokenizer)
    rng = random.Random(0)
    text = " ".join(rng.choice(WORDS) for _ in range(max(SIZES) // 3))
    inline = TokenizePool(tokenizer)
    with TokenizePool(tokenizer, args.tokenizer, workers=1, inline_max_chars=0) as pooled:
        print("| chars | ids | thread: ms | thread: worst loop pause ms | pool: ms | pool: worst loop pause ms |")
        print("|---:|---:|---:|---:|---:|---:|")
        for size in SIZES:
            sample = text[:size]
            row = [f"{size:,}", f"{len(tokenizer.encode(sample)):,}"]
            for pool in (inline, pooled):
                runs = [asyncio.run(_measure(pool, sample, args.keep)) for _ in range(args.repeats)]
                median = sorted(t for t, _ in runs)[len(runs) // 2]
                row += [f"{median * 1000:.1f}", f"{max(p for _, p in runs) * 1000:.1f}"]
            print("| " + " | ".join(row) + " |", flush=True)


if __name__ == "__main__":
    main()
