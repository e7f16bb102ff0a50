"""Reading a llama.cpp LoRA adapter (a `.gguf` file, as llama.cpp's convert_lora_to_gguf.py writes it) into the
same per-layer matrices a PEFT directory gives (peft_adapter.LoRAWeights).

The file, as llama.cpp's loader (src/llama-adapter.cpp) checks it:

    general.type = "adapter", adapter.type = "lora", adapter.lora.alpha (float32; 0: no scaling)
    general.architecture                   the base's llama.cpp architecture (llama for Llama/Mistral/SmolLM)
    blk.{i}.{attn_q,...}.weight.lora_a     numpy [rank, in]   (GGUF ne [in, rank])
    blk.{i}.{attn_q,...}.weight.lora_b     numpy [out, rank]  (GGUF ne [rank, out])

Scale: alpha / rank (llama.cpp's; rank = lora_b's columns), folded into B as the PEFT reader folds its own.
The converter writes `lora_alpha` as is, so an rsLoRA adapter is served as llama.cpp serves it (alpha / rank).

Row order: the converter runs the base model's tensor changes on (A, B) pairs, so for `llama` models the rows
of attn_q / attn_k are permuted for llama.cpp's RoPE exactly as the base weights are; a row permutation of
the product B A moves B's rows only (A is untouched), and they are permuted back with the base loader's
order (engine/loading/gguf_weights.py):

    stored lora_b rows [heads, half, 2] -> [heads, 2, half]     (heads = kv heads for attn_k)

Refused by name: LoRA on token_embd / output (the engine serves whole replacement matrices there, PEFT's
modules_to_save, not low-rank ones), norm tensors (mergekit-extract-lora's), other adapter kinds (aLoRA's
invocation tokens, control vectors), and a file converted for another architecture than the base's.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from engine.errors import LoRAAdapterError, LoRARankError
from engine.lora.adapter_layout import PROJECTIONS
from engine.lora.peft_adapter import LoRAWeights

if TYPE_CHECKING:
    from engine.lora.lora_stack import ModelShape

SUFFIXES = (".lora_a", ".lora_b")

GGUF_ARCHITECTURES = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
"""The HF model types of the Llama family and the llama.cpp architecture their GGUF files name."""

_BASE_TENSOR = re.compile(r"model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.weight")


class GgufTarget(NamedTuple):
    """What reading a GGUF adapter needs of the base: its HF model type and (whole-model) head counts."""

    model_type: str
    num_heads: int
    num_kv_heads: int

    @classmethod
    def of(cls, arch: "ModelShape") -> "GgufTarget":
        """The target of a model shape (a LlamaArch: the whole model's, not a tensor-parallel rank's share)."""
        return cls(arch.model_type, arch.num_heads, arch.num_kv_heads)


def is_gguf_adapter(path: str) -> bool:
    """Whether `path` names a GGUF adapter file (a PEFT adapter is a directory)."""
    return path.endswith(".gguf") and Path(path).is_file()


def check_gguf_adapter(name: str, path: str, max_rank: int, num_layers: int, target: GgufTarget) -> int:
    """Validate the file's header and tensor names and shapes (no tensor data read); its rank."""
    reader = _open(name, path, target)
    pairs = _pairs(name, reader, num_layers)
    rank = 0
    for module, (a, b) in pairs.items():
        rank = max(rank, _pair_rank(name, module, _shape(a), _shape(b), max_rank))
    return rank


def load_gguf_adapter(name: str, path: str, max_rank: int, num_layers: int, target: GgufTarget) -> LoRAWeights:
    """Read and validate `path`'s adapter (float32 on CPU, scale folded into B, llama.cpp's q/k rows undone)."""
    from engine.loading.gguf_weights import permuted_heads, read_float, unpermute_rows

    reader = _open(name, path, target)
    alpha = float(_field(reader, "adapter.lora.alpha", 0.0))
    architecture = str(_field(reader, "general.architecture", "llama"))
    adapter = LoRAWeights(name, path, rank=0, content_hash=hashlib.sha256(Path(path).read_bytes()).digest())
    for module, (a_tensor, b_tensor) in _pairs(name, reader, num_layers).items():
        rank = _pair_rank(name, module, _shape(a_tensor), _shape(b_tensor), max_rank)
        a, b = read_float(a_tensor), read_float(b_tensor)  # [rank, in], [out, rank]
        base = a_tensor.name[: -len(".lora_a")]
        heads = permuted_heads(base, architecture, target.num_heads, target.num_kv_heads)
        if heads:
            if b.shape[0] % (2 * heads):
                raise LoRAAdapterError(name, f"{base}: lora_b's {b.shape[0]} rows do not split into {heads} heads")
            b = b[unpermute_rows(b.shape[0], heads)]
        scale = alpha / rank if alpha else 1.0  # llama.cpp's: no alpha, no scaling
        adapter.a[module] = a.contiguous()
        adapter.b[module] = (b * scale).contiguous()
        adapter.rank = max(adapter.rank, rank)
    return adapter


