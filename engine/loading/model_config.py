"""Model configuration: which checkpoint, in which dtype, on which device (pydantic, unknown keys refused)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, TYPE_CHECKING, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, field_validator

from engine.pooling.pooler_config import PoolerConfig

if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig

    from engine.loading.rope_context import ScaledContext


def cpu_has_fast_bf16() -> bool:
    """True when this CPU has native bf16 matrix instructions (AVX512-BF16 or AMX)."""
    import torch

    checks = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(getattr(torch.cpu, name, lambda: False)() for name in checks)


def model_max_length(hf_config: "PretrainedConfig") -> Optional[int]:
    """The context length a HF config declares, or None when it declares none."""
    declared = _declared_context_length(hf_config)
    return None if declared is None else declared[1]


def _declared_context_length(hf_config: "PretrainedConfig") -> Optional[tuple[str, int]]:
    """(where it comes from, the context length) a HF config declares, or None: its RoPE scaling's extended
    context where a linear or YaRN scaling reaches past the key it states (engine/loading/rope_context.py)."""
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(hf_config, key, None)
        if isinstance(value, int) and value > 0:
            scaled = _rope_scaled_context(hf_config, key, value)
            return (scaled.source, scaled.length) if scaled is not None and scaled.length > value else (key, value)
    return None


def _rope_scaled_context(hf_config: "PretrainedConfig", key: str, value: int) -> Optional["ScaledContext"]:
    from engine.loading.rope_context import scaled_context
    from engine.loading.rope_settings import rope_settings

    if key != "max_position_embeddings":
        return None
    return scaled_context(str(getattr(hf_config, "model_type", "")), value, rope_settings(hf_config)[1])


class ContextLengthError(ValueError):
    """max_model_len over the model's context length: a setting the user chose that this model cannot
    honour (the server exits 2 for it, naming the flag), not a model that fails to load."""

    def __init__(self, requested: int, limit: int, key: str):
        # key: a config key, or how a RoPE scaling extends one ("original_max_position_embeddings 32 x the ...")
        detail = f"{key}={limit}" if key.isidentifier() else f"{limit}: {key}"
        super().__init__(f"max_model_len={requested} is larger than the model's context length ({detail})")
        self.requested, self.limit, self.key = requested, limit, key


DEFAULT_MAX_IMAGES = 999  # vLLM's default --limit-mm-per-prompt, per modality

DTYPE_ALIASES = {"half": "float16", "float": "float32"}
"""vLLM's other names of --dtype's values (`--dtype half`, `LLM(dtype="float")`), read as the names they stand for."""


class ModelConfig(BaseModel):
    """Which model to serve and how to place it.

    `model` None is the embedded SmolLM2-135M-Instruct GGUF; otherwise a checkpoint
    directory, a `.gguf` file or a hub id (see `engine.loading.loader.prepare_checkpoint`).
    """

    model_config = ConfigDict(extra="forbid")

    model: Optional[str] = Field(None, description="checkpoint dir, .gguf file or hub id; None = embedded")
    tokenizer: Optional[str] = Field(None, description="tokenizer source; None = the model's")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    max_model_len: Optional[int] = Field(None, ge=1, description="None = the model's own context length")
    seed: int = 0
    revision: Optional[str] = Field(None, description="hub revision (branch, tag or commit) of a hub id")
    tokenizer_revision: Optional[str] = Field(
        None, description="hub revision of a hub --tokenizer (vLLM's --tokenizer-revision); None: its main branch"
    )
    download_dir: Optional[str] = Field(
        None, description="where hub downloads go and are looked up; None = the Hugging Face cache"
    )
    trust_remote_code: bool = Field(
        False,
        description="let the checkpoint's own Python code build its config and tokenizer (transformers' "
        "trust_remote_code); the model itself always runs pagedserve's implementation",
    )
    quantization: Literal["auto", "none", "gguf", "int8", "int4", "awq", "gptq", "gptq_marlin"] = Field(
        "auto",
        description="weight storage: gguf keeps a .gguf file's Q4_0/Q4_1/Q8_0 blocks quantized (native CPU "
        "kernels, engine/quantization/model_weights.py); int8 (per output channel) or int4 (group-wise) quantize "
        "a float checkpoint's projections at load time, awq loads an AWQ checkpoint, gptq (or vLLM's gptq_marlin) "
        "a GPTQ one (engine/quantization/weight_quantizer.py); none loads float weights; auto = awq or gptq for "
        "such a checkpoint, else none",
    )
    chat_template: Optional[str] = Field(
        None, description="a Jinja chat template, or a file holding one, instead of the tokenizer's"
    )
    generation_config: str = Field(
        "auto",
        min_length=1,
        description="where requests' sampling defaults come from (vLLM's --generation-config): auto = the "
        "model's generation_config.json (its repetition_penalty, temperature, top_k, top_p, min_p), vllm = none "
        "(the neutral defaults), else a directory holding a generation_config.json "
        "(engine/loading/generation_defaults.py)",
    )
    override_generation_config: Optional[dict[str, Any]] = Field(
        None,
        description="sampling defaults set over generation_config's (vLLM's --override-generation-config), e.g. "
        '{"temperature": 0.5}: repetition_penalty, temperature, top_k, top_p, min_p',
    )
    hf_overrides: Optional[dict[str, Any]] = Field(
        None,
        description="keys set on the model's HF config after it is read (vLLM's --hf-overrides), e.g. a "
        "YaRN rope_scaling to serve past the trained context "
        "(engine/loading/loader.py's apply_hf_overrides)",
    )
    runner: Literal["auto", "generate", "pooling"] = Field(
        "auto",
        description="vLLM's --runner: generate (completions, chat, responses) or pooling (embeddings); auto: "
        "pooling for a checkpoint whose architecture names a base model without an LM head (LlamaModel, "
        "Qwen2Model, ...), else generate (engine/pooling/pooler_config.py)",
    )
    convert: Literal["auto", "none", "embed", "classify"] = Field(
        "auto",
        description="vLLM's --convert: embed serves a generative checkpoint for embeddings, classify a sequence "
        "classifier's for classification (pooling runner)",
    )
    pooler_config: Optional[PoolerConfig] = Field(
        None,
        description="vLLM's --pooler-config: the pooling model's pooling_type (LAST, MEAN, CLS), normalize and "
        "default dimensions, over its Sentence Transformers files' and vLLM's default (LAST, normalized)",
    )
    limit_mm_per_prompt: dict[str, int] = Field(
        default_factory=dict,
        description='vLLM\'s --limit-mm-per-prompt, e.g. {"image": 4}: the most images one prompt of a '
        "vision-language model may hold (default 999); 0 serves it as a text model (no vision encoder loaded)",
    )
    allowed_local_media_path: Optional[str] = Field(
        None,
        description="vLLM's --allowed-local-media-path: a folder whose files requests may name as images "
        "(file:// URLs); None: no local file is read",
    )
    quantization_group_size: Optional[Literal[32, 64, 128]] = Field(
        None,
        description="input columns per int4 scale and zero; None = 32 with --quantization int4 (llama.cpp's "
        "Q4 block: measured on the embedded model, groups of 64 and 128 lose 39% and 66% of perplexity), the "
        "checkpoint's own with awq. A value is refused where no groups apply (none, gguf, int8, a float checkpoint "
        "under auto) and with awq when it is not the checkpoint's (engine/builder.py)",
    )

    @field_validator("dtype", mode="before")
    @classmethod
    def _vllm_dtype_names(cls, value: Any) -> Any:
        """vLLM's `half` and `float`, and a torch dtype (`LLM(dtype=torch.float16)`), as vLLM takes them."""
        if isinstance(value, str):
            return DTYPE_ALIASES.get(value, value)
        torch = sys.modules.get("torch")  # a torch dtype can only come from a process that imported torch
        if torch is not None and isinstance(value, torch.dtype):
            return str(value).removeprefix("torch.")  # float32, bfloat16, float16; any other stays refused
        return value

    @field_validator("limit_mm_per_prompt")
    @classmethod
    def _check_media_limits(cls, value: dict[str, int]) -> dict[str, int]:
        """Images only (the models served take no audio or video), a count of at least 0."""
        for modality, count in value.items():
            if modality != "image":
                raise ValueError(f"{modality!r}: the models served here take images only")
            if count < 0:
                raise ValueError(f"the image limit must be at least 0, got {count}")
        return value

    @property
    def media_path(self) -> Optional[Path]:
        """The folder whose files requests may name as images (--allowed-local-media-path); None: none."""
        return None if self.allowed_local_media_path is None else Path(self.allowed_local_media_path)

    @property
    def max_images(self) -> int:
        """The most images one prompt may hold (vLLM's default: 999)."""
        return self.limit_mm_per_prompt.get("image", DEFAULT_MAX_IMAGES)

    @field_validator("quantization", mode="before")
    @classmethod
    def _none_is_auto(cls, value: Any) -> Any:
        """vLLM's `quantization=None` (what the checkpoint says) is auto; its `gptq_marlin` (GPTQ through its Marlin
        kernels) reads the same checkpoints as gptq."""
        return "auto" if value is None else "gptq" if value == "gptq_marlin" else value

    @field_validator("chat_template")
    @classmethod
    def _check_chat_template(cls, value: Optional[str]) -> Optional[str]:
        """Inline Jinja that parses, or the path of a file that exists (read when the tokenizer loads)."""
        from engine.loading.chat_template import check_chat_template, is_template_file

        if value is None or is_template_file(value):
            return value
        if not any(m in value for m in ("{{", "{%", "{#")):
            raise ValueError(f"neither a file nor a Jinja template: no file {value!r}, and no {{{{ or {{%")
        check_chat_template(value, "the inline chat template")
        return value

    @property
    def tokenizer_source(self) -> Optional[str]:
        """Where the tokenizer comes from: `tokenizer` when set, else the model."""
        return self.tokenizer if self.tokenizer is not None else self.model

    def resolve_device(self) -> "torch.device":
        """`cuda` when asked for or (auto) when available, else `cpu`."""
        import torch

        if self.device == "cpu":
            return torch.device("cpu")
        if torch.cuda.is_available():
            return torch.device("cuda")
        if self.device == "cuda":
            raise ValueError("device='cuda' was asked for, but torch sees no CUDA device")
        return torch.device("cpu")

    def resolve_dtype(self, device: Optional["torch.device"] = None) -> "torch.dtype":
        """The weight/activation dtype; `auto` is bf16 on CUDA and on CPUs with native bf16, else fp32."""
        import torch

        if self.dtype != "auto":
            return getattr(torch, self.dtype)  # the literal names are torch dtype names
        device = device if device is not None else self.resolve_device()
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.bfloat16 if cpu_has_fast_bf16() else torch.float32

    def resolve_max_model_len(self, hf_config: "PretrainedConfig") -> int:
        """`max_model_len`, checked against the model's context length (which it defaults to); ContextLengthError
        when it is larger."""
        declared = _declared_context_length(hf_config)
        if self.max_model_len is None:
            if declared is None:
                raise ValueError("the model config declares no context length; set max_model_len")
            return declared[1]
        if declared is not None and self.max_model_len > declared[1]:
            raise ContextLengthError(self.max_model_len, declared[1], declared[0])
        return self.max_model_len
