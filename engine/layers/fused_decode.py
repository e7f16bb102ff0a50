"""The decode forward for small batches on the cpu backend: one native call for every layer of the step
(csrc/decode_layer.cpp) instead of ~11 operator calls per layer.

    per layer   decode_qkv      [residual += h;] [norm;] qkv product; [q/k norms;] RoPE; K/V cached; -> queries
                paged_decode    attention of each query over its sequence's cache [window; soft-cap]
                decode_o_mlp    o product; [norm; x scale;] residual += ; [norm;] gate|up product;
                                SiLU or GELU(tanh) * up; down product; [norm; x scale]
    then        residual += h, in the kernel (before the final norm), as `LlamaForCausalLM.forward` returns

The two fused kernels are one OpenMP team each, running the products through the column-block kernel of
csrc/column_blocks.h (bf16 weights packed for it, AVX512-BF16), the small-batch kernel of csrc/gemv.h (plain
weights) or the integer product of csrc/quant_product.h (GGUF blocks kept quantized, `--quantization gguf`),
with every intermediate rounded where the unfused ops round it: the result is the unfused path's, bit for
bit. It applies to steps whose every token is a decode (one new token per sequence; or decodes beside prompt
chunks of at most MIXED_PREFILL_MAX_TOKENS, their tokens rows of their own, in every KV group) of at most `max_rows`
sequences (with GGUF blocks, fewer than the rows from which the unfused path leaves the integer product),
on weights in the model's dtype (plain or packed in column blocks) or GGUF blocks, a KV cache of the model's
dtype or of fp8 (`--kv-cache-dtype fp8`: K/V converted as they are written and widened as they are read), and
models with RoPE over whole heads or their first dimensions (Phi-4-mini): Llama's family and the generic
decoder's (engine/models/decoder.py), with their RMSNorms before and/or after each branch, q/k norms per head or
over the projection (OLMo 2), SwiGLU or GeGLU (Gemma), a residual scale (Granite), sliding-window layers in KV
groups of their own with their own RoPE (Gemma 3) and soft-capped scores (Gemma 2); anything else (attention
sinks, latent caches, int8/int4/AWQ weights, Cohere's LayerNorms, parallel branches and layers without RoPE among
them, and StarCoder2's plain MLP) takes the general path.

A step with LoRA adapters stays fused when their deltas run on the native kernels (the stack's `native`):
each projection's deltas (csrc/lora_delta.h, the code the unfused path calls) are added inside the same team,
and an adapter's replacement embedding is looked up before the call (its LM head: `compute_logits`).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from engine.attention import AttentionBackend
from engine.attention.kv_cache import kv_scale
from engine.attention.metadata import AttentionMetadata
from engine.kernels.cpu import CpuKernels, DecodeLoRA
from engine.kernels.cpu_ops import cache_addresses
from engine.kernels.column_block_weight import PackedWeight
from engine.quantization.gguf_formats import X16
from engine.quantization.gguf_weight import GgufWeight
from engine.lora.lora_stack import LoRAStack
from engine.lora.lora_step import LoRAStep


VECTOR_COLUMNS = (
    "input_norm",
    "post_norm",
    "qkv_bias",
    "o_bias",
    "gate_up_bias",
    "down_bias",
    "q_norm",
    "k_norm",
    "attn_post_norm",
    "mlp_post_norm",
)
MATRIX_COLUMNS = ("qkv", "o_proj", "gate_up", "down")
"""A layer's row of the weight table, in csrc/decode_layer.cpp's WeightColumn order: one address per
vector (0: no such norm or bias), then six values per matrix (`_matrix_entry`)."""

DENSE_FORMAT = -1
COLUMN_BLOCKS_FORMAT = -2
COLUMN_BLOCKS_TILES_FORMAT = -3
"""A matrix entry's format code for a plain [out, in] tensor and for a column-block `PackedWeight` (-3: its
product may run on AMX tiles, as the model's `ColumnBlockLinear` does) (csrc/decode_layer.cpp's Matrix; GGUF
blocks carry their format's code, >= 0)."""


