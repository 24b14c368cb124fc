"""Bytes of one rank's weights, routed experts dense or MXFP4-packed, from a config alone.

    python -m mstar.distributed.weight_bytes mstar/models/kimi_k3/fixtures/kimi_k3_pruned75_config.json --tp 8

Counts the rank module's state_dict (built on the meta device, nothing allocated): every float
tensor in the serving dtype, packed experts as their uint8 bytes and scales (`MXFP4Linear`), which is
what `load_rank_model` holds. Non-persistent buffers (e.g. rotary tables) and the KV/state pools are
not weights and are not counted.

A packed expert is counted from the shapes of its MXFP4 pair (`packed_shapes`, the layout the loader
reads) rather than by swapping `MXFP4Linear`s into the module: the swap took as long as building the
module (~8 s for pruned75 at TP8).
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass

import torch

from mstar.models.kimi_k3.config import KimiK3Config, load_config
from mstar.models.kimi_k3.weights import is_expert_weight, packed_shapes

from .loader import rank_module
from .sharding import ShardingPlan

GIB = 2**30


@dataclass(frozen=True)
class WeightBytes:
    experts: int  # the routed experts this rank holds
    other: int  # everything else: attention, dense MLP, shared experts, router, norms, embeddings
    expert_weights: int  # how many routed-expert weights `experts` holds (packed or not: FLOPs count these)
    embedding: int  # the rank's embed_tokens slice (part of `other`)
    lm_head: int  # the rank's lm_head slice (part of `other`)

    @property
    def total(self) -> int:
        return self.experts + self.other


def rank_weight_bytes(config: KimiK3Config, plan: ShardingPlan, *, dtype: torch.dtype = torch.bfloat16,
                      packed_experts: bool = True) -> WeightBytes:
    """Weight bytes of rank `plan.rank` with float weights in `dtype`; routed experts MXFP4 when
    `packed_experts` (as loaded from an MXFP4 checkpoint), else dense in `dtype`."""
    experts = expert_weights = 0
    other: dict[str, int] = {}  # name -> bytes
    for name, t in rank_module(config, plan).state_dict().items():
        if is_expert_weight(name):  # routed experts (the shared experts are `shared_experts.`)
            expert_weights += t.numel()
            if packed_experts:  # uint8 pairs: one byte per element
                experts += sum(math.prod(shape) for shape in packed_shapes(tuple(t.shape)))
            else:
                experts += t.numel() * dtype.itemsize
        else:
            other[name] = t.numel() * dtype.itemsize
    return WeightBytes(experts, sum(other.values()), expert_weights, other["model.embed_tokens.weight"],
                       other["lm_head.weight"])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("config", help="a checkpoint directory or its config.json")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks")
    parser.add_argument("--ep", type=int, default=1, help="expert-parallel groups")
    parser.add_argument("--rank", type=int, default=0)
    args = parser.parse_args(argv)
    config = load_config(args.config)
    plan = ShardingPlan(args.tp, args.rank, args.ep)
    for label, packed in (("dense bf16 experts", False), ("MXFP4 experts", True)):
        b = rank_weight_bytes(config, plan, packed_experts=packed)
        print(f"{label:>20}: rank {args.rank} of tp={args.tp} ep={args.ep}: experts {b.experts / GIB:.1f} GiB "
              f"+ other {b.other / GIB:.1f} GiB = {b.total / GIB:.1f} GiB ({b.total:,} bytes)")


if __name__ == "__main__":
    main()
