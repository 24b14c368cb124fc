"""Load one tensor-parallel rank's model, reading only that rank's slices of the checkpoint.

Every tensor is read through `CheckpointReader.get_slice(name)[index]`, which memory-maps the
safetensors shard and copies out just the indexed part; a rank never materialises a whole split
tensor. Replicated tensors (norms, AttnRes, the router, the latent projections, ...) are read whole.

MXFP4 routed experts are sliced in their packed form, consistently, and stay packed (the rank
module holds them as `MXFP4Linear`s, `weights.assign_weights`):
- w1/w3 (split by rows): the same rows of `weight_packed` [out, in/2] and `weight_scale` [out, in/32];
- w2 (split by input columns c0..c1): `weight_packed[:, c0/2 : c1/2]` and `weight_scale[:, c0/32 : c1/32]`,
  which needs c0 and c1 on 32-column scale-group boundaries (`ExpertSharding.check_mxfp4`).
Experts other expert-parallel groups hold are not read at all.
K3's zero-padded `A_log` is read at the rank's heads only.

Before reading, every name and full shape is checked against the whole model of the checkpoint's
config (headers only), as the single-rank loader does.

`load_vocab_heads` is the one exception to "only the rank's slices": the whole embedding and lm_head,
which rank 0 reads for the DSpark draft when speculation is on.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from mstar.checkpoint.safetensors_io import CheckpointError, CheckpointReader
from mstar.models.kimi_k3.config import KimiK3Config, load_config
from mstar.models.kimi_k3.model import KimiK3ForCausalLM
from mstar.models.kimi_k3.weights import (
    assign_weights,
    check_checkpoint_layout,
    packed_names,
    packed_shapes,
    read_a_log,
)

from .communicator import Communicator, NullCommunicator
from .sharding import ShardingPlan, even_range


def rank_module(config: KimiK3Config, plan: ShardingPlan, comm: Communicator | None = None) -> KimiK3ForCausalLM:
    """The rank's model on the meta device (no memory): its config, its experts, its communicator."""
    comm = comm or NullCommunicator(plan.tp_size, plan.rank)
    with torch.device("meta"):
        return KimiK3ForCausalLM(plan.rank_config(config), comm, plan.expert_sharding(config))


def load_rank_model(checkpoint_dir: str | Path, plan: ShardingPlan, comm: Communicator, *,
                    dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> KimiK3ForCausalLM:
    """Rank `plan.rank`'s model with its slices of the checkpoint, on `device`, in `dtype`."""
    if comm.world_size != plan.tp_size or comm.rank != plan.rank:
        raise ValueError(f"the communicator is rank {comm.rank} of {comm.world_size}, the plan rank {plan.rank} "
                         f"of {plan.tp_size}")
    config = load_config(checkpoint_dir)
    model = rank_module(config, plan, comm)
    shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    with CheckpointReader(checkpoint_dir) as reader:
        tensors = read_rank_tensors(reader, config, plan, shapes, what=str(checkpoint_dir))
    return assign_weights(model, tensors, dtype=dtype, device=device)


def load_vocab_heads(checkpoint_dir: str | Path, *, dtype: torch.dtype = torch.float32,
                     device: str | torch.device = "cpu") -> tuple[nn.Embedding, nn.Linear]:
    """The checkpoint's whole embed_tokens and lm_head (every vocabulary row, not a rank's slice) as
    plain modules: what rank 0's DSpark draft borrows (worker.py says why, and what it costs)."""
    config = load_config(checkpoint_dir)
    with torch.device("meta"):
        embed = nn.Embedding(config.vocab_size, config.hidden_size)
        lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
    with CheckpointReader(checkpoint_dir) as reader:
        for module, name in ((embed, "model.embed_tokens.weight"), (lm_head, "lm_head.weight")):
            weight = reader.get(config.weight_prefix + name).to(device=device, dtype=dtype)
            module.load_state_dict({"weight": weight}, strict=True, assign=True)
    return embed.eval(), lm_head.eval()


def read_rank_tensors(reader: Any, config: KimiK3Config, plan: ShardingPlan, shapes: dict[str, tuple[int, ...]],
                      *, what: str = "checkpoint") -> dict[str, torch.Tensor]:
    """{module name: the rank's slice} for every name in `shapes` (the rank module's state_dict shapes),
    in the checkpoint's dtypes and forms: an expert projection `....wN.weight` that the checkpoint holds
    as MXFP4 comes as its `weight_packed` and `weight_scale` slices (what `assign_weights` loads).
    `reader` is a CheckpointReader (or anything with its `names`, `has`, `shape`, `get`, `get_slice`)."""
    with torch.device("meta"):
        whole_names = list(KimiK3ForCausalLM(config).state_dict())
    packed = check_checkpoint_layout(reader, config, whole_names, what=what)
    if packed and plan.tp_size > 1:
        plan.expert_sharding(config).check_mxfp4()
    out: dict[str, torch.Tensor] = {}
    for name, shape in shapes.items():
        forms = dict(zip(packed_names(name), packed_shapes(shape), strict=True)) if name in packed else {name: shape}
        for form, form_shape in forms.items():
            out[form] = _read_rank_slice(reader, config, plan, form, form_shape)
    return out


def _read_rank_slice(reader: Any, config: KimiK3Config, plan: ShardingPlan, name: str,
                     shape: tuple[int, ...]) -> torch.Tensor:
    ck = config.weight_prefix + name
    split = plan.split_of(name, config)
    if name.endswith(".A_log"):
        t = _read_a_log_heads(reader, ck, config, plan)
    elif split is None:
        t = reader.get(ck)
    else:
        t = reader.get_slice(ck)[split.region(reader.shape(ck))]
    if tuple(t.shape) != shape:
        raise CheckpointError(
            f"{ck}: rank {plan.rank} of {plan.tp_size} read a slice of shape {tuple(t.shape)} but its module "
            f"needs {shape}; no sharding rule in mstar/distributed/sharding.py matches this tensor correctly"
        )
    return t


def _read_a_log_heads(reader: Any, ck: str, config: KimiK3Config, plan: ShardingPlan) -> torch.Tensor:
    heads = config.linear_attn.num_heads
    if plan.tp_size == 1:
        return read_a_log(reader, ck, heads)
    h0, h1 = even_range(heads, plan.tp_size, plan.rank)
    stored = reader.shape(ck)
    if len(stored) == 1:  # K3: [pad >= heads], heads first
        return reader.get_slice(ck)[h0:h1]
    if len(stored) == 4:  # Kimi-Linear: [1, 1, heads, 1]
        return reader.get_slice(ck)[:, :, h0:h1, :].reshape(-1)
    raise CheckpointError(f"{ck}: shape {stored} is neither K3's [padded heads] nor Kimi-Linear's [1, 1, heads, 1]")