def _open(name: str, path: str, target: GgufTarget) -> Any:
    """The file's reader, its header checked: a LoRA adapter for the base's architecture."""
    from engine.loading.gguf_reader import read_gguf

    try:
        reader = read_gguf(path)
    except (OSError, ValueError) as exc:
        raise LoRAAdapterError(name, f"{path!r} is not a readable GGUF file: {exc}") from None
    kind = _field(reader, "general.type", None)
    if kind != "adapter":
        raise LoRAAdapterError(name, f"{path!r} is a GGUF of general.type {kind!r}, not an adapter")
    adapter_type = _field(reader, "adapter.type", None)
    if adapter_type != "lora":
        raise LoRAAdapterError(name, f"adapter.type {adapter_type!r} is not served (LoRA only)")
    if _field(reader, "adapter.alora.invocation_tokens", None) is not None:
        raise LoRAAdapterError(name, "activated LoRA (adapter.alora.invocation_tokens) is not served")
    architecture = _field(reader, "general.architecture", None)
    expected = GGUF_ARCHITECTURES.get(target.model_type)
    if expected is None:  # (other families' GGUF tensors are named and laid out otherwise: not read here)
        raise LoRAAdapterError(
            name,
            f"llama.cpp adapters are read for {sorted(GGUF_ARCHITECTURES)} bases; the base is {target.model_type!r}",
        )
    if architecture != expected:
        raise LoRAAdapterError(
            name, f"the adapter was converted for a {architecture!r} model; the base is {target.model_type!r}"
        )
    return reader


def _field(reader: Any, key: str, default: Any) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _pairs(name: str, reader: Any, num_layers: int) -> dict[tuple[int, str], tuple[Any, Any]]:
    """(layer, HF projection) -> the (lora_a, lora_b) reader tensors, every name checked."""
    from engine.loading.gguf_weights import hf_name

    found: dict[tuple[int, str], dict[str, Any]] = {}
    for tensor in reader.tensors:
        suffix = next((s for s in SUFFIXES if tensor.name.endswith(s)), None)
        if suffix is None:
            raise LoRAAdapterError(name, f"tensor {tensor.name!r} is not a LoRA matrix (.lora_a / .lora_b)")
        base = tensor.name[: -len(suffix)]
        try:
            match = _BASE_TENSOR.fullmatch(hf_name(base))
        except KeyError:
            match = None
        if match is None or match.group(2) not in PROJECTIONS:
            raise LoRAAdapterError(
                name, f"LoRA on {base!r} is not served (only the layers' attn_q/k/v/output, ffn_gate/up/down)"
            )
        layer = int(match.group(1))
        if layer >= num_layers:
            raise LoRAAdapterError(name, f"tensor {tensor.name!r} names layer {layer}; the model has {num_layers}")
        found.setdefault((layer, match.group(2)), {})[suffix] = tensor
    pairs = {}
    for module, parts in found.items():
        if len(parts) != 2:
            raise LoRAAdapterError(name, f"lora_a and lora_b do not pair up at {module}")
        pairs[module] = (parts[".lora_a"], parts[".lora_b"])
    if not pairs:
        raise LoRAAdapterError(name, "the adapter file holds no LoRA matrices")
    return pairs


def _shape(tensor: Any) -> tuple[int, ...]:
    return tuple(int(n) for n in reversed(tensor.shape))  # GGUF lists dims innermost first


def _pair_rank(name: str, module: tuple[int, str], a: tuple[int, ...], b: tuple[int, ...], max_rank: int) -> int:
    """The rank of a (lora_a [rank, in], lora_b [out, rank]) pair, checked as llama.cpp checks it."""
    if len(a) != 2 or len(b) != 2 or a[0] != b[1]:
        raise LoRAAdapterError(name, f"lora_a {a} and lora_b {b} of {module} do not pair ([rank, in], [out, rank])")
    if a[0] > max_rank:
        raise LoRARankError(name, a[0], max_rank)
    return a[0]
