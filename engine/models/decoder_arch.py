"""The shape and the recipe of a generic pre/post-norm decoder (Gemma 1/2/3, Phi-3, OLMo 2, Granite, Cohere, GLM-4,
StarCoder2, Arcee, Phi-2, GPT-NeoX, Seed-OSS, Apertus, GPT-J, GPT-BigCode, Falcon; with mixtures of experts: OLMoE,
Granite MoE, Phi-3.5-MoE, Llama 4), as data.

A Llama layer is `x + attn(norm(x))`, then `x + mlp(norm(x))`. The families here differ from it only in
what `DecoderArch` says: which norms a layer has (`norms`: before and/or after each branch) and of which kind
(RMSNorm or LayerNorm), whether the two branches run in sequence or side by side on one norm of the input
(`x + attn(norm(x)) + mlp(norm(x))`, or each branch on its own norm: GPT-NeoX), the MLP's activation and whether
it is gated, q/k norms per head or over the whole projection, scalars on the embeddings, the residual branches and
the logits, a bias on the logits, a final soft-cap, per layer its attention (window, soft-cap, scale) and its RoPE
(or none), how much of each head RoPE rotates and whether the checkpoint rotates its pairs interleaved, and the
checkpoint's names where they are not Llama's (renamed at load: engine/models/checkpoint_names.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from engine.attention.layer_attention import LayerAttention
from engine.models.llama_arch import LlamaArch

NORM_ROLES = ("attn_pre", "attn_post", "mlp_pre", "mlp_post")
"""Where a layer may have an RMSNorm: on the attention branch's input or output, on the MLP's input or output."""
LLAMA_NORMS = (("attn_pre", "input_layernorm"), ("mlp_pre", "post_attention_layernorm"))
SANDWICH_NORMS = (
    ("attn_pre", "input_layernorm"),
    ("attn_post", "post_attention_layernorm"),
    ("mlp_pre", "pre_feedforward_layernorm"),
    ("mlp_post", "post_feedforward_layernorm"),
)
INPUT_NORM = (("attn_pre", "input_layernorm"),)  # one norm, read by both branches (parallel_branches: Cohere, Phi-2)
POST_NORMS = (("attn_post", "post_attention_layernorm"), ("mlp_post", "post_feedforward_layernorm"))
GLM4_NORMS = (  # GLM-4-0414's sandwich, by its own names
    ("attn_pre", "input_layernorm"),
    ("attn_post", "post_self_attn_layernorm"),
    ("mlp_pre", "post_attention_layernorm"),
    ("mlp_post", "post_mlp_layernorm"),
)
ACTIVATIONS = ("silu", "gelu_tanh", "gelu", "relu2", "xielu")
"""silu (SwiGLU), gelu_tanh (GeGLU, or StarCoder2's plain GELU); gelu (erf: GPT-NeoX's), relu2, relu(x)^2
(Arcee's), and xielu (Apertus's xIELU, its alpha_p, alpha_n, beta and eps each layer's, from the checkpoint), of a
plain MLP only."""
QK_NORMS = (None, "head", "projection", "l2")
NORM_KINDS = ("rms", "layer")
"""RMSNorm (x / rms(x) * w), or LayerNorm ((x - mean) / std * w, + b with `norm_bias`: StarCoder2's; Cohere's has
no b)."""


@dataclass(frozen=True, slots=True)
class DecoderArch(LlamaArch):
    """LlamaArch's shape (its `sliding_window` left None: windows are per layer, in `layer_attention`) and:"""

    architecture: str = ""  # the HF architecture served, for messages
    norms: tuple[tuple[str, str], ...] = LLAMA_NORMS  # (role in NORM_ROLES, the checkpoint's name of that norm)
    norm_offset: bool = False  # Gemma's RMSNorm multiplies by (1 + w): folded into w at load
    norm_kind: str = "rms"  # of every norm (the layers', the q/k norms, the final one), in NORM_KINDS; its
    # epsilon is `rms_norm_eps` whatever the kind (Cohere's layer_norm_eps)
    norm_bias: bool = False  # the LayerNorms (the layers' and the final one) have a shift: each norm's `.bias`
    # Cohere: x + attn(n(x)) + mlp(n(x)), the MLP reading the attention's input; with an mlp_pre norm the MLP reads
    # its own norm of x (GPT-NeoX's use_parallel_residual: x + attn(n1(x)) + mlp(n2(x)))
    parallel_branches: bool = False
    activation: str = "silu"  # of the MLP, in ACTIVATIONS
    # "head": each head's q and k (Gemma 3); "projection": all of q, all of k (OLMo 2); "l2": each head's q and k
    # through a norm without weight after RoPE, on the layers that rotate only (Llama 4's use_qk_norm)
    qk_norm: Optional[str] = None
    embedding_scale: Optional[float] = None  # Gemma: sqrt(hidden) (rounded to the model's dtype); Granite
    embedding_scale_in_dtype: bool = False  # Gemma rounds its scale to the model's dtype first
    residual_scale: float = 1.0  # Granite: residual + branch * residual_multiplier
    logits_divisor: float = 1.0  # Granite: logits / logits_scaling
    logits_scale: float = 1.0  # Cohere: logits * logit_scale
    lm_head_bias: bool = False  # the LM head adds its `lm_head.bias` to the logits (Phi-3.5-MoE's lm_head_bias)
    final_softcap: Optional[float] = None  # Gemma 2: logits -> cap * tanh(logits / cap)
    layer_attention: tuple[LayerAttention, ...] = ()  # one per layer
    ropes: tuple[tuple[float, Optional[dict]], ...] = ()  # (theta, scaling) of each distinct RoPE
    # per layer, its index in `ropes` (Gemma 3: local and global layers); None: no positional embedding at all
    # (Cohere 2's full-attention layers)
    layer_rope: tuple[Optional[int], ...] = ()
    rotary_dim: Optional[int] = None  # RoPE rotates each head's first rotary_dim dimensions (None: all; Phi-4-mini)
    # the checkpoint's RoPE turns pairs (x0, x1), (x2, x3), ... of each head (Cohere, GLM), where the rotary turns
    # (x_i, x_{i + d/2}): q and k rows are reordered into halves at load (DecoderForCausalLM._rope_halves), the same
    # permutation for both, so every score is the same (the fused decode step reads the reordered rows too)
    rope_interleaved: bool = False
    # A non-gated MLP, x -> down(act(up(x))), by the checkpoint's names of its two products (StarCoder2: c_fc,
    # c_proj; Arcee: up_proj, down_proj); None: the gated one (gate_proj and up_proj, or gate_up_proj; down_proj)
    plain_mlp: Optional[tuple[str, str]] = None
    # (checkpoint's, Llama's) parts of tensor names, replaced in each name in turn at load (Phi-2's self_attn.dense
    # -> self_attn.o_proj; GPT-NeoX's gpt_neox.layers. -> model.layers., ...): the loader reads Llama's names
    renames: tuple[tuple[str, str], ...] = ()
    # the causal LM's path to its base model (GPT-NeoX's gpt_neox., GPT-J's transformer.): a checkpoint saved as the
    # base model (AutoModel: an embedding model) names its tensors without it, and gets it back before `renames`
    base_prefix: str = ""
    ignored: tuple[str, ...] = ()  # name endings of stored tensors nothing reads (GPT-NeoX's old mask buffers)
    # the fused qkv_proj's rows are per KV head, each group's query heads then its k and v ([q_h; k_h; v_h] with as
    # many KV heads as queries: GPT-NeoX's query_key_value; Falcon's new_decoder_architecture groups): reordered at
    # load into q | k | v, the layout the attention splits (with several ranks, each reorders its own groups)
    qkv_per_head: bool = False
    # learned absolute positions added to the token embeddings (GPT-BigCode's wpe): the checkpoint's
    # embed_positions.weight [max_position_embeddings, hidden], read at each token's position
    learned_positions: bool = False
    # Llama 4's attention temperature tuning (floor_scale, attn_scale): on the layers without RoPE each query is
    # multiplied by log1p(floor((position + 1) / floor_scale)) * attn_scale + 1 before its scores
    temperature_tuning: Optional[tuple[float, float]] = None
    # each head's attention output times the sigmoid of a gate projected from the layer's input (Qwen3.5's: q_proj's
    # rows per head are [q_h; gate_h], split at load into q_proj and gate_proj, fused after v as q | k | v | gate)
    attention_gate: bool = False
    # ends of norm weights that `norm_offset` leaves as they are (Qwen3.5's linear attention's gated norm is w, not
    # 1 + w)
    unfolded: tuple[str, ...] = ()

    def __post_init__(self):
        roles = [role for role, _ in self.norms]
        if not set(roles) <= set(NORM_ROLES) or self.activation not in ACTIVATIONS or self.norm_kind not in NORM_KINDS:
            raise ValueError(f"norm roles {roles} / activation {self.activation!r} / norm {self.norm_kind!r} unknown")
        if self.activation in ("relu2", "xielu") and self.plain_mlp is None:
            raise ValueError(f"{self.activation} is a plain MLP's activation (Arcee's, Apertus's): no gated kernel")
        if self.norm_bias and self.norm_kind != "layer":
            raise ValueError("a norm's shift (norm_bias) is a LayerNorm's")
        if self.qk_norm not in QK_NORMS:
            raise ValueError(f"q/k norm {self.qk_norm!r} unknown")
        if self.qk_norm in ("projection", "l2") and self.norm_kind != "rms":
            raise ValueError("q/k norms over the whole projection or without weight are RMSNorms (OLMo 2's, Llama 4's)")
        if self.activation == "gelu" and self.plain_mlp is None:
            raise ValueError("gelu (erf) is served for a plain MLP only (a gated one: silu or gelu_tanh)")
        if self.qkv_per_head and self.num_heads % self.num_kv_heads:
            raise ValueError("a fused qkv by KV groups needs the query heads in whole groups")
        if len(self.layer_attention) != self.num_layers or len(self.layer_rope) != self.num_layers:
            raise ValueError(f"{self.num_layers} layers need as many attention and RoPE entries")

    @property
    def fused_attention(self) -> bool:
        """Whether the fused decode step computes this attention: no weightless q/k norm after RoPE, no
        temperature tuning (Llama 4's), no output gate (Qwen3.5's)."""
        return self.qk_norm != "l2" and self.temperature_tuning is None and not self.attention_gate

    @property
    def positional_layers(self) -> bool:
        """Whether every layer rotates its queries and keys (some families leave layers without RoPE)."""
        return all(rope is not None for rope in self.layer_rope)
