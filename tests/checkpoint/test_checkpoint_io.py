"""safetensors checkpoint I/O: single-file and sharded round trips, index layout, laziness, errors."""

from __future__ import annotations

import hashlib
import json
import re

import pytest
import torch
from safetensors.torch import load_file

from mstar.checkpoint.safetensors_io import (
    INDEX_FILE,
    SINGLE_FILE,
    CheckpointError,
    CheckpointReader,
    check_tensor_names_and_shapes,
    plan_shards,
    write_checkpoint,
)


def _random_tensors() -> dict[str, torch.Tensor]:
    """Fresh random tensors of mixed dtypes and awkward shapes (odd byte counts, scalar, empty, strided)."""
    n = int(torch.randint(3, 40, ()).item())
    return {
        "layers.0.w": torch.randn(n, 17).to(torch.bfloat16),
        "layers.0.norm": torch.randn(n),
        "layers.1.w": torch.randn(33, n, dtype=torch.bfloat16).t(),  # non-contiguous
        "layers.1.packed": torch.randint(0, 256, (n, 7), dtype=torch.uint8),
        "layers.1.scale": torch.randint(0, 256, (n, 3), dtype=torch.uint8),
        "bias": torch.randn(1),
        "scalar": torch.randn(()),
        "empty": torch.zeros(0, 5),
        "ids": torch.randint(-(2**40), 2**40, (11,), dtype=torch.int64),
        "special": torch.tensor([float("nan"), float("inf"), -0.0, 1e-40]),
    }


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _assert_bit_identical(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape
    assert torch.equal(_bits(a), _bits(b))


def _sha(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_single_file_round_trip(tmp_path):
    tensors = _random_tensors()
    written = write_checkpoint(tmp_path, tensors, metadata={"note": "hello"})
    assert written == [tmp_path / SINGLE_FILE]
    assert not (tmp_path / INDEX_FILE).exists()
    with CheckpointReader(tmp_path) as r:
        assert r.names() == sorted(tensors)
        assert r.metadata() == {"format": "pt", "note": "hello"}
        for name, t in tensors.items():
            assert r.has(name) and name in r
            assert r.shape(name) == tuple(t.shape)
            assert r.dtype(name) == t.dtype
            _assert_bit_identical(r.get(name), t)
    # The official loader reads the same file.
    official = load_file(tmp_path / SINGLE_FILE)
    for name, t in tensors.items():
        _assert_bit_identical(official[name], t)


def test_no_limit_or_big_limit_gives_one_file(tmp_path):
    tensors = _random_tensors()
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    assert write_checkpoint(tmp_path, tensors, max_shard_bytes=total) == [tmp_path / SINGLE_FILE]


def test_sharded_round_trip_and_index_layout(tmp_path):
    tensors = _random_tensors()
    sizes = {n: t.numel() * t.element_size() for n, t in tensors.items()}
    limit = max(sizes.values()) // 2 + 1  # forces several shards, and one tensor larger than the limit
    written = write_checkpoint(tmp_path, tensors, max_shard_bytes=limit)
    assert not (tmp_path / SINGLE_FILE).exists()
    index = json.loads((tmp_path / INDEX_FILE).read_text())
    assert set(index) == {"metadata", "weight_map"}
    assert index["metadata"]["total_size"] == sum(sizes.values())
    weight_map = index["weight_map"]
    assert list(weight_map) == sorted(tensors)
    shard_files = sorted(set(weight_map.values()))
    count = len(shard_files)
    assert count > 1
    assert shard_files == [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]
    assert written == [tmp_path / f for f in shard_files] + [tmp_path / INDEX_FILE]
    for f in shard_files:
        held = [n for n, sf in weight_map.items() if sf == f]
        assert sum(sizes[n] for n in held) <= limit or len(held) == 1
        assert sorted(load_file(tmp_path / f)) == held
    # Shards follow sorted name order.
    assert [weight_map[n] for n in sorted(tensors)] == sorted(weight_map[n] for n in sorted(tensors))
    with CheckpointReader(tmp_path) as r:
        assert r.names() == sorted(tensors)
        for name, t in tensors.items():
            assert r.file_of(name) == weight_map[name]
            _assert_bit_identical(r.get(name), t)


def test_writes_are_deterministic_and_replace_an_old_checkpoint(tmp_path):
    tensors = _random_tensors()
    a, b = tmp_path / "a", tmp_path / "b"
    limit = 600
    write_checkpoint(a, tensors, max_shard_bytes=limit)
    reordered = dict(reversed(list(tensors.items())))
    write_checkpoint(b, reordered, max_shard_bytes=limit)
    files = sorted(p.name for p in a.iterdir())
    assert files == sorted(p.name for p in b.iterdir())
    assert all(_sha(a / f) == _sha(b / f) for f in files)
    # Rewriting as one file removes the index and shards, so the reader cannot see stale data.
    write_checkpoint(a, {"x": torch.ones(2)})
    assert sorted(p.name for p in a.iterdir()) == [SINGLE_FILE]
    with CheckpointReader(a) as r:
        assert r.names() == ["x"]


def test_plan_shards_is_greedy_in_name_order():
    sizes = {"d": 4, "a": 3, "c": 10, "b": 3}
    assert plan_shards(sizes, None) == [["a", "b", "c", "d"]]
    assert plan_shards(sizes, 6) == [["a", "b"], ["c"], ["d"]]
    assert plan_shards(sizes, 100) == [["a", "b", "c", "d"]]


def test_reader_is_lazy_and_get_slice_reads_a_part(tmp_path):
    rows, cols = int(torch.randint(8, 40, ()).item()), 24
    tensors = {f"t{i}": torch.randn(rows, cols).to(torch.bfloat16) for i in range(4)}
    write_checkpoint(tmp_path, tensors, max_shard_bytes=rows * cols * 2)  # one tensor per shard
    r = CheckpointReader(tmp_path)
    assert r.num_open_files == 0  # the index alone gives the names
    assert r.names() == sorted(tensors) and len(r) == 4
    assert r.shape("t2") == (rows, cols)
    assert r.num_open_files == 1
    sl = r.get_slice("t1")
    lo, hi = rows // 4, rows // 2
    part = sl[lo:hi, 8:16]
    _assert_bit_identical(part, tensors["t1"][lo:hi, 8:16].contiguous())
    assert r.num_open_files == 2
    r.close()
    assert r.num_open_files == 0
    _assert_bit_identical(r.get("t3"), tensors["t3"])  # reopens on demand after close
    r.close()


def test_missing_dir_and_empty_dir(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        CheckpointReader(tmp_path / "nowhere")
    (tmp_path / "notes.txt").write_text("no weights here")
    with pytest.raises(CheckpointError) as e:
        CheckpointReader(tmp_path)
    assert INDEX_FILE in str(e.value) and SINGLE_FILE in str(e.value)


def test_index_naming_a_missing_shard(tmp_path):
    tensors = {f"t{i}": torch.randn(16) for i in range(3)}
    write_checkpoint(tmp_path, tensors, max_shard_bytes=64)
    gone = json.loads((tmp_path / INDEX_FILE).read_text())["weight_map"]["t1"]
    (tmp_path / gone).unlink()
    with pytest.raises(CheckpointError, match=re.escape(gone)):
        CheckpointReader(tmp_path)


def test_index_pointing_at_the_wrong_shard(tmp_path):
    write_checkpoint(tmp_path, {"a": torch.randn(16), "b": torch.randn(16)}, max_shard_bytes=64)
    index = json.loads((tmp_path / INDEX_FILE).read_text())
    index["weight_map"]["a"] = index["weight_map"]["b"]
    (tmp_path / INDEX_FILE).write_text(json.dumps(index))
    with CheckpointReader(tmp_path) as r, pytest.raises(CheckpointError, match="'a'.*does not hold it"):
        r.get("a")


def test_tensor_not_found(tmp_path):
    write_checkpoint(tmp_path, {"layers.0.weight": torch.randn(3)})
    with CheckpointReader(tmp_path) as r:
        for call in (r.get, r.shape, r.dtype, r.get_slice):
            with pytest.raises(CheckpointError, match=r"'layers\.0\.wieght'.*similar names: layers\.0\.weight"):
                call("layers.0.wieght")


def test_check_names_and_shapes_reports_everything():
    expected = {"a": (2, 3), "b": (4,), "c": (5, 5), "d": (1,)}
    found = {"a": (2, 3), "b": (5,), "c": [5, 6], "x": (7,)}
    check_tensor_names_and_shapes(expected, expected, what="ok")
    with pytest.raises(CheckpointError) as e:
        check_tensor_names_and_shapes(found, expected, what="my model")
    msg = str(e.value)
    assert msg.startswith("my model")
    assert "1 missing: d" in msg
    assert "1 unexpected: x" in msg
    assert "2 mis-shaped" in msg
    assert "b (expected (4,), found (5,))" in msg and "c (expected (5, 5), found (5, 6))" in msg


def test_check_names_and_shapes_caps_long_lists():
    expected = {f"w{i:03d}": (1,) for i in range(100)}
    with pytest.raises(CheckpointError) as e:
        check_tensor_names_and_shapes({}, expected, what="big")
    msg = str(e.value)
    assert "100 missing" in msg and "and 88 more" in msg
    assert "w000" in msg and "w099" not in msg