class FusedDecode:
    def __init__(self, kernels: CpuKernels, max_rows: int):
        self.kernels = kernels
        self.max_rows = max_rows
        self._model_ok: Optional[bool] = None  # decided once, on the first step (the weights are loaded)
        self._max_rows = max_rows  # lowered for GGUF blocks to the rows the unfused path multiplies as integers
        self._weights: Optional[torch.Tensor] = None  # the weight table (`_weight_table`)
        self._caches: Optional[tuple[list[torch.Tensor], list[torch.Tensor]]] = None
        self._caches_of: Optional[Sequence] = None  # the kv_caches sequence they were split from
        self._addresses: Optional[tuple[torch.Tensor, torch.Tensor]] = None  # the caches' (cache_addresses)
        self._lora_table: Optional[torch.Tensor] = None  # the LoRA stacks' addresses (`_lora_table`)
        self._layers: Optional[_LayerTable] = None  # what differs between the layers (`_LayerTable`)
        self.mixed_prefill_tokens = MIXED_PREFILL_MAX_TOKENS  # 0: steps with prompt tokens stay unfused

    def takes(
        self,
        model,
        num_tokens: int,
        metadata: Sequence[AttentionMetadata],
        kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]],
        backend: AttentionBackend,
    ) -> bool:
        """Whether this step can run fused (cheap after the first call)."""
        if (
            self._model_ok is False
            or num_tokens == 0
            or backend.name != "cpu"
            or not _fusable_rows(metadata[0], num_tokens, self.mixed_prefill_tokens)
        ):
            return False
        if self._model_ok is None:
            self._model_ok = _model_fits(model, kv_caches)
            if self._model_ok and has_gguf_blocks(model):
                self._max_rows = _integer_rows(model, self.max_rows)
        return self._model_ok and num_tokens <= self._max_rows

    def forward(
        self,
        model,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]],
        metadata: Sequence[AttentionMetadata],  # each layer's (its KV group's; one shared by timing and draft steps)
    ) -> torch.Tensor:  # [num_tokens, hidden], before the final norm
        arch, rotary = model.arch, model.rotary
        step = metadata[0]
        if self._weights is None:
            self._weights = _weight_table(model)
            self._layers = _LayerTable.of(model)
        assert self._layers is not None
        if self._caches is None or self._caches_of is not kv_caches:
            self._caches = [k for k, _ in kv_caches], [v for _, v in kv_caches]
            self._caches_of = kv_caches
            self._addresses = cache_addresses(*self._caches)
        key_caches, value_caches = self._caches
        tables, lens = _step_tables(step)
        # [T, hidden], updated in place layer by layer (an adapter's replacement embedding rows looked up there)
        residual = model.input_embeddings(input_ids)
        lora = self._lora(model.lora, model.lora_step)
        self.kernels.decode_layers(
            residual,
            self._weights,
            key_caches,
            value_caches,
            positions,
            rotary.cos,
            rotary.sin_signed,
            step.slot_mapping,
            tables,
            lens,
            arch.num_heads,
            arch.intermediate_size,
            arch.rms_norm_eps,
            model.scale,
            lora,
            self._addresses,
            model.residual_scale,
            model.qk_norm_projection,
            model.activation == "gelu_tanh",
            model.attention_layers[0].softcap or 0.0,  # every layer's (`_model_fits`)
            self._layers.for_step(metadata, (tables, lens)),
        )
        return residual  # the stream after the last layer (its MLP output added in the kernel)

    def _lora(self, stack: Optional[LoRAStack], step: Optional[LoRAStep]) -> Optional[DecodeLoRA]:
        """The step's adapters for the native call (None: base only)."""
        if stack is None or step is None or step.native_slots is None:
            return None
        if self._lora_table is None:
            self._lora_table = _lora_table(stack)
        slots, scales = step.native_slots
        return DecodeLoRA(self._lora_table, slots, scales, stack.ranks, stack.max_rank)


