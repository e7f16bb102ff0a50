"""Each generic-decoder family's reading of its HF config into a DecoderArch, refusing what it does not serve.

One function per family: what its config says about norms, activation, scales, windows and RoPE. A config
field that would change the model's output and that is not implemented is a ValueError naming it, never
ignored.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

from engine.attention.attention_shape import AttentionShape
from engine.attention.layer_attention import LayerAttention
from engine.layers.rotary import check_longrope_factors, check_rope_scaling
from engine.loading.rope_settings import rope_settings
from engine.models.decoder_arch import GLM4_NORMS, INPUT_NORM, LLAMA_NORMS, POST_NORMS, SANDWICH_NORMS, DecoderArch
from engine.models.llama_arch import shared_fields

GELU_TANH = ("gelu_pytorch_tanh", "gelu_new", "gelu_fast")
"""HF activations that are GELU's tanh approximation (GeGLU as Gemma computes it)."""


def gemma2_arch(config: Any) -> DecoderArch:
    """Gemma 2: sandwich norms of (1 + w), GeGLU, embeddings times sqrt(hidden), scale query_pre_attn_scalar^-0.5,
    soft-capped attention scores and logits, sliding-window layers by `layer_types` (every other one)."""
    _refuse_bidirectional(config)
    rope = rope_settings(config)
    attention = _layer_attention(config, config.query_pre_attn_scalar**-0.5, config.attn_logit_softcapping)
    return _arch(
        config,
        rope,
        norms=SANDWICH_NORMS,
        norm_offset=True,
        activation=_gelu_tanh(config),
        embedding_scale=config.hidden_size**0.5,
        embedding_scale_in_dtype=True,
        final_softcap=config.final_logit_softcapping,
        layer_attention=attention,
    )


def gemma3_arch(config: Any) -> DecoderArch:
    """Gemma 3 (text): Gemma 2's layer with per-head q/k norms of (1 + w); sliding layers rotate with
    `rope_local_base_freq` (unscaled), global ones with rope_theta and the config's scaling."""
    _refuse_bidirectional(config)
    layer_types = _layer_types(config)
    ropes = (rope_settings(config, "full_attention"), rope_settings(config, "sliding_attention"))
    layer_rope = tuple(1 if kind == "sliding_attention" else 0 for kind in layer_types)
    attention = _layer_attention(config, config.query_pre_attn_scalar**-0.5, config.attn_logit_softcapping)
    return _arch(
        config,
        ropes[0],
        norms=SANDWICH_NORMS,
        norm_offset=True,
        activation=_gelu_tanh(config),
        qk_norm="head",
        embedding_scale=config.hidden_size**0.5,
        embedding_scale_in_dtype=True,
        final_softcap=config.final_logit_softcapping,
        layer_attention=attention,
        ropes=ropes,
        layer_rope=layer_rope,
    )


def phi3_arch(config: Any) -> DecoderArch:
    """Phi-3 / Phi-4: Llama's layer from fused qkv_proj and gate_up_proj (taken as they are: the model fuses them
    anyway), LongRoPE, RoPE over the first `partial_rotary_factor` of each head (Phi-4-mini), a sliding window on
    every layer when the config sets one."""
    theta, scaling = rope_settings(config)
    if scaling is not None and scaling["rope_type"] == "longrope":
        original = getattr(config, "original_max_position_embeddings", None)
        scaling.setdefault("original_max_position_embeddings", original)
    window = getattr(config, "sliding_window", None)
    attention = tuple(
        LayerAttention(_head_scale(config), sliding_window=window) for _ in range(config.num_hidden_layers)
    )
    return _arch(
        config, (theta, scaling), activation=_silu(config), layer_attention=attention, rotary_dim=_rotary_dim(config)
    )


def olmo2_arch(config: Any) -> DecoderArch:
    """OLMo 2: no norms before the branches, norms on their outputs, q and k normalised over the whole
    projection before RoPE."""
    return _arch(
        config,
        rope_settings(config),
        norms=POST_NORMS,
        activation=_silu(config),
        qk_norm="projection",
        layer_attention=_uniform_attention(config, _head_scale(config)),
    )


def olmo3_arch(config: Any) -> DecoderArch:
    """OLMo 3: OLMo 2's layer with sliding-window layers by `layer_types`; each kind of layer rotates by its own
    RoPE (rope_parameters per layer type: the config's scaling on the full-attention layers)."""
    layer_types = _layer_types(config)
    ropes = (rope_settings(config, "full_attention"), rope_settings(config, "sliding_attention"))
    return _arch(
        config,
        ropes[0],
        norms=POST_NORMS,
        activation=_silu(config),
        qk_norm="projection",
        layer_attention=_layer_attention(config, _head_scale(config), None),
        ropes=ropes,
        layer_rope=tuple(1 if kind == "sliding_attention" else 0 for kind in layer_types),
    )


def granite_arch(config: Any) -> DecoderArch:
    """Granite: Llama's layer with embedding_multiplier, residual_multiplier, attention_multiplier as the
    attention scale and the logits divided by logits_scaling."""
    return _arch(
        config,
        rope_settings(config),
        activation=_silu(config),
        embedding_scale=float(config.embedding_multiplier),
        residual_scale=float(config.residual_multiplier),
        logits_divisor=float(config.logits_scaling),
        layer_attention=_uniform_attention(config, float(config.attention_multiplier)),
    )


