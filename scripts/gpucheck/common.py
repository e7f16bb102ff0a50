"""What the parts share: their context (deadline, result, saving), model shapes, random checkpoints, helpers."""

from __future__ import annotations

import gc
import importlib.metadata
import logging
import os
import platform
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

import torch

from gpucheck.results import write_json

DISTRIBUTIONS = (
    "torch",
    "triton",
    "transformers",
    "tokenizers",
    "pydantic",
    "flash-attn",
    "flash-attn-4",
    "nvidia-cutlass-dsl",
    "quack-kernels",
    "apache-tvm-ffi",
    "cuda-bindings",
    "nvidia-ml-py",
    "pytest",
    "pytest-timeout",
)
HBM_BYTES_PER_S = 4.8e12  # the H200's memory bandwidth by its datasheet: the floors' denominator
BF16_TARGET_MAX_ABS_ERR = 2e-2

logger = logging.getLogger("gpu_check")


@dataclass
class PartContext:
    """One part's run: where it writes, on what device, until when (a wall-clock deadline, seconds since
    the epoch, shared with the parent process), and the result it fills."""

    name: str
    out_dir: Path
    work_dir: Path
    device: torch.device
    quick: bool
    deadline: float
    options: dict = field(default_factory=dict)
    result: dict = field(default_factory=dict)

    @property
    def path(self) -> Path:
        return self.out_dir / f"{self.name}.json"

    @property
    def on_cuda(self) -> bool:
        return self.device.type == "cuda"

    def remaining(self) -> float:
        return self.deadline - time.time()

    def has_time(self, seconds: float) -> bool:
        return self.remaining() >= seconds

    def save(self) -> None:
        """Write the result so far (atomically: a killed part leaves the last complete version)."""
        write_json(self.path, self.result)


def error_record(exc: BaseException) -> dict:
    """What a failed item records: the exception's type and message (the traceback goes to the log)."""
    logger.error("failed: %s", exc, exc_info=exc)
    return {"status": "error", "error": f"{type(exc).__name__}: {exc}"[:2000]}


# ---------------------------------------------------------------------- model shapes

QWEN3_0_6B = {  # Qwen/Qwen3-0.6B's config.json, the architecture fields
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "vocab_size": 151936,
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "hidden_act": "silu",
    "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": True,
    "attention_bias": False,
    "use_sliding_window": False,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
}
LLAMA_3_1_8B = {  # meta-llama/Llama-3.1-8B's config.json, the architecture fields
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 128256,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "hidden_act": "silu",
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "tie_word_embeddings": False,
    "attention_bias": False,
    "mlp_bias": False,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
}
_QUICK = {  # --quick: the same architectures, tiny
    "vocab_size": 1024,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
SHAPES = {"qwen3-0.6b": QWEN3_0_6B, "llama-3.1-8b": LLAMA_3_1_8B}


def shape_config(name: str, quick: bool) -> dict:
    config = dict(SHAPES[name])
    if quick:
        config.update(_QUICK)
    return config


def ensure_checkpoint(work_dir: Path, name: str, quick: bool, device: torch.device) -> Path:
    """A random-weight bf16 checkpoint of shape `name` (built once per check, shared by the parts)."""
    path = work_dir / (name + ("-quick" if quick else ""))
    if (path / "READY").is_file():
        return path
    started = time.monotonic()
    config = shape_config(name, quick)
    write_random_checkpoint(config, path, device)
    write_wordlevel_tokenizer(path, config["vocab_size"], config["eos_token_id"])
    (path / "READY").write_text("")
    size = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    logger.info("wrote a random %s checkpoint (%.2f GB) in %.1f s", name, size / 1e9, time.monotonic() - started)
    return path


def write_random_checkpoint(config_dict: dict, path: Path, device: torch.device) -> None:
    """HF model from the config with transformers' own random init (on `device`: seconds even for 8B),
    saved as bf16 safetensors."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(**config_dict)
    torch.manual_seed(0)
    try:
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    except Exception as exc:  # noqa: BLE001 - slower on the CPU, but it must not stop the part
        logger.warning("random init on %s failed (%s: %s); initialising on the CPU", device, type(exc).__name__, exc)
        free_memory()
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    del model
    free_memory()


def write_wordlevel_tokenizer(path: Path, vocab_size: int, eos_id: int) -> None:
    """A word-level tokenizer with one token per id ("t0", "t1", ...): every id the model can sample
    detokenizes, with no hub access. Generation config: eos only (the checks ignore it)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import GenerationConfig, PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(vocab_size)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    hf = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=f"t{eos_id}", unk_token="t0")
    hf.save_pretrained(path)
    GenerationConfig(eos_token_id=eos_id).save_pretrained(path)


# ---------------------------------------------------------------------- engines and devices


def build_llm(model_dir: Path, **kwargs):
    from engine.llm import LLM

    return LLM(str(model_dir), **kwargs)


def with_torch_fallback(run: Callable[[dict], dict], settings: dict, ctx: "PartContext", min_left_s: float) -> dict:
    """`run(settings)`; if it fails with another attention backend and time is left, again on `torch`
    (a figure from the reference backend beats none), recording why."""
    try:
        return run(settings)
    except Exception as exc:  # noqa: BLE001 - recorded
        failed = error_record(exc)
    if settings.get("attention_backend") == "torch" or not ctx.has_time(min_left_s):
        return failed
    logger.info("retrying with the torch attention backend")
    record = run({**settings, "attention_backend": "torch"})
    record["fallback_from"] = {"attention_backend": settings.get("attention_backend"), **failed}
    return record


