"""One KDA layer of a verify step through kernels/kda_blocks.py (`GpuMixerOps.kda` on a staged
`kda_fla.BlockLayout`: each sequence replays its accepted pending prefix from the slot's checkpoint, then
its k + 1 verify rows) at one TP8
rank of pruned75 (hidden 7168, 12 heads of 128), bf16, captured in a CUDA graph:

    python3 benchmarks/kernels/bench_kda_blocks.py [--batch 1 16 64] [--rows 5] [--pending 2]

The floor is the layer's bytes at 4.3 TB/s: its projection weights once (stacked inputs, f_b, g_b,
o_proj), each sequence's fp32 state read once and written once, its conv window and pending rows. Prints
one line per batch size as it goes.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_moe_mxfp4 import capture, time_graphs  # noqa: E402

from mstar.kernels import kda_fla  # noqa: E402
from mstar.models.kimi_k3.config import parse_config  # noqa: E402
from mstar.models.kimi_k3.gpu_ops import GpuMixerOps  # noqa: E402
from mstar.models.kimi_k3.kda import KimiDeltaAttention  # noqa: E402
from mstar.models.kimi_k3.serving import BatchPlan, StagedLayout, StepKind  # noqa: E402
from mstar.resources.recurrent_pool import RecurrentStatePool  # noqa: E402
from mstar.tools.make_tiny import real_dims_raw_config  # noqa: E402

HBM = 4.3e12


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--rows", type=int, default=5, help="rows per verify block (k + 1)")
    parser.add_argument("--pending", type=int, default=2, help="accepted prefix rows replayed first")
    parser.add_argument("--reps", type=int, default=50)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_kda_blocks: needs a CUDA GPU")
    cfg = parse_config(real_dims_raw_config(num_layers=4, num_experts=8, tp_size=8, tp_rank=0))
    la = cfg.linear_attn
    with torch.device("cuda"):
        attn = KimiDeltaAttention(cfg, 0).to(torch.bfloat16).eval()
    for p in attn.parameters():
        if p.dim() > 1:
            torch.nn.init.normal_(p, std=p.shape[-1] ** -0.5)
    mixers = GpuMixerOps(fused=True)  # as a bf16 model serves: stacked input projections, one-launch head norm
    weight_bytes = sum(p.numel() * p.element_size() for p in attn.parameters())
    print(f"{torch.cuda.get_device_name()}; layer weights {weight_bytes / 1e6:.1f} MB", flush=True)
    for batch in args.batch:
        pool = RecurrentStatePool(1, batch + 1, la.num_heads, la.head_dim, la.short_conv_kernel_size, torch.float32,
                                  torch.bfloat16, "cuda", hidden_size=cfg.hidden_size, max_block=args.rows)
        pool.state.normal_(0, 0.05)
        pool.conv.normal_()
        pool.prefix_x.normal_()
        slots = tuple(range(1, batch + 1))
        for s in slots:
            pool.prefix_len[s] = args.pending
        starts = tuple(range(0, batch * args.rows + 1, args.rows))
        layout = kda_fla.BlockLayout.build(starts, slots, [args.pending] * batch, (True,) * batch,
                                           args.rows, torch.device("cuda"))
        # a verify graph's bucket: the layout staged on the device, as runner/cuda_graphs.py captures it
        plan = BatchPlan(input_ids=None, seq_starts=starts, num_computed=(0,) * batch, kv=None,
                         kda_slots=layout.slots, sample_rows=None, verify=(True,) * batch, slot_ids=slots,
                         kind=StepKind.STAGED_BLOCKS, staged=StagedLayout(torch.tensor(starts, device="cuda"), layout))
        x = torch.randn(batch * args.rows, cfg.hidden_size, device="cuda", dtype=torch.bfloat16)
        with torch.no_grad():
            graph = capture(lambda x=x, plan=plan, pool=pool: mixers.kda(attn, 0, x, plan, pool))
            us = time_graphs([graph], args.reps)
        state = la.num_heads * la.head_dim * la.head_dim * 4
        rows = batch * (args.rows + args.pending)
        floor_bytes = weight_bytes + batch * 2 * state + rows * cfg.hidden_size * 2 * 2
        floor_us = floor_bytes / HBM * 1e6
        print(f"| {batch} | {args.rows} | {args.pending} | {floor_us:.1f} | {us:.1f} | {us / floor_us:.2f} |",
              flush=True)


if __name__ == "__main__":
    main()
