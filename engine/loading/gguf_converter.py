"""One-time conversion of a `.gguf` file into an HF checkpoint directory, cached by content hash.

Reading a GGUF through transformers (dequantize, un-permute q/k, rebuild the tokenizer)
takes tens of seconds, so it is done once per file content and published atomically:

    <cache_dir>/gguf/<sha256>.lock          held while converting (one converter at a time)
    <cache_dir>/gguf/<sha256>.tmp-XXXX/     written here ...
    <cache_dir>/gguf/<sha256>/              ... then renamed here, manifest last inside
    <cache_dir>/gguf-stat/<key>             the sha256 of a file seen before, keyed by its resolved
                                            path, size and mtime (so a start does not re-read it)

A directory counts as converted only when its manifest exists and every file it lists
has the recorded size; anything else is a leftover and is replaced.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterator

from engine.file_lock import exclusive_lock
from engine.loading.child_process import call_in_child_process

logger = logging.getLogger(__name__)

MANIFEST_NAME = "pagedserve-checkpoint.json"
FORMAT_VERSION = 3
"""Conversions recorded under another version are redone (2: mixture-of-experts GGUFs, which version 1 handed to
transformers, which reads a Mixtral GGUF as a dense Llama, are converted by gguf_moe_checkpoint.py; 3: a Llama
3.x GGUF's llama3 RoPE scaling, read from its rope_freqs.weight, which earlier conversions left out)."""
_HASH_CHUNK = 1 << 20


def file_sha256(path: Path) -> str:
    """Hex sha256 of a file's content, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def is_complete_checkpoint(path: Path) -> bool:
    """True when `path` holds a finished conversion: a manifest whose files all exist with their sizes."""
    try:
        manifest = json.loads((path / MANIFEST_NAME).read_text())
        files = manifest["files"]
        if manifest.get("format") != FORMAT_VERSION or not files:
            return False
        return all((path / name).stat().st_size == size for name, size in files.items())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False


def ensure_converted(gguf_path: Path, cache_dir: Path) -> Path:
    """The converted checkpoint directory for `gguf_path`, converting it first if needed."""
    digest = _known_sha256(gguf_path, cache_dir / "gguf-stat")
    final = cache_dir / "gguf" / digest
    if is_complete_checkpoint(final):
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    with exclusive_lock(final.parent / f"{digest}.lock"):
        if is_complete_checkpoint(final):  # another process finished while we waited
            return final
        _remove_leftovers(final)
        tmp = Path(tempfile.mkdtemp(prefix=f"{digest}.tmp-", dir=final.parent))
        try:
            logger.info("converting %s into %s (once; later starts reuse it)", gguf_path, final)
            # In a child process: transformers' model classes import torch._dynamo, which imports Triton
            # wherever it is installed (and Triton's nanobind reports leaked types when the process exits);
            # the conversion's peak memory goes with the child too.
            call_in_child_process(convert_gguf, gguf_path, tmp)
            write_manifest(tmp, source_name=gguf_path.name, sha256=digest)
            _make_readable(tmp)
            _publish(tmp, final)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return final


def _known_sha256(path: Path, index_dir: Path) -> str:
    """`file_sha256(path)`, remembered per (resolved path, size, mtime): the whole file is read only
    when it is new or changed."""
    stat = path.stat()
    key = hashlib.sha256(f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()
    entry = index_dir / key
    try:
        digest = entry.read_text().strip()
        if len(digest) == 64:
            return digest
    except OSError:
        pass
    digest = file_sha256(path)
    index_dir.mkdir(parents=True, exist_ok=True)
    handle, partial = tempfile.mkstemp(dir=index_dir, prefix=".tmp-")
    with os.fdopen(handle, "w") as out:
        out.write(digest)
    os.replace(partial, entry)  # atomic: a concurrent reader sees a whole digest or none
    return digest


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Write config.json, model.safetensors (fp32), generation_config.json and the tokenizer to `out_dir`.

    Its progress is shown by `ConversionProgress` (transformers' own bars and warnings are held back
    meanwhile). Mixtures of experts are converted by gguf_moe_checkpoint.py.
    """
    from engine.loading.gguf_moe_checkpoint import convert_moe_gguf, moe_architecture
    from engine.loading.gguf_reader import shared_readers

    with shared_readers():  # transformers parses the file for the config, the weights and the tokenizer: once
        architecture = moe_architecture(gguf_path)
        if architecture is not None:
            convert_moe_gguf(gguf_path, architecture, out_dir)
            return
        _convert_dense(gguf_path, out_dir)


def _convert_dense(gguf_path: Path, out_dir: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from engine.loading.conversion_progress import ConversionProgress

    source: dict[str, Any] = dict(pretrained_model_name_or_path=gguf_path.parent, gguf_file=gguf_path.name)
    with ConversionProgress(gguf_path.name) as progress, _quiet_transformers(progress):
        config = _gguf_config(gguf_path, source)
        model = AutoModelForCausalLM.from_pretrained(**source, config=config, dtype=torch.float32)
        progress.stage("writing the weights")
        _save_config(model.config, type(model).__name__, out_dir)
        _save_generation_config(model.config, out_dir)
        _save_weights(model, out_dir)
        del model
        progress.stage("converting the tokenizer")
        AutoTokenizer.from_pretrained(**source).save_pretrained(out_dir)


def _gguf_config(gguf_path: Path, source: dict[str, Any]):
    """transformers' config of the GGUF, with the head size the file states (`<arch>.attention.key_length`)
    where transformers does not read it: its table for qwen3 leaves `head_dim` at Qwen3Config's default of
    128, so a Qwen3 file of any other head size failed to load (a size mismatch of every attention matrix)."""
    from transformers import AutoConfig

    from engine.loading.gguf_reader import read_gguf

    config = AutoConfig.from_pretrained(**source)
    reader = read_gguf(gguf_path)
    architecture = reader.fields.get("general.architecture")
    key_length = architecture and reader.fields.get(f"{architecture.contents()}.attention.key_length")
    head_dim = getattr(config, "head_dim", None)
    if key_length and head_dim is not None and int(key_length.contents()) != head_dim:
        logger.info(
            "head_dim %s from the GGUF's attention.key_length (transformers read %s)", key_length.contents(), head_dim
        )
        config.head_dim = int(key_length.contents())
    _read_rope_freqs(config, reader)
    return config


def _read_rope_freqs(config, reader) -> None:
    """The llama3 RoPE scaling a Llama 3.x GGUF keeps in its `rope_freqs.weight` tensor (gguf_rope_freqs.py), set
    on `config` (transformers reads neither it nor any scaling from a Llama GGUF); ValueError when the tensor is
    not one."""
    from engine.loading.gguf_rope_freqs import ROPE_FREQS, llama3_scaling
    from engine.loading.gguf_weights import read_float
    from engine.loading.rope_settings import rope_settings

    tensor = next((t for t in reader.tensors if t.name == ROPE_FREQS), None)
    if tensor is None:
        return
    theta, scaling = rope_settings(config)
    if scaling is not None:
        raise ValueError(f"the GGUF has both a RoPE scaling ({scaling['rope_type']}) and {ROPE_FREQS}")
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    found = llama3_scaling(read_float(tensor).tolist(), theta, head_dim)
    if found is not None:
        logger.info("RoPE scaling %s from the GGUF's %s", found, ROPE_FREQS)
        config.rope_parameters = {"rope_theta": theta, **found}


@contextlib.contextmanager
def _quiet_transformers(progress) -> Iterator[None]:
    """transformers' progress bars off and its warnings held back; its per-tensor GGUF loop counted on
    `progress`."""
    import transformers.modeling_gguf_pytorch_utils as gguf_utils
    from transformers.utils import logging as hf_logging

    def counted(iterable, *args, **kwargs):
        items = list(iterable)
        progress.start_tensors(len(items))
        for item in items:
            yield item
            progress.tensor_done()

    bars_were_on, verbosity = hf_logging.is_progress_bar_enabled(), hf_logging.get_verbosity()
    original = getattr(gguf_utils, "tqdm", None)
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    if original is not None:
        gguf_utils.tqdm = counted
    try:
        yield
    finally:
        if original is not None:
            gguf_utils.tqdm = original
        hf_logging.set_verbosity(verbosity)
        if bars_were_on:
            hf_logging.enable_progress_bar()


def write_manifest(out_dir: Path, *, source_name: str, sha256: str) -> None:
    """Record every file of `out_dir` with its size; written last, it marks the conversion complete."""
    files = {
        str(p.relative_to(out_dir)): p.stat().st_size
        for p in sorted(out_dir.rglob("*"))
        if p.is_file() and p.name != MANIFEST_NAME
    }
    manifest = {"format": FORMAT_VERSION, "source": source_name, "sha256": sha256, "files": files}
    (out_dir / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2) + "\n")


def _save_config(config, architecture: str, out_dir: Path) -> None:
    """A plain HF config: no GGUF quantization_config, no local name_or_path."""
    config = config.__class__.from_dict(config.to_dict())
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    config._name_or_path = ""
    config.architectures = [architecture]
    config.save_pretrained(out_dir)


def _save_generation_config(config, out_dir: Path) -> None:
    from transformers import GenerationConfig

    keys = ("bos_token_id", "eos_token_id", "pad_token_id")
    values = {k: getattr(config, k, None) for k in keys}
    GenerationConfig(**{k: v for k, v in values.items() if v is not None}).save_pretrained(out_dir)


def _save_weights(model, out_dir: Path) -> None:
    """The state dict in fp32 as one safetensors file; tied duplicates (lm_head) are left out."""
    import torch
    from safetensors.torch import save_file

    tensors = {}
    seen = set()
    for name, tensor in model.state_dict().items():
        if tensor.data_ptr() in seen:
            continue
        seen.add(tensor.data_ptr())
        tensors[name] = tensor.detach().to(torch.float32).contiguous()
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})


def _make_readable(out_dir: Path) -> None:
    """mkdtemp makes a private directory; a shared cache should be readable by all (like HF's)."""
    out_dir.chmod(0o755)
    for path in out_dir.rglob("*"):
        path.chmod(0o755 if path.is_dir() else 0o644)


def _publish(tmp: Path, final: Path) -> None:
    """Rename `tmp` to `final` (atomic on one filesystem); keep `final` if someone else completed it."""
    try:
        os.rename(tmp, final)
    except OSError:
        if not is_complete_checkpoint(final):
            raise


def _remove_leftovers(final: Path) -> None:
    """Delete interrupted conversions of this digest and an incomplete `final` (caller holds the lock)."""
    for stale in final.parent.glob(f"{final.name}.tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)
    if final.exists():
        logger.warning("ignoring incomplete converted checkpoint %s", final)
        doomed = Path(tempfile.mkdtemp(prefix=f"{final.name}.tmp-stale-", dir=final.parent))
        os.rename(final, doomed / "old")
        shutil.rmtree(doomed, ignore_errors=True)
