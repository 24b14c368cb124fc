"""The training corpus every machine already has: the Python standard library's source files.

Files are taken in sorted path order (tests, site-packages and non-UTF-8 files left out) and split by
a hash of the relative path, so the split is the same on every machine with the same Python version.
Each document ends with `[EOS]` (the HF eos token, one of K3's stop ids), so a trained model ends a file
by stopping.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from mstar.models.kimi_k3.tokenizer import EOS, KimiTokenizer

_SKIPPED_DIRS = {"test", "tests", "site-packages", "dist-packages", "__pycache__", "idle_test", "lib2to3"}
HELD_OUT_PER_MILLE = 50  # 5% of files are held out for perplexity and acceptance


def stdlib_dir() -> Path:
    return Path(os.__file__).parent


def stdlib_files(root: Path | None = None) -> list[Path]:
    root = root or stdlib_dir()
    files = []
    for path in sorted(root.rglob("*.py")):
        if _SKIPPED_DIRS.isdisjoint(path.relative_to(root).parts[:-1]):
            files.append(path)
    return files


def is_held_out(path: Path, root: Path) -> bool:
    digest = hashlib.sha256(str(path.relative_to(root)).encode()).digest()
    return int.from_bytes(digest[:4], "little") % 1000 < HELD_OUT_PER_MILLE


def read_source(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return None


@dataclass
class Corpus:
    train: torch.Tensor  # [N] token ids, documents separated by end-of-text
    held_out: torch.Tensor
    num_files: tuple[int, int]  # (train, held out)


def build_corpus(tokenizer: KimiTokenizer, root: Path | None = None, max_train_tokens: int | None = None) -> Corpus:
    """Tokenize the standard library into one train and one held-out stream."""
    root = root or stdlib_dir()
    streams: dict[bool, list[int]] = {False: [], True: []}
    counts = {False: 0, True: 0}
    end_of_text = tokenizer.token_id(EOS)
    for path in stdlib_files(root):
        text = read_source(path)
        if not text:
            continue
        held = is_held_out(path, root)
        if not held and max_train_tokens is not None and len(streams[False]) >= max_train_tokens:
            continue
        streams[held].extend(tokenizer.encode(text))
        streams[held].append(end_of_text)
        counts[held] += 1
    return Corpus(
        train=torch.tensor(streams[False], dtype=torch.long),
        held_out=torch.tensor(streams[True], dtype=torch.long),
        num_files=(counts[False], counts[True]),
    )


def random_windows(stream: torch.Tensor, length: int, count: int, gen: torch.Generator) -> torch.Tensor:
    """`count` windows of `length` tokens at random offsets: [count, length]."""
    if stream.numel() <= length:
        raise ValueError(f"the stream has {stream.numel()} tokens, fewer than one window of {length}")
    starts = torch.randint(0, stream.numel() - length, (count,), generator=gen)
    return torch.stack([stream[s : s + length] for s in starts.tolist()])


def fixed_windows(stream: torch.Tensor, length: int, count: int) -> torch.Tensor:
    """`count` evenly spaced windows (deterministic, for evaluation): [count, length]."""
    if stream.numel() <= length:
        raise ValueError(f"the stream has {stream.numel()} tokens, fewer than one window of {length}")
    step = max(1, (stream.numel() - length) // count)
    return torch.stack([stream[i * step : i * step + length] for i in range(count)])
