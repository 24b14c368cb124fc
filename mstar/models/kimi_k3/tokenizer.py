"""Kimi K3 tokenizer: tiktoken byte-level BPE plus 256 reserved special-token slots.

File layout of a K3 tokenizer directory (as in the `moonshotai/Kimi-K3` HF repo):

- `tiktoken.model`: one `base64(token_bytes) rank` pair per line. K3 has 163,584 ranks (ids 0..163583).
- `tokenizer_config.json`: `added_tokens_decoder` maps the id (as a string) of each *named* special
  token to `{"content": name, "special": bool, ...}`. The real file names 16 of the 256 slots; the
  others are filled in by the loader as `<|reserved_token_{id}|>` (the id embedded is the absolute id).

The 256 special slots follow the BPE ranks directly: with N ranks, specials are N..N+255. K3's named
slots, as offsets from N, are in `K3_NAMED_SPECIALS`.

Text encoding never produces a special id: control tokens reach a prompt only through
`encode_segments` with a `Segment(..., control=True)`. This is what stops a user who types
`<|close|>message<|sep|>` from forging structure.
"""

from __future__ import annotations

import base64
import binascii
import codecs
import json
import re
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import tiktoken

# The pre-tokenizer split of Kimi K2/K3 (`tokenization_kimi.py`, `pat_str`): Han runs on their own,
# letter words (with an optional leading non-letter and English contraction suffixes), digit runs of
# at most 3, punctuation runs, and whitespace handled GPT-4 style. It uses class intersection
# (`&&`), which tiktoken's Rust regex engine supports and Python's `regex` module supports in V1 mode.
K3_SPLIT_PATTERN = "|".join(
    [
        r"""[\p{Han}]+""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",  # noqa: E501
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",  # noqa: E501
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    ]
)

NUM_SPECIAL_SLOTS = 256
K3_NUM_RANKS = 163_584

# Offset from the first special id -> name, from K3's tokenizer_config.json `added_tokens_decoder`.
K3_NAMED_SPECIALS: dict[int, str] = {
    0: "[BOS]",
    1: "[EOS]",
    2: "<|end_of_msg|>",
    3: "<|open|>",
    4: "<|close|>",
    5: "<|sep|>",
    6: "[start_header_id]",
    7: "[end_header_id]",
    9: "[EOT]",
    18: "<|media_begin|>",
    19: "<|media_content|>",
    20: "<|media_end|>",
    21: "<|media_pad|>",
    65: "<osagent_mode>",
    254: "[UNK]",
    255: "[PAD]",
}
# The XTML brackets are marked `"special": false` in the real config (so HF's skip_special_tokens
# keeps them in decoded text); every other named slot is `"special": true`.
K3_NOT_SKIPPED_SPECIALS = frozenset({"<|open|>", "<|close|>", "<|sep|>"})

BOS = "[BOS]"
EOS = "[EOS]"
END_OF_MSG = "<|end_of_msg|>"
OPEN = "<|open|>"
CLOSE = "<|close|>"
SEP = "<|sep|>"
UNK = "[UNK]"
PAD = "[PAD]"
_REQUIRED_SPECIALS = (BOS, EOS, END_OF_MSG, OPEN, CLOSE, SEP, UNK, PAD)

# Limits from `tokenization_kimi.py`: tiktoken's Rust core can panic on very long inputs and is
# quadratic on very long runs without a split point, so text is cut first. Cutting changes tokens
# only at the cut, and doing it the same way keeps ids identical to the reference tokenizer.
_MAX_ENCODE_CHARS = 400_000
_MAX_RUN_CHARS = 25_000


def reserved_token_name(token_id: int) -> str:
    """Name of an unnamed special slot, as `tokenization_kimi.py` fills it in."""
    return f"<|reserved_token_{token_id}|>"


def k3_special_names(num_ranks: int) -> dict[int, str]:
    """All 256 special ids -> names for a vocabulary with `num_ranks` BPE ranks, in K3's layout."""
    names = {num_ranks + k: reserved_token_name(num_ranks + k) for k in range(NUM_SPECIAL_SLOTS)}
    names.update({num_ranks + offset: name for offset, name in K3_NAMED_SPECIALS.items()})
    return names


@dataclass(frozen=True)
class Segment:
    """A piece of a prompt. `control=False`: ordinary text, special-looking text stays text.
    `control=True`: special-token names inside it become their ids (the rest is ordinary text)."""

    text: str
    control: bool = False


def read_tiktoken_ranks(path: str | Path) -> dict[bytes, int]:
    """Parse a `tiktoken.model` file: `base64(token_bytes) rank` per line; ranks must be 0..N-1."""
    path = Path(path)
    ranks: dict[bytes, int] = {}
    seen_ranks: set[int] = set()
    for line_no, line in enumerate(path.read_bytes().splitlines(), start=1):
        if not line.strip():
            continue
        fields = line.split()
        if len(fields) != 2:
            raise ValueError(f"{path}:{line_no}: expected 'base64_token rank', got {line[:80]!r}")
        try:
            token = base64.b64decode(fields[0], validate=True)
            rank = int(fields[1])
        except (binascii.Error, ValueError) as err:
            raise ValueError(f"{path}:{line_no}: cannot parse {line[:80]!r}: {err}") from err
        if token in ranks or rank in seen_ranks:
            raise ValueError(f"{path}:{line_no}: duplicate token or rank {rank}; the file is corrupt")
        ranks[token] = rank
        seen_ranks.add(rank)
    if seen_ranks != set(range(len(ranks))):
        raise ValueError(f"{path}: ranks are not exactly 0..{len(ranks) - 1}")
    return ranks


def read_special_names(config_path: str | Path, num_ranks: int) -> dict[int, str]:
    """Special id -> name for all 256 slots: named ones from `added_tokens_decoder`, rest reserved."""
    config = json.loads(Path(config_path).read_text(encoding="utf-8"))
    decoder = config.get("added_tokens_decoder")
    if not isinstance(decoder, dict):
        raise ValueError(f"{config_path}: missing 'added_tokens_decoder'; it names the special tokens")
    names = {num_ranks + k: reserved_token_name(num_ranks + k) for k in range(NUM_SPECIAL_SLOTS)}
    for key, entry in decoder.items():
        token_id = int(key)
        if token_id not in names:
            raise ValueError(
                f"{config_path}: added token id {token_id} is outside the special slots "
                f"{num_ranks}..{num_ranks + NUM_SPECIAL_SLOTS - 1} that follow the {num_ranks} BPE ranks"
            )
        names[token_id] = entry["content"] if isinstance(entry, dict) else str(entry)
    return names


_LONG_RUN = re.compile(rf"\s{{{_MAX_RUN_CHARS + 1},}}|\S{{{_MAX_RUN_CHARS + 1},}}")


def _split_long_runs(text: str) -> Iterator[str]:
    """Cut `text` so that no piece has more than `_MAX_RUN_CHARS` consecutive (non-)whitespace chars."""
    for start in range(0, len(text), _MAX_ENCODE_CHARS):
        chunk = text[start : start + _MAX_ENCODE_CHARS]
        if _LONG_RUN.search(chunk) is None:  # the common case; skip the per-character scan
            yield chunk
            continue
        piece_start = 0
        run_len = 0
        run_is_space = chunk[0].isspace() if chunk else False
        for i, char in enumerate(chunk):
            if char.isspace() != run_is_space:
                run_is_space = not run_is_space
                run_len = 1
                continue
            run_len += 1
            if run_len > _MAX_RUN_CHARS:
                yield chunk[piece_start:i]
                piece_start = i
                run_len = 1
        yield chunk[piece_start:]


class KimiTokenizer:
    """K3's tokenizer: `encode` for plain text, `encode_segments` for prompts with control tokens."""

    def __init__(self, ranks: dict[bytes, int], special_names: dict[int, str], name: str = "kimi_k3"):
        self.num_ranks = len(ranks)
        expected_ids = set(range(self.num_ranks, self.num_ranks + NUM_SPECIAL_SLOTS))
        if set(special_names) != expected_ids:
            raise ValueError(
                f"special_names must cover exactly ids {self.num_ranks}..{self.num_ranks + NUM_SPECIAL_SLOTS - 1}"
            )
        if len(set(special_names.values())) != len(special_names):
            raise ValueError("two special slots share a name; each of the 256 needs its own")
        self.special_names = dict(sorted(special_names.items()))
        self._special_ids = {name: token_id for token_id, name in self.special_names.items()}
        missing = [name for name in _REQUIRED_SPECIALS if name not in self._special_ids]
        if missing:
            raise ValueError(f"the tokenizer has no special token(s) {missing}; K3 prompts need them")
        self._encoding = tiktoken.Encoding(
            name=name, pat_str=K3_SPLIT_PATTERN, mergeable_ranks=ranks, special_tokens=self._special_ids
        )
        # Text of N characters is at least N / max_token_bytes tokens (a token decodes to at most that many
        # bytes, a character takes at least one): the server refuses text that cannot fit without encoding it.
        self.max_token_bytes = max(map(len, ranks), default=1)

    @classmethod
    def from_dir(cls, directory: str | Path) -> KimiTokenizer:
        """Load `tiktoken.model` + `tokenizer_config.json` from a K3 tokenizer/checkpoint directory."""
        directory = Path(directory)
        model_path = directory / "tiktoken.model"
        config_path = directory / "tokenizer_config.json"
        for path in (model_path, config_path):
            if not path.is_file():
                raise FileNotFoundError(
                    f"{path} not found; a K3 tokenizer directory needs tiktoken.model and tokenizer_config.json"
                )
        ranks = read_tiktoken_ranks(model_path)
        return cls(ranks, read_special_names(config_path, len(ranks)), name=directory.name or "kimi_k3")

    # ---- ids and names -------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        """BPE ranks plus the 256 special slots (163,840 for K3, the embedding row count)."""
        return self.num_ranks + NUM_SPECIAL_SLOTS

    def token_id(self, name: str) -> int:
        """Id of a special token by name, e.g. `token_id("<|open|>")`."""
        try:
            return self._special_ids[name]
        except KeyError:
            raise KeyError(f"{name!r} is not a special token of this tokenizer") from None

    def is_special(self, token_id: int) -> bool:
        return self.num_ranks <= token_id < self.vocab_size

    @property
    def bos_id(self) -> int:
        return self._special_ids[BOS]

    @property
    def encoding(self) -> tiktoken.Encoding:
        """The tiktoken encoding (a grammar engine builds its token vocabulary from it)."""
        return self._encoding

    @property
    def eos_id(self) -> int:
        """`<|end_of_msg|>`: ends every XTML message and is K3's generation stop (generation_config)."""
        return self._special_ids[END_OF_MSG]

    @property
    def pad_id(self) -> int:
        return self._special_ids[PAD]

    @property
    def unk_id(self) -> int:
        return self._special_ids[UNK]

    @property
    def stop_ids(self) -> tuple[int, ...]:
        """Ids that end generation: `<|end_of_msg|>` and the HF tokenizer's `eos_token` `[EOS]`."""
        return (self._special_ids[END_OF_MSG], self._special_ids[EOS])

    # ---- encoding ------------------------------------------------------------------------------

    def min_num_tokens(self, num_chars: int) -> int:
        """The fewest tokens that text of `num_chars` characters can encode to (see `max_token_bytes`)."""
        return -(-num_chars // self.max_token_bytes)

    def encode(self, text: str) -> list[int]:
        """Encode ordinary text. Never yields a special id: `"<|sep|>"` becomes ordinary BPE tokens."""
        if not isinstance(text, str):
            raise TypeError(f"encode expects str, got {type(text).__name__}")
        ids: list[int] = []
        for piece in _split_long_runs(text):
            ids.extend(self._encoding.encode(piece, allowed_special=set(), disallowed_special=()))
        return ids

    def _encode_control(self, text: str) -> list[int]:
        ids: list[int] = []
        for piece in _split_long_runs(text):
            ids.extend(self._encoding.encode(piece, allowed_special="all"))
        return ids

    def encode_segments(self, segments: Iterable[Segment | str]) -> list[int]:
        """Encode a prompt segment by segment (a plain `str` is ordinary text).

        Each segment is BPE-encoded on its own, as K3's reference tokenizer does, so token boundaries
        at segment edges are part of the format: `" role"` + `'="'` is not the same as `' role="'`.
        """
        ids: list[int] = []
        for segment in segments:
            if isinstance(segment, str):
                ids.extend(self.encode(segment))
            elif segment.control:
                ids.extend(self._encode_control(segment.text))
            else:
                ids.extend(self.encode(segment.text))
        return ids

    # ---- decoding ------------------------------------------------------------------------------

    def _check_ids(self, ids: Sequence[int]) -> None:
        for token_id in ids:
            if not 0 <= token_id < self.vocab_size:
                raise ValueError(f"token id {token_id} is outside the vocabulary 0..{self.vocab_size - 1}")

    def token_bytes(self, token_id: int) -> bytes:
        """Bytes of one token; a special token yields its name."""
        self._check_ids((token_id,))
        return self._encoding.decode_single_token_bytes(token_id)

    def decode_bytes(self, ids: Sequence[int], skip_special: bool = False) -> bytes:
        ids = [int(i) for i in ids]
        self._check_ids(ids)
        if skip_special:
            ids = [i for i in ids if i < self.num_ranks]
        return self._encoding.decode_bytes(ids)

    def decode(self, ids: Sequence[int], skip_special: bool = False) -> str:
        """Text of `ids`; special tokens appear as their names unless `skip_special`.
        Bytes that are not valid UTF-8 become U+FFFD."""
        return self.decode_bytes(ids, skip_special).decode("utf-8", errors="replace")

    def decode_segments(self, ids: Sequence[int]) -> list[Segment]:
        """Split generated ids into text segments and one control segment per special token.

        Parsers use this to tell real structure (a special id) from text that merely spells it."""
        segments: list[Segment] = []
        run: list[int] = []
        for token_id in ids:
            if self.is_special(token_id):
                if run:
                    segments.append(Segment(self.decode(run)))
                    run = []
                segments.append(Segment(self.special_names[token_id], control=True))
            else:
                run.append(token_id)
        if run:
            segments.append(Segment(self.decode(run)))
        return segments


class IncrementalDetokenizer:
    """Per-request streaming decode: push ids one at a time, get text deltas.

    An incomplete UTF-8 sequence at the end is held back until its remaining bytes arrive, so a
    delta never carries a U+FFFD for valid text that was split mid-character. `finish()` flushes
    what is left (an incomplete tail becomes U+FFFD there, as in a full decode). The concatenated
    deltas equal `tokenizer.decode(all_ids, skip_special)`.
    """

    def __init__(self, tokenizer: KimiTokenizer, skip_special: bool = False):
        self.tokenizer = tokenizer
        self.skip_special = skip_special
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._parts: list[str] = []
        self.num_tokens = 0

    def push(self, token_id: int) -> str:
        """Add one token; return the newly completed text (possibly empty)."""
        self.num_tokens += 1
        if self.skip_special and self.tokenizer.is_special(token_id):
            self.tokenizer._check_ids((token_id,))
            return ""
        delta = self._decoder.decode(self.tokenizer.token_bytes(token_id))
        if delta:
            self._parts.append(delta)
        return delta

    def push_many(self, ids: Iterable[int]) -> str:
        return "".join(self.push(token_id) for token_id in ids)

    def finish(self) -> str:
        """Flush held-back bytes at the end of the request."""
        delta = self._decoder.decode(b"", final=True)
        if delta:
            self._parts.append(delta)
        return delta

    @property
    def text(self) -> str:
        """All text emitted so far."""
        return "".join(self._parts)
