import os
import subprocess
import sys

from server.cli import main


def test_bench_scheduler_runs(capsys):
    assert main(["bench", "scheduler", "--num-running", "8", "--steps", "20", "--output-len", "16"]) == 0
    assert "median" in capsys.readouterr().out


def test_console_script_is_installed():
    result = subprocess.run(
        [sys.executable, "-m", "server.cli", "--help"], capture_output=True, text=True, check=True
    )
    assert "serve" in result.stdout and "bench" in result.stdout


def test_version_flag_prints_the_package_version():
    result = subprocess.run([sys.executable, "-m", "server.cli", "--version"], capture_output=True, text=True,
                            check=True)
    from server.version import package_version

    assert result.stdout.strip() == f"pagedserve {package_version()}" and package_version() != ""


def test_make_serve_passes_args_through():
    import shutil
    from pathlib import Path

    import pytest

    if shutil.which("make") is None:
        pytest.skip("no make here")
    repo = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MAKELEVEL", "MFLAGS")}  # not as a sub-make
    result = subprocess.run(["make", "--no-print-directory", "-n", "serve", "ARGS=--port 8011 --max-num-seqs 4"],
                            capture_output=True, text=True, check=True, cwd=repo, env=env)
    assert result.stdout.strip().splitlines()[-1].endswith(
        "pagedserve serve --config configs/default.yaml --port 8011 --max-num-seqs 4")


def test_child_servers_share_the_tests_cache_dir(monkeypatch):
    from tests.conftest import server_environment

    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", "/somewhere/cache")
    monkeypatch.setenv("PAGEDSERVE_PORT", "1234")
    env = server_environment(EXTRA="1")
    assert env["PAGEDSERVE_CACHE_DIR"] == "/somewhere/cache" and "PAGEDSERVE_PORT" not in env
    assert env["HF_HUB_OFFLINE"] == "1" and env["EXTRA"] == "1"
