"""fla's chunk_kda against kda_fla's forward over a chunk table staged once a step (`PrefillLayout.stage`): shared
by the interpreter's test and the GPU's."""

from __future__ import annotations

import torch

from mstar.kernels import kda_fla


def chunk_kda_both_ways(device, dtype, lengths, num_rows, heads=2, head_dim=32):
    """fla's chunk_kda(use_graph=True) and kda_fla's staged forward on the same random inputs over a staged
    PrefillLayout of 8 sequences at most (ragged, a padding sequence, empty ones): (theirs, ours), each (o, final)."""
    from fla.ops.kda import chunk_kda

    gen = torch.Generator(device=device).manual_seed(torch.seed() % 2**31)
    layout = kda_fla.PrefillLayout.allocate(num_rows, torch.zeros(9, dtype=torch.long, device=device))
    layout.stage(torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device=device))
    shape = (1, num_rows, heads, head_dim)
    q, k, v = (torch.randn(shape, generator=gen, device=device).to(dtype) for _ in range(3))
    g = torch.randn(shape, generator=gen, device=device).to(dtype)
    beta = torch.randn(shape[:3], generator=gen, device=device).float()
    state = torch.randn(layout.num_seqs, heads, head_dim, head_dim, generator=gen, device=device) * 0.3
    w = kda_fla.KDAWeights(conv_weight=None, conv1d=None, a_log=torch.randn(heads, device=device) * 0.3,
                           dt_bias=torch.randn(heads * head_dim, device=device) * 0.5 - 3, num_heads=heads,
                           head_dim=head_dim, scale=head_dim ** -0.5, lower_bound=-5.0, l2_eps=1e-6)
    args = dict(q=q, k=k, v=v, g=g, beta=beta, initial_state=state, output_final_state=True,
                cu_seqlens=layout.cu_seqlens, **w.fla_args())
    theirs = chunk_kda(safe_gate=True, use_graph=True, max_num_seqs=layout.num_seqs, **args)
    ours = kda_fla._chunk_kda_staged(layout, w, **args)
    return layout, theirs, ours
