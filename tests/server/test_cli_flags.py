"""`pagedserve serve` with vLLM's flags, started for real: HTTPS (--ssl-*), --root-path, --api-key given as a
flag (the printed curl line works as printed on a terminal), --chat-template, --max-logprobs,
--enable-log-requests, a served name with a slash (GET /v1/models/{model})."""

from __future__ import annotations

import datetime
import json
import os
import pty
import select
import ssl
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from tests.server.test_errors import assert_error
from tests.conftest import server_environment

REPO = Path(__file__).resolve().parents[2]
KEY = "flag-key-7d1c"
PROMPT = "zebra quartz secret prompt"
TEMPLATE = "{% for m in messages %}[{{ m.content }}]{% endfor %}"


def make_self_signed(directory: Path) -> tuple[Path, Path]:
    """(certificate, key) for 127.0.0.1 and localhost: with `cryptography` when installed, else `openssl`."""
    cert, key = directory / "cert.pem", directory / "key.pem"
    try:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import NameOID
    except ImportError:
        if shutil.which("openssl") is None:
            pytest.skip("neither the cryptography package nor openssl: no certificate to test HTTPS with")
        subprocess.run(
            [
                "openssl",
                "req",
                "-x509",
                "-newkey",
                "ec",
                "-pkeyopt",
                "ec_paramgen_curve:prime256v1",
                "-nodes",
                "-keyout",
                str(key),
                "-out",
                str(cert),
                "-days",
                "2",
                "-subj",
                "/CN=localhost",
                "-addext",
                "subjectAltName=IP:127.0.0.1,DNS:localhost",
            ],
            check=True,
            capture_output=True,
            timeout=60,
        )
        return cert, key
    import ipaddress

    private = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.timezone.utc)
    certificate = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(private.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(days=2))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]),
            critical=False,
        )
        .sign(private, hashes.SHA256())
    )
    cert.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    key.write_bytes(
        private.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    return cert, key


def trusting(cert: Path) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=str(cert))


def _read_terminal(master: int, process: subprocess.Popen, needle: str, timeout: float) -> str:
    """What the server wrote to its terminal, once it holds `needle` (or the process ended, or time ran out)."""
    text, deadline = b"", time.monotonic() + timeout
    while needle.encode() not in text and time.monotonic() < deadline and process.poll() is None:
        ready, _, _ = select.select([master], [], [], 0.2)
        if ready:
            try:
                text += os.read(master, 65536)
            except OSError:
                break
    return text.decode(errors="replace").replace("\r\n", "\n")


@pytest.fixture(scope="module")
def flagged(tmp_path_factory, tiny_model_dir):
    tmp = tmp_path_factory.mktemp("flags")
    cert, key = make_self_signed(tmp)
    template = tmp / "template.jinja"
    template.write_text(TEMPLATE)
    stderr = tmp / "stderr.txt"
    env = server_environment()
    master, slave = pty.openpty()
    with stderr.open("w") as err:
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "server.cli",
                "serve",
                "--config",
                str(REPO / "configs" / "tiny.yaml"),
                "--model",
                str(tiny_model_dir),
                "--served-model-name",
                "org/tiny",
                "--port",
                "0",
                "--api-key",
                KEY,
                "--ssl-certfile",
                str(cert),
                "--ssl-keyfile",
                str(key),
                "--root-path",
                "/llm",
                "--chat-template",
                str(template),
                "--max-logprobs",
                "3",
                "--enable-log-requests",
            ],
            stdout=slave,
            stderr=err,
            env=env,
            cwd=REPO,
        )
    os.close(slave)
    try:
        printed = _read_terminal(master, process, "curl ", timeout=120)
        assert "curl " in printed, stderr.read_text()
        curl = next(line.strip() for line in printed.splitlines() if line.strip().startswith("curl "))
        url = printed.split(" at ", 1)[1].split("/v1", 1)[0]
        client = httpx.Client(
            base_url=url, verify=trusting(cert), headers={"Authorization": f"Bearer {KEY}"}, timeout=60
        )
        yield {"url": url, "curl": curl, "printed": printed, "cert": cert, "stderr": stderr, "client": client}
        client.close()
    finally:
        process.send_signal(signal.SIGINT)
        process.wait(timeout=60)
        os.close(master)


