"""Compile Triton kernels for a GPU architecture without a GPU: Triton's front end, its MLIR passes and the ptxas
it ships turn each launch configuration into a cubin, so what the interpreter never checks (module globals a
compiled kernel may not read, loop-carried types, `tl.dot` shapes, shared memory, a conversion the architecture
lacks) fails here.

Run in a process where Triton was imported without TRITON_INTERPRET (the interpreter replaces `triton.jit`):

    python -m tests.engine.triton.ahead_of_time [ARCH] [lora|attention|moe]   # one JSON line per configuration
                                                                              # ARCH 90: Hopper, 80: A100
"""

from __future__ import annotations

import json
import sys
from typing import Any

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from engine.kernels.triton import lora_sgmv
from engine.kernels.triton.fused_moe import _grouped_product_kernel
from engine.kernels.triton.paged_decode import _decode_partition_kernel, _decode_reduce_kernel, decode_partitions
from engine.kernels.triton.paged_kv import KV_AS_STORED, KV_FP8_BITS, KV_FP8_CONVERT, KV_FP8_E5M2
from engine.kernels.triton.paged_prefill import _prefill_kernel, prefill_tiles
from engine.kernels.triton.write_kv import _write_kv_kernel

DTYPES = {"float32": "fp32", "bfloat16": "bf16"}  # float16 takes bfloat16's path
FLOAT_ARGS = ("scale_log2", "cap_in", "cap_out")
SHAPES = [(1, 16, 4096), (8192, 64, 4096)]  # (tokens, rank, in): the decode and the prefill blocks


def compile_kernel(kernel: Any, pointers: dict[str, str], constants: dict[str, Any], arch: int) -> dict[str, Any]:
    """One configuration to a cubin; the other (integer) arguments as int32. Returns what it compiled to."""
    signature = {name: "constexpr" if name in constants else pointers.get(name, "i32") for name in kernel.arg_names}
    signature.update({name: "fp32" for name in FLOAT_ARGS if name in signature and name not in constants})
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


def attention_configurations(arch: int) -> list[tuple[str, Any, dict[str, str], dict[str, Any]]]:
    """The paged-attention kernels at a Llama-3-8B shape (32 query heads over 8 KV heads of 128) as the wrappers
    launch them: caches in the query's dtype, e4m3 ones widened the way `fp8_widening` picks for `arch` (the
    conversion from sm_89 on, integer arithmetic before), e5m2 ones; the variants (window, soft-cap, sinks)
    on."""
    group, head_dim = 4, 128
    fp8 = KV_FP8_CONVERT if arch >= 89 else KV_FP8_BITS
    partition, _ = decode_partitions(32768)
    prefill_m, prefill_n = prefill_tiles(group, head_dim, 2048)
    found = []
    caches = (("bf16", "bf16", KV_AS_STORED), ("bf16", "u8", fp8), ("fp16", "u8", fp8), ("bf16", "u8", KV_FP8_E5M2))
    for query, cache, widening in caches:
        cached = {
            "q_ptr": f"*{query}",
            "out_ptr": f"*{query}",
            "k_cache_ptr": f"*{cache}",
            "v_cache_ptr": f"*{cache}",
            "block_table_ptr": "*i32",
            "seq_lens_ptr": "*i32",
            "cu_seqlens_q_ptr": "*i32",
            "sinks_ptr": "*fp32",
            "part_acc_ptr": "*fp32",
            "part_max_ptr": "*fp32",
            "part_sum_ptr": "*fp32",
        }
        shared = {
            "GROUP": group,
            "HEAD_DIM": head_dim,
            "HEAD_DIM_PAD": head_dim,
            "UPCAST": False,
            "DOT_PRECISION": "tf32",
            "KV_FP8": widening,
        }
        variants = {"WINDOW": query == "fp16", "SOFTCAP": query == "fp16", "SINKS": query == "fp16"}
        found.append((
            f"decode q {query} cache {cache} kv_fp8 {widening}", _decode_partition_kernel, cached,
            {**shared, **variants, "BLOCK_M": max(16, group), "BLOCK_N": min(64, partition),
             "PARTITION": partition, "SPLIT": True},
        ))  # fmt: skip
        found.append((
            f"prefill q {query} cache {cache} kv_fp8 {widening}", _prefill_kernel, cached,
            {**shared, **variants, "BLOCK_M": prefill_m, "BLOCK_Q": prefill_m // group, "BLOCK_N": prefill_n},
        ))  # fmt: skip
    found.append((
        "decode reduce", _decode_reduce_kernel,
        {"part_acc_ptr": "*fp32", "part_max_ptr": "*fp32", "part_sum_ptr": "*fp32", "seq_lens_ptr": "*i32",
         "sinks_ptr": "*fp32", "out_ptr": "*bf16"},
        {"HEAD_DIM": head_dim, "HEAD_DIM_PAD": head_dim, "PARTITIONS_PAD": 64, "PARTITION": partition,
         "WINDOW": False, "SINKS": False},
    ))  # fmt: skip
    for source, cache in (("bf16", "bf16"), ("u8", "u8")):  # fp8 K/V arrive converted: their bytes are copied
        found.append((
            f"write_kv {source} into {cache}", _write_kv_kernel,
            {"key_ptr": f"*{source}", "value_ptr": f"*{source}", "key_cache_ptr": f"*{cache}",
             "value_cache_ptr": f"*{cache}", "slot_mapping_ptr": "*i64"},
            {"NUM_KV_HEADS": 8, "HEAD_DIM": head_dim, "HEADS_PAD": 8, "HEAD_DIM_PAD": head_dim},
        ))  # fmt: skip
    return found


def moe_configurations(arch: int) -> list[tuple[str, Any, dict[str, str], dict[str, Any]]]:
    """The mixture-of-experts grouped product as `fused_moe` launches it (tiles of 16 rows, 64 x 64 weight tiles
    at an expert's 2,880-wide products): the first product (bias, no routing weights) and the second (both), in
    bfloat16 and float32."""
    found = []
    for dtype, short in DTYPES.items():
        pointers = {
            "a_ptr": f"*{short}",
            "b_ptr": f"*{short}",
            "c_ptr": f"*{short}",
            "weights_ptr": "*fp32",
            "bias_ptr": f"*{short}",
            "sorted_pairs_ptr": "*i32",
            "tile_expert_ptr": "*i32",
            "num_padded_ptr": "*i32",
        }
        precision = "ieee" if dtype == "float32" else "tf32"
        for product, scale_rows in (("gate_up", False), ("down", True)):
            found.append((
                f"moe {product} {dtype}", _grouped_product_kernel, pointers,
                {"SCALE_ROWS": scale_rows, "BIAS": True, "UPCAST": False, "DOT_PRECISION": precision,
                 "BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 64},
            ))  # fmt: skip
    return found


FAMILIES = {"lora": lambda arch: configurations(), "attention": attention_configurations, "moe": moe_configurations}


def main(arch: int, family: str = "lora") -> None:
    for name, kernel, pointers, constants in FAMILIES[family](arch):
        print(json.dumps({"name": name, **compile_kernel(kernel, pointers, constants, arch)}), flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 90, sys.argv[2] if len(sys.argv) > 2 else "lora")
