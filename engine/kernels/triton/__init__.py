"""Triton paged-attention kernels over the KV-cache layout `[num_blocks, block_size, num_kv_heads, head_dim]`
(per layer, one tensor for K and one for V), for float32, float16 and bfloat16 queries (caches of theirs or of
fp8) with float32 accumulation.

    write_kv(key, value, key_cache, value_cache, slot_mapping)
        key, value [T, KVH, D]; slot_mapping [T] int64/int32. Token j goes to block
        slot_mapping[j] // block_size, offset slot_mapping[j] % block_size (a negative slot is skipped).

    paged_attention(q, key_cache, value_cache, cu_seqlens_q, seq_lens, block_table, scale, max_query_len) -> out
        q, out [T, H, D]; cu_seqlens_q [B + 1] int32; seq_lens [B] int32 (KV length of each request,
        its new tokens included); block_table [B, max_blocks] int32; max_query_len a host int.
        Caches in q's dtype, or fp8 (e4m3, e5m2) under a q of any of the three: their bytes widened exactly
        to q's dtype as each tile is read (`kv_widening`: the conversion instruction for e4m3 from sm_89,
        integer arithmetic before; a shift for e5m2).
        Request b's queries are rows cu_seqlens_q[b] .. cu_seqlens_q[b+1]-1, the last positions of
        its context, attending causally to it. The new tokens' K/V must be written first.
        max_query_len == 1: `paged_decode`; otherwise `paged_prefill` for the whole batch.

    paged_decode(q [B, H, D], key_cache, value_cache, block_table, seq_lens, scale,
                 *, max_seq_len=None, partition_size=None) -> out [B, H, D]
        One query per request; the context split into partitions of `partition_size` tokens (512, or
        more past 64 partitions: a CUDA graph's grid is sized for max_model_len) run in
        parallel, then combined (flash-decoding). One program serves all query heads of a KV head.

    paged_prefill(q [T, H, D], key_cache, value_cache, cu_seqlens_q, seq_lens, block_table, scale,
                  max_query_len, *, block_m=None, block_n=None) -> out [T, H, D]
        Variable-length query chunks over cached prefixes: whole prefills, chunked prefill,
        prefix-cache hits, one-token rows.

    fused_moe(x [T, H], gate_up [E, 2I, H], down [E, H, I], weights [T, k], expert_ids [T, k]) -> [T, H]
        A mixture-of-experts MLP: the (token, expert) pairs sorted by expert into tiles of one expert
        each, two grouped products (gate|up, then down scaled by the routing weights), summed per token.

    lora_shrink(x [T, in], a_stack [S, r, in], token_slots [T] int32, scales [T], out [T, r])
    lora_expand(y [T, r], b_stack [S, out_dim, r], token_slots [T], out [T, out_total], offset, add)
        Multi-LoRA's segmented products (Punica's SGMV): each token reads its adapter's slot (-1: none);
        [T, M] slots and scales give a weighted mix of M adapters per token (lora_sgmv.py).

Head dims need not be powers of two (80: padded lanes are masked), nor block sizes (tiles gather
token by token through the block table). Group sizes (H / KVH) are any integer.

On a machine without a GPU the same kernels run on CPU tensors under Triton's interpreter: set
TRITON_INTERPRET=1 before this package is imported (the kernels are decorated at import). That is for
testing only: it is orders of magnitude slower than the native CPU kernels.
"""

from engine.kernels.triton.fused_moe import fused_moe
from engine.kernels.triton.lora_sgmv import group_by_slot, lora_expand, lora_shrink
from engine.kernels.triton.paged_attention import kv_widening, paged_attention
from engine.kernels.triton.paged_decode import paged_decode
from engine.kernels.triton.paged_prefill import paged_prefill
from engine.kernels.triton.write_kv import write_kv

__all__ = [
    "fused_moe",
    "group_by_slot",
    "kv_widening",
    "lora_expand",
    "lora_shrink",
    "paged_attention",
    "paged_decode",
    "paged_prefill",
    "write_kv",
]