def cohere_arch(config: Any) -> DecoderArch:
    """Command-R / Command-R+: one LayerNorm (no shift) of each layer's input, read by the attention and the MLP
    side by side, per-head LayerNorms of q and k with a weight per head (use_qk_norm), RoPE over interleaved pairs,
    logits times logit_scale, norms' epsilon layer_norm_eps."""
    return _arch(
        config,
        rope_settings(config),
        **_cohere_recipe(config),
        qk_norm="head" if getattr(config, "use_qk_norm", False) else None,
        layer_attention=_uniform_attention(config, _head_scale(config)),
    )


def gemma_arch(config: Any) -> DecoderArch:
    """Gemma (1): Llama's layer with RMSNorms of (1 + w), GeGLU (HF reads `hidden_act` here, not
    `hidden_activation`) and the embeddings times sqrt(hidden), rounded to the model's dtype."""
    _refuse_bidirectional(config)
    return _arch(
        config,
        rope_settings(config),
        norm_offset=True,
        activation=_gelu_tanh(config, "hidden_act"),
        embedding_scale=config.hidden_size**0.5,
        embedding_scale_in_dtype=True,
        layer_attention=_uniform_attention(config, _head_scale(config)),
    )


def cohere2_arch(config: Any) -> DecoderArch:
    """Command-R7B / Command-A: Cohere's layer (no q/k norms) with sliding-window layers by `layer_types` (or
    `sliding_window_pattern`: every n-th layer full); only the sliding layers rotate by RoPE, the full-attention
    layers have no positional embedding (as HF: a layer rotates when it has a window)."""
    attention = _layer_attention(config, _head_scale(config), None)
    return _arch(
        config,
        rope_settings(config),
        **_cohere_recipe(config),
        layer_attention=attention,
        layer_rope=tuple(None if layer.sliding_window is None else 0 for layer in attention),
    )


def glm_arch(config: Any) -> DecoderArch:
    """GLM-4 (glm: GLM-4-9B): Llama's layer from a fused gate_up_proj, with q/k/v biases and RoPE over the first
    `partial_rotary_factor` of each head in interleaved pairs (reordered into halves at load)."""
    return _glm(config, LLAMA_NORMS)


def glm4_arch(config: Any) -> DecoderArch:
    """GLM-4-0414 (glm4): GLM's layer with norms on the attention's and the MLP's outputs too (a sandwich)."""
    return _glm(config, GLM4_NORMS)


def _glm(config: Any, norms: tuple[tuple[str, str], ...]) -> DecoderArch:
    return _arch(
        config,
        rope_settings(config),
        norms=norms,
        activation=_silu(config),
        layer_attention=_uniform_attention(config, _head_scale(config)),
        rotary_dim=_rotary_dim(config),
        rope_interleaved=True,
    )


def starcoder2_arch(config: Any) -> DecoderArch:
    """StarCoder2: LayerNorms with biases (norm_epsilon), biases on every projection (use_bias: read from the
    checkpoint), a plain GELU(tanh) MLP c_fc -> c_proj, a sliding window on every layer when the config sets one."""
    window = getattr(config, "sliding_window", None)
    attention = tuple(
        LayerAttention(_head_scale(config), sliding_window=window) for _ in range(config.num_hidden_layers)
    )
    return _arch(
        config,
        rope_settings(config),
        activation=_gelu_tanh(config, "hidden_act"),
        layer_attention=attention,
        norm_kind="layer",
        norm_bias=True,
        norm_eps=float(config.norm_epsilon),
        plain_mlp=("c_fc", "c_proj"),
    )


def smollm3_arch(config: Any) -> DecoderArch:
    """SmolLM3: Llama's layer (biases where attention_bias / mlp_bias) whose NoPE layers (`no_rope_layers`: 0,
    by default every `no_rope_layer_interval`-th) rotate nothing, and sliding-window layers by `layer_types` where
    use_sliding_window."""
    no_rope = list(config.no_rope_layers)
    if len(no_rope) != config.num_hidden_layers:
        raise ValueError(f"{_name(config)}: no_rope_layers must name each of the {config.num_hidden_layers} layers")
    layer_types = _layer_types(config)
    # HF's masks slide wherever layer_types says so, its flash-attention path only where use_sliding_window: a
    # sliding layer without both is read neither way
    if "sliding_attention" in layer_types and not (config.use_sliding_window and config.sliding_window):
        raise ValueError(f"{_name(config)}: sliding_attention layers need use_sliding_window and a sliding_window")
    return _arch(
        config,
        rope_settings(config),
        activation=_silu(config),
        layer_attention=_layer_attention(config, _head_scale(config), None),
        layer_rope=tuple(0 if use_rope else None for use_rope in no_rope),
    )


def arcee_arch(config: Any) -> DecoderArch:
    """Arcee (AFM): Llama's layer with a plain MLP up_proj -> relu^2 -> down_proj (biases where mlp_bias)."""
    act = str(getattr(config, "hidden_act", "relu2"))
    if act != "relu2":
        raise ValueError(f"{_name(config)}: hidden_act {act!r} is not supported (supported: relu2)")
    return _arch(
        config,
        rope_settings(config),
        activation="relu2",
        layer_attention=_uniform_attention(config, _head_scale(config)),
        plain_mlp=("up_proj", "down_proj"),
    )


def ernie4_5_arch(config: Any) -> DecoderArch:
    """ERNIE 4.5 (dense): Llama's layer with RoPE over interleaved pairs (reordered into halves at load) and biases
    on every projection where use_bias (read from the checkpoint)."""
    return _arch(
        config,
        rope_settings(config),
        activation=_silu(config),
        layer_attention=_uniform_attention(config, _head_scale(config)),
        rope_interleaved=True,
    )


