"""Hugging Face style safetensors checkpoints: write (single file or sharded + index) and read lazily.

Layout on disk (the HF convention): either one `model.safetensors`, or shards
`model-00001-of-0000N.safetensors` … plus `model.safetensors.index.json` holding
`{"metadata": {"total_size": bytes}, "weight_map": {tensor name: shard file}}`.

The writer streams each tensor's bytes straight into the file (no whole-file buffer in memory), so
it is fast and memory-flat even for multi-GB shards. The reader uses `safetensors.safe_open`, which
memory-maps each shard: nothing is read until a tensor (or a slice of one) is asked for.
"""

from __future__ import annotations

import difflib
import json
import os
import re
import struct
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_SHARD_RE = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$")
_MAX_LISTED = 12  # names listed per category in a mismatch report; the rest are counted

_DTYPE_NAMES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.complex64: "C64",
}
# Dtypes that only newer torch builds have.
for _attr, _name in (
    ("uint16", "U16"),
    ("uint32", "U32"),
    ("uint64", "U64"),
    ("float8_e4m3fn", "F8_E4M3"),
    ("float8_e5m2", "F8_E5M2"),
    ("float8_e8m0fnu", "F8_E8M0"),
):
    if hasattr(torch, _attr):
        _DTYPE_NAMES[getattr(torch, _attr)] = _name
_DTYPES_BY_NAME = {v: k for k, v in _DTYPE_NAMES.items()}


class CheckpointError(ValueError):
    """A checkpoint that is missing, malformed, or does not hold the tensors a model needs."""


# --- writing ----------------------------------------------------------------------------------


def shard_file_name(index: int, count: int) -> str:
    """HF shard name, 1-based: `model-00001-of-00003.safetensors`."""
    return f"model-{index:05d}-of-{count:05d}.safetensors"


def plan_shards(sizes: Mapping[str, int], max_shard_bytes: int | None) -> list[list[str]]:
    """Group tensor names (sorted) into shards of at most `max_shard_bytes` each.

    Greedy in name order, so the plan depends only on the names and sizes. A tensor larger than
    the limit gets a shard of its own (tensors are never split).
    """
    names = sorted(sizes)
    if max_shard_bytes is None or sum(sizes.values()) <= max_shard_bytes:
        return [names]
    if max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    shards: list[list[str]] = [[]]
    used = 0
    for name in names:
        if shards[-1] and used + sizes[name] > max_shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += sizes[name]
    return shards