def test_the_printed_curl_line_works_as_printed_with_a_key_from_the_flag(flagged):
    assert flagged["url"].startswith("https://127.0.0.1:")
    if shutil.which("curl") is not None:
        result = subprocess.run(["bash", "-c", flagged["curl"]], capture_output=True, text=True, timeout=120)
        reply = json.loads(result.stdout)
    else:  # no curl here: send what the line says
        words = shlex.split(flagged["curl"])
        headers = dict(words[i + 1].split(": ", 1) for i, w in enumerate(words) if w == "-H")
        url = next(w for w in words if w.startswith("https://"))
        reply = httpx.post(url, headers=headers, content=words[words.index("-d") + 1], verify=False).json()
    assert reply["object"] == "text_completion" and reply["usage"]["completion_tokens"] > 0
    assert KEY not in flagged["stderr"].read_text()  # on the terminal only, never in the log


def test_https_with_the_given_certificate_and_plain_http_refused(flagged):
    assert flagged["client"].get("/health").status_code == 200
    with pytest.raises(httpx.HTTPError):
        httpx.get(flagged["url"].replace("https://", "http://") + "/health", timeout=10)


def test_root_path_keeps_authentication_and_serves_the_prefixed_schema(flagged):
    client = flagged["client"]
    assert_error(httpx.get(f"{flagged['url']}/v1/models", verify=trusting(flagged["cert"]), timeout=30), 401)
    assert client.get("/v1/models").json()["data"][0]["id"] == "org/tiny"
    assert client.get("/openapi.json").json()["servers"] == [{"url": "/llm"}]
    assert "/llm/openapi.json" in client.get("/docs").text


def test_sdk_retrieves_a_model_whose_id_has_a_slash(flagged):
    sdk = openai.OpenAI(
        base_url=f"{flagged['url']}/v1",
        api_key=KEY,
        max_retries=0,
        http_client=httpx.Client(verify=trusting(flagged["cert"])),
    )
    assert sdk.models.retrieve("org/tiny").id == "org/tiny"
    with pytest.raises(openai.NotFoundError):
        sdk.models.retrieve("org/other")


def test_max_logprobs_refuses_more_naming_the_field(flagged):
    client = flagged["client"]
    ok = client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1, "logprobs": 3})
    assert ok.status_code == 200 and len(ok.json()["choices"][0]["logprobs"]["top_logprobs"][0]) >= 3
    error = assert_error(
        client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1, "logprobs": 4}), 400, "logprobs"
    )
    assert "--max-logprobs 3" in error["message"]
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1, "logprobs": True, "top_logprobs": 4}
    assert_error(client.post("/v1/chat/completions", json=chat), 400, "top_logprobs")


def test_chat_template_from_the_flag_renders_the_prompt(flagged):
    client = flagged["client"]
    tokens = client.post("/tokenize", json={"messages": [{"role": "user", "content": "hello"}]}).json()["tokens"]
    assert client.post("/detokenize", json={"tokens": tokens}).json()["prompt"] == "[hello]"


def test_requests_are_logged_at_info_without_their_text(flagged):
    reply = flagged["client"].post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, "stop": ["zebra"]})
    request_id = reply.json()["id"]
    deadline = time.monotonic() + 30
    while request_id not in flagged["stderr"].read_text() and time.monotonic() < deadline:
        time.sleep(0.1)
    log = flagged["stderr"].read_text()
    line = next(line for line in log.splitlines() if f"request {request_id}" in line)
    assert " INFO " in line and "prompt tokens" in line and "1 stop string(s)" in line
    assert PROMPT not in log and "zebra" not in log and KEY not in log