def exaone4_arch(config: Any) -> DecoderArch:
    """EXAONE 4.0: OLMo 2's post-norms with per-head q/k RMSNorms, sliding-window layers by `layer_types` (or
    `sliding_window_pattern`); with a window set only the sliding layers rotate by RoPE, the global ones have no
    positional embedding (as HF: without a window every layer rotates)."""
    attention = _layer_attention(config, _head_scale(config), None)
    hybrid = config.sliding_window is not None
    return _arch(
        config,
        rope_settings(config),
        norms=POST_NORMS,
        activation=_silu(config),
        qk_norm="head",
        layer_attention=attention,
        layer_rope=tuple(None if hybrid and layer.sliding_window is None else 0 for layer in attention),
    )


def seed_oss_arch(config: Any) -> DecoderArch:
    """Seed-OSS: Llama's layer with q/k/v biases (attention_bias), an output bias (attention_out_bias) and MLP
    biases (mlp_bias), each read from the checkpoint where stored; its own head_dim."""
    return _arch(
        config,
        rope_settings(config),
        activation=_silu(config),
        layer_attention=_uniform_attention(config, _head_scale(config)),
    )


APERTUS_NORMS = (("attn_pre", "attention_layernorm"), ("mlp_pre", "feedforward_layernorm"))


def apertus_arch(config: Any) -> DecoderArch:
    """Apertus: Llama's layer (its norms named attention_layernorm, feedforward_layernorm) with per-head q/k RMSNorms
    before RoPE (llama3 scaling by default), q/k/v/o biases where attention_bias, and a plain MLP
    up_proj -> xIELU -> down_proj whose activation has each layer's learned alpha_p, alpha_n, beta and eps."""
    act = str(getattr(config, "hidden_act", "xielu"))
    if act != "xielu":
        raise ValueError(f"{_name(config)}: hidden_act {act!r} is not supported (supported: xielu)")
    return _arch(
        config,
        rope_settings(config),
        norms=APERTUS_NORMS,
        activation="xielu",
        qk_norm="head",
        layer_attention=_uniform_attention(config, _head_scale(config)),
        plain_mlp=("up_proj", "down_proj"),
    )


PHI_NAMES = (
    ("self_attn.dense.", "self_attn.o_proj."),
    ("self_attn.q_layernorm.", "self_attn.q_norm."),
    ("self_attn.k_layernorm.", "self_attn.k_norm."),
    ("model.final_layernorm.", "model.norm."),
)
"""Phi-2's names that are not Llama's (its fc1, fc2: `plain_mlp`)."""


def phi_arch(config: Any) -> DecoderArch:
    """Phi-1.5 / Phi-2: one LayerNorm (with a bias) of each layer's input, read by the attention and the MLP side by
    side, q/k/v and output (dense) biases, per-head q/k LayerNorms shared by the heads (qk_layernorm), RoPE over
    the first `partial_rotary_factor` of each head, a plain GELU MLP fc1 -> fc2 with biases, a final LayerNorm and
    an LM head with a bias; norms' epsilon layer_norm_eps."""
    return _arch(
        config,
        rope_settings(config),
        norms=INPUT_NORM,
        norm_kind="layer",
        norm_bias=True,
        norm_eps=float(config.layer_norm_eps),
        parallel_branches=True,
        activation=_plain_gelu(config),
        qk_norm="head" if getattr(config, "qk_layernorm", False) else None,
        layer_attention=_uniform_attention(config, _head_scale(config)),
        rotary_dim=_rotary_dim(config),
        plain_mlp=("fc1", "fc2"),
        lm_head_bias=True,
        renames=PHI_NAMES,
    )


GPT_NEOX_NAMES = (
    ("gpt_neox.embed_in.", "model.embed_tokens."),
    ("gpt_neox.final_layer_norm.", "model.norm."),
    ("gpt_neox.layers.", "model.layers."),
    (".attention.query_key_value.", ".self_attn.qkv_proj."),
    (".attention.dense.", ".self_attn.o_proj."),
    ("embed_out.", "lm_head."),
)
"""GPT-NeoX's names that are not Llama's (its dense_h_to_4h, dense_4h_to_h: `plain_mlp`)."""


def gpt_neox_arch(config: Any) -> DecoderArch:
    """GPT-NeoX / Pythia: LayerNorms with biases before the attention and the MLP, side by side on the layer's input
    (use_parallel_residual: x + attn(ln1(x)) + mlp(ln2(x))) or in sequence, a fused query_key_value whose rows are
    per head (reordered at load), biases where attention_bias, RoPE over the first rotary_pct of each head (as
    partial_rotary_factor), a plain GELU MLP dense_h_to_4h -> dense_4h_to_h with biases, an LM head embed_out."""
    heads, kv_heads = config.num_attention_heads, getattr(config, "num_key_value_heads", None)
    if kv_heads is not None and kv_heads != heads:  # (the model's view of query_key_value has no KV groups)
        raise ValueError(f"{_name(config)}: num_key_value_heads {kv_heads} is not served (as many as the heads)")
    return _arch(
        config,
        rope_settings(config),
        norm_kind="layer",
        norm_bias=True,
        norm_eps=float(config.layer_norm_eps),
        parallel_branches=bool(getattr(config, "use_parallel_residual", True)),
        activation=_plain_gelu(config),
        layer_attention=_uniform_attention(config, _head_scale(config)),
        rotary_dim=_rotary_dim(config),
        plain_mlp=("dense_h_to_4h", "dense_4h_to_h"),
        renames=GPT_NEOX_NAMES,
        base_prefix="gpt_neox.",
        ignored=(".attention.bias", ".attention.masked_bias"),  # old transformers' causal-mask buffers
        qkv_per_head=True,
    )


