import os
import subprocess
import sys

from server.cli import main


def test_bench_scheduler_runs(capsys):
    assert main(["bench", "scheduler", "--num-running", "8", "--steps", "20", "--output-len", "16"]) == 0
    assert "median" in capsys.readouterr().out


def test_console_script_is_installed():
    result = subprocess.run([sys.executable, "-m", "server.cli", "--help"], capture_output=True, text=True, check=True)
    assert "serve" in result.stdout and "bench" in result.stdout


def test_version_flag_prints_the_package_version():
    result = subprocess.run(
        [sys.executable, "-m", "server.cli", "--version"], capture_output=True, text=True, check=True
    )
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
    result = subprocess.run(
        ["make", "--no-print-directory", "-n", "serve", "ARGS=--port 8011 --max-num-seqs 4"],
        capture_output=True,
        text=True,
        check=True,
        cwd=repo,
        env=env,
    )
    assert (
        result.stdout.strip()
        .splitlines()[-1]
        .endswith("pagedserve serve --config configs/default.yaml --port 8011 --max-num-seqs 4")
    )


def test_child_servers_share_the_tests_cache_dir(monkeypatch):
    from tests.conftest import server_environment

    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", "/somewhere/cache")
    monkeypatch.setenv("PAGEDSERVE_PORT", "1234")
    env = server_environment(EXTRA="1")
    assert env["PAGEDSERVE_CACHE_DIR"] == "/somewhere/cache" and "PAGEDSERVE_PORT" not in env
    assert env["HF_HUB_OFFLINE"] == "1" and env["EXTRA"] == "1"


def _make_dry_run(target: str, venv) -> list[str]:
    """What `make -n TARGET` would run against the virtual environment VENV (no sub-make flags)."""
    import shutil
    from pathlib import Path

    import pytest

    if shutil.which("make") is None:
        pytest.skip("no make here")
    repo = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MAKELEVEL", "MFLAGS")}
    result = subprocess.run(
        ["make", "--no-print-directory", "-n", target, f"VENV={venv}"],
        capture_output=True,
        text=True,
        check=True,
        cwd=repo,
        env=env,
    )
    return [line for line in result.stdout.splitlines() if "pip install" in line]


def test_make_serve_installs_the_runtime_dependencies_and_make_test_adds_the_dev_extra(tmp_path):
    import time

    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").touch()
    serve = _make_dry_run("serve", venv)
    assert any(line.endswith("install --quiet -e .") for line in serve), serve
    assert not any("[dev]" in line for line in serve), serve

    # After `make serve` (its stamp newer than pyproject.toml), `make test` still installs the dev extra ...
    later = time.time() + 60
    runtime_stamp = venv / ".installed-runtime"
    runtime_stamp.touch()
    os.utime(runtime_stamp, (later, later))
    assert any("[dev]" in line for line in _make_dry_run("test", venv))
    assert _make_dry_run("serve", venv) == []

    # ... and after `make test`, neither installs anything.
    dev_stamp = venv / ".installed-dev"
    dev_stamp.touch()
    os.utime(dev_stamp, (later, later))
    assert _make_dry_run("test", venv) == [] and _make_dry_run("serve", venv) == []
