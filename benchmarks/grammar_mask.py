"""Per-step host cost of structured outputs (engine/structured_output.py) at batch 1 and 64: each constrained
row's bitmask fill and its matcher's advance by the chosen token, for llguidance (what the engine uses) and,
where installed, xgrammar; each one row by row and through its own parallel batch call.

    PYTHONPATH=. python benchmarks/grammar_mask.py [--tokenizer models/kimi_k3_mini]
    PYTHONPATH=. python benchmarks/grammar_mask.py --ranks o200k_base.tiktoken.gz --num-ranks 163584

`--ranks` takes a tiktoken ranks file (plain or gzip) cut to its first `--num-ranks` ranks, plus K3's 256
special slots: with 163,584 ranks that is K3's vocabulary size (163,840), the width every mask row has in
serving. (The real K3 `tiktoken.model` is not public here; any large byte-level BPE gives the trie shape.)

Every engine replays the same token walks: B requests follow a JSON Schema, each step's token drawn at random
(seeded) among those llguidance's mask allows, a request restarting when its grammar completes. Masks of the
two engines are compared row by row (they differ where their JSON whitespace rules do). First, the device's
share: the mask's upload and `apply_token_bitmask` over [B, 163,840] fp32 logits (`--device`, a GPU if present).
"""

from __future__ import annotations

import argparse
import base64
import gzip
import json
import os
import random
import time
from pathlib import Path

import llguidance
import llguidance.numpy
import numpy as np
import torch

from mstar.engine.structured_output import Grammar, GrammarCompiler, apply_token_bitmask
from mstar.models.kimi_k3.tokenizer import KimiTokenizer, k3_special_names


def _person(bounded: bool) -> dict:
    """A string, an integer and an array of strings; `bounded` adds maxLength and maxItems (a counting lexer)."""
    name, tag = ({"type": "string", "maxLength": 40}, {"type": "string", "maxLength": 12}) if bounded else (
        {"type": "string"}, {"type": "string"})
    tags = {"type": "array", "items": tag} | ({"maxItems": 4} if bounded else {})
    return {"type": "object", "required": ["name", "age", "tags"], "additionalProperties": False,
            "properties": {"name": name, "age": {"type": "integer"}, "tags": tags}}


SCHEMAS = {"plain": _person(False), "bounded": _person(True)}


def load_tokenizer(args) -> KimiTokenizer:
    if args.ranks is None:
        return KimiTokenizer.from_dir(args.tokenizer)
    raw = Path(args.ranks).read_bytes()
    text = gzip.decompress(raw) if raw[:2] == b"\x1f\x8b" else raw
    ranks = {}
    for line in text.splitlines():
        token, rank = line.split()
        if int(rank) < args.num_ranks:
            ranks[base64.b64decode(token)] = int(rank)
    return KimiTokenizer(ranks, k3_special_names(len(ranks)), name=Path(args.ranks).name)


def allowed_tokens(row: np.ndarray, vocab: int) -> np.ndarray:
    bits = np.unpackbits(row.view(np.uint8), bitorder="little")[:vocab]
    return np.flatnonzero(bits)


def token_walks(engines, vocab: int, batch: int, steps: int, seed: int) -> list[list[int]]:
    """Per step, the token each of `batch` requests takes (-1: it restarts its grammar before this step), drawn
    among the tokens every engine allows (their masks differ a little: main's doc)."""
    rng = random.Random(seed)
    words = (vocab + 31) // 32
    matchers = [[e.new() for e in engines] for _ in range(batch)]
    walks = []
    for _ in range(steps):
        chosen = []
        for i, ms in enumerate(matchers):
            if ms[0].is_stopped():  # llguidance, the first engine
                matchers[i] = ms = [e.new() for e in engines]
                chosen.append(-1)
                continue
            both = np.full((words,), -1, dtype=np.int32)
            for e, m in zip(engines, ms, strict=True):
                mask = np.zeros((1, words), dtype=np.int32)
                e.fill([m], mask)
                both &= mask[0]
            token = int(rng.choice(allowed_tokens(both, vocab)))
            assert not any(e.advance([(m, token)]) for e, m in zip(engines, ms, strict=True))
            chosen.append(token)
        walks.append(chosen)
    return walks