class _LayerTable:
    """What differs between a model's layers beyond their weights (decode_layers' layer table, csrc's LayerColumn):
    the KV group whose block tables and slots each layer reads (sliding-window layers hold their own blocks), its
    window, its RoPE tables (Gemma 3's sliding layers rotate with another base)."""

    def __init__(self, fixed: torch.Tensor, uniform: bool):
        self.fixed = fixed  # [num_layers, 3] int64: window, cos and sin addresses
        self.uniform = uniform  # no window (so one KV group) and one RoPE: no table
        self.keep: list[tuple[torch.Tensor, torch.Tensor]] = []

    @classmethod
    def of(cls, model) -> "_LayerTable":
        rotaries = [model.rotary_of(layer) for layer in range(len(model.layers))]
        windows = [attention.sliding_window or 0 for attention in model.attention_layers]
        fixed = [[w, r.cos.data_ptr(), r.sin_signed.data_ptr()] for w, r in zip(windows, rotaries)]
        uniform = not any(windows) and all(rotary is model.rotary for rotary in rotaries)
        return cls(torch.tensor(fixed, dtype=torch.int64), uniform)

    def for_step(
        self, metadata: Sequence[AttentionMetadata], first_tables: tuple[torch.Tensor, torch.Tensor]
    ) -> Optional[torch.Tensor]:
        """[num_layers, 7] int64 for this step, or None (every layer takes the step's own arguments: a model
        without windows has one KV group): each layer's group's row tables, lengths, width and slots, then the
        layer's fixed columns. The groups are read from this step's metadata (one object per KV group from the
        runner; a timing step may pass one for every layer). `first_tables`: `_step_tables(metadata[0])`, already
        made (the step's own arguments). The tensors live in the step's metadata, or in the table's `keep`, until
        the next step."""
        self.keep = []  # row tables made for this step (a step with prompt rows): alive through the native call
        if self.uniform:
            return None
        index: dict[int, int] = {}
        layer_group = [index.setdefault(id(each), len(index)) for each in metadata]
        rows = []
        for group in {id(each): each for each in metadata}.values():
            tables, lens = first_tables if group is metadata[0] else _step_tables(group)
            self.keep.append((tables, lens))
            rows.append([tables.data_ptr(), lens.data_ptr(), tables.shape[1], group.slot_mapping.data_ptr()])
        groups = torch.tensor(rows, dtype=torch.int64)[torch.tensor(layer_group)]
        return torch.cat([groups, self.fixed], dim=1)


MIXED_PREFILL_MAX_TOKENS = 64
"""A step of decodes that also admits prompts runs fused when each prompt chunk is at most this long: its tokens
become rows of their own (the native step writes every row's K/V before any row attends, so token i of a chunk
attends over the cache up to itself, as a decode would, and as the runner already serves draft tokens). Without
it, a newcomer's prompt sends the whole step to the general path, which cost the running streams 1.9x a decode
step (embedded model, 16 streams, a 17-token prompt; 1.3x fused). Longer chunks stay there: the per-row
attention reads the chunk's keys once per row, where the general path's flash kernel tiles them. The prompt's
attention then sums in the decode kernel's order, not the flash kernel's: its logprobs may differ in the last
bits from a step without running streams (tokens in float32 do not; `--batch-invariant` fixes one order)."""


def _fusable_rows(step: AttentionMetadata, num_tokens: int, chunk_limit: int) -> bool:
    """Every token a decode, or decodes beside prompt chunks of at most `chunk_limit` tokens. A step of prompts
    alone keeps the general path, so a prompt computed without running streams keeps its numerics."""
    if step.num_decodes == num_tokens:
        return True
    return step.num_decodes > 0 and all(chunk.query_len <= chunk_limit for chunk in step.prefills)