def write_checkpoint(
    out_dir: str | Path,
    tensors: Mapping[str, torch.Tensor],
    *,
    max_shard_bytes: int | None = None,
    metadata: dict[str, str] | None = None,
) -> list[Path]:
    """Write `tensors` as an HF safetensors checkpoint into `out_dir`; return the files written.

    One `model.safetensors` if everything fits in `max_shard_bytes` (or there is no limit), else
    numbered shards plus `model.safetensors.index.json`. Output is deterministic: names sorted,
    stable sharding, dtypes and shapes preserved. `metadata` goes into every file header (with
    `format: pt`, which transformers expects). Checkpoint files of an earlier write in `out_dir`
    (`model.safetensors`, the index, `model-*-of-*.safetensors`) are removed first so the
    directory never holds two inconsistent checkpoints.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for name, t in tensors.items():
        if not isinstance(name, str) or not name:
            raise CheckpointError(f"tensor names must be non-empty strings, got {name!r}")
        if not isinstance(t, torch.Tensor):
            raise CheckpointError(f"tensor '{name}' is a {type(t).__name__}, not a torch.Tensor")
        if t.dtype not in _DTYPE_NAMES:
            raise CheckpointError(f"tensor '{name}' has dtype {t.dtype}, which safetensors cannot store")
    header_meta = {"format": "pt", **(metadata or {})}
    for k, v in header_meta.items():
        if not isinstance(k, str) or not isinstance(v, str):
            raise CheckpointError(f"safetensors metadata must map str to str; got {k!r}: {v!r}")

    sizes = {name: t.numel() * t.element_size() for name, t in tensors.items()}
    shards = plan_shards(sizes, max_shard_bytes)
    _remove_old_checkpoint(out)
    if len(shards) == 1:
        path = out / SINGLE_FILE
        _write_safetensors_file(path, {n: tensors[n] for n in shards[0]}, header_meta)
        return [path]

    written: list[Path] = []
    weight_map: dict[str, str] = {}
    for i, names in enumerate(shards, start=1):
        file_name = shard_file_name(i, len(shards))
        _write_safetensors_file(out / file_name, {n: tensors[n] for n in names}, header_meta)
        weight_map.update(dict.fromkeys(names, file_name))
        written.append(out / file_name)
    index = {"metadata": {"total_size": sum(sizes.values())}, "weight_map": dict(sorted(weight_map.items()))}
    _atomic_write_text(out / INDEX_FILE, json.dumps(index, indent=2) + "\n")
    written.append(out / INDEX_FILE)
    return written


def _remove_old_checkpoint(out: Path) -> None:
    for p in out.iterdir():
        if p.is_file() and (p.name in (SINGLE_FILE, INDEX_FILE) or _SHARD_RE.match(p.name)):
            p.unlink()


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _write_safetensors_file(path: Path, tensors: Mapping[str, torch.Tensor], metadata: dict[str, str]) -> None:
    """Stream one safetensors file: u64 header length, JSON header, then the raw little-endian bytes."""
    # Wider dtypes first (then by name) keeps every tensor aligned to its element size, as the
    # reference writer does; the header lists names sorted.
    order = sorted(tensors, key=lambda n: (-tensors[n].element_size(), n))
    entries: dict[str, Any] = {}
    offset = 0
    for name in order:
        t = tensors[name]
        nbytes = t.numel() * t.element_size()
        entries[name] = {
            "dtype": _DTYPE_NAMES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    header = {"__metadata__": metadata, **dict(sorted(entries.items()))}
    header_bytes = json.dumps(header, separators=(",", ":")).encode()
    header_bytes += b" " * (-len(header_bytes) % 8)  # data starts 8-byte aligned

    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(header_bytes)))
        f.write(header_bytes)
        for name in order:
            f.write(_tensor_bytes(tensors[name]))
    os.replace(tmp, path)


def _tensor_bytes(t: torch.Tensor) -> memoryview:
    flat = t.detach().to("cpu").contiguous().reshape(-1)
    # A byte view of the contiguous storage: no per-element conversion, and bf16/fp8 need no numpy dtype.
    return memoryview(flat.view(torch.uint8).numpy())


# --- reading ----------------------------------------------------------------------------------


class CheckpointReader:
    """Lazy access to a safetensors checkpoint directory (single file or sharded with an index).

    Shards are opened (memory-mapped) on first use and stay open until `close()`; use as a
    context manager. `get_slice(name)[rows, cols]` reads only the requested part of a tensor.
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._handles: dict[str, Any] = {}
        self._keys: dict[str, frozenset[str]] = {}
        self.files, self._weight_map = _locate_checkpoint(self.path)
        if self._weight_map is None:  # a single file: its own header is the name list
            only = next(iter(self.files))
            self._weight_map = dict.fromkeys(sorted(self._open(only).keys()), only)

    # -- context management
    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for handle in self._handles.values():
            handle.__exit__(None, None, None)
        self._handles.clear()
        self._keys.clear()

    @property
    def num_open_files(self) -> int:
        return len(self._handles)

    # -- names and metadata
    def names(self) -> list[str]:
        return list(self._weight_map)

    def has(self, name: str) -> bool:
        return name in self._weight_map

    def __contains__(self, name: object) -> bool:
        return name in self._weight_map

    def __iter__(self) -> Iterator[str]:
        return iter(self._weight_map)

    def __len__(self) -> int:
        return len(self._weight_map)

    def file_of(self, name: str) -> str:
        """The file (relative to the checkpoint directory) holding `name`."""
        self._require(name)
        return self._weight_map[name]

    def metadata(self) -> dict[str, str]:
        """The `__metadata__` of the first file's header."""
        return dict(self._open(next(iter(self.files))).metadata() or {})

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.get_slice(name).get_shape())

    def dtype(self, name: str) -> torch.dtype:
        st_name = self.get_slice(name).get_dtype()
        if st_name not in _DTYPES_BY_NAME:
            raise CheckpointError(f"tensor '{name}' has safetensors dtype {st_name}, which mstar does not handle")
        return _DTYPES_BY_NAME[st_name]

    # -- data
    def get(self, name: str) -> torch.Tensor:
        """The whole tensor (a CPU tensor; copied out of the memory map)."""
        return self._handle_for(name).get_tensor(name)

    def get_slice(self, name: str) -> Any:
        """A lazy slice object: `get_shape()`, `get_dtype()`, and `[...]` indexing that reads only that part."""
        return self._handle_for(name).get_slice(name)

    # -- internals
    def _require(self, name: str) -> None:
        if name not in self._weight_map:
            close = difflib.get_close_matches(name, self._weight_map, n=3)
            hint = f"; similar names: {', '.join(close)}" if close else ""
            raise CheckpointError(
                f"tensor '{name}' is not in the checkpoint at {self.path} ({len(self._weight_map)} tensors){hint}"
            )

    def _handle_for(self, name: str) -> Any:
        self._require(name)
        file_name = self._weight_map[name]
        handle = self._open(file_name)
        if name not in self._keys[file_name]:
            raise CheckpointError(
                f"{INDEX_FILE} in {self.path} puts tensor '{name}' in {file_name}, but that file does not hold it"
            )
        return handle

    def _open(self, file_name: str) -> Any:
        if file_name not in self._handles:
            file_path = self.files[file_name]
            try:
                handle = safe_open(str(file_path), framework="pt")
            except Exception as e:  # safetensors raises its own error types for bad headers
                raise CheckpointError(f"cannot read {file_path} as safetensors: {e}") from e
            self._handles[file_name] = handle
            self._keys[file_name] = frozenset(handle.keys())
        return self._handles[file_name]


