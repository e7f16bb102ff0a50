"""`pagedserve serve`: its help, its errors (exit 2, no traceback), its ready message, a real start."""

import json
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from server.cli import main, ready_message
from tests.conftest import server_environment
from tests.engine.factories import make_tiny_gguf, swap_token_ids
from server.config.settings import OPTIONS

SERVE = [sys.executable, "-m", "server.cli", "serve"]
REPO = Path(__file__).resolve().parents[2]
TINY_PRESET = REPO / "configs" / "tiny.yaml"


def run_serve(*args: str, env=None) -> subprocess.CompletedProcess:
    environ = server_environment()
    return subprocess.run(
        [*SERVE, *args], capture_output=True, text=True, timeout=60, cwd=REPO, env={**environ, **(env or {})}
    )


def test_help_documents_every_flag_with_its_default_and_variable():
    result = run_serve("--help")
    assert result.returncode == 0, result.stderr
    help_text = " ".join(result.stdout.split())  # argparse wraps lines
    for option in OPTIONS:
        assert option.flag in help_text
        assert option.env in help_text
    for flag in (
        "--no-enable-prefix-caching",
        "--no-strict-params",
        "PAGEDSERVE_API_KEY",
        "(default: 8000;",
        "(default: 256;",
        "(default: fcfs;",
        "Precedence: defaults < --config",
    ):
        assert flag in help_text


def test_top_level_help_still_lists_serve_and_bench():
    result = subprocess.run(
        [sys.executable, "-m", "server.cli", "--help"], capture_output=True, text=True, timeout=60, cwd=REPO
    )
    assert result.returncode == 0 and "serve" in result.stdout and "bench" in result.stdout


@pytest.mark.parametrize(
    "args,env,expected",
    [
        (["--max-num-seqs", "many"], {}, "--max-num-seqs: expected an integer, got 'many'"),
        ([], {"PAGEDSERVE_GPU_MEMORY_UTILIZATION": "2"}, "PAGEDSERVE_GPU_MEMORY_UTILIZATION: Input should be less"),
        (["--scheduling-policy", "lifo"], {}, "--scheduling-policy: expected one of fcfs, priority"),
        (
            ["--chat-template", "{{ messages[0].content "],
            {},
            "--chat-template: the inline chat template is not valid Jinja",
        ),
    ],
)
def test_a_bad_value_exits_2_with_a_clear_message_and_no_traceback(args, env, expected):
    result = run_serve(*args, env=env)
    assert result.returncode == 2
    assert expected in result.stderr
    assert result.stderr.startswith("pagedserve serve: error: ")
    assert "Traceback" not in result.stderr and result.stdout == ""


def test_a_bad_yaml_key_exits_2(tmp_path, capsys):
    preset = tmp_path / "bad.yaml"
    preset.write_text("server:\n  prot: 8000\n")
    assert main(["serve", "--config", str(preset)]) == 2
    assert "bad.yaml: server.prot: unknown key" in capsys.readouterr().err


def test_a_busy_port_exits_1_before_loading_a_model(capsys):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert main(["serve", "--port", str(port), "--model", "/nonexistent"]) == 1
    assert f"cannot listen on 127.0.0.1:{port}" in capsys.readouterr().err


def test_a_max_model_len_over_the_models_context_exits_2_naming_the_flag_and_the_limit(tiny_model_dir):
    result = run_serve("--model", str(tiny_model_dir), "--max-model-len", "99999", "--port", "0")
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines()[-1] == (
        "pagedserve serve: error: --max-model-len 99999 is larger than the model's context length, 256 (its "
        "max_position_embeddings): give 256 or less, or none for the model's own"
    )
    assert "Traceback" not in result.stderr and "cannot load the model" not in result.stderr


def _sharded_copy(model_dir: Path, out: Path) -> Path:
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(model_dir).save_pretrained(out, max_shard_size="100KB")
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(model_dir / name, out / name)
    return out


@pytest.mark.parametrize("damage", ["missing shard", "truncated shard"])
def test_a_checkpoint_with_a_missing_or_damaged_weight_file_exits_1_naming_it(tiny_model_dir, tmp_path, damage):
    sharded = _sharded_copy(tiny_model_dir, tmp_path / "sharded")
    shard = sorted(sharded.glob("model-*.safetensors"))[1]
    if damage == "missing shard":  # the index names a shard that is not there: a download or copy cut short
        shard.unlink()
    else:
        shard.write_bytes(shard.read_bytes()[:100])
    result = run_serve("--model", str(sharded), "--port", "0")
    assert result.returncode == 1, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("pagedserve serve: error: cannot load the model: ") and shard.name in last, result.stderr
    assert "Traceback" not in result.stderr


