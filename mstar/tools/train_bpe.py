"""A small deterministic byte-level BPE trainer, and a writer for K3's tokenizer directory layout.

Used to make tiny tokenizers for tests and tiny models: same split regex, same file layout and the
same special-token names at the same offsets as Kimi K3, with far fewer ranks.

Training: text is split with K3's regex; each piece is a sequence of byte tokens (ranks 0..255 are
the 256 single bytes in byte order, so any text encodes). Then, repeatedly, the most frequent
adjacent pair (ties broken by the smaller byte strings) is merged into a new token whose rank is
the next free one, until `num_ranks` ranks exist. tiktoken encodes with these ranks by merging the
lowest-ranked pair first, which replays the training merges.
"""

from __future__ import annotations

import argparse
import base64
import heapq
import json
import os
from collections import Counter, defaultdict
from collections.abc import Iterable
from pathlib import Path

import regex

from mstar.models.kimi_k3.hf_tokenizer import write_hf_tokenizer
from mstar.models.kimi_k3.tokenizer import (
    BOS,
    EOS,
    K3_NOT_SKIPPED_SPECIALS,
    K3_SPLIT_PATTERN,
    NUM_SPECIAL_SLOTS,
    PAD,
    UNK,
    k3_special_names,
    reserved_token_name,
)

# V1 mode gives the nested set and `&&` intersection semantics that K3's pattern relies on.
_SPLIT = regex.compile(K3_SPLIT_PATTERN, flags=regex.V1)

DEFAULT_CORPUS_BYTES = 600_000


def split_pieces(text: str) -> list[str]:
    """Pre-tokenize `text` the way K3's tokenizer does (the pieces BPE never merges across)."""
    return _SPLIT.findall(text)


# ---- training ------------------------------------------------------------------------------


class _PairStats:
    """Pair counts over a multiset of words, kept current under merges, with a lazy max-heap."""

    def __init__(self, words: list[list[bytes]], counts: list[int]):
        self.words = words
        self.counts = counts
        self.pair_count: Counter[tuple[bytes, bytes]] = Counter()
        self.pair_words: defaultdict[tuple[bytes, bytes], set[int]] = defaultdict(set)
        for index, word in enumerate(words):
            self._add_word(index, word, +1)
        self.heap = [(-count, pair) for pair, count in self.pair_count.items()]
        heapq.heapify(self.heap)

    def _add_word(self, index: int, word: list[bytes], sign: int) -> None:
        weight = sign * self.counts[index]
        for pair in zip(word, word[1:], strict=False):
            self.pair_count[pair] += weight
            if sign > 0:
                self.pair_words[pair].add(index)

    def best_pair(self) -> tuple[bytes, bytes] | None:
        """Most frequent pair; among equals the lexicographically smallest (left, right) bytes."""
        while self.heap:
            negative_count, pair = self.heap[0]
            current = self.pair_count.get(pair, 0)
            if current <= 0:
                heapq.heappop(self.heap)
                continue
            if -negative_count != current:  # stale entry: re-push with the current count
                heapq.heapreplace(self.heap, (-current, pair))
                continue
            return pair
        return None

    def merge(self, pair: tuple[bytes, bytes]) -> None:
        left, right = pair
        merged = left + right
        touched: set[tuple[bytes, bytes]] = set()
        for index in sorted(self.pair_words.pop(pair, ())):
            word = self.words[index]
            if len(word) < 2:
                continue
            self._add_word(index, word, -1)
            new_word: list[bytes] = []
            i = 0
            while i < len(word):
                if i + 1 < len(word) and word[i] == left and word[i + 1] == right:
                    new_word.append(merged)
                    i += 2
                else:
                    new_word.append(word[i])
                    i += 1
            self.words[index] = new_word
            self._add_word(index, new_word, +1)
            touched.update(zip(new_word, new_word[1:], strict=False))
        self.pair_count.pop(pair, None)
        for new_pair in touched:
            count = self.pair_count.get(new_pair, 0)
            if count > 0:
                heapq.heappush(self.heap, (-count, new_pair))


def train_bpe_ranks(texts: Iterable[str], num_ranks: int) -> dict[bytes, int]:
    """Learn `num_ranks` BPE ranks (>= 256) from `texts`. Deterministic for the same input.

    Stops early if no pair is left to merge (a corpus too small for `num_ranks`)."""
    if num_ranks < 256:
        raise ValueError(f"num_ranks={num_ranks}: at least 256 are needed for the single bytes")
    piece_counts: Counter[bytes] = Counter()
    for text in texts:
        piece_counts.update(piece.encode("utf-8") for piece in split_pieces(text))
    ordered = sorted(piece_counts.items())
    words = [[bytes([b]) for b in piece] for piece, _ in ordered]
    stats = _PairStats(words, [count for _, count in ordered])

    ranks = {bytes([b]): b for b in range(256)}
    while len(ranks) < num_ranks:
        pair = stats.best_pair()
        if pair is None:
            break
        merged = pair[0] + pair[1]
        # A byte string reachable by two different merges gets one rank (tiktoken needs unique
        # tokens); the merge is still applied so training continues on the merged token.
        if merged not in ranks:
            ranks[merged] = len(ranks)
        stats.merge(pair)
    return ranks


