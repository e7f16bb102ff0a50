"""One Llama-family decoder for llama, mistral, smollm, qwen2 (q/k/v bias) and qwen3 (q/k norm).

The model works on a flat batch of tokens (no padding) and keeps its weights as
plain tensors, fused where HF has separate projections (q|k|v, gate|up), so a
layer costs few operator calls.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterable, Optional, Sequence, Union

import torch
import torch.nn.functional as F

from engine.attention import AttentionBackend, AttentionMetadata
from engine.attention.layer_attention import LayerAttention
from engine.distributed.parallel_group import ParallelGroup
from engine.distributed.pipeline_stage import PipelineStage
from engine.profiling.memory_bandwidth import tensor_bytes
from engine.layers.fused_decode import FusedDecode, has_gguf_blocks
from engine.layers.layer_ops import NativeLayerOps, TorchLayerOps
from engine.kernels.column_block_weight import PackedWeight
from engine.layers.invariant_linear import ColumnBlockLinear
from engine.layers.linear import GEMV_MAX_ROWS, GemvLinear, Linear, PackedOneDnnLinear, select_linear
from engine.layers.vocab_parallel import VocabParallel
from engine.models.llama_arch import LlamaArch
from engine.layers.mrope import MultimodalRotary, SectionedRows
from engine.layers.rotary import RotaryEmbedding
from engine.quantization.int4_groups import Int4Groups
from engine.loading.model_weights import fuse_rows
from engine.quantization.quantized_weight import QuantizedWeight
from engine.quantization.weight_quantizer import WeightQuantizer

if TYPE_CHECKING:
    from engine.layers.recurrent_state import RecurrentStates, RecurrentStep
    from engine.lora.lora_stack import LoRAStack
    from engine.lora.lora_step import LoRAStep


@dataclass(slots=True)
class LlamaLayerWeights:
    # The projections (qkv, o_proj, gate_up, down) are held in the form the model's Linear prepared (a tensor,
    # a packed or quantized matrix): typed Any, as Linear.prepare's result is.
    input_norm: torch.Tensor  # [hidden]
    qkv: Any  # [(heads + 2 * kv_heads) * head_dim, hidden]
    qkv_bias: Optional[torch.Tensor]
    q_norm: Optional[torch.Tensor]  # [head_dim] (qwen3)
    k_norm: Optional[torch.Tensor]
    o_proj: Any  # [hidden, heads * head_dim]
    o_bias: Optional[torch.Tensor]
    post_norm: torch.Tensor  # [hidden]
    gate_up: Any  # [2 * intermediate, hidden]; None: the layer is a mixture of experts
    gate_up_bias: Optional[torch.Tensor]
    down: Any  # [hidden, intermediate]
    down_bias: Optional[torch.Tensor]

    @property
    def attn_post_norm(self) -> None:
        """No norm after a branch in Llama's layer (the generic decoder's layers may have them)."""
        return None

    @property
    def mlp_post_norm(self) -> None:
        return None


def layer_tensors(state: dict[str, Any], index: int) -> tuple[Callable[[str], Any], Callable[[str], Optional[Any]]]:
    """(take, maybe): layer `index`'s checkpoint tensor by its name within the layer, popped from `state` (take: a
    ValueError naming it where the checkpoint lacks it; maybe: None)."""
    prefix = f"layers.{index}."

    def take(name: str) -> Any:
        try:
            return state.pop(prefix + name)
        except KeyError:
            raise ValueError(f"checkpoint lacks {prefix + name}") from None

    def maybe(name: str) -> Optional[Any]:
        return state.pop(prefix + name, None)

    return take, maybe


class LlamaForCausalLM:
    """Forward pass over paged KV caches; `compute_logits` only for the rows that need them."""

    def __init__(
        self,
        arch: LlamaArch,
        dtype: torch.dtype,
        device: torch.device,
        ops: Optional[TorchLayerOps] = None,
        linear: Optional[Linear] = None,
        quantizer: Optional[WeightQuantizer] = None,
        max_model_len: Optional[int] = None,
        tp: ParallelGroup = ParallelGroup.single(),
    ):
        """`arch`: this rank's shape (engine/models/tensor_parallel.py) when `tp` has several ranks."""
        self.arch = arch
        self.tp = tp  # the attention output and the MLP output are partial sums across its ranks
        # Several ranks: each holds a slice of the vocabulary's rows (embedding and LM head); None: the whole.
        self.vocab_parallel = VocabParallel(arch.vocab_size, tp) if tp.is_parallel else None
        self.dtype = dtype
        self.device = device
        self.max_model_len = max_model_len  # the longest sequence served (None: the config's context); LongRoPE's
        # factor set is chosen from it (engine/layers/rotary.py)
        self.rotary = self._rotary(arch.rope_theta, arch.rope_scaling)
        # Qwen2-VL's multimodal RoPE: image rows of a step rotate by section (None: 1-D RoPE only)
        self.mrope = None if arch.mrope_section is None else MultimodalRotary(arch.mrope_section, self.rotary)
        self.scale = arch.head_dim**-0.5
        # Each layer's attention: Mistral's sliding window (Qwen's, when on, from max_window_layers), no soft-cap.
        self.layer_attention: tuple[LayerAttention, ...] = tuple(
            LayerAttention(self.scale, sliding_window=window).within(max_model_len) for window in arch.layer_windows
        )
        self.linear = linear or select_linear(device, dtype)  # BatchInvariantLinear in batch-invariant mode
        self.ops = ops or TorchLayerOps()  # NativeLayerOps with the cpu attention backend
        self.quantizer = quantizer  # --quantization: projections become QuantizedWeights at load
        # Small decode steps in one native call (cpu backend): bf16 weights plain or packed, float32 weights packed
        # in column blocks (AVX2 and AVX-512 builds), or GGUF blocks in either dtype (float32 elsewhere keeps
        # oneDNN's packed weights, which the native step cannot read, or torch's product where oneDNN is missing,
        # whose sums the native one would not repeat: load_weights drops it there unless the layers hold GGUF
        # blocks). The native step runs every layer in one call: no all-reduce
        # between them, so one rank only.
        self.fused: Optional[FusedDecode] = None
        if isinstance(self.ops, NativeLayerOps) and not tp.is_parallel:
            if isinstance(self.linear, (GemvLinear, ColumnBlockLinear)):
                self.fused = FusedDecode(self.linear.kernels, self.linear.max_rows)
            elif isinstance(self.linear, PackedOneDnnLinear) or type(self.linear) is Linear:
                self.fused = FusedDecode(self.ops.kernels, GEMV_MAX_ROWS)
        # Set by load_weights (an empty model until then). embed and lm_head: a tensor, or the quantized or packed
        # matrix the products take; with several ranks, this rank's rows (vocab_parallel.rows of them).
        self.embed: Any = None  # [vocab, hidden]
        self.final_norm: Any = None  # [hidden]
        self.lm_head: Any = None  # [vocab, hidden]
        # False for a model served for pooling (embeddings): its LM head is never loaded, nor needed at all
        self.keeps_lm_head = True
        self.classifier: Optional[torch.Tensor] = None  # [num_labels, hidden]: a sequence classifier's `score`
        self.layers: list[LlamaLayerWeights] = []
        self.stage = PipelineStage.whole(arch.num_layers)  # the layers this process holds (`hold_stage`)
        self.quantization = "none"  # the storage of its matrices (engine/quantization/model_weights.py)
        # LoRA (engine/lora/): the adapters' stacked slot weights (set at build with enable_lora), and the
        # current step's deltas, which the runner sets around a forward pass and its logits (None: base only).
        self.lora: Optional["LoRAStack"] = None
        self.lora_step: Optional["LoRAStep"] = None
        # A hybrid model's step of recurrent states (models/hybrid.py), set by the runner as `lora_step` is.
        self.recurrent_step: Optional["RecurrentStep"] = None
        # EAGLE-3's features (engine/spec_decode/eagle_model.py): the residual stream entering each of these layers
        # (in the head's order) is kept in `tapped_features` by every forward pass, by layer, which the runner
        # takes after it (the fused decode step, which runs every layer in one call, is then not used)
        self.feature_layers: tuple[int, ...] = ()
        self.tapped_features: dict[int, torch.Tensor] = {}

    def _rotary(self, theta: float, scaling: Optional[dict], rotary_dim: Optional[int] = None) -> RotaryEmbedding:
        arch = self.arch
        return RotaryEmbedding(
            arch.head_dim,
            arch.max_position_embeddings,
            theta,
            scaling,
            self.dtype,
            self.device,
            rotary_dim,
            self.max_model_len,
        )

    def hold_stage(self, stage: PipelineStage) -> None:
        """Hold only `stage`'s layers (pipeline parallelism; before load_weights): stage 0 also the embedding,
        the final norm and the LM head (it samples); the others none of them."""
        self.stage = stage
        self.layer_attention = self.layer_attention[stage.layers.start : stage.layers.stop]
        if stage.is_split:
            self.fused = None  # (the native step runs the embedding and every layer in one call)

    def _held(self, name: str) -> bool:
        """Whether this stage holds the checkpoint tensor `name` (HF's name, "model." removed)."""
        stage = self.stage
        if not stage.is_split:
            return True
        if name.startswith("layers."):
            return int(name.split(".", 2)[1]) in stage.layers
        return stage.is_first

    @property
    def attention_layers(self) -> tuple[LayerAttention, ...]:
        """Each layer's attention, as the backend computes it (checked against the backend at start-up)."""
        return self.layer_attention

    # What the fused decode step reads of a model's recipe (engine/layers/fused_decode.py); the generic decoder
    # sets its own.
    residual_scale = 1.0
    """Each branch's output times this before it joins the residual stream (Granite's residual_multiplier)."""
    qk_norm_projection = False
    """Whether the q and k norms normalize all of q and all of k (OLMo 2), not each head (Qwen3)."""
    activation = "silu"
    """The gated MLP's: silu (SwiGLU) or gelu_tanh (GeGLU, Gemma)."""
    fused_recipe = True
    """Whether the fused decode step computes this model's layer recipe (not the generic decoder's LayerNorms,
    branches side by side, or layers without RoPE: Cohere's)."""

    float32_names: tuple[str, ...] = ()
    """Ends of the checkpoint names loaded in float32 whatever the model's dtype (HF's _keep_in_fp32_modules_strict:
    GLM-4.5's router and its correction bias)."""

    @property
    def qk_norms_as_loaded(self) -> bool:
        """Whether the forward pass applies each layer's q/k norms wherever the layer has them (as the fused
        decode step does)."""
        return True

    def recurrent_states(self, rows: int, snapshots: int = 0) -> Optional["RecurrentStates"]:
        """Zeroed recurrent states for `rows` requests and `snapshots` snapshots of them, which the runner holds
        beside the KV cache (a hybrid model's recurrent layers: models/hybrid.py); None: every layer attends over
        the KV cache."""
        return None

    def recurrent_state_bytes(self, rows: int) -> int:
        """What `recurrent_states(rows)` takes."""
        return 0

    def rotary_of(self, layer: int) -> Optional[RotaryEmbedding]:
        """The RoPE of layer `layer` (of this stage's); None: the layer has no positional embedding."""
        return self.rotary

    # ------------------------------------------------------------------ weights

    def load_weights(self, weights: Iterable[tuple[str, Union[torch.Tensor, QuantizedWeight, Int4Groups]]]) -> None:
        """Take HF state-dict names and tensors (this stage's: `hold_stage`); fuse q|k|v and gate|up."""
        state: dict[str, Any] = {}
        for name, tensor in weights:
            if name.startswith("model."):
                name = name[len("model.") :]
            if "rotary_emb" in name or not self._held(name):
                continue
            # quantized matrices keep their own storage: GGUF blocks (on CPU), AWQ groups until `_prepare`
            dtype = torch.float32 if name.endswith(self.float32_names) else self.dtype
            state[name] = tensor if not isinstance(tensor, torch.Tensor) else tensor.to(dtype=dtype, device=self.device)
        self.layers = [self._take_layer(state, i) for i in self.stage.layers]
        if (
            self.fused is not None
            and not isinstance(self.linear, (GemvLinear, ColumnBlockLinear))
            and not has_gguf_blocks(self)
        ):
            self.fused = None  # float32's products (oneDNN's or torch's) on plain weights: the unfused path
        if self.stage.is_first:
            self._take_ends(state)
        if state:
            unused = ", ".join(sorted(state)[:8])
            raise ValueError(f"{len(state)} checkpoint tensors were not used by the model: {unused}")

    def _take_ends(self, state: dict[str, Any]) -> None:
        """The embedding, the final norm and the LM head (tied to the embedding or its own)."""
        arch = self.arch
        take = state.pop
        self.embed = take("embed_tokens.weight")
        self.final_norm = take("norm.weight")
        lm_head = state.pop("lm_head.weight", None)
        if not self.keeps_lm_head:  # a pooling model's output is its final hidden states, or their classes
            self.classifier = state.pop("score.weight", None)
            return
        if lm_head is None and not arch.tie_word_embeddings:
            raise ValueError(
                "checkpoint has no lm_head.weight and the config does not tie embeddings (a base model saved "
                "without its head, as embedding models are: serve it with --runner pooling)"
            )
        lm_head = self.embed if arch.tie_word_embeddings or lm_head is None else lm_head
        self.lm_head = self.linear.prepare(lm_head if self.quantizer is None else self.quantizer.lm_head(lm_head))
        if lm_head is self.embed and (
            isinstance(self.embed, QuantizedWeight) or isinstance(self.lm_head, PackedWeight)
        ):
            # tied and stored quantized (GGUF), or packed in column blocks: one matrix, in the form its product
            # takes (it also looks rows up); a float embedding stays float where the LM head is quantized from it
            self.embed = self.lm_head

    def _take_layer(self, state: dict, index: int) -> LlamaLayerWeights:
        take, maybe = layer_tensors(state, index)

        cat = self._cat_rows
        attn = "self_attn."
        prepare = self._prepare
        return LlamaLayerWeights(
            input_norm=take("input_layernorm.weight"),
            qkv=prepare(cat(take(attn + "q_proj.weight"), take(attn + "k_proj.weight"), take(attn + "v_proj.weight"))),
            qkv_bias=cat(maybe(attn + "q_proj.bias"), maybe(attn + "k_proj.bias"), maybe(attn + "v_proj.bias")),
            q_norm=maybe(attn + "q_norm.weight"),
            k_norm=maybe(attn + "k_norm.weight"),
            o_proj=prepare(take(attn + "o_proj.weight")),
            o_bias=maybe(attn + "o_proj.bias"),
            post_norm=take("post_attention_layernorm.weight"),
            **self._take_mlp(index, take, maybe, cat),
        )

    def _cat_rows(self, *tensors: Any) -> Any:
        """Matrices stacked by rows, fused in their own storage (tensors, GGUF blocks or AWQ groups); None where
        the first is None (an absent bias)."""
        if tensors[0] is None:
            return None
        if isinstance(tensors[0], Int4Groups):
            return Int4Groups.concat(list(tensors))
        if any(isinstance(t, QuantizedWeight) for t in tensors):
            return fuse_rows(tensors, self.dtype)
        return torch.cat(tensors, dim=0).contiguous()

    def _take_mlp(self, index: int, take, maybe, cat) -> dict:
        """The dense MLP's fields of layer `index` (a mixture of experts takes its own: models/moe.py)."""
        return dict(
            gate_up=self._prepare(cat(take("mlp.gate_proj.weight"), take("mlp.up_proj.weight"))),
            gate_up_bias=cat(maybe("mlp.gate_proj.bias"), maybe("mlp.up_proj.bias")),
            down=self._prepare(take("mlp.down_proj.weight")),
            down_bias=maybe("mlp.down_proj.bias"),
        )

    def _prepare(self, weight):
        """A projection in the form the product takes: quantized (--quantization), packed once (oneDNN)."""
        if isinstance(weight, Int4Groups) and self.quantizer is None:
            raise ValueError("the checkpoint holds int4 (AWQ) matrices but the model was built without a quantizer")
        return self.linear.prepare(weight if self.quantizer is None else self.quantizer(weight))

    def weight_tensors(self) -> list[torch.Tensor]:
        """Every matrix the forward pass reads once per step (for the bandwidth floor), as `self.linear` takes them."""
        mats = [
            w for layer in self.layers for w in (layer.qkv, layer.o_proj, layer.gate_up, layer.down) if w is not None
        ]  # a mixture-of-experts layer has no dense MLP
        return mats + ([self.lm_head] if self.lm_head is not None else [])

    def weight_bytes(self) -> int:
        """The memory its weights take (tied matrices once; quantized ones by their blocks and scales)."""
        fields = [getattr(layer, name) for layer in self.layers for name in LlamaLayerWeights.__slots__]
        ends = [t for t in (self.embed, self.final_norm, self.lm_head) if t is not None]
        return tensor_bytes([*ends, *fields])

    # ------------------------------------------------------------------ forward

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]],
        metadata: Sequence[AttentionMetadata],  # each layer's (its KV group's)
        backend: AttentionBackend,
        hidden_states: Optional[torch.Tensor] = None,  # [num_tokens, hidden]: the stage before's output
        sectioned: Optional[SectionedRows] = None,
    ) -> torch.Tensor:  # [num_tokens, hidden], before the final norm
        """The layer loop (pre-norms, residual adds fused with the next norm), each layer attending with its own
        LayerAttention over its own KV group's metadata. A pipeline stage after the first starts from the
        hidden states the stage before returned (its residual stream, before the next layer's norm); a
        vision-language model's step with image rows from `input_embeddings` with the images' rows replaced, and
        with M-RoPE (`sectioned`: those rows' three-component positions) rotates them by section."""
        if hidden_states is None and sectioned is None and self._fuses(input_ids, metadata, kv_caches, backend):
            assert self.fused is not None
            return self.fused.forward(self, input_ids, positions, kv_caches, metadata)
        eps = self.arch.rms_norm_eps
        ops = self.ops
        rotary = self.rotary
        if sectioned is not None:
            if self.mrope is None:
                raise ValueError("a step with multimodal RoPE positions reached a model without mrope_section")
            rotary, positions = self.mrope.step_tables(rotary, positions, sectioned)
        angles = ops.rotary_angles(positions, rotary)
        h = self.input_embeddings(input_ids) if hidden_states is None else hidden_states  # [num_tokens, hidden]
        residual = h  # the residual stream; ops.add_rms_norm may update it in place
        x = ops.rms_norm(h, self.layers[0].input_norm, eps)
        attention, tp = self.layer_attention, self.tp
        taps, tapped = self.feature_layers, self.tapped_features
        for index, (layer, (key_cache, value_cache), step) in enumerate(zip(self.layers, kv_caches, metadata)):
            if index:
                x, residual = ops.add_rms_norm(h, residual, layer.input_norm, eps)
            if index in taps:
                tapped[index] = residual.clone()  # the stream entering this layer (later adds may write in place)
            h = tp.all_reduce(
                self._attention(
                    layer, x, angles, key_cache, value_cache, step, backend, attention[index], index, rotary
                )
            )
            x, residual = ops.add_rms_norm(h, residual, layer.post_norm, eps)
            h = tp.all_reduce(self._mlp(index, layer, x))
        return residual + h

    def _fuses(self, input_ids, metadata, kv_caches, backend) -> bool:
        """Whether the fused decode step runs this step (engine/layers/fused_decode.py)."""
        lora = self.lora_step
        return (
            self.fused is not None
            and not self.feature_layers
            and (lora is None or lora.fusable)
            and self.fused.takes(self, input_ids.shape[0], metadata, kv_caches, backend)
        )

    def _mlp(self, index: int, layer: LlamaLayerWeights, x: torch.Tensor) -> torch.Tensor:
        linear = self.linear
        lora = self.lora_step
        if lora is None:
            return linear(
                self.ops.silu_and_mul(linear(x, layer.gate_up, layer.gate_up_bias)), layer.down, layer.down_bias
            )
        gate_up = linear(x, layer.gate_up, layer.gate_up_bias)  # [T, 2 * intermediate]
        lora.add(index, "gate_up", x, gate_up)
        act = self.ops.silu_and_mul(gate_up)  # [T, intermediate]
        out = linear(act, layer.down, layer.down_bias)
        lora.add(index, "down", act, out)
        return out

    def input_embeddings(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[T, hidden]: what the first layer takes for these tokens (their embeddings, with a LoRA adapter's
        embedding deltas)."""
        return self._adapter_rows(input_ids, self.embed_tokens(input_ids))

    def _adapter_rows(self, input_ids: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """h [T, hidden] with the rows of tokens whose LoRA adapter replaces the embedding looked up in its own."""
        lora = self.lora_step
        return h if lora is None or not lora.embeds else lora.embed(input_ids, h)

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [T] -> [T, hidden] in the model's dtype (quantized embeddings dequantized by row)."""
        if self.vocab_parallel is not None:
            return self.vocab_parallel.embed(input_ids, self._embed_rows)
        return self._embed_rows(input_ids)

    def _embed_rows(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Rows of `self.embed` (this rank's rows, with several)."""
        if isinstance(self.embed, QuantizedWeight):
            return self.embed.rows(input_ids, self.dtype)
        if isinstance(self.embed, PackedWeight):
            return self.embed.rows(input_ids)
        return F.embedding(input_ids, self.embed)

    def _attention(
        self,
        layer: LlamaLayerWeights,
        x,
        angles,
        key_cache,
        value_cache,
        metadata: AttentionMetadata,
        backend: AttentionBackend,
        attention: LayerAttention,
        index: int = 0,
        rotary: Optional[RotaryEmbedding] = None,
    ) -> torch.Tensor:
        """Layer `index`'s attention block (the index selects its LoRA deltas; `rotary`: the tables `angles` were
        taken from, when not the model's: a step's own under M-RoPE)."""
        arch = self.arch
        ops = self.ops
        lora = self.lora_step
        num_tokens = x.shape[0]
        heads, kv_heads, head_dim = arch.num_heads, arch.num_kv_heads, arch.head_dim
        qkv = self.linear(x, layer.qkv, layer.qkv_bias)  # [T, (heads + 2 kv_heads) * head_dim]
        if lora is not None:
            lora.add(index, "qkv", x, qkv)
        qkv = qkv.view(num_tokens, heads + 2 * kv_heads, head_dim)
        if layer.q_norm is None or layer.k_norm is None:  # (a family has both or neither)
            qk = qkv[:, : heads + kv_heads]  # [T, heads + kv_heads, head_dim]
        else:
            eps = arch.rms_norm_eps
            q = ops.rms_norm(qkv[:, :heads].reshape(-1, head_dim), layer.q_norm, eps)
            k = ops.rms_norm(qkv[:, heads : heads + kv_heads].reshape(-1, head_dim), layer.k_norm, eps)
            qk = torch.cat([q.view(num_tokens, heads, head_dim), k.view(num_tokens, kv_heads, head_dim)], dim=1)
        qk = ops.rotary(qk, angles, self.rotary if rotary is None else rotary)
        query, key = qk[:, :heads], qk[:, heads:]
        value = qkv[:, heads + kv_heads :]
        backend.write_kv(key, value, key_cache, value_cache, metadata)
        out = backend.attend(query, key, value, key_cache, value_cache, metadata, attention)
        out = out.reshape(num_tokens, heads * head_dim)
        projected = self.linear(out, layer.o_proj, layer.o_bias)  # [T, hidden]
        if lora is not None:
            lora.add(index, "o_proj", out, projected)
        return projected

    def final_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [n, hidden] (the forward's rows) -> [n, hidden] through the final norm: what the LM head
        reads, and what a HF base model returns as its last hidden state (a pooling model's output)."""
        return self.ops.rms_norm(hidden, self.final_norm, self.arch.rms_norm_eps)

    @torch.inference_mode()
    def compute_logits(
        self, hidden: torch.Tensor, lm_heads: Sequence[tuple[torch.Tensor, torch.Tensor]] = ()
    ) -> torch.Tensor:
        """hidden [n, hidden] (rows to sample) -> logits [n, vocab] in float32. With several ranks every rank
        must call it for the same rows in the same order (its slices are gathered): all ranks get the whole.
        `lm_heads`: (rows, [vocab, hidden]) whose rows take their logits from that LM head instead (a LoRA
        adapter's modules_to_save). A quantized LM head's kernel may write float32 outright (GGUF's integer
        product, eagerly, on one rank: logits not rounded to the model's dtype first); other products, and the
        vocabulary slices gathered across ranks, are rounded to it, then widened."""
        return self.head_logits(self.final_hidden(hidden), lm_heads)

    def head_logits(self, x: torch.Tensor, lm_heads: Sequence[tuple[torch.Tensor, torch.Tensor]] = ()) -> torch.Tensor:
        """x [n, hidden] (after the final norm; an EAGLE head's output as it is) -> logits [n, vocab] in float32
        through the LM head (as `compute_logits`)."""
        if self.vocab_parallel is None and isinstance(self.lm_head, QuantizedWeight):
            logits = self.lm_head.matmul_float32(x)  # [n, vocab], by a kernel that writes float32 where it can
        else:
            logits = self.linear(x, self.lm_head, None)  # [n, vocab] or [n, this rank's rows]
            if self.vocab_parallel is not None:
                logits = self.vocab_parallel.gather_logits(logits)  # gathered before widening: half the bytes
            logits = logits.float()
        for rows, lm_head in lm_heads:
            logits[rows] = F.linear(x[rows], lm_head).float()
        return logits
