"""`pagedserve serve` with vLLM's listening and logging flags, started for real: --uds (a Unix domain socket),
--log-config-file, --disable-access-log-for-endpoints; HTTPS with client certificates (--ssl-ca-certs,
--ssl-cert-reqs 2) and --enable-ssl-refresh (a renewed certificate served without a restart)."""

from __future__ import annotations

import json
import shutil
import signal
import ssl
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.conftest import server_environment
from tests.server.test_cli_flags import make_self_signed, trusting

REPO = Path(__file__).resolve().parents[2]


def _start(tiny_model_dir: Path, log: Path, *flags: str) -> tuple[subprocess.Popen, str]:
    """The server started with `flags`, once it prints that it serves: (process, the ready message)."""
    command = [sys.executable, "-m", "server.cli", "serve", "--config", str(REPO / "configs" / "tiny.yaml")]
    command += ["--model", str(tiny_model_dir), *flags]
    with log.open("w") as err:
        process = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=err, env=server_environment(), cwd=REPO, text=True
        )
    assert process.stdout is not None
    printed, deadline = "", time.monotonic() + 120
    while "curl " not in printed and time.monotonic() < deadline and process.poll() is None:
        printed += process.stdout.readline()
    assert "curl " in printed, log.read_text()
    return process, printed


def _stop(process: subprocess.Popen) -> None:
    process.send_signal(signal.SIGINT)
    process.wait(timeout=60)


def test_a_unix_socket_with_a_log_config_and_quiet_health_checks(tiny_model_dir, tmp_path):
    socket_path = tmp_path / "pagedserve.sock"
    access = tmp_path / "access.log"
    config = {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"plain": {"format": "ACCESS %(message)s"}},
        "handlers": {"file": {"class": "logging.FileHandler", "filename": str(access), "formatter": "plain"}},
        "loggers": {"uvicorn.access": {"handlers": ["file"], "level": "INFO", "propagate": False}},
    }
    config_file = tmp_path / "logging.json"
    config_file.write_text(json.dumps(config))
    socket_path.write_bytes(b"")  # not a socket: refused, never deleted
    process = subprocess.run(
        [sys.executable, "-m", "server.cli", "serve", "--model", str(tiny_model_dir), "--uds", str(socket_path)],
        capture_output=True,
        text=True,
        env=server_environment(),
        cwd=REPO,
        timeout=120,
    )
    assert process.returncode == 1 and "--uds" in process.stderr and socket_path.exists()
    socket_path.unlink()
    flags = ["--uds", str(socket_path), "--log-config-file", str(config_file)]
    flags += ["--disable-access-log-for-endpoints", "/health,/metrics", "--served-model-name", "tiny"]
    process, printed = _start(tiny_model_dir, tmp_path / "stderr.txt", *flags)
    try:
        assert f"--unix-socket {socket_path}" in printed
        transport = httpx.HTTPTransport(uds=str(socket_path))
        with httpx.Client(transport=transport, base_url="http://localhost", timeout=60) as client:
            assert client.get("/health").status_code == 200
            assert client.get("/metrics?x=1").status_code == 200
            assert client.get("/v1/models").json()["data"][0]["id"] == "tiny"
            # a second server on the same socket is refused, as a port in use is: it must not take the socket
            # from this one (which would go on running, unreachable)
            second = subprocess.run(
                [sys.executable, "-m", "server.cli", "serve", "--model", str(tiny_model_dir), *flags],
                capture_output=True,
                text=True,
                env=server_environment(),
                cwd=REPO,
                timeout=120,
            )
            assert second.returncode == 1 and "--uds" in second.stderr, second.stderr
            assert client.get("/health").status_code == 200
            reply = client.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2})
            assert reply.json()["usage"]["completion_tokens"] == 2
            if shutil.which("curl") is not None:  # the printed line works as printed
                curl = next(line.strip() for line in printed.splitlines() if line.strip().startswith("curl "))
                result = subprocess.run(["bash", "-c", curl], capture_output=True, text=True, timeout=60)
                assert json.loads(result.stdout)["object"] == "text_completion"
    finally:
        _stop(process)
    lines = access.read_text().splitlines()
    assert any("/v1/models" in line for line in lines) and any("/v1/completions" in line for line in lines)
    assert not any("/health" in line or "/metrics" in line for line in lines)
    assert all(line.startswith("ACCESS ") for line in lines)


@pytest.mark.parametrize(
    "content, flag, why",
    [
        ("{not json", "--log-config-file", "cannot read it as JSON"),
        ('{"handlers": {}}', "--log-config-file", "not a logging config"),
        ('{"version": 1, "handlers": {"h": {"class": "no.such.Handler"}}}', "--log-config-file", "--log-config-file:"),
        (None, "--middleware", "cannot import"),
    ],
)
def test_a_bad_log_config_or_middleware_exits_2_before_the_model_loads(tiny_model_dir, tmp_path, content, flag, why):
    value = "no_such_module_here.Thing"
    if content is not None:
        value = str(tmp_path / "logging.json")
        (tmp_path / "logging.json").write_text(content)
    process = subprocess.run(
        [sys.executable, "-m", "server.cli", "serve", "--model", str(tiny_model_dir), flag, value],
        capture_output=True,
        text=True,
        env=server_environment(),
        cwd=REPO,
        timeout=120,
    )
    assert process.returncode == 2 and why in process.stderr, process.stderr


def test_client_certificates_and_a_renewed_certificate(tiny_model_dir, tmp_path):
    server_dir, client_dir, renewed_dir = (tmp_path / name for name in ("server", "client", "renewed"))
    for directory in (server_dir, client_dir, renewed_dir):
        directory.mkdir()
    cert, key = make_self_signed(server_dir)
    client_cert, client_key = make_self_signed(client_dir)  # self-signed: its own CA
    flags = ["--port", "0", "--ssl-certfile", str(cert), "--ssl-keyfile", str(key)]
    flags += ["--ssl-ca-certs", str(client_cert), "--ssl-cert-reqs", "2", "--enable-ssl-refresh"]
    process, printed = _start(tiny_model_dir, tmp_path / "stderr.txt", *flags)
    url = printed.split(" at ", 1)[1].split("/v1", 1)[0]

    def get(server_cert: Path, with_client_cert: bool = True) -> int:
        context = trusting(server_cert)
        if with_client_cert:
            context.load_cert_chain(str(client_cert), str(client_key))
        return httpx.get(f"{url}/health", verify=context, timeout=30).status_code

    try:
        assert get(cert) == 200
        with pytest.raises((httpx.HTTPError, ssl.SSLError)):
            get(cert, with_client_cert=False)
        old_cert = shutil.copyfile(cert, tmp_path / "old_cert.pem")
        new_cert, new_key = make_self_signed(renewed_dir)
        shutil.copyfile(new_key, key)  # (a key and certificate that do not match yet: logged, the old ones kept)
        time.sleep(1.5)
        shutil.copyfile(new_cert, cert)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                if get(new_cert) == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        assert get(new_cert) == 200
        with pytest.raises(httpx.HTTPError):  # the old certificate is no longer what new connections get
            get(old_cert)
    finally:
        _stop(process)
    assert "do not load" in (tmp_path / "stderr.txt").read_text()