GPTJ_NAMES = (
    ("transformer.wte.", "model.embed_tokens."),
    ("transformer.ln_f.", "model.norm."),
    ("transformer.h.", "model.layers."),
    (".attn.out_proj.", ".self_attn.o_proj."),
    (".attn.", ".self_attn."),
)
"""GPT-J's names that are not Llama's (its ln_1: `norms`; fc_in, fc_out: `plain_mlp`)."""


def gptj_arch(config: Any) -> DecoderArch:
    """GPT-J: one LayerNorm (with a bias) of each layer's input, read by the attention and the MLP side by side, q/k/v
    and out_proj without biases, RoPE (base 10000, fixed in HF's code) over each head's first rotary_dim dimensions in
    interleaved pairs (rotate_every_two: reordered into halves at load), a plain GELU MLP fc_in -> fc_out (n_inner,
    else 4 x hidden) with biases, an LM head with a bias; norms' epsilon layer_norm_epsilon."""
    heads, kv_heads = config.num_attention_heads, getattr(config, "num_key_value_heads", None)
    if kv_heads is not None and kv_heads != heads:  # (HF's GPT-J has no KV groups: it reads no such field)
        raise ValueError(f"{_name(config)}: num_key_value_heads {kv_heads} is not served (as many as the heads)")
    head_dim = AttentionShape.from_hf_config(config).head_dim
    rotary_dim = int(config.rotary_dim)  # (transformers' GPTJConfig requires one)
    if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
        raise ValueError(f"{_name(config)}: rotary_dim {rotary_dim} is not an even number of at most {head_dim}")
    return _arch(
        config,
        (10000.0, None),
        norms=(("attn_pre", "ln_1"),),
        norm_kind="layer",
        norm_bias=True,
        norm_eps=float(config.layer_norm_epsilon),
        parallel_branches=True,
        activation=_plain_gelu(config, "activation_function"),
        layer_attention=_uniform_attention(config, head_dim**-0.5),
        rotary_dim=None if rotary_dim == head_dim else rotary_dim,
        rope_interleaved=True,
        plain_mlp=("fc_in", "fc_out"),
        lm_head_bias=True,
        renames=GPTJ_NAMES,
        base_prefix="transformer.",
        ignored=(".attn.bias", ".attn.masked_bias"),  # old transformers' causal-mask buffers
        intermediate_size=getattr(config, "n_inner", None) or 4 * config.hidden_size,
    )


GPT_BIGCODE_NAMES = (
    ("transformer.wte.", "model.embed_tokens."),
    ("transformer.wpe.", "model.embed_positions."),
    ("transformer.ln_f.", "model.norm."),
    ("transformer.h.", "model.layers."),
    (".attn.c_attn.", ".self_attn.qkv_proj."),
    (".attn.c_proj.", ".self_attn.o_proj."),
)
"""GPT-BigCode's names that are not Llama's (its ln_1, ln_2: `norms`; mlp.c_fc, mlp.c_proj: `plain_mlp`)."""


def gpt_bigcode_arch(config: Any) -> DecoderArch:
    """GPT-BigCode (StarCoder 1, SantaCoder): learned absolute positions (wpe) added to the token embeddings, no RoPE,
    LayerNorms with biases before the attention and the MLP in sequence, a fused c_attn with biases whose rows are
    q | k | v with one KV head (multi_query) or per head [q_h; k_h; v_h] (reordered at load), scores scaled by
    head_dim^-0.5 where scale_attn_weights (else 1), a plain GELU MLP c_fc -> c_proj (n_inner, else 4 x hidden) with
    biases; norms' epsilon layer_norm_epsilon."""
    if getattr(config, "add_cross_attention", False):
        raise ValueError(f"{_name(config)}: add_cross_attention is not supported (a decoder alone)")
    heads = config.num_attention_heads
    kv_heads = 1 if config.multi_query else heads
    stated = AttentionShape.from_hf_config(config).num_kv_heads  # (what the engine sizes the KV cache by)
    if stated != kv_heads:  # (HF's attention reads multi_query only; its config derives the field unless given)
        raise ValueError(
            f"{_name(config)}: num_key_value_heads {stated} disagrees with multi_query {config.multi_query} "
            f"({kv_heads} KV heads)"
        )
    head_dim = AttentionShape.from_hf_config(config).head_dim
    scale = head_dim**-0.5 if getattr(config, "scale_attn_weights", True) else 1.0
    return _arch(
        config,
        (10000.0, None),  # (no RoPE: every layer's layer_rope is None)
        norms=(("attn_pre", "ln_1"), ("mlp_pre", "ln_2")),
        norm_kind="layer",
        norm_bias=True,
        norm_eps=float(config.layer_norm_epsilon),
        activation=_plain_gelu(config, "activation_function"),
        layer_attention=_uniform_attention(config, scale),
        layer_rope=(None,) * config.num_hidden_layers,
        plain_mlp=("c_fc", "c_proj"),
        renames=GPT_BIGCODE_NAMES,
        base_prefix="transformer.",
        ignored=(".attn.bias", ".attn.masked_bias"),  # old transformers' causal-mask buffers
        qkv_per_head=not config.multi_query,
        learned_positions=True,
        intermediate_size=getattr(config, "n_inner", None) or 4 * config.hidden_size,
    )


