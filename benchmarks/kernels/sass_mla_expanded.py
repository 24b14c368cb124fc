"""The expanded MLA prefill kernel (and the absorbed kernel's prefix pass with its lse output) compiled for sm_90
without a GPU: registers, spills, shared memory and the tensor-core instructions, per tile. What this machine can
say about the kernels before a device run.

    PYTHONPATH=<triton 3.6>:. python benchmarks/kernels/sass_mla_expanded.py [--tiles 128x64x8x2 64x64x4x2 ...]

Shapes: one TP8 rank of K3 (12 heads; nope 128, rope 64, v 128; cached rows 512 + 64, pages of 64) at 8,192 tokens.
The arguments are specialised as Triton's JIT does on the device (pointers and integers divisible by 16 marked so):
see sass_moe_mxfp4.py, whose disassembly this reuses. A tile is BLOCK_MxBLOCK_NxWARPSxSTAGES.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import tempfile

import triton
from sass_moe_mxfp4 import disassemble, loops, opcode
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from mstar.kernels import mla_attention, mla_expanded

HEADS, NOPE, ROPE, V_DIM, LATENT, PAGE, TOKENS = 12, 128, 64, 128, 512, 64, 8192
DEFAULT_TILES = ["128x64x8x2", "128x64x8x3", "64x64x4x2", "128x32x8x2", "64x32x4x2", "128x128x8x2"]


def expanded_args() -> tuple[dict[str, str], dict[str, int]]:
    """(pointer types, integer values) of `mla_prefill_expanded`'s launch at K3's shapes: q_nope/q_pe views of
    q [N, H, 192], k_nope/v views of the expansion GEMM's output [N, H, 256], k_pe a view of the gathered cache rows
    [N, 576], o_prefix the W_UV einsum's head-major output."""
    pointers = {name: "*bf16" for name in ("qn_ptr", "qp_ptr", "kn_ptr", "kp_ptr", "v_ptr", "op_ptr", "out_ptr")}
    pointers.update(cu_ptr="*i32", ctx_ptr="*i32", lse_ptr="*fp32")
    q, kv = HEADS * (NOPE + ROPE), HEADS * (NOPE + V_DIM)
    ints = dict(stride_qnt=q, stride_qnh=NOPE + ROPE, stride_qpt=q, stride_qph=NOPE + ROPE, stride_knt=kv,
                stride_knh=NOPE + V_DIM, stride_kpt=LATENT + ROPE, stride_vt=kv, stride_vh=NOPE + V_DIM,
                stride_opt=V_DIM, stride_oph=TOKENS * V_DIM, stride_lt=HEADS, stride_ot=HEADS * V_DIM,
                stride_oh=V_DIM)
    return pointers, ints


def absorbed_args() -> tuple[dict[str, str], dict[str, int]]:
    """The prefix pass: `paged_mla_prefill(causal=False, lse=...)` unsplit, q_lat the W_UK einsum's head-major
    output."""
    pointers = {name: "*bf16" for name in ("q_lat_ptr", "q_pe_ptr", "cache_ptr", "out_ptr", "part_o_ptr")}
    pointers.update(page_table_ptr="*i32", cu_ptr="*i32", ctx_ptr="*i32", part_lse_ptr="*fp32")
    ints = dict(num_heads=HEADS, num_splits=1, stride_qlt=LATENT, stride_qlh=TOKENS * LATENT,
                stride_qpt=HEADS * (NOPE + ROPE), stride_qph=NOPE + ROPE, stride_pt=TOKENS // PAGE + 1,
                stride_ot=HEADS * LATENT, stride_oh=LATENT, stride_ps=0, stride_pn=0, stride_ph=0, stride_ls=0,
                stride_ln=HEADS)
    return pointers, ints


