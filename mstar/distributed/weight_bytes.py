"""Bytes of one rank's weights, routed experts dense or MXFP4-packed, from a config alone.

    python -m mstar.distributed.weight_bytes mstar/models/kimi_k3/fixtures/kimi_k3_pruned75_config.json --tp 8

Counts the rank module's state_dict (built on the meta device, nothing allocated): every float
tensor in the serving dtype, packed experts as their uint8 bytes and scales (`MXFP4Linear`), which is
what `load_rank_model` holds. Non-persistent buffers (e.g. rotary tables) and the KV/state pools are
not weights and are not counted.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch

from mstar.models.kimi_k3.config import KimiK3Config, load_config
from mstar.models.kimi_k3.weights import is_expert_weight
from mstar.quant.mxfp4_linear import use_mxfp4_linears

from .loader import rank_module
from .sharding import ShardingPlan

GIB = 2**30


@dataclass(frozen=True)
class WeightBytes:
    experts: int  # the routed experts this rank holds
    other: int  # everything else: attention, dense MLP, shared experts, router, norms, embeddings

    @property
    def total(self) -> int:
        return self.experts + self.other


def rank_weight_bytes(config: KimiK3Config, plan: ShardingPlan, *, dtype: torch.dtype = torch.bfloat16,
                      packed_experts: bool = True) -> WeightBytes:
    """Weight bytes of rank `plan.rank` with float weights in `dtype`; routed experts MXFP4 when
    `packed_experts` (as loaded from an MXFP4 checkpoint), else dense in `dtype`."""
    model = rank_module(config, plan)
    if packed_experts:
        use_mxfp4_linears(model, {n for n in model.state_dict() if is_expert_weight(n)})
    experts = other = 0
    for name, t in model.state_dict().items():
        size = t.numel() * (t.element_size() if t.dtype == torch.uint8 else dtype.itemsize)
        if ".experts." in name:  # routed experts (the shared experts are `shared_experts.`)
            experts += size
        else:
            other += size
    return WeightBytes(experts, other)


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