FALCON_NAMES = (
    ("transformer.word_embeddings.", "model.embed_tokens."),
    ("transformer.ln_f.", "model.norm."),
    ("transformer.h.", "model.layers."),
    (".self_attention.query_key_value.", ".self_attn.qkv_proj."),
    (".self_attention.dense.", ".self_attn.o_proj."),
)
"""Falcon's names that are not Llama's (its ln_attn, ln_mlp: `norms`; dense_h_to_4h, dense_4h_to_h: `plain_mlp`)."""


def falcon_arch(config: Any) -> DecoderArch:
    """Falcon: LayerNorms with biases; new_decoder_architecture (Falcon-40B/180B, Falcon2): attention and MLP side by
    side, each on its own norm (ln_attn, ln_mlp) or both on one (num_ln_in_parallel_attn 1), query_key_value's rows
    by KV group (num_kv_heads; reordered at load); else (Falcon-7B/1B) side by side on one norm where parallel_attn or
    in sequence, query_key_value q | k | v with one KV head where multi_query or per head; biases where `bias`,
    RoPE over whole heads, a plain GELU MLP dense_h_to_4h -> dense_4h_to_h of ffn_hidden_size."""
    if getattr(config, "alibi", False):  # (Falcon-RW: a per-head bias on the scores no attention backend adds)
        raise ValueError(f"{_name(config)}: alibi is not supported (RoPE only)")
    heads = config.num_attention_heads
    new, multi_query, parallel = config.new_decoder_architecture, config.multi_query, config.parallel_attn
    kv_heads = config.num_kv_heads if new or not multi_query else 1
    stated = AttentionShape.from_hf_config(config).num_kv_heads  # (what the engine sizes the KV cache by)
    if stated != kv_heads:  # (HF's attention reads num_kv_heads and multi_query; its config derives the field)
        raise ValueError(f"{_name(config)}: num_key_value_heads {stated} disagrees with its {kv_heads} KV heads")
    if not new and not multi_query and kv_heads != heads:  # (HF splits query_key_value per head there)
        raise ValueError(f"{_name(config)}: num_kv_heads {kv_heads} without new_decoder_architecture or multi_query")
    if new and not parallel:  # (HF's layer then builds norms its forward does not read)
        raise ValueError(f"{_name(config)}: new_decoder_architecture without parallel_attn is not supported")
    if new:
        two_norms = (getattr(config, "num_ln_in_parallel_attn", None) or 2) == 2
        norms = (("attn_pre", "ln_attn"), ("mlp_pre", "ln_mlp")) if two_norms else INPUT_NORM
    else:
        norms = INPUT_NORM if parallel else LLAMA_NORMS
    return _arch(
        config,
        rope_settings(config),
        norms=norms,
        norm_kind="layer",
        norm_bias=True,
        norm_eps=float(config.layer_norm_epsilon),
        parallel_branches=bool(new or parallel),
        activation=_plain_gelu(config, "activation"),
        layer_attention=_uniform_attention(config, _head_scale(config)),
        plain_mlp=("dense_h_to_4h", "dense_4h_to_h"),
        renames=FALCON_NAMES,
        base_prefix="transformer.",
        qkv_per_head=bool(new or not multi_query),
        intermediate_size=getattr(config, "ffn_hidden_size", None) or 4 * config.hidden_size,
    )


ARCH_READERS: dict[str, Callable[[Any], DecoderArch]] = {
    "Gemma2ForCausalLM": gemma2_arch,
    "Gemma3ForCausalLM": gemma3_arch,
    "Phi3ForCausalLM": phi3_arch,
    "Olmo2ForCausalLM": olmo2_arch,
    "GraniteForCausalLM": granite_arch,
    "CohereForCausalLM": cohere_arch,
    "Cohere2ForCausalLM": cohere2_arch,
    "GemmaForCausalLM": gemma_arch,
    "GlmForCausalLM": glm_arch,
    "Glm4ForCausalLM": glm4_arch,
    "Starcoder2ForCausalLM": starcoder2_arch,
    "SmolLM3ForCausalLM": smollm3_arch,
    "Olmo3ForCausalLM": olmo3_arch,
    "ArceeForCausalLM": arcee_arch,
    "Ernie4_5ForCausalLM": ernie4_5_arch,
    "Exaone4ForCausalLM": exaone4_arch,
    "PhiForCausalLM": phi_arch,
    "GPTNeoXForCausalLM": gpt_neox_arch,
    "SeedOssForCausalLM": seed_oss_arch,
    "ApertusForCausalLM": apertus_arch,
    "GPTJForCausalLM": gptj_arch,
    "GPTBigCodeForCausalLM": gpt_bigcode_arch,
    "FalconForCausalLM": falcon_arch,
}