def compile_sm90(fn, pointers: dict[str, str], ints: dict[str, int], constexprs: dict, tile):
    signature, attrs, constexprs = {}, {}, dict(constexprs)
    for index, name in enumerate(fn.arg_names):
        if name in pointers or (name in ints and ints[name] % 16 == 0):
            attrs[(index,)] = [["tt.divisibility", 16]]
        if ints.get(name) == 1:  # as the JIT specialises them
            constexprs[name] = 1
        signature[name] = ("constexpr" if name in constexprs else pointers.get(name)
                           or ("i32" if name in ints else "fp32"))
    source = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": tile.num_warps, "num_stages": tile.num_stages})


def ptxas_usage(ptx: str) -> str:
    """ptxas -v of the kernel's PTX for sm_90a (registers, spill stores and loads), as n_regs / n_spills say on
    a device (a compiled kernel reports those only once loaded)."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        done = subprocess.run([tool, "-arch=sm_90a", "-v", path, "-o", os.path.join(tmp, "k.cubin")],
                              capture_output=True, text=True, check=True)
    text = done.stdout + done.stderr
    regs = re.search(r"Used (\d+) registers", text)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)
    return (f"regs={regs.group(1) if regs else '?'} spill stores/loads={spills.group(1)}/{spills.group(2)} B"
            if spills else text.strip().replace("\n", " | "))


def report(name: str, compiled, tile) -> str:
    sass, usage = disassemble(compiled.asm["cubin"])
    resources = " ".join(re.findall(r"(?:REG|STACK|SHARED|LOCAL):\d+", usage))
    line = (f"{name:9s} {tile.block_m}x{tile.block_n}x{tile.num_warps}x{tile.num_stages}  "
            f"{ptxas_usage(compiled.asm['ptx'])} shared={compiled.metadata.shared} B  [{resources}]")
    for body in loops(sass):  # the unmasked and the diagonal key loops (one main loop in the absorbed kernel)
        count = collections.Counter(map(opcode, body))
        if count["HGMMA"] or count["HMMA"]:
            line += (f"\n          loop of {len(body)} instructions: HGMMA {count['HGMMA']}, HMMA {count['HMMA']}, "
                     f"LDGSTS {count['LDGSTS']}, LDG {count['LDG']}, MUFU {count['MUFU']}")
    return line


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiles", nargs="+", default=DEFAULT_TILES, metavar="MxNxWARPSxSTAGES")
    args = parser.parse_args()
    print(f"Triton {triton.__version__}; default tile at {TOKENS} tokens: "
          f"{mla_expanded.default_config(TOKENS, HEADS)}")
    for spec in args.tiles:
        m, n, w, s = (int(x) for x in spec.split("x"))
        tile = mla_attention.KernelConfig(block_m=m, block_n=n, num_warps=w, num_stages=s)
        constexprs = dict(NOPE=NOPE, ROPE=ROPE, VDIM=V_DIM, BLOCK_M=m, BLOCK_N=n, PREFIX=True, PDL=True)
        try:
            compiled = compile_sm90(mla_expanded._mla_expanded_kernel, *expanded_args(), constexprs, tile)
            print(report("expanded", compiled, tile))
        except Exception as e:  # a tile that does not fit (shared memory) is reported, not fatal
            print(f"expanded  {spec}: {type(e).__name__}: {str(e).splitlines()[0][:160]}")
    prefix_tile = mla_attention.default_config(HEADS, PAGE, multi_query=True, query_rows=TOKENS)
    constexprs = dict(PAGE_SIZE=PAGE, LATENT=LATENT, ROPE=ROPE, BLOCK_M=prefix_tile.block_m,
                      BLOCK_N=prefix_tile.block_n, SPLIT_KV=False, MIN_SPLIT=mla_attention.DEFAULT_MIN_SPLIT_TOKENS,
                      MULTI_QUERY=True, CAUSAL=False, WRITE_LSE=True, PDL=True)
    pointers, ints = absorbed_args()
    for write_lse in (True, False):
        constexprs["WRITE_LSE"] = write_lse
        compiled = compile_sm90(mla_attention._mla_attn_kernel, pointers, ints, constexprs, prefix_tile)
        print(report("prefix" if write_lse else "no-lse", compiled, prefix_tile))


if __name__ == "__main__":
    main()
