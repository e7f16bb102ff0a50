"""The servers under test: how each is installed, started, made ready, asked and stopped.

    pagedserve     this checkout, by the Python running the benchmark (`configs/default.yaml`)
    llama.cpp      its own C++ HTTP server from the `xllamacpp` wheel (llamacpp_server.py), same GGUF file,
                   `slots` = the workload's concurrency, restarted when that changes
    transformers   `transformers serve --continuous-batching` on the GGUF converted to safetensors

Each runs as a process group of its own on a free loopback port, its output in a log file; stopping it
sends SIGTERM to the group, then SIGKILL. Children also get SIGTERM when the benchmark process dies
(PR_SET_PDEATHSIG), so none outlives it.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import httpx

MODEL_NAME = "SmolLM2-135M-Instruct"  # what every server is asked for
REPO = Path(__file__).resolve().parent.parent


@dataclass(frozen=True, slots=True)
class VenvSpec:
    name: str
    requirements: tuple[str, ...]


# torch pinned to the CPU build pagedserve uses: an unpinned torch pulls a multi-GB CUDA build
LLAMACPP_VENV = VenvSpec("llamacpp", ("xllamacpp",))
TRANSFORMERS_VENV = VenvSpec("transformers", ("torch==2.13.0", "transformers[serving]>=5.0"))
PLOTS_VENV = VenvSpec("plots", ("matplotlib>=3.8",))


def venv_python(root: Path, spec: VenvSpec) -> Path:
    return root / spec.name / "bin" / "python"


def ensure_venv(root: Path, spec: VenvSpec, log: Path) -> Path:
    """A virtualenv under `root` with the spec's requirements (made once; remade when they change); its
    Python. pip's output goes to `log`."""
    venv = root / spec.name
    stamp = venv / ".bench-requirements.json"
    wanted = json.dumps(list(spec.requirements))
    if stamp.exists() and stamp.read_text() == wanted and venv_python(root, spec).exists():
        return venv_python(root, spec)
    with open(log, "w") as out:
        subprocess.run(["rm", "-rf", str(venv)], check=True)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, stdout=out, stderr=subprocess.STDOUT)
        result = subprocess.run(
            [str(venv_python(root, spec)), "-m", "pip", "install", "--quiet", *spec.requirements],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    if result.returncode != 0:
        raise RuntimeError(f"pip install {' '.join(spec.requirements)} failed (see {log})")
    stamp.write_text(wanted)
    return venv_python(root, spec)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when the benchmark process dies, whatever kills it."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


@dataclass
class ServerProcess:
    """One started server: its process group, port and log."""

    name: str
    process: subprocess.Popen
    port: int
    log: Path
    config_key: object = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log_tail(self, lines: int = 15) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        return ""

    def wait_ready(self, timeout_s: float) -> None:
        """Until GET /health answers 200; raises if the process exits or the time runs out."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"{self.name} exited with status {self.process.returncode} while starting:\n{self.log_tail()}"
                )
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.base_url + "/health", timeout=5).status_code == 200:
                    return
            time.sleep(0.5)
        raise RuntimeError(f"{self.name} not ready after {timeout_s:.0f} s:\n{self.log_tail()}")

    def stop(self, grace_s: float = 15.0) -> None:
        """SIGTERM to the whole process group, SIGKILL after `grace_s`; waits for the process."""
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(grace_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        with contextlib.suppress(ProcessLookupError):  # anything the group left behind
            os.killpg(self.process.pid, signal.SIGKILL)


@dataclass
class Peer:
    """How to run one server: its command for a port and slot count, and the request options it takes."""

    name: str
    command: Callable[[int, int], list[str]]  # (port, slots) -> argv
    ignore_eos: bool
    extra_body: dict = field(default_factory=dict)
    env: dict = field(default_factory=dict)
    cwd: Path = REPO
    slots_matter: bool = False  # restart when the workload's concurrency changes
    ready_timeout_s: float = 600.0  # a fresh machine's first pagedserve start converts the GGUF
    versions: dict = field(default_factory=dict)

    def config_key(self, slots: int) -> object:
        return slots if self.slots_matter else None

    def start(self, slots: int, log_dir: Path) -> ServerProcess:
        port = free_port()
        log = log_dir / f"{self.name}-{port}.log"
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", **self.env}
        with open(log, "w") as out:
            process = subprocess.Popen(
                self.command(port, slots),
                cwd=self.cwd,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                preexec_fn=_die_with_parent,
            )
        server = ServerProcess(self.name, process, port, log, self.config_key(slots))
        try:
            server.wait_ready(self.ready_timeout_s)
        except BaseException:
            server.stop()
            raise
        return server


class ServerPool:
    """The servers running now, one per peer, restarted only when a peer's configuration must change; stops
    them all on exit (also on Ctrl-C and errors)."""

    def __init__(self, log_dir: Path, on_event: Callable[[str], None] = print):
        self.log_dir = log_dir
        self.running: dict[str, ServerProcess] = {}
        self.on_event = on_event

    def get(self, peer: Peer, slots: int) -> ServerProcess:
        current = self.running.get(peer.name)
        if current is not None and current.config_key == peer.config_key(slots) and current.process.poll() is None:
            return current
        if current is not None:
            current.stop()
            del self.running[peer.name]
        started = time.perf_counter()
        server = peer.start(slots, self.log_dir)
        self.running[peer.name] = server
        self.on_event(
            f"  started {peer.name} on port {server.port}"
            + (f" with {slots} slots" if peer.slots_matter else "")
            + f" ({time.perf_counter() - started:.1f} s)"
        )
        return server

    def stop(self, name: str) -> None:
        server = self.running.pop(name, None)
        if server is not None:
            server.stop()

    def stop_all(self) -> None:
        for name in list(self.running):
            self.stop(name)

    def __enter__(self) -> "ServerPool":
        return self

    def __exit__(self, *exc) -> None:
        self.stop_all()


PAGEDSERVE_VARIANTS = {"pagedserve": (), "pagedserve-gguf": ("--quantization", "gguf")}
"""pagedserve as configured by default (float weights), and serving the GGUF's quantized blocks as stored."""


def pagedserve_peer(name: str = "pagedserve", extra: Sequence[str] = ()) -> Peer:
    """pagedserve on the default preset, as variant `name` (PAGEDSERVE_VARIANTS), with `extra` flags."""

    def command(port: int, slots: int) -> list[str]:
        return [
            sys.executable,
            "-m",
            "server.cli",
            "serve",
            "--config",
            "configs/default.yaml",
            "--port",
            str(port),
            "--served-model-name",
            MODEL_NAME,
            "--log-level",
            "warning",
            *PAGEDSERVE_VARIANTS[name],
            *extra,
        ]

    return Peer(name, command, ignore_eos=True)


def llamacpp_peer(python: Path, gguf: Path, threads: int, eos_ids: list[int], extra: Sequence[str] = ()) -> Peer:
    """llama.cpp's server on `gguf` (`extra`: more llamacpp_server.py flags, e.g. its embedding mode)."""
    script = Path(__file__).resolve().parent / "llamacpp_server.py"

    def command(port: int, slots: int) -> list[str]:
        return [
            str(python),
            str(script),
            "--model",
            str(gguf),
            "--port",
            str(port),
            "--parallel",
            str(slots),
            "--threads",
            str(threads),
            "--alias",
            MODEL_NAME,
            *extra,
        ]

    bias = [[token, -100] for token in eos_ids]  # with ignore_eos: every request runs its max_tokens
    return Peer(
        "llama.cpp", command, ignore_eos=True, extra_body={"logit_bias": bias}, slots_matter=True, ready_timeout_s=180.0
    )


def transformers_peer(python: Path, checkpoint: Path, work_dir: Path, dtype: str) -> Peer:
    """`transformers serve` names the model by the path it was given: it runs in a folder where MODEL_NAME
    links to the checkpoint, so that the name sent is the same as for the others (and no path is recorded)."""
    models = work_dir / "models"
    models.mkdir(parents=True, exist_ok=True)
    link = models / MODEL_NAME
    if link.is_symlink() or link.exists():
        link.unlink()
    link.symlink_to(checkpoint, target_is_directory=True)
    cli = python.parent / "transformers"

    def command(port: int, slots: int) -> list[str]:
        # 32-token blocks x 2048: room for 64 requests of 1024 tokens, ~0.75 GB in bf16 (its default takes
        # a share of all free memory)
        return [
            str(cli),
            "serve",
            MODEL_NAME,
            "--continuous-batching",
            "--device",
            "cpu",
            "--dtype",
            dtype,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--cb-block-size",
            "32",
            "--cb-num-blocks",
            "2048",
            "--log-level",
            "warning",
        ]

    return Peer("transformers", command, ignore_eos=False, cwd=models, ready_timeout_s=300.0)


def probe_versions(python: Path, code: str) -> dict:
    """A dict a one-line Python program prints as JSON in another venv ({} if it fails)."""
    result = subprocess.run([str(python), "-c", code], capture_output=True, text=True, timeout=120)
    try:
        return json.loads(result.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        return {}


LLAMACPP_VERSIONS = (
    "import json, importlib.metadata as m, xllamacpp as x; b = x.BUILD_INFO; "
    "print(json.dumps({'xllamacpp': m.version('xllamacpp'), **({'llama.cpp build': "
    "f\"{b.get('build_number')} {b.get('commit')}\"} if b.get('build_number') else {})}))"
)
TRANSFORMERS_VERSIONS = (
    "import json, importlib.metadata as m; print(json.dumps({p: m.version(p) for p in ('transformers', 'torch')}))"
)


def pagedserve_versions() -> dict:
    import importlib.metadata as metadata

    import torch

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    dirty = subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO, capture_output=True, text=True
    )
    return {
        "pagedserve": metadata.version("pagedserve"),
        "commit": (commit.stdout.strip() or "?") + ("+dirty" if dirty.stdout.strip() else ""),
        "torch": torch.__version__,
    }