def _arch(
    config: Any,
    rope: tuple[float, Optional[dict]],
    *,
    layer_attention: tuple[LayerAttention, ...],
    norms=LLAMA_NORMS,
    ropes: Optional[tuple] = None,
    layer_rope: Optional[tuple[Optional[int], ...]] = None,
    norm_eps: Optional[float] = None,
    intermediate_size: Optional[int] = None,
    **recipe,
) -> DecoderArch:
    """`intermediate_size`: the MLP's width where the config names it otherwise (GPT-J's n_inner)."""
    ropes = ropes or (rope,)
    rotary_dim = recipe.get("rotary_dim") or AttentionShape.from_hf_config(config).head_dim
    for _, scaling in ropes:
        check_rope_scaling(scaling)
        check_longrope_factors(scaling, rotary_dim)
    fields = shared_fields(config, rope, norm_eps, intermediate_size)
    return DecoderArch(
        **fields,
        sliding_window=None,
        architecture=_name(config),
        norms=norms,
        layer_attention=layer_attention,
        ropes=ropes,
        layer_rope=layer_rope or (0,) * config.num_hidden_layers,
        **recipe,
    )


def _cohere_recipe(config: Any) -> dict[str, Any]:
    """What Cohere and Cohere 2 share: LayerNorms, parallel branches, interleaved RoPE, logit_scale."""
    scale = getattr(config, "logit_scale", None)
    if scale is None:  # (HF's forward multiplies by it: None serves nothing)
        raise ValueError(f"{_name(config)}: logit_scale must be set")
    return dict(
        norms=INPUT_NORM,
        norm_kind="layer",
        norm_eps=float(config.layer_norm_eps),
        parallel_branches=True,
        activation=_silu(config),
        logits_scale=float(scale),
        rope_interleaved=True,
    )


def _name(config: Any) -> str:
    return (getattr(config, "architectures", None) or [config.model_type])[0]


def _head_scale(config: Any) -> float:
    return AttentionShape.from_hf_config(config).head_dim ** -0.5


def _rotary_dim(config: Any) -> Optional[int]:
    """The dimensions RoPE rotates of each head, `int(head_dim * partial_rotary_factor)` as HF computes them
    (None: the whole head); the factor from rope_parameters (transformers 5) or the config (older)."""
    params = getattr(config, "rope_parameters", None) or {}
    factor = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", None))
    if factor is None or factor == 1.0:
        return None
    head_dim = AttentionShape.from_hf_config(config).head_dim
    rotary_dim = int(head_dim * factor)
    if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
        raise ValueError(
            f"{_name(config)}: partial_rotary_factor {factor} rotates {rotary_dim} of {head_dim} dimensions "
            "per head; RoPE needs an even number of them, at least 2"
        )
    return rotary_dim


def _uniform_attention(config: Any, scale: float) -> tuple[LayerAttention, ...]:
    if getattr(config, "sliding_window", None) is not None and getattr(config, "use_sliding_window", True):
        raise ValueError(f"{_name(config)}: sliding_window is not supported for this family")
    return (LayerAttention(scale),) * config.num_hidden_layers


def _layer_types(config: Any) -> list[str]:
    layer_types = list(getattr(config, "layer_types", None) or [])
    if len(layer_types) != config.num_hidden_layers:
        raise ValueError(f"{_name(config)}: layer_types must name each of the {config.num_hidden_layers} layers")
    unknown = sorted(set(layer_types) - {"sliding_attention", "full_attention"})
    if unknown:
        raise ValueError(
            f"{_name(config)}: layer types {unknown} are not supported (supported: sliding_attention, full_attention)"
        )
    return layer_types


def _layer_attention(config: Any, scale: float, softcap: Optional[float]) -> tuple[LayerAttention, ...]:
    return tuple(
        LayerAttention(
            scale, sliding_window=config.sliding_window if kind == "sliding_attention" else None, softcap=softcap
        )
        for kind in _layer_types(config)
    )


def _refuse_bidirectional(config: Any) -> None:
    if getattr(config, "use_bidirectional_attention", False):
        raise ValueError(f"{_name(config)}: use_bidirectional_attention is not supported (causal decoding only)")