class Llguidance:
    name = "llguidance"

    def __init__(self, compiler: GrammarCompiler, grammar: Grammar, parallel: bool):
        self.compiler, self.grammar, self.parallel = compiler, grammar, parallel
        self.executor = llguidance.LLExecutor() if parallel else None

    def new(self):
        return self.compiler.matcher(self.grammar)

    def fill(self, matchers, mask: np.ndarray) -> None:
        if self.parallel:
            llguidance.numpy.fill_next_token_bitmask_par(self.executor, [(m, i) for i, m in enumerate(matchers)], mask)
        else:
            for i, m in enumerate(matchers):
                llguidance.numpy.fill_next_token_bitmask(m, mask, i)

    def advance(self, pairs) -> int:
        """How many of the tokens the matchers refused."""
        if self.parallel:
            return sum(not ok for ok in llguidance.numpy.consume_token_par(self.executor, pairs))
        return sum(not m.consume_token(t) for m, t in pairs)


class Xgrammar:
    name = "xgrammar"

    def __init__(self, tokenizer: KimiTokenizer, grammar: Grammar, parallel: bool):
        import xgrammar

        self.xgr, self.parallel = xgrammar, parallel
        vocab = [tokenizer.encoding.decode_single_token_bytes(t) for t in range(tokenizer.num_ranks)]
        vocab += [b""] * (tokenizer.vocab_size - tokenizer.num_ranks)  # empty: xgrammar's mark of a special token
        t0 = time.perf_counter()
        info = xgrammar.TokenizerInfo(vocab, vocab_size=tokenizer.vocab_size, stop_token_ids=list(tokenizer.stop_ids))
        self.compiled = xgrammar.GrammarCompiler(info).compile_json_schema(
            grammar.source, any_whitespace=False, separators=(", ", ": "), strict_mode=True)
        self.setup_s = time.perf_counter() - t0
        self.batch = xgrammar.BatchGrammarMatcher() if parallel else None

    def new(self):
        return self.xgr.GrammarMatcher(self.compiled)

    def fill(self, matchers, mask: np.ndarray) -> None:
        out = torch.from_numpy(mask)
        if self.parallel:
            self.batch.batch_fill_next_token_bitmask(matchers, out)
        else:
            for i, m in enumerate(matchers):
                m.fill_next_token_bitmask(out, i)

    def advance(self, pairs) -> int:
        if self.parallel:
            accepted = self.xgr.BatchGrammarMatcher.batch_accept_token([m for m, _ in pairs], [t for _, t in pairs])
            return sum(not ok for ok in accepted)
        return sum(not m.accept_token(t) for m, t in pairs)


def replay(engine, walks: list[list[int]], words: int) -> tuple[float, float, float, list[np.ndarray]]:
    """Fill and advance per step (seconds, averaged), a request's matcher creation, and each step's masks."""
    batch = len(walks[0])
    t0 = time.perf_counter()
    matchers = [engine.new() for _ in range(batch)]
    created = (time.perf_counter() - t0) / batch
    fill = advance = 0.0
    masks = []
    for chosen in walks:
        for i, token in enumerate(chosen):
            if token < 0:
                matchers[i] = engine.new()
        live = [i for i, t in enumerate(chosen) if t >= 0]
        mask = np.zeros((len(live), words), dtype=np.int32)
        t0 = time.perf_counter()
        engine.fill([matchers[i] for i in live], mask)
        t1 = time.perf_counter()
        refused = engine.advance([(matchers[i], chosen[i]) for i in live])
        t2 = time.perf_counter()
        assert not refused, f"{engine.name} refused {refused} tokens every engine's mask allowed"
        fill, advance = fill + t1 - t0, advance + t2 - t1
        masks.append(mask)
    return fill / len(walks), advance / len(walks), created, masks


