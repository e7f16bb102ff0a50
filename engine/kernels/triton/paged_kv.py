"""Reading the paged KV cache from Triton: token positions -> cache offsets through a block table.

The cache of one layer is `[num_blocks, block_size, num_kv_heads, head_dim]` (K and V alike):

    position t of a request  ->  block  block_table[t // block_size]
                                 slot   t %  block_size

A tile gathers its tokens one by one through the table, so a tile may span
several blocks (small blocks) or part of one (large blocks), and the block size
need not be a power of two.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

LOG2_E = 1.4426950408889634
"""Scores are scaled by `scale * log2(e)` so the softmax runs on exp2."""

KV_AS_STORED = 0
"""How a cache's elements become the query's dtype (the kernels' KV_FP8): K/V stored in the query's dtype."""
KV_FP8_CONVERT = 1
"""e4m3 bytes widened by Triton's fp8e4nv conversion: the GPU's own instruction from sm_89 (Ada, Hopper) on."""
KV_FP8_BITS = 2
"""e4m3 bytes widened by integer arithmetic: GPUs before sm_89, where Triton compiles no fp8e4nv conversion."""
KV_FP8_E5M2 = 3
"""e5m2 bytes: each is the high byte of the float16 of the same value, widened by a shift on any GPU."""


@triton.jit
def token_offsets(block_table_row, tokens, token_mask, block_size, stride_block, stride_slot):
    """Element offsets (int64) of `tokens` [BLOCK_N] of one request in a cache, heads and lanes excluded.

    Masked-out tokens read no block table entry and get offset 0 (their loads are masked too).
    """
    logical = tokens // block_size
    physical = tl.load(block_table_row + logical, mask=token_mask, other=0).to(tl.int64)
    return physical * stride_block + (tokens % block_size).to(tl.int64) * stride_slot


@triton.jit
def load_for_dot(ptrs, mask, UPCAST: tl.constexpr):
    """A tile as the products take it: in its own dtype, or in float32 when UPCAST (see `needs_upcast`)."""
    tile = tl.load(ptrs, mask=mask, other=0.0)
    if UPCAST:
        tile = tile.to(tl.float32)
    return tile


@triton.jit
def e4m3_to_float32(bits):
    """float8 e4m3 (fn: no infinities, NaN at 0x7F/0xFF) codes, uint8, to float32, exactly, in integer
    arithmetic. A normal code's magnitude bits shifted to float32's exponent and mantissa fields, its exponent
    rebiased from 7 to 127 (+120); exponent field 0 is mantissa x 2^-9; the sign bit put back as a bit (so
    that 0x80 is -0.0)."""
    code = bits.to(tl.int32)
    magnitude = code & 0x7F
    small = (magnitude.to(tl.float32) * 0.001953125).to(tl.int32, bitcast=True)
    widened = tl.where(magnitude < 8, small, (magnitude + (120 << 3)) << 20)
    widened = tl.where(magnitude == 0x7F, 0x7FC00000, widened)
    return (widened | ((code & 0x80) << 24)).to(tl.float32, bitcast=True)


@triton.jit
def load_kv_for_dot(ptrs, mask, COMPUTE: tl.constexpr, UPCAST: tl.constexpr, KV_FP8: tl.constexpr):
    """A K or V tile in the products' dtype: as `load_for_dot` when the cache holds the query's dtype;
    fp8 bytes (KV_FP8) widened to the query's dtype COMPUTE, which holds every e4m3 and e5m2 value exactly."""
    if KV_FP8 == 0:
        tile = load_for_dot(ptrs, mask, UPCAST)
    else:
        bits = tl.load(ptrs, mask=mask, other=0)
        if KV_FP8 == 1:
            tile = bits.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        elif KV_FP8 == 2:
            tile = e4m3_to_float32(bits)
        else:
            tile = (bits.to(tl.uint16) << 8).to(tl.float16, bitcast=True).to(tl.float32)
        if not UPCAST:
            tile = tile.to(COMPUTE)
    return tile


@triton.jit
def probs_for_dot(p, V_DTYPE: tl.constexpr, UPCAST: tl.constexpr):
    """The float32 probabilities rounded to the query's dtype for the P @ V product (what flash attention does)."""
    p = p.to(V_DTYPE)
    if UPCAST:
        p = p.to(tl.float32)
    return p


@triton.jit
def attend_tiles(
    q,
    query_pos,
    table,
    k_head,
    v_head,
    n_start,
    n_end,
    lanes,
    lane_mask,
    block_size,
    stride_kc_block,
    stride_kc_slot,
    stride_kc_dim,
    stride_vc_block,
    stride_vc_slot,
    stride_vc_dim,
    scale_log2,
    window,
    cap_in,
    cap_out,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    CAUSAL: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    WINDOW: tl.constexpr,
    SOFTCAP: tl.constexpr,
    COMPUTE: tl.constexpr,
    KV_FP8: tl.constexpr,
):
    """Online softmax of query rows `q` [BLOCK_M, HEAD_DIM_PAD] over keys n_start .. n_end - 1 of one
    request and KV head, tile by tile; when CAUSAL, row r sees keys up to `query_pos[r]` only, and with
    a WINDOW (causal only) keys after `query_pos[r] - window` only. SOFTCAP: each score s (q . k) becomes
    softcap * tanh(s * scale / softcap), given as `cap_in` = scale / softcap and `cap_out` = softcap * log2(e)
    (`softcap_factors`). K/V tiles come in the query's dtype COMPUTE (KV_FP8: how, see KV_AS_STORED).

    Returns (acc [BLOCK_M, HEAD_DIM_PAD], l [BLOCK_M], m [BLOCK_M]): the unnormalised output, the
    softmax denominator and the running max (log2 units), for the caller to divide or to combine.
    Without a WINDOW the first tile must hold a key every row may see, so that m turns finite at once;
    with one, a row may see nothing in a tile, so the max is kept finite where a row saw nothing yet.
    """
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
    for n0 in range(n_start, n_end, BLOCK_N):
        tokens = n0 + tl.arange(0, BLOCK_N)
        token_mask = tokens < n_end
        kv_mask = token_mask[:, None] & lane_mask[None, :]
        k_offs = token_offsets(table, tokens, token_mask, block_size, stride_kc_block, stride_kc_slot)
        k = load_kv_for_dot(k_head + k_offs[:, None] + lanes[None, :] * stride_kc_dim, kv_mask, COMPUTE, UPCAST, KV_FP8)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # [BLOCK_M, BLOCK_N]
        if SOFTCAP:  # tanh(x) = 1 - 2 / (exp(2x) + 1): exp's overflow to inf gives 1
            s = (1.0 - 2.0 / (tl.exp(2.0 * cap_in * s) + 1.0)) * cap_out
        else:
            s = s * scale_log2
        if CAUSAL:
            visible = token_mask[None, :] & (tokens[None, :] <= query_pos[:, None])
            if WINDOW:
                visible = visible & (tokens[None, :] > query_pos[:, None] - window)
        else:
            visible = token_mask[None, :]
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        if WINDOW:
            m_new = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no key seen yet: all terms 0
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v_offs = token_offsets(table, tokens, token_mask, block_size, stride_vc_block, stride_vc_slot)
        v = load_kv_for_dot(v_head + v_offs[:, None] + lanes[None, :] * stride_vc_dim, kv_mask, COMPUTE, UPCAST, KV_FP8)
        p = probs_for_dot(p, COMPUTE, UPCAST)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def sink_normalizer(m, l, sink_log2):
    """What a row's unnormalised output is multiplied by when its head's sink (log2 units, as m) joins the
    softmax's denominator: e^(m - M) / (l e^(m - M) + e^(sink - M)), M = max(m, sink), so nothing overflows."""
    top = tl.maximum(m, sink_log2)
    factor = tl.exp2(m - top)
    return factor / (l * factor + tl.exp2(sink_log2 - top))


def sinks_log2(sinks, like: torch.Tensor) -> torch.Tensor:
    """The sinks [heads] in the kernels' log2 units, float32 on the query's device (a placeholder without)."""
    if sinks is None:
        return like
    return (sinks.to(device=like.device, dtype=torch.float32) * LOG2_E).contiguous()


def softcap_factors(scale: float, softcap) -> tuple[float, float]:
    """(cap_in, cap_out) of `attend_tiles` for a soft-cap (None: unused zeros)."""
    if softcap is None:
        return 0.0, 0.0
    return scale / softcap, softcap * LOG2_E


def is_interpreted(kernel) -> bool:
    """Whether `kernel` was decorated under TRITON_INTERPRET=1 (it then runs on CPU tensors in numpy)."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(kernel, InterpretedFunction)


def needs_upcast(kernel, dtype: torch.dtype) -> bool:
    """Triton's interpreter stores bfloat16 as raw uint16 and computes no bfloat16 arithmetic, only
    loads, stores and conversions. There the bfloat16 tiles go to float32 before the products: the
    same result (a product of two bfloat16 numbers is exact in float32), with fp32 accumulation."""
    return dtype == torch.bfloat16 and is_interpreted(kernel)


def dot_precision(dtype: torch.dtype) -> str:
    """`ieee` for float32 inputs (no TF32 rounding on GPUs); the 16-bit types ignore it."""
    return "ieee" if dtype == torch.float32 else "tf32"


TORCH_TO_TL = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}
SUPPORTED_DTYPES = frozenset(TORCH_TO_TL)
"""Query dtypes, and cache dtypes besides fp8 (e4m3 and e5m2, which the kernels read as bytes)."""
FP8 = torch.float8_e4m3fn
FP8_DTYPES = frozenset({FP8, torch.float8_e5m2})


def check_cache(key_cache: torch.Tensor, value_cache: torch.Tensor) -> tuple[int, int, int, int]:
    """The caches' common shape `(num_blocks, block_size, num_kv_heads, head_dim)`, checked."""
    if key_cache.dim() != 4 or key_cache.shape != value_cache.shape:
        raise ValueError(
            f"K/V caches must share one [num_blocks, block_size, num_kv_heads, head_dim] shape, "
            f"got {tuple(key_cache.shape)} and {tuple(value_cache.shape)}"
        )
    if key_cache.dtype != value_cache.dtype or key_cache.dtype not in SUPPORTED_DTYPES | FP8_DTYPES:
        raise ValueError(
            "K/V caches must share a float32/float16/bfloat16/float8_e4m3fn/float8_e5m2 dtype, "
            f"got {key_cache.dtype} and {value_cache.dtype}"
        )
    num_blocks, block_size, num_kv_heads, head_dim = key_cache.shape
    return num_blocks, block_size, num_kv_heads, head_dim


def check_query(q: torch.Tensor, key_cache: torch.Tensor) -> None:
    """A query the kernels read over this cache: in the cache's dtype, or any of theirs over an fp8 cache."""
    if q.dtype not in SUPPORTED_DTYPES or (key_cache.dtype not in FP8_DTYPES and q.dtype != key_cache.dtype):
        raise ValueError(
            f"query dtype {q.dtype} must match the cache's {key_cache.dtype} "
            "(over an fp8 cache: float32, float16 or bfloat16)"
        )


def fp8_widening(kernel, cache: torch.Tensor, widening: int | None = None) -> int:
    """KV_FP8 for `cache`: KV_AS_STORED unless it is fp8; KV_FP8_E5M2 for e5m2; for e4m3 `widening` when given
    (as a caller found it once, `kv_widening`; tests take both ways), else the conversion where Triton compiles
    it (the interpreter emulates it), integer arithmetic elsewhere. A widening the cache cannot take is a
    ValueError; one given is not checked against the device (the caller asked it once; Triton's compiler
    refuses the conversion before sm_89 by name)."""
    if cache.dtype not in FP8_DTYPES:
        return KV_AS_STORED
    if cache.dtype != FP8:
        if widening not in (None, KV_FP8_E5M2):
            raise ValueError(f"an e5m2 cache widens by KV_FP8_E5M2, not {widening}")
        return KV_FP8_E5M2
    if widening is not None:
        if widening not in (KV_FP8_CONVERT, KV_FP8_BITS):
            raise ValueError(f"an e4m3 cache widens by KV_FP8_CONVERT or KV_FP8_BITS, not {widening}")
        return widening
    if is_interpreted(kernel):
        return KV_FP8_CONVERT
    if cache.is_cuda and torch.version.hip is None and torch.cuda.get_device_capability(cache.device) >= (8, 9):
        return KV_FP8_CONVERT
    return KV_FP8_BITS


def as_bytes(cache: torch.Tensor) -> torch.Tensor:
    """An fp8 cache as the uint8 tensor the kernels address (Triton's fp8 pointers need sm_89); others as is."""
    return cache.view(torch.uint8) if cache.dtype in FP8_DTYPES else cache
