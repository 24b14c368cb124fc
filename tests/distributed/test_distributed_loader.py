"""The sharded loader reads only each rank's slices of the safetensors shards, and they are the right ones."""

from __future__ import annotations

import pytest
import torch

from mstar.checkpoint.safetensors_io import CheckpointReader
from mstar.distributed.communicator import NullCommunicator
from mstar.distributed.loader import load_rank_model, rank_module, read_rank_tensors
from mstar.distributed.sharding import ShardingPlan
from mstar.models.kimi_k3.config import load_config
from mstar.quant.mxfp4 import dequantize_mxfp4

LAYOUTS = [(2, 1), (2, 2), (4, 2)]


class RecordingReader:
    """A CheckpointReader that records every tensor read and how many bytes came out of the file."""

    def __init__(self, reader: CheckpointReader):
        self.reader = reader
        self.bytes_read: dict[str, int] = {}
        self.whole: set[str] = set()

    def __getattr__(self, name):  # names, has, shape: metadata only
        return getattr(self.reader, name)

    def _count(self, name: str, t: torch.Tensor) -> torch.Tensor:
        self.bytes_read[name] = self.bytes_read.get(name, 0) + t.numel() * t.element_size()
        return t

    def get(self, name: str) -> torch.Tensor:
        self.whole.add(name)
        return self._count(name, self.reader.get(name))

    def get_slice(self, name: str):
        recorder = self

        class Sliced:
            def __getitem__(self, index):
                return recorder._count(name, recorder.reader.get_slice(name)[index])

        return Sliced()


def _stored_bytes(reader: CheckpointReader, name: str) -> int:
    shape = reader.shape(name)
    return int(torch.tensor(shape).prod()) * torch.empty((), dtype=reader.dtype(name)).element_size()


@pytest.mark.parametrize("latent_sharded", [False, True], ids=["latent-replicated", "latent-sharded"])
@pytest.mark.parametrize("tp, ep", LAYOUTS)
def test_each_rank_reads_exactly_its_slices(tiny_dir, tiny_model, tp, ep, latent_sharded):
    config = load_config(tiny_dir)
    full = tiny_model.state_dict()
    prefix = config.weight_prefix
    read_by_rank = []
    with CheckpointReader(tiny_dir) as reader:
        for rank in range(tp):
            plan = ShardingPlan(tp, rank, ep, latent_sharded)
            shapes = {n: tuple(t.shape) for n, t in rank_module(config, plan).state_dict().items()}
            recorder = RecordingReader(reader)
            tensors = read_rank_tensors(recorder, config, plan, shapes)
            for name, t in tensors.items():
                split = plan.split_of(name, config)
                whole = full[name]
                if name.endswith(".A_log"):
                    h = whole.shape[0] // tp
                    expect = whole[rank * h : (rank + 1) * h]
                else:
                    expect = whole if split is None else whole[split.region(tuple(whole.shape))]
                assert torch.equal(t.float(), expect.float()), name
                if split is not None:  # a split tensor is never read whole (MXFP4 halves included)
                    forms = {prefix + name, prefix + name + "_packed", prefix + name + "_scale"}
                    assert not forms & recorder.whole, name
            read_by_rank.append(recorder.bytes_read)

        # Summed over the ranks, each split tensor's bytes (packed experts' bytes and scales) were read
        # exactly once: no rank read another's slice. Replicated ones: once per rank.
        module_names = {n for n in full}
        for ck in reader.names():
            name = ck.removeprefix(prefix)
            stem = name.removesuffix("_packed").removesuffix("_scale")
            module = stem if stem in module_names else name
            split = ShardingPlan(tp, 0, ep, latent_sharded).split_of(module, config)
            if ".routed_expert_" in ck and "_norm" not in ck:  # the latent projections: split iff sharded
                assert (split is not None) == (latent_sharded and tp > 1), ck
            total = sum(r.get(ck, 0) for r in read_by_rank)
            stored = _stored_bytes(reader, ck)
            if ck.endswith(".A_log"):
                assert total == stored * config.linear_attn.num_heads // 128  # only the heads, never the padding
            elif ".experts." in ck and ep > 1 and split is None:
                assert total == stored, ck  # pure EP: each expert is read whole, by its group only
            elif split is None:
                assert total == stored * tp, ck
            else:
                assert total == stored, ck


def test_mxfp4_w2_column_slices_keep_whole_scale_groups(tiny_dir):
    """w2's packed bytes and scales are cut at the same 32-column group boundary (hybrid layout)."""
    config = load_config(tiny_dir)
    name = "model.layers.1.block_sparse_moe.experts.3.w2.weight"
    with CheckpointReader(tiny_dir) as reader:
        packed = reader.get(config.weight_prefix + name + "_packed")
        scale = reader.get(config.weight_prefix + name.removesuffix("weight") + "weight_scale")
        whole = dequantize_mxfp4(packed, scale)
        pieces = []
        for rank in (0, 1):  # the EP group of ranks 0 and 1 holds expert 3, 32 columns each
            plan = ShardingPlan(4, rank, 2)
            got = read_rank_tensors(reader, config, plan, {name: (whole.shape[0], whole.shape[1] // 2)})
            assert set(got) == {name + "_packed", name.removesuffix("weight") + "weight_scale"}  # kept packed
            pieces.append(dequantize_mxfp4(got[name + "_packed"], got[name.removesuffix("weight") + "weight_scale"]))
    assert torch.equal(torch.cat(pieces, dim=1), whole)


def test_load_rank_model(tiny_dir, tiny_model):
    plan = ShardingPlan(2, 1)
    model = load_rank_model(tiny_dir, plan, NullCommunicator(2, 1))
    assert model.model.layers[0].self_attn.num_heads == tiny_model.model.layers[0].self_attn.num_heads // 2
    assert torch.equal(model.lm_head.weight, tiny_model.lm_head.weight[tiny_model.config.vocab_size // 2:])
    with pytest.raises(ValueError, match="communicator"):
        load_rank_model(tiny_dir, plan, NullCommunicator(2, 0))