def time_apply(batch: int, vocab: int, device: torch.device, reps: int = 50) -> float:
    """Seconds per step of the device's share: the pinned mask's upload and `apply_token_bitmask` on fp32 logits
    [batch, vocab] (every row constrained), timed with CUDA events on a GPU."""
    words = (vocab + 31) // 32
    host = torch.randint(-2**31, 2**31 - 1, (batch, words), dtype=torch.int32, pin_memory=device.type == "cuda")
    logits = torch.randn(batch, vocab, device=device)
    rows = torch.arange(batch, device=device)

    def step() -> torch.Tensor:
        return apply_token_bitmask(logits, rows, host.to(device, non_blocking=True))

    for _ in range(3):
        step()
    if device.type != "cuda":
        t0 = time.perf_counter()
        for _ in range(reps):
            step()
        return (time.perf_counter() - t0) / reps
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(reps):
        step()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / reps


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizer", default="models/kimi_k3_mini")
    ap.add_argument("--ranks", help="a tiktoken ranks file (plain or .gz) instead of --tokenizer's")
    ap.add_argument("--num-ranks", type=int, default=163_584)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--schemas", nargs="+", choices=sorted(SCHEMAS), default=["plain", "bounded"])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                    help="where the mask is applied (the upload and apply_token_bitmask are timed there)")
    ap.add_argument("--apply-vocab", type=int, default=163_840, help="logits width of the apply timing (K3's)")
    args = ap.parse_args()
    t0 = time.perf_counter()
    tok = load_tokenizer(args)
    compiler = GrammarCompiler(tok.encoding, tok.vocab_size, tuple(tok.stop_ids))
    words = (tok.vocab_size + 31) // 32
    print(f"vocabulary {tok.vocab_size} ({tok.num_ranks} ranks of {args.ranks or args.tokenizer}), set up in "
          f"{time.perf_counter() - t0:.1f} s; {args.steps} steps; {os.cpu_count()} CPUs")
    device = torch.device(args.device)
    for batch in args.batch:
        print(f"apply on {device.type}, vocabulary {args.apply_vocab}, batch {batch:3d}: upload + apply_token_bitmask "
              f"{time_apply(batch, args.apply_vocab, device) * 1e6:8.1f} us/step", flush=True)
    for schema_name in args.schemas:
        grammar = Grammar("json_schema", json.dumps(SCHEMAS[schema_name]), "bench")
        engines = [Llguidance(compiler, grammar, False), Llguidance(compiler, grammar, True)]
        try:
            engines += [Xgrammar(tok, grammar, False), Xgrammar(tok, grammar, True)]
        except ImportError:
            print("xgrammar is not installed: llguidance only")
        for batch in args.batch:
            walks = token_walks([e for e in engines if not e.parallel], tok.vocab_size, batch, args.steps, args.seed)
            reference = None
            for engine in engines:
                fill, advance, created, masks = replay(engine, walks, words)
                kind = "batch call" if engine.parallel else "row by row"
                agree = ""
                if reference is None:
                    reference = masks
                else:
                    same = sum(int(np.array_equal(a, b)) for a, b in zip(masks, reference, strict=True))
                    agree = f"  masks equal llguidance's at {same}/{len(masks)} steps"
                print(f"{schema_name:7s} batch {batch:3d} {engine.name:10s} {kind:10s}: fill {fill * 1e6:8.1f} us/step "
                      f"({fill / batch * 1e6:6.1f} us/row), advance {advance * 1e6:7.1f} us/step, "
                      f"new matcher {created * 1e6:7.1f} us{agree}", flush=True)

if __name__ == "__main__":
    main()