def encode_with_ranks(text: str, ranks: dict[bytes, int]) -> list[int]:
    """Reference (slow, pure Python) encoder: split, then merge the lowest-ranked pair first.
    A piece that is itself a token is taken whole, as tiktoken does."""
    ids: list[int] = []
    for piece in split_pieces(text):
        data = piece.encode("utf-8")
        if data in ranks:
            ids.append(ranks[data])
            continue
        parts = [bytes([b]) for b in data]
        while len(parts) > 1:
            candidates = [
                (ranks[parts[i] + parts[i + 1]], i) for i in range(len(parts) - 1) if parts[i] + parts[i + 1] in ranks
            ]
            if not candidates:
                break
            _, i = min(candidates)
            parts[i : i + 2] = [parts[i] + parts[i + 1]]
        ids.extend(ranks[part] for part in parts)
    return ids


# ---- directory writer ----------------------------------------------------------------------


def _added_token_entry(name: str) -> dict:
    return {
        "content": name,
        "lstrip": False,
        "normalized": False,
        "rstrip": False,
        "single_word": False,
        "special": name not in K3_NOT_SKIPPED_SPECIALS,
    }


def write_tokenizer_dir(
    out_dir: str | Path,
    ranks: dict[bytes, int],
    *,
    name_reserved_slots: bool = False,
    model_max_length: int = 1_048_576,
) -> Path:
    """Write `tiktoken.model`, `tokenizer_config.json` and `special_tokens_map.json` in K3's layout,
    and the same tokenizer as `tokenizer.json` (models/kimi_k3/hf_tokenizer.py), which the config names
    (`PreTrainedTokenizerFast`) so that `transformers.AutoTokenizer` loads the folder offline.

    The 256 special slots start right after the ranks, with K3's names at K3's offsets. K3's real
    `added_tokens_decoder` lists only the 16 named slots; `name_reserved_slots=True` also lists the
    240 `<|reserved_token_{id}|>` slots (the loader fills those names in either way).
    """
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ValueError("ranks must be exactly 0..N-1")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    num_ranks = len(ranks)

    lines = [f"{base64.b64encode(token).decode('ascii')} {rank}" for token, rank in sorted(ranks.items(), key=_by_rank)]
    (out_dir / "tiktoken.model").write_text("\n".join(lines) + "\n", encoding="ascii")

    all_names = k3_special_names(num_ranks)
    write_hf_tokenizer(out_dir, ranks, [(i, name, name not in K3_NOT_SKIPPED_SPECIALS)
                                        for i, name in all_names.items()])
    names = all_names
    if not name_reserved_slots:
        names = {i: name for i, name in names.items() if name != reserved_token_name(i)}
    assert len(k3_special_names(num_ranks)) == NUM_SPECIAL_SLOTS
    config = {
        "added_tokens_decoder": {str(i): _added_token_entry(name) for i, name in names.items()},
        "bos_token": BOS,
        "clean_up_tokenization_spaces": False,
        "eos_token": EOS,
        "model_max_length": model_max_length,
        "pad_token": PAD,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": UNK,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    special_map = {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD, "unk_token": UNK}
    (out_dir / "special_tokens_map.json").write_text(json.dumps(special_map, indent=2) + "\n", encoding="utf-8")
    return out_dir


def _by_rank(item: tuple[bytes, int]) -> int:
    return item[1]


# ---- tiny tokenizer from the standard library ----------------------------------------------


def stdlib_corpus(max_bytes: int = DEFAULT_CORPUS_BYTES) -> list[str]:
    """Source text of the Python standard library's top-level modules, by sorted file name, until
    `max_bytes` (UTF-8) are collected. Every Python install has it, so no download is needed."""
    stdlib_dir = Path(os.__file__).parent
    texts: list[str] = []
    total = 0
    for path in sorted(stdlib_dir.glob("*.py")):
        text = path.read_text(encoding="utf-8", errors="replace")
        size = len(text.encode("utf-8"))
        if total + size > max_bytes:
            text = text.encode("utf-8")[: max_bytes - total].decode("utf-8", errors="ignore")
            size = len(text.encode("utf-8"))
        texts.append(text)
        total += size
        if total >= max_bytes:
            break
    return texts


def train_tiny_tokenizer(
    out_dir: str | Path, num_ranks: int = 1024, max_bytes: int = DEFAULT_CORPUS_BYTES, **write_kwargs
) -> Path:
    """Train `num_ranks` ranks on stdlib source and write a K3-layout tokenizer directory."""
    ranks = train_bpe_ranks(stdlib_corpus(max_bytes), num_ranks)
    if len(ranks) != num_ranks:
        raise ValueError(f"corpus of {max_bytes} bytes yields only {len(ranks)} ranks; raise max_bytes")
    return write_tokenizer_dir(out_dir, ranks, **write_kwargs)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Train a tiny K3-layout BPE tokenizer on stdlib source.")
    parser.add_argument("out_dir")
    parser.add_argument("--num-ranks", type=int, default=1024)
    parser.add_argument("--max-bytes", type=int, default=DEFAULT_CORPUS_BYTES)
    args = parser.parse_args(argv)
    out = train_tiny_tokenizer(args.out_dir, args.num_ranks, args.max_bytes)
    print(f"wrote {out} ({args.num_ranks} ranks + {NUM_SPECIAL_SLOTS} specials)")


if __name__ == "__main__":
    main()