def shutdown(llm) -> None:
    """`llm.shutdown()` (it releases the KV cache, graphs and weights) where the engine has one; the
    caller then drops its reference and calls free_memory() for engines without it."""
    method = getattr(llm, "shutdown", None)
    if callable(method):
        method()


def free_memory() -> None:
    """Release what dropped engines held. gc.unfreeze() for engine builders that gc.freeze() what they
    loaded (frozen objects are never collected); without a freeze it does nothing."""
    gc.unfreeze()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def backend_available(
    name: str, device: torch.device, dtype: torch.dtype = torch.bfloat16, block_size: Optional[int] = None
) -> tuple[bool, str]:
    """Whether `get_attention_backend` gives backend `name` here for blocks of `block_size` (and why not;
    without a block size flash-attn 2 is ruled out)."""
    from engine.attention import get_attention_backend

    try:
        backend = get_attention_backend(name, device, dtype, block_size=block_size)
    except Exception as exc:  # noqa: BLE001 - any failure means unavailable, with its reason
        return False, f"{type(exc).__name__}: {exc}"
    return True, getattr(backend, "name", name)


FLASH_GENERATIONS = {4: (16, 256), 2: (256,)}
"""Each flash-attn generation with the block sizes it is measured at (flash-attn 2's paged kernels
take multiples of 256 only)."""


def flash_label(generation: int) -> str:
    return f"flash-attn {generation}"


def find_flash(generation: int, device: torch.device, dtype: torch.dtype, block_size: int, shape=None):
    """`find_flash_kernel` limited to one generation: (FlashAttentionBackend or None, why). With the
    model's `shape` the kernel must also pass the engine's start-up probe of that configuration."""
    from engine.attention.flash_backend import FlashAttentionBackend, find_flash_kernel

    search = find_flash_kernel(device, dtype, block_size, shape, generations=(generation,))
    backend = FlashAttentionBackend(search.kernel) if search.kernel is not None else None
    return backend, search.summary


def speed_block_size(backend: str, device: torch.device) -> int:
    """The KV block size of the speed parts: 16, or 256 where flash-attn 2 is the only flash kernel that
    loads (its paged kernels need it) and `backend` may pick flash."""
    if backend not in ("auto", "flash") or device.type != "cuda":
        return 16
    try:
        fa4, _ = find_flash(4, device, torch.bfloat16, 16)
        fa2, _ = find_flash(2, device, torch.bfloat16, 256)
    except Exception as exc:  # noqa: BLE001 - the engine's own choice will say more
        logger.warning("looking for flash-attn failed (%s: %s): blocks of 16", type(exc).__name__, exc)
        return 16
    return 256 if fa4 is None and fa2 is not None else 16


def distribution_versions(names: Iterable[str]) -> dict[str, Optional[str]]:
    """Installed versions by distribution name (None: not installed), read without importing: flash-attn 4
    installs `flash_attn.cute` into a namespace package that has no __version__."""
    versions: dict[str, Optional[str]] = {}
    for name in names:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def cuda_graph_modes() -> list[tuple[str, dict]]:
    """[(label, LLM kwargs)]: eager and graphs where the engine takes `enforce_eager`, else eager alone."""
    from engine.llm import engine_config_from_kwargs

    try:
        engine_config_from_kwargs(None, enforce_eager=True)
    except (TypeError, ValueError):
        return [("eager", {})]
    return [("cuda_graphs", {"enforce_eager": False}), ("eager", {"enforce_eager": True})]


def weight_read_bytes(model) -> int:
    """Bytes of the matrices one decode step reads (every layer's projections and the LM head)."""
    total = 0
    for weight in model.weight_tensors():
        if isinstance(weight, torch.Tensor) and weight.layout == torch.strided:
            total += weight.numel() * weight.element_size()
        else:  # a packed CPU weight: count it as its plain matrix
            from engine.bench import _plain

            plain = _plain(weight, model.dtype)
            total += plain.numel() * plain.element_size()
    return total


def kv_bytes_per_token(spec) -> int:
    """K and V of one token in every layer."""
    return spec.bytes_per_block // spec.block_size


def environment(device: torch.device) -> dict:
    """Versions and the device, for the summary."""
    info: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "device": str(device),
        "cuda_available": torch.cuda.is_available(),
        "hostname": platform.node(),
    }
    for module in ("transformers", "tokenizers", "triton", "pydantic"):
        try:
            info[module] = __import__(module).__version__
        except Exception as exc:  # noqa: BLE001 - absent or broken: say which
            info[module] = f"unavailable ({type(exc).__name__})"
    info["flash_versions"] = distribution_versions(("flash-attn", "flash-attn-4"))
    info["versions"] = distribution_versions(DISTRIBUTIONS)
    info["carried_wheels"] = os.environ.get("GPU_CHECK_CARRIED", "").split()
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(
            gpu=props.name,
            gpu_memory_gib=round(props.total_memory / 2**30, 1),
            sm_count=props.multi_processor_count,
            cuda=torch.version.cuda,
            capability=".".join(map(str, torch.cuda.get_device_capability(0))),
        )
    info["triton_interpret"] = os.environ.get("TRITON_INTERPRET", "")
    return info
