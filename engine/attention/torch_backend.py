"""Paged attention in plain torch: the CPU backend and the reference for the GPU ones."""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from engine.attention.kv_write import write_kv_by_slots
from engine.attention.layer_attention import FEATURES, LATENT, SINKS, LayerAttention
from engine.attention.metadata import AttentionMetadata, PrefillChunk, decode_and_chunks
from engine.attention.step_metadata import BIDIRECTIONAL_SPANS, StepMetadata
from engine.attention.kv_cache import (
    KV_CACHE_DTYPES,
    KVCacheSpec,
    from_cache,
    select_blocks,
    to_cache,
    values_in_keys,
)


class TorchAttentionBackend:
    """Decodes are one batched gather + two batched matmuls; prefill chunks use SDPA per request.

    It also reads multi-head latent attention's cache (a layer with `latent_rank`): one KV head of latent
    entries whose values are their first `latent_rank` features, so values may be narrower than the queries.
    """

    name = "torch"
    cuda_graphs = False  # its metadata is shaped by host values (per-request chunks, the decode width)
    # windows and soft-caps as masks and a tanh; sinks as a column; the latent layout (MLA); an image's rows seeing
    # each other both ways, in its chunk's mask
    attention_features: tuple[str, ...] = (*FEATURES, SINKS, LATENT, BIDIRECTIONAL_SPANS)

    def kv_cache_dtypes(self, model_dtype: torch.dtype) -> tuple[torch.dtype, ...]:
        return tuple(dict.fromkeys(KV_CACHE_DTYPES.values()))  # converted on read (from_cache), fp8 with its scale

    def build_metadata(self, step: StepMetadata, spec: KVCacheSpec) -> AttentionMetadata:
        """Decode tables and lengths (views of the step's), one PrefillChunk per other request, and the
        decodes' additive mask: 0 up to each context length, -inf past it (padding of the gather)."""
        metadata = decode_and_chunks(step, spec.block_size)
        if not metadata.num_decodes:
            return metadata
        tables, lens = metadata.decodes()
        _, max_blocks = tables.shape
        key_pos = torch.arange(max_blocks * spec.block_size, device=lens.device)
        bias_dtype = torch.float32 if spec.dtype.itemsize == 1 else spec.dtype  # fp8 has no -inf
        bias = torch.zeros(
            (metadata.num_decodes, 1, 1, max_blocks * spec.block_size), dtype=bias_dtype, device=lens.device
        )
        bias.masked_fill_((key_pos[None, :] >= lens[:, None]).view(metadata.num_decodes, 1, 1, -1), float("-inf"))
        return dataclasses.replace(metadata, decode_bias=bias)

    def write_kv(self, key, value, key_cache, value_cache, metadata: AttentionMetadata) -> None:
        if values_in_keys(key_cache, value_cache):  # a latent cache: the values are written with the entries
            write_kv_by_slots(key, key, key_cache, key_cache, metadata.slot_mapping, values=False)
            return
        write_kv_by_slots(key, value, key_cache, value_cache, metadata.slot_mapping)

    def attend(self, query, key, value, key_cache, value_cache, metadata: AttentionMetadata, layer: LayerAttention):
        num_decodes = metadata.num_decodes
        if not metadata.prefills:
            return self._decode(query, key_cache, value_cache, metadata, layer)
        out = query.new_empty(*query.shape[:2], value.shape[-1])  # latent attention: values narrower than queries
        if num_decodes:
            out[:num_decodes] = self._decode(query[:num_decodes], key_cache, value_cache, metadata, layer)
        for chunk in metadata.prefills:
            rows = slice(chunk.query_start, chunk.query_start + chunk.query_len)
            out[rows] = self._prefill(query[rows], key[rows], value[rows], key_cache, value_cache, chunk, layer)
        return out

    @classmethod
    def _decode(cls, query, key_cache, value_cache, metadata: AttentionMetadata, layer: LayerAttention) -> torch.Tensor:
        """One query per request over its gathered blocks, masked past its context length.

        The gathered K/V stay in the cache's layout ([B, tokens, kv_heads, head_dim]);
        the products read them in place instead of transposing copies of them.
        """
        num_decodes, num_heads, head_dim = query.shape
        _, block_size, num_kv_heads, _ = key_cache.shape
        tables, lens = metadata.decodes()
        flat = tables.reshape(-1)  # [B * max_blocks]
        max_len = tables.shape[1] * block_size
        keys = from_cache(
            select_blocks(key_cache, flat).view(num_decodes, max_len, num_kv_heads, head_dim), query.dtype
        )  # --kv-cache-dtype
        if layer.latent_rank is not None:  # the entries' first features: no second gather
            values = keys[..., : layer.latent_rank]
        else:
            values = select_blocks(value_cache, flat).view(num_decodes, max_len, num_kv_heads, value_cache.shape[-1])
            values = from_cache(values, query.dtype)
        bias = metadata.decode_bias
        assert bias is not None  # build_metadata masks every step with decodes
        if layer.sliding_window is not None:  # keys before each query's window are masked out too
            first_seen = (lens - layer.sliding_window).view(num_decodes, 1, 1, 1)
            key_pos = torch.arange(max_len, device=bias.device)
            bias = bias.masked_fill(key_pos < first_seen, float("-inf"))
        if num_kv_heads <= cls.DIAGONAL_MAX_KV_HEADS:
            return cls._decode_all_pairs(query, keys, values, bias, layer)
        return cls._decode_per_kv_head(query, keys, values, bias, layer)

    DIAGONAL_MAX_KV_HEADS = 4
    """Up to this many KV heads, score every (head, kv head) pair and keep the matching ones:
    kv_heads times the (small) arithmetic, two products per layer. Beyond, loop over KV heads."""

    @staticmethod
    def _decode_all_pairs(query, keys, values, bias, layer: LayerAttention) -> torch.Tensor:
        """
        scores[b, h, t, k] = q[b, h] . K[b, t, k]   for every pair, then keep k == kv_head(h)
        kv_head(h) = h // group
        """
        batch, num_heads, head_dim = query.shape
        _, max_len, num_kv_heads, _ = keys.shape
        value_dim = values.shape[-1]
        group = num_heads // num_kv_heads
        pairs = torch.bmm(query, keys.view(batch, max_len * num_kv_heads, head_dim).transpose(1, 2))
        # [B, heads, max_len * kv_heads] -> [B, kv_heads, group, max_len]
        scores = torch.diagonal(pairs.view(batch, num_kv_heads, group, max_len, num_kv_heads), dim1=1, dim2=4)
        scores = biased_scores(scores.permute(0, 3, 1, 2), bias, layer)  # [B, kv_heads, group, max_len]
        probs = softmax_probs(scores, layer, (1, num_kv_heads, group, 1)).to(query.dtype)
        probs = probs.view(batch, num_heads, max_len)
        out = torch.bmm(probs, values.view(batch, max_len, num_kv_heads * value_dim))  # [B, heads, kv_heads * vd]
        out = torch.diagonal(out.view(batch, num_kv_heads, group, num_kv_heads, value_dim), dim1=1, dim2=3)
        return out.permute(0, 3, 1, 2).reshape(batch, num_heads, value_dim)

    @staticmethod
    def _decode_per_kv_head(query, keys, values, bias, layer: LayerAttention) -> torch.Tensor:
        """One pair of batched products per KV head, reading the strided K/V views in place."""
        batch, num_heads, head_dim = query.shape
        _, max_len, num_kv_heads, _ = keys.shape
        group = num_heads // num_kv_heads
        q = query.view(batch, num_kv_heads, group, head_dim)
        scores = torch.empty((batch, num_kv_heads, group, max_len), dtype=query.dtype, device=query.device)
        for k in range(num_kv_heads):
            torch.bmm(q[:, k], keys[:, :, k].transpose(1, 2), out=scores[:, k])
        scores = biased_scores(scores, bias, layer)
        probs = softmax_probs(scores, layer, (1, num_kv_heads, group, 1)).to(query.dtype)
        value_dim = values.shape[-1]
        out = torch.empty((batch, num_kv_heads, group, value_dim), dtype=query.dtype, device=query.device)
        for k in range(num_kv_heads):
            torch.bmm(probs[:, k], values[:, :, k], out=out[:, k])
        return out.view(batch, num_heads, value_dim)

    @staticmethod
    def _prefill(query, key, value, key_cache, value_cache, chunk: PrefillChunk, layer: LayerAttention) -> torch.Tensor:
        """Causal attention of a chunk; continues a cached prefix when context_len > query_len.

        query i (position context_len - query_len + i) sees keys [0, context_len - query_len + i]
        (with a sliding window W, only the last W of them), and within a bidirectional range of the chunk's
        every key of that range (ahead of it too: the window bounds only the keys behind)
        """
        # 4-D [1, heads, len, head_dim] views: SDPA's fused CPU kernel takes those (3-D ones fall back to
        # the unfused math path, 1.8x slower here).
        q = query.transpose(0, 1).unsqueeze(0)
        plain = layer.sliding_window is None and layer.softcap is None and layer.sinks is None
        causal = not chunk.bidirectional
        if chunk.context_len == chunk.query_len:
            if key_cache.dtype != key.dtype:
                # the chunk's K/V as the cache holds them, as every later read sees them: a prompt computed
                # whole, in chunks, or after a prefix hit or a KV tier's restore attends over the same values
                # (a latent cache's values are its entries' first features: rounded alike)
                key = from_cache(to_cache(key, key_cache.dtype), query.dtype)
                value = from_cache(to_cache(value, value_cache.dtype), query.dtype)
            k, v = key.transpose(0, 1).unsqueeze(0), value.transpose(0, 1).unsqueeze(0)
            if plain and causal:
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=layer.scale, enable_gqa=True)
                return out[0].transpose(0, 1)
        else:
            _, block_size, num_kv_heads, head_dim = key_cache.shape
            num_blocks = -(-chunk.context_len // block_size)
            table = chunk.block_table[:num_blocks]
            k = from_cache(
                select_blocks(key_cache, table).view(-1, num_kv_heads, head_dim)[: chunk.context_len], query.dtype
            )
            if layer.latent_rank is not None:  # the entries' first features
                v = k[..., : layer.latent_rank]
            else:
                v = select_blocks(value_cache, table).view(-1, num_kv_heads, value_cache.shape[-1])
                v = from_cache(v[: chunk.context_len], query.dtype)
            k, v = k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)
        offset = chunk.context_len - chunk.query_len
        query_pos = torch.arange(offset, chunk.context_len, device=query.device)
        key_pos = torch.arange(chunk.context_len, device=query.device)
        mask = key_pos[None, :] <= query_pos[:, None]  # [query_len, context_len]
        for first, end in chunk.bidirectional:  # (or'ed before the window: HF's `(causal or block) and window`)
            mask[first:end, offset + first : offset + end] = True
        if layer.sliding_window is not None:
            mask &= key_pos[None, :] > query_pos[:, None] - layer.sliding_window
        if layer.softcap is None and layer.sinks is None:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=layer.scale, enable_gqa=True)
        else:  # SDPA has no soft-cap and no sinks: the scores in full
            group = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
            bias = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill_(~mask, float("-inf"))
            scores = biased_scores(q @ k.transpose(-1, -2), bias, layer)
            out = softmax_probs(scores, layer, (1, q.shape[1], 1, 1)).to(q.dtype) @ v
        return out[0].transpose(0, 1)


def biased_scores(raw: torch.Tensor, bias: torch.Tensor, layer: LayerAttention) -> torch.Tensor:
    """bias + the layer's scores from the raw products q . k (scaled, then soft-capped as HF computes it)."""
    if layer.softcap is None:
        return torch.add(bias, raw, alpha=layer.scale)
    return bias + torch.tanh(raw * layer.scale / layer.softcap) * layer.softcap


def softmax_probs(scores: torch.Tensor, layer: LayerAttention, sinks_shape: tuple[int, ...]) -> torch.Tensor:
    """The softmax of the scores over the last dimension, in float32; with attention sinks, each head's sink
    logit (`layer.sinks` viewed as `sinks_shape` against the scores) joins the denominator as one more column,
    dropped after: the keys' probabilities then sum to less than 1."""
    if layer.sinks is None:
        return torch.softmax(scores, dim=-1, dtype=torch.float32)
    sinks = layer.sinks.to(device=scores.device, dtype=torch.float32).view(sinks_shape)
    column = sinks.expand(*scores.shape[:-1], 1)
    return torch.softmax(torch.cat([scores.float(), column], dim=-1), dim=-1)[..., :-1]
