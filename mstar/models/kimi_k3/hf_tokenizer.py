"""K3's tiktoken BPE as a standard Hugging Face fast-tokenizer file (`tokenizer.json`).

K3 ships `tiktoken.model` and a `tokenization_kimi.py` that `transformers` must import as remote
code; tools that only load tokenizers (aiperf, guidellm, lm-eval) cannot. The same BPE as a
`tokenizers` file loads with `AutoTokenizer.from_pretrained(folder)` offline and gives the same ids:

- pre-tokenizer: K3's split pattern (Oniguruma, which `tokenizers` uses, has the `&&` class
  intersection it needs), then byte-level mapping (GPT-2's bytes-to-unicode table) without its
  own regex;
- model: byte-level BPE over the ranks, one merge per multi-byte token, ordered by the token's
  rank. Token t's merge is the pair that tiktoken's own merging reaches for t's bytes using only
  lower ranks, so merging by merge order equals tiktoken's merging by rank; `ignore_merges` takes a
  piece that is itself a token whole, as tiktoken does;
- the 256 special slots are added tokens, with the `special` flags of `tokenizer_config.json`.

The file is built as plain JSON (no `tokenizers` needed to write it), deterministically. One difference stays:
`KimiTokenizer` cuts text of over 400,000 characters (or with a run of over 25,000) before encoding, as
`tokenization_kimi.py` does, and the fast tokenizer encodes it whole, so ids may differ at a cut.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from mstar.models.kimi_k3.tokenizer import K3_SPLIT_PATTERN

HF_TOKENIZER_FILE = "tokenizer.json"


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's table: every byte as a printable character (printable Latin-1 bytes map to themselves)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _merge_pair(token: bytes, ranks: dict[bytes, int]) -> tuple[bytes, bytes] | None:
    """The last merge tiktoken makes for `token`'s bytes with ranks below its own, or None when
    those merges do not end in two parts (the token is then only ever taken whole)."""
    limit = ranks[token]
    parts = [token[i : i + 1] for i in range(len(token))]
    while len(parts) > 2:
        best, at = limit, None
        for i in range(len(parts) - 1):
            rank = ranks.get(parts[i] + parts[i + 1])
            if rank is not None and rank < best:
                best, at = rank, i
        if at is None:
            return None
        parts[at : at + 2] = [parts[at] + parts[at + 1]]
    return (parts[0], parts[1]) if len(parts) == 2 else None


def hf_tokenizer_json(ranks: dict[bytes, int], added: list[tuple[int, str, bool]]) -> dict[str, Any]:
    """The `tokenizer.json` document. `added`: (id, name, special) of every special slot."""
    table = bytes_to_unicode()

    def text(token: bytes) -> str:
        return "".join(table[b] for b in token)

    by_rank = sorted(ranks.items(), key=lambda item: item[1])
    merges = []
    for token, _ in by_rank:
        if len(token) > 1 and (pair := _merge_pair(token, ranks)) is not None:
            merges.append([text(pair[0]), text(pair[1])])
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [{"id": i, "content": name, "single_word": False, "lstrip": False, "rstrip": False,
                          "normalized": False, "special": special} for i, name, special in added],
        "normalizer": None,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": K3_SPLIT_PATTERN}, "behavior": "Isolated", "invert": False},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False},
        ]},
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": True,
                  "vocab": {text(token): rank for token, rank in by_rank}, "merges": merges},
    }


def write_hf_tokenizer(out_dir: str | Path, ranks: dict[bytes, int], added: list[tuple[int, str, bool]]) -> Path:
    path = Path(out_dir) / HF_TOKENIZER_FILE
    path.write_text(json.dumps(hf_tokenizer_json(ranks, added), ensure_ascii=False) + "\n", encoding="utf-8")
    return path