def _activation(config: Any) -> str:
    return str(getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", "silu"))


def _gelu_tanh(config: Any, field: str = "hidden_activation") -> str:
    """GELU(tanh), as the family's `field` (Gemma 2/3's hidden_activation, else hidden_act) names it."""
    act = _activation(config) if field == "hidden_activation" else str(getattr(config, field))
    if act not in GELU_TANH:
        raise ValueError(f"{_name(config)}: {field} {act!r} is not supported (supported: {', '.join(GELU_TANH)})")
    return "gelu_tanh"


PLAIN_GELUS = ("gelu", *GELU_TANH)


def _plain_gelu(config: Any, field: str = "hidden_act") -> str:
    """A plain MLP's GELU as `field` names it (GPT-J's activation_function): erf's (gelu: GPT-NeoX) or tanh's
    (gelu_new: Phi-2)."""
    act = str(getattr(config, field, None))
    if act not in PLAIN_GELUS:
        raise ValueError(f"{_name(config)}: {field} {act!r} is not supported (supported: {', '.join(PLAIN_GELUS)})")
    return "gelu" if act == "gelu" else "gelu_tanh"


def _silu(config: Any) -> str:
    act = _activation(config)
    if act not in ("silu", "swish"):
        raise ValueError(f"{_name(config)}: hidden_act {act!r} is not supported (supported: silu)")
    return "silu"


# ---------------------------------------------------------------- mixtures of experts on the generic decoder
# (models/decoder_moe.py; their routing and experts are read by models/moe_arch.py)


def olmoe_arch(config: Any) -> DecoderArch:
    """OLMoE: Llama's pre-norms with q and k normalised over the whole projection before RoPE (as OLMo 2's)."""
    if getattr(config, "clip_qkv", None) is not None:
        raise ValueError(f"{_name(config)}: clip_qkv {config.clip_qkv} is not supported")
    return _arch(
        config,
        rope_settings(config),
        activation=_silu(config),
        qk_norm="projection",
        layer_attention=_uniform_attention(config, _head_scale(config)),
    )


PHIMOE_ROPE_TYPES = ("default", "longrope")


def phimoe_arch(config: Any) -> DecoderArch:
    """Phi-3.5-MoE: LayerNorms (with biases) before each branch and at the end, q/k/v/o biases where
    attention_bias, a biased LM head where lm_head_bias, a sliding window on every layer when set, and LongRoPE
    whose cos and sin are scaled by the config's short_mscale or long_mscale (HF reads those, not the factor
    Phi-3's LongRoPE derives), the one matching the factor set served."""
    theta, scaling = rope_settings(config)
    if scaling is not None:
        if scaling["rope_type"] not in PHIMOE_ROPE_TYPES:
            raise ValueError(
                f"{_name(config)}: RoPE scaling {scaling['rope_type']!r} is not supported "
                f"(supported: {', '.join(PHIMOE_ROPE_TYPES)})"
            )
        scaling.setdefault(
            "original_max_position_embeddings", getattr(config, "original_max_position_embeddings", None)
        )
        mscales = [scaling.pop(key, None) for key in ("short_mscale", "long_mscale")]
        if any(not isinstance(mscale, (int, float)) for mscale in mscales):
            raise ValueError(f"{_name(config)}: LongRoPE needs short_mscale and long_mscale, got {mscales}")
        scaling["attention_factors"] = tuple(float(mscale) for mscale in mscales)  # engine/layers/rotary.py
    window = getattr(config, "sliding_window", None)
    attention = tuple(
        LayerAttention(_head_scale(config), sliding_window=window) for _ in range(config.num_hidden_layers)
    )
    return _arch(
        config,
        (theta, scaling),
        activation=_silu(config),
        layer_attention=attention,
        norm_kind="layer",  # (their epsilon: rms_norm_eps, as HF's nn.LayerNorm reads it)
        norm_bias=True,
        lm_head_bias=bool(getattr(config, "lm_head_bias", False)),
    )


LLAMA4_NAMES = ((".feed_forward.", ".mlp."),)
"""Llama 4's names that are not Llama's: its layers' feed_forward (dense MLP, or experts, router, shared_expert)."""
LLAMA4_ROPE_TYPES = ("default", "llama3")
LLAMA4_LAYER_TYPES = ("full_attention", "chunked_attention")


def llama4_arch(config: Any) -> DecoderArch:
    """Llama 4 (text): Llama's layer (its MLP feed_forward: the experts where moe_layers says, else a dense SwiGLU of
    intermediate_size_mlp) whose NoPE layers (`no_rope_layers` 0, by default every 4th) rotate nothing and scale
    their queries by attention temperature tuning (attn_temperature_tuning: floor_scale, attn_scale), the others
    rotate by RoPE (llama3 scaling where configured) over interleaved pairs (reordered into halves at load), then
    normalise each head's q and k without weight (use_qk_norm); chunked local attention (attention_chunk_size) on
    the layers `layer_types` names (LayerAttention.chunk)."""
    layers = config.num_hidden_layers
    no_rope = list(config.no_rope_layers)
    if len(no_rope) < layers:  # (HF reads it by layer index: longer lists are served as HF reads them)
        raise ValueError(f"{_name(config)}: no_rope_layers must name each of the {layers} layers")
    layer_types = list(getattr(config, "layer_types", None) or [])
    unknown = sorted(set(layer_types) - set(LLAMA4_LAYER_TYPES))
    if len(layer_types) != layers or unknown:
        raise ValueError(
            f"{_name(config)}: layer_types must name each of the {layers} layers, of the types "
            f"{', '.join(LLAMA4_LAYER_TYPES)}"
        )
    chunk = getattr(config, "attention_chunk_size", None)
    if "chunked_attention" in layer_types and not chunk:
        raise ValueError(f"{_name(config)}: chunked_attention layers need an attention_chunk_size")
    theta, scaling = rope_settings(config)
    if scaling is not None and scaling["rope_type"] not in LLAMA4_ROPE_TYPES:
        raise ValueError(
            f"{_name(config)}: RoPE scaling {scaling['rope_type']!r} is not supported "
            f"(supported: {', '.join(LLAMA4_ROPE_TYPES)})"
        )
    tuning: Optional[tuple[float, float]] = None
    if getattr(config, "attn_temperature_tuning", False):
        tuning = (float(config.floor_scale), float(config.attn_scale))
    chunk = chunk if "chunked_attention" in layer_types else None
    arch = _arch(
        config,
        (theta, scaling),
        activation=_silu(config),
        qk_norm="l2" if getattr(config, "use_qk_norm", False) else None,
        layer_attention=tuple(
            LayerAttention(_head_scale(config), chunk=chunk if kind == "chunked_attention" else None)
            for kind in layer_types
        ),
        layer_rope=tuple(0 if use_rope else None for use_rope in no_rope[:layers]),
        rope_interleaved=True,
        renames=LLAMA4_NAMES,
        temperature_tuning=tuning,
        intermediate_size=config.intermediate_size_mlp,
    )
    if chunk is None or arch.max_position_embeddings <= chunk:
        return arch
    # The RoPE tables hold a row per position up to max(max_position_embeddings, max_model_len); the frequencies
    # served (default, llama3) do not read max_position_embeddings, so the tables follow max_model_len alone. (Its
    # default is the declared context, as vLLM's: Scout's 10M positions make tables of gigabytes, and a KV cache no
    # machine holds; deployments give --max-model-len, as vLLM's do.)
    return dataclasses.replace(arch, max_position_embeddings=chunk)


LFM2_NAMES = (
    ("model.embedding_norm.", "model.norm."),
    (".operator_norm.", ".input_layernorm."),
    (".ffn_norm.", ".post_attention_layernorm."),
    (".self_attn.out_proj.", ".self_attn.o_proj."),
    (".self_attn.q_layernorm.", ".self_attn.q_norm."),
    (".self_attn.k_layernorm.", ".self_attn.k_norm."),
    (".feed_forward.w1.", ".mlp.gate_proj."),
    (".feed_forward.w3.", ".mlp.up_proj."),
    (".feed_forward.w2.", ".mlp.down_proj."),
)


def lfm2_arch(config: Any) -> DecoderArch:
    """LFM2: Llama's layer (its short-convolution layers: models/lfm2.py) under its own names (operator_norm,
    ffn_norm, out_proj, feed_forward.w1/w3/w2, embedding_norm), each head's q and k RMSNormed (q_layernorm,
    k_layernorm), the SwiGLU's width as transformers computes it from intermediate_size."""
    lfm2_conv_layers(config)
    return _arch(
        config,
        rope_settings(config),
        qk_norm="head",
        layer_attention=_uniform_attention(config, _head_scale(config)),
        norm_eps=float(config.norm_eps),
        intermediate_size=_lfm2_mlp_width(config),
        renames=LFM2_NAMES,
    )


def lfm2_conv_layers(config: Any) -> tuple[int, ...]:
    """LFM2's layers whose mixer is a short convolution; ValueError for a layer type other than conv or attention."""
    types = list(config.layer_types)
    unknown = sorted(set(types) - {"conv", "full_attention"})
    if unknown:
        raise ValueError(f"{_name(config)}: layer types {unknown} are not supported (conv, full_attention)")
    return tuple(i for i, kind in enumerate(types) if kind == "conv")


def _lfm2_mlp_width(config: Any) -> int:
    """The SwiGLU's width as transformers' Lfm2MLP computes it (block_auto_adjust_ff_dim)."""
    width = int(config.intermediate_size)
    if config.block_auto_adjust_ff_dim:
        width = int(2 * width / 3)
        if config.block_ffn_dim_multiplier is not None:
            width = int(config.block_ffn_dim_multiplier * width)
            multiple = int(config.block_multiple_of)
            width = multiple * ((width + multiple - 1) // multiple)
    return width


def qwen3_5_arch(config: Any) -> DecoderArch:
    """Qwen3.5's text model: Llama's layer (its linear-attention layers: models/qwen3_5.py) with zero-centred RMSNorms
    (1 + w; not the linear attention's gated norm), per-head q/k norms, each head's output gated by the sigmoid of
    its gate rows of q_proj, partial RoPE (partial_rotary_factor; mrope's sections rotate a text prompt's one
    position alike)."""
    qwen3_5_linear_layers(config)
    return _arch(
        config,
        rope_settings(config),
        norm_offset=True,
        unfolded=("linear_attn.norm.weight",),
        activation=_silu(config),
        qk_norm="head",
        attention_gate=True,
        layer_attention=_uniform_attention(config, _head_scale(config)),
        rotary_dim=_rotary_dim(config),
        # (Qwen3.5-MoE's config names no dense width: every layer's MLP is its experts)
        intermediate_size=getattr(config, "intermediate_size", None) or config.moe_intermediate_size,
    )


def qwen3_5_linear_layers(config: Any) -> tuple[int, ...]:
    """Qwen3.5's layers whose mixer is linear attention (Gated DeltaNet); ValueError for another layer type."""
    types = list(config.layer_types)
    unknown = sorted(set(types) - {"linear_attention", "full_attention"})
    if unknown:
        raise ValueError(f"{_name(config)}: layer types {unknown} are not supported (linear_attention, full_attention)")
    return tuple(i for i, kind in enumerate(types) if kind == "linear_attention")


BAMBA_NAMES = (
    (".feed_forward.", ".mlp."),
    (".pre_ff_layernorm.", ".post_attention_layernorm."),
    ("model.final_layernorm.", "model.norm."),
)


def bamba_arch(config: Any) -> DecoderArch:
    """Bamba: Llama's layer (its Mamba-2 layers: models/hybrid.py) under its names (feed_forward, pre_ff_layernorm,
    final_layernorm), RoPE over the first half of each head (partial_rotary_factor 0.5), q/k/v/o and MLP biases
    where the config sets them."""
    return _arch(
        config,
        rope_settings(config),
        activation=_silu(config),
        layer_attention=_uniform_attention(config, _head_scale(config)),
        rotary_dim=_rotary_dim(config),
        renames=BAMBA_NAMES,
    )


MOE_ARCH_READERS: dict[str, Callable[[Any], DecoderArch]] = {
    "OlmoeForCausalLM": olmoe_arch,
    "GraniteMoeForCausalLM": granite_arch,  # Granite's multipliers, read alike
    "GraniteMoeSharedForCausalLM": granite_arch,
    "PhimoeForCausalLM": phimoe_arch,
    "Llama4ForCausalLM": llama4_arch,
}
"""The generic decoder's reading of each mixture of experts served on it (their experts: MoeArch)."""
