"""Layering: scheduler/ stands alone (no torch, engine or server) and speaks no HTTP."""

import subprocess
import sys
from pathlib import Path


def test_scheduler_imports_no_torch_engine_or_server():
    code = (
        "import sys, scheduler, scheduler.bench\n"
        "bad = [m for m in ('torch', 'engine', 'server', 'numpy') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# What only the HTTP front end may say: OpenAI's error fields and codes, HTTP itself.
HTTP_WORDING = (
    "param=",
    "code=",
    "context_length_exceeded",
    "HTTP",
    "http",
    "status_code",
    "OpenAI",
    "openai",
    "invalid_request_error",
    "Shorten the prompt",
)


def test_scheduler_holds_no_http_wording():
    """Refusals carry facts (typed errors); the server words them for clients."""
    root = Path(__file__).resolve().parents[2] / "scheduler"
    sources = sorted(root.rglob("*.py"))
    assert sources
    found = [
        f"{path.relative_to(root.parent)}:{number}: {word}"
        for path in sources
        for number, line in enumerate(path.read_text().splitlines(), 1)
        for word in HTTP_WORDING
        if word in line
    ]
    assert not found, found
