"""Tensor parallelism for the Llama family, the generic decoder (Gemma 1/2/3, Phi-3, OLMo 2/3, Granite, Cohere, GLM-4,
StarCoder2, SmolLM3, Arcee, ERNIE 4.5, EXAONE 4, Phi-2, GPT-NeoX, Seed-OSS, Apertus, GPT-J, GPT-BigCode, Falcon) and
the mixtures of experts on either (Mixtral, Qwen2-MoE, Qwen3-MoE, GLM-4.5; OLMoE, Granite MoE, Phi-3.5-MoE, Llama
4), DeepSeek-V2/V3, GPT-OSS and the hybrids Granite 4.0-H, Nemotron-H and LFM2: each rank's share of the heads and
of the MLPs' widths, and its slice of every checkpoint tensor (Megatron's column- and row-parallel layers).

    q|k|v, gate|up   column-parallel: rank r keeps its heads' rows (its query heads, and the KV heads they read)
                     and its share of the intermediate rows; no communication
    o_proj, down     row-parallel: rank r keeps the matching input columns; its product is a partial sum,
                     all-reduced after the layer (the model's `tp.all_reduce`); the bias joins on rank 0 only
    embed, lm_head   vocab-parallel: rank r keeps its slice of the vocabulary's rows, zero-padded to
                     ceil(vocab / ranks) rows (engine/layers/vocab_parallel.py); tied, one slice serves both
    norms            replicated, LayerNorms' shifts too (Gemma's post-norms act on all-reduced outputs); OLMo 2's
                     and OLMoE's q/k norms over the whole projection are cut like q and k, their mean square
                     all-reduced (models/decoder.py); Cohere's q/k norms, a weight per head [heads, head_dim], cut
                     by this rank's heads
    lm_head.bias     replicated: added to the gathered logits (Phi-3.5-MoE)
    qkv_proj, gate_up_proj   Phi-3's fused tensors: each part cut as above, this rank's parts fused again
    query_key_value  GPT-NeoX's, rows per head [q_h; k_h; v_h] (no KV groups): this rank's heads are whole rows,
                     reordered into q | k | v by the model (models/checkpoint_names.py)
    experts          each expert (and Qwen2-MoE's shared expert, GLM-4.5's shared experts, Granite MoE's shared_mlp)
                     cut like an MLP: its share of the expert's intermediate width (stacked experts, Granite MoE's
                     input_linear and output_linear, alike; Llama 4's, stacked transposed, along their own axes);
                     the router (GLM-4.5's correction bias too) and the
                     shared expert's gate replicated (every rank routes every token alike), the weighted sum of
                     partial outputs all-reduced with the layer's
    latent attention DeepSeek's, by heads: q_proj or q_b_proj (rows per head, q_nope | q_pe) and kv_b_proj (k_nope |
                     v per head) column-parallel, o_proj row-parallel; q_a_proj, kv_a_proj_with_mqa and their norms
                     replicated, so the latent and the shared rope key (the KV cache's entries) are the same on every
                     rank, each rank's cache a whole copy (as vLLM's); its experts as above, the routed scaling
                     factor unchanged
    Mamba-2          a hybrid model's: in_proj's rows and the convolution's channels part by part, by heads (gate,
                     x, dt) and by groups (B, C; one group whole on every rank), the heads' dt_bias, A_log, D and
                     norm channels; out_proj row-parallel
    Gated DeltaNet   Qwen3.5's: by heads, in_proj_qkv's rows and the convolution's channels part by part (q, k by
                     key heads, v by value heads), z, b, a, dt_bias and A_log by value heads, out_proj row-parallel
    short conv       LFM2's: in_proj's B, C and x rows each by channels, the convolution's channels, out_proj
                     row-parallel (its bias on rank 0)
    GPT-OSS          q/k/v (and biases) by heads, o_proj row-parallel (its bias on rank 0), the attention sinks (one
                     per query head) cut by this rank's heads; its experts in transformers' layout: gate_up_proj
                     [E, H, 2I] interleaves gate and up in its columns, so a rank's share of the width is one run
                     of 2I / ranks columns (its bias alike), down_proj [E, I, H] its rows, down's bias [E, H] on
                     rank 0 (added once before the all-reduce); the router replicated
    padded experts   an expert's (or shared expert's) width that does not split into equal shares of whole units
                     (1 for floats, 32 for MXFP4 blocks, G for int4 groups) is padded with zero units up to the
                     smallest multiple of ranks x unit, as vLLM pads it (engine/models/expert_padding.py): a zero
                     unit adds nothing (zero gate/up rows and biases, zero down column), so gpt-oss-120b's 2880 (90
                     blocks) serves on 4 ranks as 2944 (23 blocks each); the padding is appended, so GPT-OSS's
                     interleaved gate|up stays paired in each rank's run. Heads and dense MLP widths are not padded
                     (refused, as vLLM refuses them), nor are GGUF experts (refused by number)

With fewer KV heads than ranks (GQA), the KV heads are replicated: rank r reads KV head r * kv_heads // ranks,
the one its query heads share; each rank's KV cache holds its own KV heads only.

Quantized weights are cut so that every rank holds exactly the whole model's quantized values (TP=N serves the
weights TP=1 serves; only the all-reduce's summation order differs):

    GGUF blocks   a block is 32 consecutive inputs of one row with its scale: output rows cut anywhere (whole
                  rows of blocks), input columns only at block boundaries (refused, naming the tensor, else)
    int8          one scale per output row: column-parallel shards quantize alike whole or cut; row-parallel
                  matrices are quantized whole, then cut (a shard's own maximum would give other scales)
    int4          groups of G inputs per row: each rank quantizes its shard, whose groups are the whole
                  model's when each rank's inputs are whole groups (check_group_split refuses otherwise; the
                  experts' downs are padded to whole groups instead, and a group of zeros quantizes to zeros)
    AWQ           the checkpoint's own groups (Int4Groups): output rows cut anywhere, input columns at group
                  boundaries (check_group_split, with the checkpoint's group size; experts padded with zero groups)
    MXFP4         GPT-OSS's experts, 32 inputs of a row per block with one E8M0 scale: cut in their blocks before
                  they are dequantized (the slices of the dequantized whole: decoding is per value); gate_up's
                  blocks [E, 2I, H / 32, 16] by rows; down's [E, H, I / 32, 16] by whole blocks of inputs, each
                  rank's share padded to whole blocks (zero blocks: code 0 is +0.0 under any scale)
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Callable, Iterable, Iterator, Optional, Union

import torch

from engine.distributed.parallel_group import ParallelGroup
from engine.errors import SettingsConflictError
from engine.layers.gated_delta_net import DeltaNetShape
from engine.layers.recurrent_state import MambaShape
from engine.layers.vocab_parallel import VocabParallel
from engine.models.deepseek_arch import DeepseekArch
from engine.models.expert_padding import expert_share, padded_int4_columns, padded_int4_rows, padded_slice
from engine.models.llama_arch import LlamaArch
from engine.models.moe_arch import MoeArch
from engine.quantization.gguf_weight import GgufWeight
from engine.quantization.int4_groups import Int4Groups
from engine.quantization.mxfp4 import BLOCK_VALUES as MXFP4_BLOCK
from engine.quantization.mxfp4 import E8M0_BIAS
from engine.quantization.quantized_weight import QuantizedWeight

# (GPT-J's transformer.h.N.; Nemotron-H's backbone.layers.N.)
_LAYER = re.compile(r"(?:(?:model\.|gpt_neox\.|backbone\.)?layers|transformer\.h)\.\d+\.(.+)")
# rows split evenly (plain MLPs' ups: StarCoder2's c_fc, Phi-2's fc1, GPT-NeoX's dense_h_to_4h; GPT-NeoX's
# query_key_value, whose rows are per head)
_COLUMN = (
    *("self_attn.q_proj.", "mlp.gate_proj.", "mlp.up_proj.", "mlp.c_fc.", "mlp.fc1.", "mlp.dense_h_to_4h."),
    *("attention.query_key_value.", "attn.q_proj.", "mlp.fc_in.", "feed_forward.gate_proj.", "feed_forward.up_proj."),
    # (GPT-BigCode's c_attn, Falcon's query_key_value: by heads or KV groups, else cut as _FUSED_QKV)
    *("attn.c_attn.", "self_attention.query_key_value."),
    # DeepSeek's latent attention: rows per head (q_nope | q_pe; k_nope | v), so an even cut is by heads
    *("self_attn.q_b_proj.", "self_attn.kv_b_proj."),
    *("mixer.q_proj.", "mixer.up_proj."),  # Nemotron-H's attention and MLP blocks (one mixer each)
    *("feed_forward.w1.", "feed_forward.w3."),  # LFM2's SwiGLU
)
_KV = ("self_attn.k_proj.", "self_attn.v_proj.", "attn.k_proj.", "attn.v_proj.", "mixer.k_proj.", "mixer.v_proj.")
_FUSED_QKV = "self_attn.qkv_proj."  # Phi-3: [q; k; v] rows in one tensor
# fused q | k | v (GPT-BigCode's, one KV head where multi_query; Falcon's), or, where the arch says qkv_per_head,
# rows by KV group (a rank's whole groups: its query heads and their KV head)
_QKV_BY_ARCH = ("attn.c_attn.", "self_attention.query_key_value.")
_FUSED_GATE_UP = "mlp.gate_up_proj."  # Phi-3: [gate; up]
_EXPERT_COLUMN = re.compile(  # each expert's (and Qwen2-MoE's shared expert's, GLM-4.5's shared experts') gate and
    # up: cut like an MLP's
    r"(?:block_sparse_moe|mlp|feed_forward|mixer)\."
    r"(?:experts\.\d+\.(?:w1|w3|gate_proj|up_proj)|shared_experts?\.(?:gate_proj|up_proj))\..+"
)
_EXPERT_ROW = re.compile(
    r"(?:block_sparse_moe|mlp|feed_forward|mixer)\.(?:experts\.\d+\.(?:w2|down_proj)|shared_experts?\.down_proj)\.weight"
)
# stacked experts [E, 2I, H] and [E, H, I]: transformers' in-memory names, Granite MoE's checkpoint names
_STACKED = re.compile(
    r"(?:block_sparse_moe|mlp)\.(?:experts\.(gate_up_proj|down_proj)|(input_linear|output_linear)\.weight)"
    r"|mixer\.experts\.(up_proj|down_proj)"  # (Nemotron 3's ungated experts, as transformers holds them)
)
_STACKED_DOWN = ("down_proj", "output_linear")
_STACKED_TRANSPOSED = re.compile(r"feed_forward\.experts\.(gate_up_proj|down_proj)")  # Llama 4's [E, H, 2I], [E, I, H]
# GPT-OSS's experts as transformers stores them: gate_up_proj [E, H, 2I] with gate and up interleaved in its columns
# (gate j at 2j, up j at 2j + 1: a rank's share of the width is one contiguous run of 2I / ranks columns) and its
# bias [E, 2I] alike, down_proj [E, I, H] and its bias [E, H]; MXFP4 checkpoints store each matrix's transpose in
# blocks of 32 inputs: *_blocks [E, out, in / 32, 16], *_scales [E, out, in / 32]
_GPT_OSS_EXPERTS = re.compile(r"mlp\.experts\.(gate_up_proj|down_proj)(_bias|_blocks|_scales)?")
_SINKS = "self_attn.sinks"  # GPT-OSS: one per query head
_SHARED_GATE_UP = "shared_mlp.input_linear.weight"  # Granite MoE's shared expert: [gate; up] fused
_SHARED_DOWN = "shared_mlp.output_linear.weight"
_QK_NORMS = ("self_attn.q_norm.weight", "self_attn.k_norm.weight")  # per head (replicated) or per projection
# input columns split, their biases added once (rank 0): the output projections (Phi-2's and GPT-NeoX's dense) and
# the downs (plain MLPs': c_proj, fc2, dense_4h_to_h)
_ROW_NAMES = (
    *("self_attn.o_proj.", "self_attn.dense.", "attention.dense.", "attn.out_proj.", "attn.c_proj."),
    "self_attention.dense.",
    *("mlp.down_proj.", "mlp.c_proj.", "mlp.fc2.", "mlp.dense_4h_to_h.", "mlp.fc_out.", "feed_forward.down_proj."),
    *("mixer.o_proj.", "mixer.down_proj."),
    *("self_attn.out_proj.", "feed_forward.w2."),  # LFM2's
)
_ROW = tuple(name + "weight" for name in _ROW_NAMES)
_ROW_BIAS = tuple(name + "bias" for name in _ROW_NAMES)
# rows split by vocab_parallel (GPT-NeoX's embed_in and embed_out too)
_VOCAB = re.compile(
    r"(?:model\.)?embed_tokens\.weight|lm_head\.weight|backbone\.embeddings\.weight"
    r"|(?:gpt_neox\.embed_in|embed_out|transformer\.wte|transformer\.word_embeddings)\.weight"
)


def has_dense_mlp(arch: LlamaArch, moe: Optional[MoeArch]) -> bool:
    """Whether some layer runs a dense MLP of `arch.intermediate_size` (a mixture of experts whose every layer is
    sparse reads that width as its experts', which are padded instead)."""
    if moe is not None and moe.dense_layers is not None:
        return bool(moe.dense_layers)
    return moe is None or len(moe.sparse_layers) < arch.num_layers


def check_shardable(arch: LlamaArch, world_size: int, moe: Optional[MoeArch] = None) -> None:
    """SettingsConflictError unless heads, KV heads and the dense MLPs' width (where a layer has one; `moe`: the
    model's experts) divide among `world_size` ranks (as vLLM, which pads only experts)."""
    problems = []
    if arch.num_heads % world_size:
        problems.append(f"{arch.num_heads} attention heads")
    if arch.num_kv_heads % world_size and world_size % arch.num_kv_heads:
        problems.append(f"{arch.num_kv_heads} KV heads (neither a multiple nor a divisor of the ranks)")
    if has_dense_mlp(arch, moe) and arch.intermediate_size % world_size:
        problems.append(f"intermediate size {arch.intermediate_size}")
    if getattr(arch, "qkv_per_head", False) and arch.num_kv_heads % world_size:  # (rows by KV group: whole groups)
        problems.append(f"{arch.num_kv_heads} KV heads, whose groups' rows query_key_value interleaves")
    if problems:
        raise SettingsConflictError(
            f"--tensor-parallel-size {world_size} does not divide the model's {', '.join(problems)}"
        )


def shard_moe(moe: MoeArch, world_size: int, unit: int = 1, held: Optional[range] = None) -> MoeArch:
    """One rank's experts: every expert, each its share of the intermediate width, padded with zero units where the
    width does not split into equal shares of whole `unit`s (engine/models/expert_padding.py); with expert
    parallelism (`held`: models/expert_parallel.py) those experts whole instead. A shared expert: its share."""
    shared = moe.shared_intermediate_size
    width = (
        moe.expert_intermediate_size
        if held is not None
        else expert_share(moe.expert_intermediate_size, world_size, unit)
    )
    return dataclasses.replace(
        moe,
        expert_intermediate_size=width,
        shared_intermediate_size=None if shared is None else expert_share(shared, world_size, unit),
        held_experts=held,
    )


def shard_deepseek(
    deepseek: DeepseekArch, world_size: int, unit: int = 1, held: Optional[range] = None
) -> DeepseekArch:
    """One rank's latent attention and experts: its query heads (the latent, shared by every head, whole), every
    expert with its (padded) share of the width, or its `held` experts whole (expert parallelism); the routing (its
    scaling factor too) as it is."""
    mla = dataclasses.replace(deepseek.mla, num_heads=deepseek.mla.num_heads // world_size)
    return dataclasses.replace(deepseek, mla=mla, moe=shard_moe(deepseek.moe, world_size, unit, held))


def shard_arch(arch: LlamaArch, world_size: int, moe: Optional[MoeArch] = None) -> LlamaArch:
    """One rank's shape: its query heads, its KV heads (one, replicated, when there are fewer than ranks), its
    share of the MLP width (rounded up where no layer has a dense MLP: `moe`'s experts hold the width, padded)."""
    check_shardable(arch, world_size, moe)
    return dataclasses.replace(
        arch,
        num_heads=arch.num_heads // world_size,
        num_kv_heads=max(arch.num_kv_heads // world_size, 1),
        intermediate_size=-(-arch.intermediate_size // world_size),
    )


def check_group_split(
    arch: LlamaArch,
    world_size: int,
    group: int,
    storage: str,
    moe: Optional[MoeArch] = None,
    recurrent_width: Optional[int] = None,
) -> None:
    """SettingsConflictError unless each rank's input columns of the row-parallel matrices (o_proj, a dense down,
    a recurrent layer's out_proj, `recurrent_width` inputs) are a whole number of `group`-input groups: a group's
    one scale cannot be cut between ranks. (The experts' downs, `moe`'s, are padded to whole groups per rank
    instead: expert_padding.expert_unit.)"""
    widths = [("o_proj", arch.num_heads * arch.head_dim)]
    if has_dense_mlp(arch, moe):
        widths.append(("down_proj", arch.intermediate_size))
    if recurrent_width is not None:
        widths.append(("out_proj", recurrent_width))
    for name, inputs in widths:
        share = inputs // world_size
        if share % group:
            raise SettingsConflictError(
                f"--tensor-parallel-size {world_size} with {storage}: {name}'s {inputs} inputs split into "
                f"{share} per rank, not a whole number of its {group}-input groups"
            )


def shard_weights(
    weights: Iterable[tuple[str, Any]],
    arch: LlamaArch,
    tp: ParallelGroup,
    quantize_whole: Optional[Callable[[torch.Tensor], QuantizedWeight]] = None,
    expert_unit: int = 1,
    held_experts: Optional[range] = None,
    mamba: Optional[MambaShape] = None,
    delta_net: Optional[DeltaNetShape] = None,
) -> Iterator[tuple[str, Any]]:
    """The checkpoint's (HF-named) tensors of the whole model `arch`, each cut to rank `tp.rank`'s slice: float
    tensors, or GGUF blocks (rows freely, input columns at block boundaries). `quantize_whole` (int8): the
    row-parallel matrices are quantized whole before their columns are cut, so each rank's columns keep the
    whole rows' scales (column-parallel rows quantize alike whole or cut: the model quantizes its shard).
    `expert_unit`: what each rank's share of an expert's width holds whole (expert_padding.expert_unit, as
    shard_moe was given); a width that does not split into equal shares of it is padded with zero units.
    `held_experts` (expert parallelism, models/expert_parallel.py): the routed experts this rank holds, taken whole
    (stacked tensors sliced along their experts, another expert's own tensors left out); shared experts cut as
    above. `mamba`: a hybrid model's whole Mamba-2 layer shape, whose tensors are cut by heads (`_mamba_share`);
    `delta_net`: Qwen3.5's whole linear-attention shape, cut by heads alike (`_delta_net_share`)."""
    rank, ranks = tp.rank, tp.world_size
    head_dim = arch.head_dim
    kv_rank_heads = max(arch.num_kv_heads // ranks, 1)
    first_kv_head = rank * arch.num_kv_heads // ranks  # (replicated heads: the one this rank's queries read)
    vocab = VocabParallel(arch.vocab_size, tp)
    for name, tensor in weights:
        match = _LAYER.fullmatch(name)
        if match is None and _VOCAB.fullmatch(name) is None:
            yield name, tensor  # the final norm
            continue
        if not isinstance(tensor, (torch.Tensor, GgufWeight, Int4Groups)):
            raise SettingsConflictError(
                f"tensor parallelism takes float, GGUF or AWQ checkpoint tensors; {name} is stored as "
                f"{type(tensor).__name__} (serve it with --tensor-parallel-size 1)"
            )
        if match is None:
            assert not isinstance(tensor, Int4Groups)  # AWQ leaves embeddings and the LM head float
            yield name, vocab.shard(tensor)
            continue
        part = match.group(1)
        if delta_net is not None and part.startswith(_DELTA_NET):
            yield name, _delta_net_share(part.removeprefix(_DELTA_NET), tensor, delta_net, rank, ranks, quantize_whole)
            continue
        if arch.model_type == "lfm2" and part.startswith(_SHORT_CONV):
            yield name, _short_conv_share(name, part.removeprefix(_SHORT_CONV), tensor, rank, ranks, quantize_whole)
            continue
        if mamba is not None and part.startswith(_MAMBA) and part.split(".", 1)[1] in _MAMBA_TENSORS:
            yield name, _mamba_share(name, part.split(".", 1)[1], tensor, mamba, rank, ranks, quantize_whole)
            continue
        if held_experts is not None and (routed := _routed_experts(part, arch)) is not None:
            if routed == "stacked":
                yield name, _held_rows(name, tensor, held_experts)
            elif routed in held_experts:
                yield name, tensor
            continue
        if _EXPERT_COLUMN.fullmatch(part):
            yield name, _expert_rows(name, tensor, rank, ranks, expert_unit)
        elif _EXPERT_ROW.fullmatch(part):
            yield name, _expert_columns(name, tensor, rank, ranks, expert_unit, quantize_whole)
        elif arch.model_type == "gpt_oss" and (experts := _GPT_OSS_EXPERTS.fullmatch(part)) is not None:
            matrix, suffix = experts.groups()
            yield name, _gpt_oss_experts(name, tensor, matrix, suffix or "", rank, ranks, expert_unit)
        elif part == _SINKS:
            yield name, _rows(tensor, rank, ranks)
        elif _STACKED_TRANSPOSED.fullmatch(part):
            yield name, _transposed_experts(name, tensor, rank, ranks, expert_unit, quantize_whole)
        elif _STACKED.fullmatch(part):  # transformers' in-memory layout, where a checkpoint stores it so
            yield name, _stacked_experts(name, tensor, rank, ranks, expert_unit, quantize_whole)
        elif part == _SHARED_GATE_UP:  # each half (gate, up) cut like an MLP's
            halves = _split_rows(tensor, (_rows_of(tensor) // 2,) * 2)
            yield name, _cat_rows([_expert_rows(name, half, rank, ranks, expert_unit) for half in halves])
        elif part == _SHARED_DOWN:
            yield name, _expert_columns(name, tensor, rank, ranks, expert_unit, quantize_whole)
        elif part.startswith(_FUSED_QKV) or (
            part.startswith(_QKV_BY_ARCH) and not getattr(arch, "qkv_per_head", False)
        ):
            # Phi-3's [q; k; v], GPT-BigCode's multi-query c_attn: each part's rows of this rank
            q, k, v = _split_rows(tensor, (arch.q_size, arch.kv_size, arch.kv_size))
            kv_rows = (first_kv_head * head_dim, (first_kv_head + kv_rank_heads) * head_dim)
            yield name, _cat_rows([_rows(q, rank, ranks), _take_rows(k, *kv_rows), _take_rows(v, *kv_rows)])
        elif part.startswith(_FUSED_GATE_UP):  # Phi-3's [gate; up]
            gate, up = _split_rows(tensor, (arch.intermediate_size, arch.intermediate_size))
            yield name, _cat_rows([_rows(gate, rank, ranks), _rows(up, rank, ranks)])
        elif part in _QK_NORMS and isinstance(tensor, torch.Tensor) and tensor.dim() == 2:
            # Cohere: a weight per head [heads, head_dim]: those of this rank's heads
            if part.startswith("self_attn.q"):
                yield name, _rows(tensor, rank, ranks)
            else:
                yield name, _take_rows(tensor, first_kv_head, first_kv_head + kv_rank_heads)
        elif part in _QK_NORMS and _rows_of(tensor) != head_dim:  # OLMo 2: over the whole projection
            if part.startswith("self_attn.q"):
                yield name, _rows(tensor, rank, ranks)
            else:
                yield name, _take_rows(tensor, first_kv_head * head_dim, (first_kv_head + kv_rank_heads) * head_dim)
        elif part.startswith(_COLUMN):
            yield name, _rows(tensor, rank, ranks)
        elif part.startswith(_KV):
            yield name, _take_rows(tensor, first_kv_head * head_dim, (first_kv_head + kv_rank_heads) * head_dim)
        elif part in _ROW:
            yield name, _columns(name, tensor, rank, ranks, quantize_whole)
        elif part in _ROW_BIAS:
            assert isinstance(tensor, torch.Tensor)  # biases are floats in every format
            yield name, tensor if rank == 0 else torch.zeros_like(tensor)
        else:
            yield name, tensor  # norms (Qwen3's per-head q/k norms are one head wide: the same on every rank)


_Cuttable = Union[torch.Tensor, GgufWeight, Int4Groups]  # a checkpoint matrix as stored: float, GGUF blocks, AWQ groups
_MAMBA = ("mamba.", "mixer.")  # Granite 4.0-H's Mamba-2 layer; Nemotron-H's block mixer (attention and MLPs: above)
_MAMBA_HEADS = ("dt_bias", "A_log", "D")  # one value per head
_MAMBA_TENSORS = (*_MAMBA_HEADS, "norm.weight", "in_proj.weight", "conv1d.weight", "conv1d.bias", "out_proj.weight")


_SHORT_CONV = "conv."  # LFM2's short-convolution layer
_DELTA_NET = "linear_attn."  # Qwen3.5's Gated DeltaNet


def _delta_net_share(
    part: str,
    tensor: Any,
    shape: DeltaNetShape,
    rank: int,
    ranks: int,
    quantize_whole: Optional[Callable[[torch.Tensor], QuantizedWeight]],
) -> Any:
    """A Gated DeltaNet cut by heads (as vLLM's): in_proj_qkv's rows and the convolution's channels [q | k | v] each
    part's share (q and k by key heads, v by value heads: each rank's value heads read its key heads), in_proj_z's,
    in_proj_b's and in_proj_a's rows and dt_bias and A_log by value heads, out_proj row-parallel; the gated norm (one
    head wide) replicated."""
    if part == "out_proj.weight":
        return _columns(part, tensor, rank, ranks, quantize_whole)
    if part in ("in_proj_qkv.weight", "conv1d.weight"):
        sizes = (shape.key_dim, shape.key_dim, shape.value_dim)
        return _cat_rows([_rows(piece, rank, ranks) for piece in _split_rows(tensor, sizes)])
    if part == "norm.weight":
        return tensor
    return _rows(tensor, rank, ranks)  # in_proj_z, in_proj_b, in_proj_a, dt_bias, A_log


def _short_conv_share(
    name: str,
    part: str,
    tensor: Any,
    rank: int,
    ranks: int,
    quantize_whole: Optional[Callable[[torch.Tensor], QuantizedWeight]],
) -> Any:
    """LFM2's short convolution cut by channels: in_proj's rows [B | C | x] each part's share (its bias alike), the
    convolution's channels, out_proj row-parallel (its bias on rank 0)."""
    if part == "out_proj.weight":
        return _columns(name, tensor, rank, ranks, quantize_whole)
    if part == "out_proj.bias":
        return tensor if rank == 0 else torch.zeros_like(tensor)
    if part.startswith("in_proj."):
        return _cat_rows([_rows(third, rank, ranks) for third in _split_rows(tensor, (_rows_of(tensor) // 3,) * 3)])
    return _rows(tensor, rank, ranks)  # conv.weight [channels, 1, kernel], conv.bias


def _mamba_share(
    name: str,
    part: str,
    tensor: Any,
    shape: MambaShape,
    rank: int,
    ranks: int,
    quantize_whole: Optional[Callable[[torch.Tensor], QuantizedWeight]],
) -> Any:
    """A Mamba-2 layer's tensor cut by heads (as vLLM's MambaMixer2): in_proj's rows [gate | x | B | C | dt] and
    conv1d's [x | B | C] each part's share of this rank (B and C by groups, or the one group whole on every
    rank), the heads' dt_bias, A_log, D and their channels of the norm; out_proj row-parallel."""
    if part == "out_proj.weight":
        return _columns(name, tensor, rank, ranks, quantize_whole)
    if not isinstance(tensor, torch.Tensor):
        raise SettingsConflictError(f"{name}: a Mamba-2 layer is cut as float tensors, not {type(tensor).__name__}")
    if part in _MAMBA_HEADS or part == "norm.weight":
        return _rows(tensor, rank, ranks)
    width, groups = shape.intermediate_size, shape.num_groups * shape.state_size
    sizes = (width, groups, groups) if part.startswith("conv1d.") else (width, width, groups, groups, shape.num_heads)
    whole_groups = shape.num_groups % ranks != 0  # (one group: every rank's heads read it)
    group_parts = (1, 2) if part.startswith("conv1d.") else (2, 3)
    return _cat_rows(
        [
            piece if whole_groups and i in group_parts else _rows(piece, rank, ranks)
            for i, piece in enumerate(_split_rows(tensor, sizes))
        ]
    )


_ONE_EXPERT = re.compile(r"(?:block_sparse_moe|mlp|feed_forward|mixer)\.experts\.(\d+)\..+")


def _routed_experts(part: str, arch: LlamaArch) -> Union[int, str, None]:
    """A layer's tensor as one routed expert's (its number), the routed experts' stacked ("stacked"), or None (not
    a routed expert's: shared experts, routers, the rest of the layer)."""
    one = _ONE_EXPERT.fullmatch(part)
    if one is not None:
        return int(one.group(1))
    stacked = (
        _STACKED.fullmatch(part)
        or _STACKED_TRANSPOSED.fullmatch(part)
        or (arch.model_type == "gpt_oss" and _GPT_OSS_EXPERTS.fullmatch(part))
    )
    return "stacked" if stacked else None


def _held_rows(name: str, tensor: Any, held: range) -> torch.Tensor:
    """Stacked experts' tensor [E, ...] (their weights, biases, MXFP4 blocks or scales) -> the held experts'."""
    if not isinstance(tensor, torch.Tensor):
        raise SettingsConflictError(
            f"{name}: stacked experts are taken as float or MXFP4 tensors, not {type(tensor).__name__}"
        )
    return tensor[held.start : held.stop].clone()  # (not a view: the other experts' memory goes with the whole)


def _stacked_experts(
    name: str,
    tensor: Any,
    rank: int,
    ranks: int,
    unit: int,
    quantize_whole: Optional[Callable[[torch.Tensor], QuantizedWeight]],
) -> Union[torch.Tensor, list[QuantizedWeight]]:
    """Stacked experts' share (I' = I's padded share, expert_padding.expert_share): gate_up [E, 2I, H] ->
    [E, 2I', H] (this rank's gate rows, then its up rows), down [E, H, I] -> [E, H, I']; with `quantize_whole`
    (int8) the down matrices as a list, each expert's quantized whole (zero-padded: its rows' maxima unchanged),
    then cut (the whole rows' scales, as a per-expert checkpoint's)."""
    if not isinstance(tensor, torch.Tensor):
        raise SettingsConflictError(f"{name}: stacked experts are cut as float tensors, not {type(tensor).__name__}")
    if name.removesuffix(".weight").endswith(_STACKED_DOWN):
        share = expert_share(tensor.shape[2], ranks, unit)
        if quantize_whole is not None:
            padded = torch.nn.functional.pad(tensor, (0, share * ranks - tensor.shape[2]))
            return [quantize_whole(expert).take_columns(rank * share, (rank + 1) * share) for expert in padded]
        return padded_slice(tensor, 2, rank, share)
    if name.endswith("mixer.experts.up_proj"):  # ungated: up [E, I, H] alone
        return padded_slice(tensor, 1, rank, expert_share(tensor.shape[1], ranks, unit)).contiguous()
    gate, up = tensor.chunk(2, dim=1)
    share = expert_share(gate.shape[1], ranks, unit)
    return torch.cat([padded_slice(gate, 1, rank, share), padded_slice(up, 1, rank, share)], dim=1).contiguous()


def _gpt_oss_experts(
    name: str, tensor: Any, matrix: str, suffix: str, rank: int, ranks: int, unit: int
) -> torch.Tensor:
    """GPT-OSS's experts' share (their padded width's rank-th run of each axis it runs along; the down bias on rank
    0), float or MXFP4. The axes hold the width I as 2I interleaved gate|up entries (gate_up_proj, its bias, its
    blocks' rows), I rows (down_proj) or I / 32 blocks (down_proj's blocks: each rank's share whole blocks, so the
    unit is 32); the padded units are appended, so gate|up stays interleaved in each rank's run."""
    if not isinstance(tensor, torch.Tensor):
        raise SettingsConflictError(f"{name}: GPT-OSS's experts are cut as float or MXFP4 tensors")
    if suffix == "_bias" and matrix == "down_proj":  # added once, before the all-reduce
        return tensor if rank == 0 else torch.zeros_like(tensor)
    if suffix in ("_blocks", "_scales"):
        # [E, 2I, H / 32, ...]: gate_up's output rows (interleaved as its columns were); [E, H, I / 32, ...]: down's
        # input blocks
        dim = 1 if matrix == "gate_up_proj" else 2
    else:
        dim = 2 if matrix == "gate_up_proj" and suffix == "" else 1  # [E, H, 2I]; [E, 2I], [E, I, H]
    fill = E8M0_BIAS if suffix == "_scales" else 0  # (a zero block is zero under any scale: 2^0)
    if matrix == "gate_up_proj":
        return padded_slice(tensor, dim, rank, 2 * expert_share(tensor.shape[dim] // 2, ranks, unit), fill)
    if suffix == "":
        return padded_slice(tensor, dim, rank, expert_share(tensor.shape[dim], ranks, unit), fill)
    blocks = tensor.shape[dim]
    share = expert_share(blocks * MXFP4_BLOCK, ranks, unit)
    if share % MXFP4_BLOCK:  # (a unit of whole blocks, expert_padding.expert_unit, never leaves one)
        raise SettingsConflictError(
            f"--tensor-parallel-size {ranks}: {name} (MXFP4, {blocks * MXFP4_BLOCK} inputs in {blocks} blocks of "
            f"{MXFP4_BLOCK}) splits into {share} inputs per rank, not whole blocks"
        )
    return padded_slice(tensor, dim, rank, share // MXFP4_BLOCK, fill)


def _transposed_experts(
    name: str,
    tensor: Any,
    rank: int,
    ranks: int,
    unit: int,
    quantize_whole: Optional[Callable[[torch.Tensor], QuantizedWeight]],
) -> Union[torch.Tensor, list[QuantizedWeight]]:
    """Llama 4's stacked experts' share, in their own layout: gate_up [E, H, 2I] -> [E, H, 2I'] (this rank's gate
    columns, then its up columns), down [E, I, H] -> [E, I', H]; with `quantize_whole` (int8) the down matrices as
    a list, each expert's transposed to [H, I] and quantized whole, then cut: `_stacked_experts`' cut of the
    transpose, transposed back."""
    if not isinstance(tensor, torch.Tensor):
        raise SettingsConflictError(f"{name}: stacked experts are cut as float tensors, not {type(tensor).__name__}")
    share = _stacked_experts(name, tensor.transpose(1, 2), rank, ranks, unit, quantize_whole)
    return share if isinstance(share, list) else share.transpose(1, 2).contiguous()


def _expert_rows(name: str, tensor: _Cuttable, rank: int, ranks: int, unit: int) -> _Cuttable:
    """An expert's (or shared expert's) gate or up: this rank's share of its rows, zero rows after the real ones
    where the width is padded (expert_padding.py)."""
    width = _rows_of(tensor)
    share = expert_share(width, ranks, unit)
    if share * ranks == width:
        return _rows(tensor, rank, ranks)
    if isinstance(tensor, GgufWeight):
        raise _unpadded_gguf(name, tensor, width, ranks)
    if isinstance(tensor, Int4Groups):
        return padded_int4_rows(tensor, rank, share)
    return padded_slice(tensor, 0, rank, share)


def _expert_columns(
    name: str,
    tensor: _Cuttable,
    rank: int,
    ranks: int,
    unit: int,
    quantize_whole: Optional[Callable[[torch.Tensor], QuantizedWeight]],
) -> Union[_Cuttable, QuantizedWeight]:
    """An expert's (or shared expert's) down: this rank's share of its input columns, zero columns after the real
    ones where the width is padded; int8's quantized whole with its zero columns (its rows' maxima unchanged)."""
    width = tensor.in_features if isinstance(tensor, (GgufWeight, Int4Groups)) else tensor.shape[1]
    share = expert_share(width, ranks, unit)
    if share * ranks == width:
        return _columns(name, tensor, rank, ranks, quantize_whole)
    if isinstance(tensor, GgufWeight):
        raise _unpadded_gguf(name, tensor, width, ranks)
    if isinstance(tensor, Int4Groups):
        return padded_int4_columns(tensor, rank, share)
    if quantize_whole is not None:
        padded = torch.nn.functional.pad(tensor, (0, share * ranks - width))
        return quantize_whole(padded).take_columns(rank * share, (rank + 1) * share)
    return padded_slice(tensor, 1, rank, share)


def _unpadded_gguf(name: str, tensor: GgufWeight, width: int, ranks: int) -> SettingsConflictError:
    return SettingsConflictError(
        f"--tensor-parallel-size {ranks}: {name} ({tensor.format}) is an expert {width} wide, which does not split "
        "into equal shares, and experts kept in GGUF blocks are not padded; serve it with --enable-expert-parallel "
        f"(each expert whole on one rank), a size that divides {width}, or --quantization none (dequantized at "
        "load, then padded)"
    )


def _rows_of(tensor: _Cuttable) -> int:
    return tensor.out_features if isinstance(tensor, (GgufWeight, Int4Groups)) else tensor.shape[0]


def _split_rows(tensor: _Cuttable, sizes: tuple[int, ...]) -> list[Any]:
    """A fused projection's parts, `sizes` rows each."""
    if _rows_of(tensor) != sum(sizes):
        raise ValueError(f"a fused projection of {_rows_of(tensor)} rows, expected {' + '.join(map(str, sizes))}")
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return [_take_rows(tensor, start, start + size) for start, size in zip(starts, sizes)]


def _cat_rows(parts: list[Any]) -> _Cuttable:
    if isinstance(parts[0], GgufWeight):
        return GgufWeight.concat_rows(parts)
    if isinstance(parts[0], Int4Groups):
        return Int4Groups.concat(parts)
    return torch.cat(parts).contiguous()


def _rows(tensor: _Cuttable, rank: int, ranks: int) -> _Cuttable:
    """Rank `rank`'s equal share of the output rows (a column-parallel shard)."""
    share = _rows_of(tensor) // ranks
    return _take_rows(tensor, rank * share, (rank + 1) * share)


def _take_rows(tensor: _Cuttable, start: int, stop: int) -> _Cuttable:
    if isinstance(tensor, GgufWeight):
        return tensor.take_rows(torch.arange(start, stop))  # whole rows of blocks: exact
    if isinstance(tensor, Int4Groups):
        return tensor.take_rows(start, stop)  # each row's own groups: exact
    return tensor[start:stop].contiguous()


def _columns(
    name: str,
    tensor: _Cuttable,
    rank: int,
    ranks: int,
    quantize_whole: Optional[Callable[[torch.Tensor], QuantizedWeight]],
) -> Union[_Cuttable, QuantizedWeight]:
    """Rank `rank`'s equal share of the input columns (a row-parallel shard)."""
    total = tensor.in_features if isinstance(tensor, (GgufWeight, Int4Groups)) else tensor.shape[1]
    share = total // ranks
    start, stop = rank * share, (rank + 1) * share
    if isinstance(tensor, GgufWeight):
        try:
            return tensor.take_columns(start, stop)
        except ValueError as error:
            raise SettingsConflictError(
                f"--tensor-parallel-size {ranks}: {name} ({tensor.format}, {total} inputs) splits into {share} "
                f"inputs per rank: {error}; serve it with a size that splits whole blocks"
            ) from None
    if isinstance(tensor, Int4Groups):  # (whole groups: check_group_split refused other sizes at start-up)
        return tensor.take_columns(start, stop)
    if quantize_whole is not None:
        return quantize_whole(tensor).take_columns(start, stop)
    return tensor[:, start:stop].contiguous()