def _step_tables(step: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """The block tables and context lengths of the step's rows: its decodes', or with prompt rows `_row_tables`."""
    return _row_tables(step) if step.prefills else step.decodes()


def _row_tables(step: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """Block tables and context lengths per row of a mixed step: the decodes' own, then for each prompt token
    its request's table and its context up to and including itself."""
    tables, lens = step.decodes()
    chunks = step.prefills
    width = max(tables.shape[1], *(c.block_table.shape[0] for c in chunks))  # the step's whole table: enough
    rows = step.num_tokens
    row_tables = torch.zeros(rows, width, dtype=torch.int32)
    row_lens = torch.empty(rows, dtype=torch.int32)
    row_tables[: step.num_decodes, : tables.shape[1]] = tables
    row_lens[: step.num_decodes] = lens
    for chunk in chunks:
        span = slice(chunk.query_start, chunk.query_start + chunk.query_len)
        row_tables[span, : chunk.block_table.shape[0]] = chunk.block_table
        first = chunk.context_len - chunk.query_len + 1
        row_lens[span] = torch.arange(first, chunk.context_len + 1, dtype=torch.int32)
    return row_tables, row_lens


def _weight_table(model) -> torch.Tensor:
    """[num_layers, 10 + 6 * 4] int64: per layer the address of each vector (0: absent), then each matrix's
    entry; the model keeps the tensors alive and never moves them."""
    tiles = getattr(model.linear, "amx", False)  # ColumnBlockLinear on AMX tiles
    rows = []
    for layer in model.layers:
        row = [0 if getattr(layer, name) is None else getattr(layer, name).data_ptr() for name in VECTOR_COLUMNS]
        for name in MATRIX_COLUMNS:
            row += _matrix_entry(getattr(layer, name), tiles)
        rows.append(row)
    return torch.tensor(rows, dtype=torch.int64)


def _lora_table(stack: LoRAStack) -> torch.Tensor:
    """[num_layers, 8] int64: per layer the addresses of the stacked A and B of each matrix (MATRIX_COLUMNS'
    order); the stack keeps them and loads adapters into them in place."""
    return torch.tensor(
        [[t.data_ptr() for name in MATRIX_COLUMNS for t in (a[name], b[name])] for a, b in zip(stack.a, stack.b)],
        dtype=torch.int64,
    )


def _matrix_entry(weight, tiles: bool = False) -> list[int]:
    """(data, d, m, format, nbp, layout): a plain [out, in] tensor (format -1), a column-block packing (format
    -2, or -3 with `tiles`), or GGUF blocks (qs, scales, Q4_1 minimums or 0, the format's code, blocks per row,
    the layout's code)."""
    if isinstance(weight, PackedWeight):
        return [weight.data.data_ptr(), 0, 0, COLUMN_BLOCKS_TILES_FORMAT if tiles else COLUMN_BLOCKS_FORMAT, 0, 0]
    if isinstance(weight, GgufWeight):
        p = weight.packed
        return [p.qs.data_ptr(), p.d.data_ptr(), 0 if p.m is None else p.m.data_ptr(), weight.fmt.code, p.nbp, p.layout]
    return [weight.data_ptr(), 0, 0, DENSE_FORMAT, 0, 0]


def has_gguf_blocks(model) -> bool:
    """Whether any layer's matrix is GGUF blocks (`--quantization gguf`)."""
    return any(isinstance(getattr(layer, name), GgufWeight) for layer in model.layers for name in MATRIX_COLUMNS)


def _integer_rows(model, limit: int) -> int:
    """The most rows, up to `limit`, that the unfused path multiplies with every GGUF matrix's integer
    product (beyond, bf16 tiles or a dense product: the fused path stops there too)."""
    blocks = [
        getattr(layer, name)
        for layer in model.layers
        for name in MATRIX_COLUMNS
        if isinstance(getattr(layer, name), GgufWeight)
    ]
    rows = 0
    while rows < limit and all(w.product(rows + 1, model.dtype) == "integer" for w in blocks):
        rows += 1
    return rows


def _model_fits(model, kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> bool:
    """A recipe it computes (`model.fused_recipe`: RMSNorms, branches in sequence, RoPE in every layer),
    contiguous weights in the model's dtype or GGUF blocks, caches in that dtype (or all fp8), q/k norms per head
    or over the projection, applied wherever loaded, RoPE tables in that dtype of one width in every layer (whole
    heads, or Phi-4-mini's first rotary_dim dimensions), and causal attention with one scale and one soft-cap in
    every layer, windowed or not (the native step has no sinks, no latent cache)."""
    if not model.fused_recipe:  # LayerNorms, parallel branches, layers without RoPE: the kernel has none of them
        return False
    dtype = model.dtype
    rotaries = {id(r): r for r in (model.rotary_of(layer) for layer in range(len(model.layers)))}.values()
    # one rotary width for every layer's tables and for the model's own (decode_layers reads it off `model.rotary`)
    if not model.qk_norms_as_loaded or len({r.rotary_dim for r in (model.rotary, *rotaries)}) != 1:
        return False
    softcap = model.attention_layers[0].softcap
    if any(
        attention.sinks is not None
        or attention.latent_rank is not None
        or attention.scale != model.scale
        or attention.softcap != softcap
        for attention in model.attention_layers
    ):
        return False
    tensors = [t for rotary in rotaries for t in (rotary.cos, rotary.sin_signed)]  # in the model's dtype
    blocks: list[torch.Tensor] = []  # GGUF blocks and scales
    if not isinstance(model.embed, (GgufWeight, PackedWeight)):
        tensors.append(model.embed)
    arch = model.arch
    # the widths the kernel normalizes q and k over: each head (Qwen3's) or all of q and all of k (OLMo 2's)
    qk_widths = (arch.q_size, arch.kv_size) if model.qk_norm_projection else (arch.head_dim, arch.head_dim)
    for layer in model.layers:
        norms = [n for n in (layer.q_norm, layer.k_norm) if n is not None]
        if norms and (len(norms) != 2 or (norms[0].numel(), norms[1].numel()) != qk_widths):
            return False  # both weights, of those widths
        layer_norms = (layer.input_norm, layer.post_norm, layer.attn_post_norm, layer.mlp_post_norm)
        tensors += [n for n in layer_norms if n is not None] + norms
        tensors += [b for b in (layer.qkv_bias, layer.o_bias, layer.gate_up_bias, layer.down_bias) if b is not None]
        for name in MATRIX_COLUMNS:
            weight = getattr(layer, name)
            if isinstance(weight, GgufWeight):
                p = weight.packed  # X16: the scales are views into qs
                blocks += [p.qs] if p.layout == X16 else [t for t in (p.qs, p.d, p.m) if t is not None]
            elif isinstance(weight, PackedWeight):
                tensors.append(weight.data)
            else:
                tensors.append(weight)
    caches = [cache for pair in kv_caches for cache in pair]
    # an fp8 cache is read and written as stored (the kernel applies no scale: the step falls back if one is set)
    cache_dtypes = (dtype, torch.float8_e4m3fn) if kv_scale(torch.float8_e4m3fn) == 1.0 else (dtype,)
    return (
        all(_plain(t) and t.dtype == dtype for t in tensors)
        and all(_plain(t) for t in blocks)
        and all(_plain(t) and t.dtype in cache_dtypes for t in caches)
        and len({t.dtype for t in caches}) == 1
    )


def _plain(t) -> bool:
    """A contiguous, strided CPU tensor (not a subclass, an opaque packed layout, or a quantized weight)."""
    return type(t) is torch.Tensor and t.device.type == "cpu" and t.is_contiguous() and t.layout == torch.strided
