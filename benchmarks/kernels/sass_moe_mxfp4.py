"""The MXFP4 MoE GEMM kernels compiled for sm_90 without a GPU: registers, spills and instructions per weight of
their main loops, read off the SASS. What this machine can say about a kernel change before a device run.

    python benchmarks/kernels/sass_moe_mxfp4.py [--tokens 1 8 64] [--kernel gate_up down]

Shapes: one TP8 rank of pruned75 (E = 224, top-16, H = 3584, I = 384), the tiles of `default_config` at each T.
The arguments are specialised as Triton's JIT does on the device (pointers and integers divisible by 16 marked so,
integers equal to 1 made constants): without that the loads compile a byte at a time and nothing here is
representative. Compile with the device's Triton version (3.6 on the H200 image; put a matching `triton` first on
PYTHONPATH): its SASS is what runs there. Triton's own cuobjdump disassembles.

Loops are the backward branches of the SASS; the main (K) loop is the one of the most instructions among those
that hold a tensor-core instruction, and "per weight" divides its instructions by the weights one thread decodes
per iteration (rows x BLOCK_K / threads).
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import tempfile

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from mstar.kernels import moe_mxfp4 as moe

E, K, H, I = 224, 16, 3584, 384
POINTERS = {"z_ptr": "*bf16", "w_ptr": "*u8", "s_ptr": "*i32", "h_ptr": "*bf16", "out_ptr": "*fp32",
            "split_sum_ptr": "*fp32", "split_count_ptr": "*i32", "ids_ptr": "*i64", "sorted_pair_ptr": "*i32",
            "block_expert_ptr": "*i32", "block_rows_ptr": "*i32", "y_ptr": "*bf16", "coef_ptr": "*fp32"}
FLOATS = ("beta", "linear_beta")


def integer_args(kernel: str, num_tokens: int) -> dict[str, int]:
    """The integer arguments the launchers pass at these shapes (the scales as int32 words of 4 bytes)."""
    common = {"num_tokens": num_tokens}
    if kernel == "gate_up":
        return {**common, "out_numel": num_tokens * H, "stride_zt": H, "stride_we": 2 * I * H // 2,
                "stride_wn": H // 2, "stride_se": 2 * I * H // 128, "stride_sn": H // 128}
    return {**common, "stride_we": H * I // 2, "stride_wn": I // 2, "stride_se": H * I // 128, "stride_sn": I // 128}


def compile_sm90(kernel: str, config: moe.MoEConfig, num_tokens: int):
    fn = moe._gate_up_kernel if kernel == "gate_up" else moe._down_kernel
    tile = config.gate_up if kernel == "gate_up" else config.down
    constexprs = moe._gemm_constexprs(config, kernel, H, I, K)
    constexprs["COMPUTE"] = tl.bfloat16  # the GPU's, whatever this process's interpreter setting
    ints = integer_args(kernel, num_tokens)
    signature, attrs = {}, {}
    for index, name in enumerate(fn.arg_names):
        if name in POINTERS or ints.get(name, 1) % 16 == 0:
            attrs[(index,)] = [["tt.divisibility", 16]]
        if ints.get(name) == 1:
            constexprs[name] = 1
        signature[name] = ("constexpr" if name in constexprs else POINTERS.get(name)
                           or ("fp32" if name in FLOATS else "i32"))
    source = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": tile.num_warps, "num_stages": tile.num_stages}), tile


def disassemble(cubin: bytes) -> tuple[str, str]:
    """(SASS, resource usage) through the cuobjdump Triton ships."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        sass = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True, check=True).stdout
        usage = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    return sass, usage


def loops(sass: str) -> list[list[str]]:
    """The instructions of each loop (a backward branch and what lies between its target and it)."""
    code = [(int(m.group(1), 16), m.group(2)) for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    found = []
    for address, text in code:
        target = re.search(r"BRA\s+(?:`\(\.L_x_\d+\)\s*)?0x([0-9a-f]+)", text)
        if target and int(target.group(1), 16) < address:
            start = int(target.group(1), 16)
            found.append([t for a, t in code if start <= a <= address])
    return found


def opcode(instruction: str) -> str:
    return re.sub(r"^@!?U?P\w+\s+", "", instruction).split()[0].split(".")[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--kernel", nargs="+", default=["gate_up", "down"], choices=["gate_up", "down"])
    args = parser.parse_args()
    print(f"Triton {triton.__version__}")
    for num_tokens in args.tokens:
        config = moe.fit_config(moe.default_config(num_tokens, K, E), H, I)
        for kernel in args.kernel:
            compiled, tile = compile_sm90(kernel, config, num_tokens)
            sass, usage = disassemble(compiled.asm["cubin"])
            resources = " ".join(re.findall(r"(?:REG|STACK|SHARED|LOCAL):\d+", usage))
            mma = [body for body in loops(sass) if any(opcode(i) in ("HGMMA", "HMMA") for i in body)]
            rows = 2 * tile.block_n if kernel == "gate_up" else tile.block_n
            per_thread = rows * tile.block_k / (32 * tile.num_warps)
            line = f"T={num_tokens:5d} {kernel:7s} {tile}  {resources}"
            if mma:
                body = max(mma, key=len)
                top = collections.Counter(opcode(i) for i in body).most_common(8)
                line += f"\n        main loop {len(body)} instructions, {len(body) / per_thread:.2f} per weight: {top}"
            print(line)


if __name__ == "__main__":
    main()
