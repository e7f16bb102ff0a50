"""Compile the multi-LoRA Triton kernels for a GPU architecture without a GPU: Triton's front end, its MLIR passes
and the ptxas it ships turn each launch configuration into a cubin, so what the interpreter never checks (module
globals a compiled kernel may not read, loop-carried types, `tl.dot` shapes, shared memory) fails here.

Run in a process where Triton was imported without TRITON_INTERPRET (the interpreter replaces `triton.jit`):

    python -m tests.engine.triton.ahead_of_time [ARCH]    # prints one JSON line per configuration; ARCH 90: Hopper
"""

from __future__ import annotations

import json
import sys
from typing import Any

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from engine.kernels.triton import lora_sgmv

DTYPES = {"float32": "fp32", "bfloat16": "bf16"}  # float16 takes bfloat16's path
SHAPES = [(1, 16, 4096), (8192, 64, 4096)]  # (tokens, rank, in): the decode and the prefill blocks


def compile_kernel(kernel: Any, pointers: dict[str, str], constants: dict[str, Any], arch: int) -> dict[str, Any]:
    """One configuration to a cubin; the other (integer) arguments as int32. Returns what it compiled to."""
    signature = {name: "constexpr" if name in constants else pointers.get(name, "i32") for name in kernel.arg_names}
    constexprs = {(kernel.arg_names.index(name),): value for name, value in constants.items()}
    compiled = triton.compile(ASTSource(kernel, signature, constexprs=constexprs), target=GPUTarget("cuda", arch, 32))
    return {"cubin_bytes": len(compiled.asm["cubin"]), "shared_bytes": compiled.metadata.shared}


def configurations() -> list[tuple[str, Any, dict[str, str], dict[str, Any]]]:
    """Every block shape the wrappers pick for SHAPES, in each dtype, with and without a token order / add."""
    found = []
    for dtype, short in DTYPES.items():
        precision = "ieee" if dtype == "float32" else "tf32"
        for tokens, rank, in_dim in SHAPES:
            shrink = lora_sgmv.shrink_blocks(tokens, rank, in_dim)
            expand = lora_sgmv.expand_blocks(tokens, rank)
            ordered = tokens > 1
            found.append((
                f"shrink {dtype} T={tokens} r={rank}",
                lora_sgmv._shrink_kernel,
                {"x_ptr": f"*{short}", "a_ptr": f"*{short}", "out_ptr": "*fp32", "slots_ptr": "*i32",
                 "scales_ptr": "*fp32", "order_ptr": "*i32"},
                {"ORDERED": ordered, "UPCAST": False, "DOT_PRECISION": precision,
                 "BLOCK_M": shrink.m, "BLOCK_N": shrink.n, "BLOCK_K": shrink.k},
            ))  # fmt: skip
            found.append((
                f"expand {dtype} T={tokens} r={rank}",
                lora_sgmv._expand_kernel,
                {"y_ptr": "*fp32", "b_ptr": f"*{short}", "out_ptr": f"*{short}", "slots_ptr": "*i32",
                 "order_ptr": "*i32"},
                {"ADD": not ordered, "ORDERED": ordered, "UPCAST": False, "DOT_PRECISION": precision,
                 "BLOCK_M": expand.m, "BLOCK_N": expand.n, "BLOCK_K": expand.k},
            ))  # fmt: skip
    return found


def main(arch: int) -> None:
    for name, kernel, pointers, constants in configurations():
        print(json.dumps({"name": name, **compile_kernel(kernel, pointers, constants, arch)}), flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 90)