def test_a_draft_model_of_another_vocabulary_exits_2(tiny_model_dir, tmp_path):
    draft = shutil.copytree(tiny_model_dir, tmp_path / "draft")
    swap_token_ids(draft, "a", "b")
    config = json.dumps({"method": "draft_model", "model": str(draft), "num_speculative_tokens": 2})
    result = run_serve("--model", str(tiny_model_dir), "--port", "0", "--speculative-config", config)
    assert result.returncode == 2, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("pagedserve serve: error: the draft model's tokenizer differs from the target's"), last


def test_a_draft_model_path_that_cannot_be_read_exits_2_naming_the_flag_and_the_draft(tiny_model_dir, tmp_path):
    """Not "cannot load the model: model path not found" and exit 1, which reads as the target's fault."""
    for draft, reason in ((tmp_path / "missing", "model path not found"), (tmp_path, "has no config.json")):
        config = json.dumps({"method": "draft_model", "model": str(draft), "num_speculative_tokens": 2})
        result = run_serve("--model", str(tiny_model_dir), "--port", "0", "--speculative-config", config)
        assert result.returncode == 2, result.stderr
        last = result.stderr.strip().splitlines()[-1]
        assert last.startswith(
            f"pagedserve serve: error: --speculative-config: the draft model {str(draft)!r} cannot be read: "
        ), last
        assert reason in last and "Traceback" not in result.stderr


def test_a_generation_config_directory_without_the_file_exits_2(tiny_model_dir, tmp_path):
    """A --generation-config directory with no generation_config.json is a bad flag value (exit 2), not "cannot
    load the model" and exit 1 (which a supervisor reads as a fault worth restarting for)."""
    result = run_serve("--model", str(tiny_model_dir), "--port", "0", "--generation-config", str(tmp_path))
    assert result.returncode == 2, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last == (
        f"pagedserve serve: error: --generation-config {str(tmp_path)!r}: no generation_config.json in that directory"
    ), result.stderr


def test_a_tokenizer_that_cannot_be_read_exits_2_naming_the_flag(tiny_model_dir, tmp_path):
    """A missing --tokenizer path was "cannot load the model: model path not found: '<the tokenizer>'" and exit 1,
    which blames the model (that loads fine) for the flag's value."""
    for tokenizer, reason in ((tmp_path / "missing", "path not found"), (tmp_path, "cannot load a tokenizer")):
        result = run_serve("--model", str(tiny_model_dir), "--port", "0", "--tokenizer", str(tokenizer))
        assert result.returncode == 2, result.stderr
        assert "model path not found" not in result.stderr and "cannot load the model" not in result.stderr
        assert f"pagedserve serve: error: --tokenizer: the tokenizer {str(tokenizer)!r} cannot be read: " in (
            result.stderr
        ), result.stderr
        assert reason in result.stderr and "Traceback" not in result.stderr


@pytest.mark.parametrize(
    "args,expected",
    [
        (["--attention-backend", "flash"], "attention backend 'flash' cannot run here"),
        (
            ["--attention-backend", "cpu", "--kv-cache-dtype", "float16"],
            "--kv-cache-dtype float16: the cpu attention backend reads a KV cache of float32, bfloat16, fp8",
        ),
        (["--quantization", "gguf"], "--quantization gguf is unavailable: the model is not a .gguf file"),
    ],
)
def test_settings_that_cannot_run_here_exit_2_as_a_bad_flag(tiny_model_dir, args, expected):
    result = run_serve("--model", str(tiny_model_dir), "--port", "0", *args)
    assert result.returncode == 2, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("pagedserve serve: error: ") and expected in last, result.stderr
    assert "Traceback" not in result.stderr and "cannot load the model" not in result.stderr


@pytest.mark.parametrize(
    "args,expected",
    [
        (["--batch-invariant"], "its products are not batch-invariant (--batch-invariant)"),
        (["--dtype", "float16"], "its kernels take float32 or bfloat16 activations, not float16"),
    ],
)
def test_gguf_blocks_with_settings_they_cannot_run_with_exit_2(tiny_model_dir, tmp_path, args, expected):
    """docs/configuration.md: a quantization with batch-invariant mode (or any setting that cannot run with it)
    exits 2 naming it, as --quantization int4 --batch-invariant does; not 1, as for a model that cannot load."""
    gguf = make_tiny_gguf(tiny_model_dir, tmp_path / "tiny.gguf", matrix_type="Q8_0")
    result = run_serve("--model", str(gguf), "--port", "0", "--quantization", "gguf", *args)
    assert result.returncode == 2, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last == f"pagedserve serve: error: --quantization gguf is unavailable: {expected}", result.stderr
    assert "Traceback" not in result.stderr