def _locate_checkpoint(path: Path) -> tuple[dict[str, Path], dict[str, str] | None]:
    """Find the checkpoint files. Returns (file name -> path, weight map or None for one file)."""
    if path.is_file() and path.name.endswith(".safetensors"):
        return {path.name: path}, None
    if path.is_file() and path.name.endswith(".safetensors.index.json"):
        return _read_index(path)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint directory {path} does not exist")
    if (path / INDEX_FILE).is_file():
        return _read_index(path / INDEX_FILE)
    if (path / SINGLE_FILE).is_file():
        return {SINGLE_FILE: path / SINGLE_FILE}, None
    # Other names (e.g. `consolidated.safetensors`) are fine when unambiguous.
    indexes = sorted(path.glob("*.safetensors.index.json"))
    singles = sorted(path.glob("*.safetensors"))
    if len(indexes) == 1:
        return _read_index(indexes[0])
    if not indexes and len(singles) == 1:
        return {singles[0].name: singles[0]}, None
    found = ", ".join(p.name for p in indexes + singles) or "none"
    raise CheckpointError(
        f"no checkpoint found in {path}: looked for {INDEX_FILE}, {SINGLE_FILE}, or exactly one "
        f"*.safetensors.index.json / *.safetensors file (safetensors files present: {found})"
    )


def _read_index(index_path: Path) -> tuple[dict[str, Path], dict[str, str]]:
    try:
        index = json.loads(index_path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{index_path} is not valid JSON: {e}") from None
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CheckpointError(f"{index_path} has no 'weight_map' object mapping tensor names to shard files")
    files = {f: index_path.parent / f for f in sorted(set(weight_map.values()))}
    missing = [f for f, p in files.items() if not p.is_file()]
    if missing:
        counts = {f: sum(1 for v in weight_map.values() if v == f) for f in missing}
        listed = ", ".join(f"{f} ({counts[f]} tensors)" for f in missing[:_MAX_LISTED])
        more = f" and {len(missing) - _MAX_LISTED} more" if len(missing) > _MAX_LISTED else ""
        raise CheckpointError(
            f"{index_path.name} in {index_path.parent} names shard files that do not exist: {listed}{more}; "
            "the download is incomplete or the index belongs to another checkpoint"
        )
    return files, dict(weight_map)


# --- validation -------------------------------------------------------------------------------


def check_tensor_names_and_shapes(
    found: Mapping[str, tuple[int, ...]],
    expected: Mapping[str, tuple[int, ...]],
    *,
    what: str,
) -> None:
    """Raise CheckpointError unless `found` has exactly the names and shapes of `expected`.

    The error lists every missing, unexpected and mis-shaped tensor (mis-shaped with both shapes),
    capped at a dozen names per category with the full counts given.
    """
    found_shapes = {n: tuple(int(d) for d in s) for n, s in found.items()}
    expected_shapes = {n: tuple(int(d) for d in s) for n, s in expected.items()}
    missing = sorted(set(expected_shapes) - set(found_shapes))
    extra = sorted(set(found_shapes) - set(expected_shapes))
    misshaped = sorted(n for n in set(found_shapes) & set(expected_shapes) if found_shapes[n] != expected_shapes[n])
    if not (missing or extra or misshaped):
        return
    parts = []
    if missing:
        parts.append(f"{len(missing)} missing: " + _capped(missing))
    if extra:
        parts.append(f"{len(extra)} unexpected: " + _capped(extra))
    if misshaped:
        items = [f"{n} (expected {expected_shapes[n]}, found {found_shapes[n]})" for n in misshaped]
        parts.append(f"{len(misshaped)} mis-shaped: " + _capped(items))
    raise CheckpointError(
        f"{what}: tensors do not match the expected layout ({len(found_shapes)} found, "
        f"{len(expected_shapes)} expected):\n  " + "\n  ".join(parts)
    )


def _capped(items: list[str]) -> str:
    shown = ", ".join(items[:_MAX_LISTED])
    return shown + (f", … and {len(items) - _MAX_LISTED} more" if len(items) > _MAX_LISTED else "")