def test_a_misspelled_variable_gets_a_warning_naming_the_setting_it_resembles():
    with socket.socket() as busy:  # the start stops at the port, once logging is set up
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = run_serve(
            "--port",
            str(port),
            "--model",
            "/nonexistent",
            env={"PAGEDSERVE_PROT": "8011", "PAGEDSERVE_CACHE_DIR": "/somewhere", "PAGEDSERVE_IMAGE": "pagedserve:cpu"},
        )
    assert result.returncode == 1, result.stderr
    warnings = [line for line in result.stderr.splitlines() if " WARNING " in line]
    assert len(warnings) == 1, result.stderr  # the allowed variables pass silently
    assert warnings[0].endswith(
        "server.config.settings: PAGEDSERVE_PROT is not a pagedserve setting, ignored (did you mean PAGEDSERVE_PORT?)"
    )


def test_ready_message_has_a_working_curl_line_and_never_a_key():
    message = ready_message("0.0.0.0", 8123, "it's-a-model", needs_key=True)
    assert "http://127.0.0.1:8123/v1" in message
    curl = shlex.split(message.splitlines()[-1])
    assert curl[:2] == ["curl", "http://127.0.0.1:8123/v1/completions"]
    assert "Authorization: Bearer $PAGEDSERVE_API_KEY" in curl
    assert json.loads(curl[curl.index("-d") + 1])["model"] == "it's-a-model"
    assert "Authorization" not in ready_message("127.0.0.1", 1, "m", needs_key=False)
    assert "http://[::1]:8000/v1" in ready_message("::", 8000, "m", needs_key=False)
    assert "export PAGEDSERVE_API_KEY=" in message  # a log never holds the key: it says to export it
    # a model served for pooling generates nothing: the line asks for an embedding
    pooling = shlex.split(ready_message("0.0.0.0", 8123, "e", needs_key=False, pooling="embed").splitlines()[-1])
    assert pooling[1] == "http://127.0.0.1:8123/v1/embeddings"
    assert json.loads(pooling[pooling.index("-d") + 1]) == {"model": "e", "input": "The capital of France is"}
    # ... and a classifier's, which refuses embeddings, a classification
    classify = shlex.split(ready_message("0.0.0.0", 8123, "c", needs_key=False, pooling="classify").splitlines()[-1])
    assert classify[1] == "http://127.0.0.1:8123/classify"
    assert json.loads(classify[classify.index("-d") + 1]) == {"model": "c", "input": "The capital of France is"}


def test_ready_message_on_a_terminal_carries_the_key_and_over_https_curl_gets_k():
    message = ready_message("127.0.0.1", 8443, "m", needs_key=True, key="it's-k", scheme="https")
    curl = shlex.split(message.splitlines()[-1])
    assert curl[:3] == ["curl", "-k", "https://127.0.0.1:8443/v1/completions"]
    assert "Authorization: Bearer it's-k" in curl and "export" not in message


def _wait_for(path, needle: str, process: subprocess.Popen, timeout: float) -> str:
    """The text of `path` once it holds `needle`, or when the process ended or time ran out."""
    deadline = time.monotonic() + timeout
    while needle not in path.read_text() and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    return path.read_text()


# SIGINT (Ctrl-C) and SIGTERM both drain, then exit 0 (see tests/reliability/test_drain.py for the drain).
@pytest.mark.parametrize("stop, status", [(signal.SIGINT, 0), (signal.SIGTERM, 0)])
def test_serve_starts_on_a_free_port_and_prints_it_once_ready(tmp_path, tiny_model_dir, stop, status):
    environ = server_environment(PAGEDSERVE_API_KEY="s3cret-key")
    stdout, stderr = tmp_path / "stdout.txt", tmp_path / "stderr.txt"
    with stdout.open("w") as out, stderr.open("w") as err:
        process = subprocess.Popen(
            [
                *SERVE,
                "--config",
                str(TINY_PRESET),
                "--model",
                str(tiny_model_dir),
                "--served-model-name",
                "tiny",
                "--log-level",
                "debug",
            ],
            stdout=out,
            stderr=err,
            env=environ,
            cwd=REPO,
        )
    try:
        printed = _wait_for(stdout, "curl ", process, timeout=120)
        assert "curl " in printed, stderr.read_text()
        url = printed.split(" at ", 1)[1].split("/v1", 1)[0]
        assert not url.endswith(":0")
        assert httpx.get(f"{url}/v1/models", timeout=30).status_code == 401
        models = httpx.get(f"{url}/v1/models", headers={"Authorization": "Bearer s3cret-key"}, timeout=30)
        assert models.status_code == 200 and models.json()["data"][0]["id"] == "tiny"
    finally:
        process.send_signal(stop)
        process.wait(timeout=60)
    assert process.returncode == status, stderr.read_text()
    assert "Application shutdown complete" in stderr.read_text()
    assert "s3cret-key" not in stdout.read_text() + stderr.read_text()
    assert "settings: Settings(" in stderr.read_text()  # the debug log of the settings, keys left out
    assert "$PAGEDSERVE_API_KEY" in printed
