"""`pagedserve serve --tensor-parallel-size 2` in a child process: the OpenAI SDK gets the tokens one process
gives, and a worker killed mid-stream (a tensor-parallel rank, or the second of two pipeline stages, whose
stream it served until then) fails the server fast: the stream ends with an error event, /health
says 503 (or the process is gone), the process exits non-zero within 10 s, and no process is left behind."""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import httpx
import openai
import pytest

from engine import LLM, SamplingParams
from tests.reliability.conftest import serve_process, sse_payloads

pytestmark = pytest.mark.timeout(180)


def children(pid: int) -> set[int]:
    """Live (not zombie) processes whose parent is `pid`."""
    found = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid and fields[0] != "Z":
                found.add(int(entry.name))
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def assert_all_gone(pids, message: str, timeout: float = 10.0) -> None:
    """Within `timeout` (a worker checks its parent every second), none of `pids` is alive."""
    deadline = time.monotonic() + timeout
    while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [pid for pid in pids if alive(pid)], message


def worker_pids(stderr: Path) -> list[int]:
    match = re.search(r"\d+ ranks .*\(rank 0 here, pids ([\d, ]+)\)", stderr.read_text())
    assert match, stderr.read_text()[-2000:]
    return [int(pid) for pid in match.group(1).split(", ")]


SPLITS = pytest.mark.parametrize(
    "split", [("--tensor-parallel-size", "2"), ("--pipeline-parallel-size", "2")], ids=["tensor", "pipeline"]
)


def test_completions_through_the_sdk_match_one_process(tmp_path, tiny_model_dir):
    prompt = [5, 9, 27, 3, 81, 44, 12, 7]
    with LLM(str(tiny_model_dir), dtype="float32", device="cpu") as llm:
        params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=0)
        expected = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0]
    process, url, stderr = serve_process(tmp_path, "--model", str(tiny_model_dir), "--tensor-parallel-size", "2")
    try:
        assert len(worker_pids(stderr)) == 1
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        completion = client.completions.create(
            model="tiny", prompt=prompt, max_tokens=12, temperature=0, logprobs=1, extra_body={"ignore_eos": True}
        )
        logprobs = completion.choices[0].logprobs
        assert logprobs is not None and logprobs.token_logprobs is not None
        assert logprobs.token_logprobs == pytest.approx([lp.logprob for lp in expected.logprobs], abs=1e-5)
        assert completion.choices[0].text == expected.text
        chunks = client.completions.create(
            model="tiny", prompt=prompt, max_tokens=12, temperature=0, stream=True, extra_body={"ignore_eos": True}
        )
        assert "".join(chunk.choices[0].text for chunk in chunks) == expected.text
    finally:
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0, stderr.read_text()[-3000:]
    assert not children(process.pid)


@SPLITS
def test_a_worker_killed_mid_stream_fails_the_server_fast(tmp_path, tiny_model_dir, split):
    process, url, stderr = serve_process(
        tmp_path,
        "--model",
        str(tiny_model_dir),
        *split,
        "--distributed-timeout",
        "30",  # the worker's start may take longer on a busy machine; its death is noticed without waiting on it
        hooks=("--pace", "0.05"),
    )
    (worker,) = worker_pids(stderr)
    family = children(process.pid) | {worker}
    try:
        body = {"model": "tiny", "prompt": [3, 4, 5], "max_tokens": 200, "ignore_eos": True, "stream": True}
        lines = []
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=30) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                lines.append(line)
                if len(lines) == 10:  # streaming: kill the worker now
                    killed = time.monotonic()
                    os.kill(worker, signal.SIGKILL)
        events = sse_payloads(lines)
        assert events[-1] == "[DONE]"
        assert "error" in events[-2], events[-2]
        try:
            health = httpx.get(f"{url}/health", timeout=5).status_code
        except httpx.TransportError:
            health = None  # already exited
        assert health in (503, None)
        assert process.wait(timeout=10) != 0
        assert time.monotonic() - killed < 10
    finally:
        process.kill()
    assert_all_gone(family, "processes left behind")


def test_sigkill_of_the_server_takes_its_workers_with_it(tmp_path, tiny_model_dir):
    process, url, stderr = serve_process(tmp_path, "--model", str(tiny_model_dir), "--tensor-parallel-size", "2")
    family = children(process.pid) | set(worker_pids(stderr))
    process.kill()
    process.wait(timeout=10)
    assert_all_gone(family, "workers outlived a SIGKILLed server")


@SPLITS
def test_ctrl_c_at_the_terminal_drains_the_stream_and_exits_0(tmp_path, tiny_model_dir, split):
    """A terminal's Ctrl-C sends SIGINT to the whole foreground process group, the workers included: they must
    not die of it (a worker that did failed the stream in flight and the server exited 1), but go on until rank 0
    has drained the requests and closes the broadcast."""
    process, url, stderr = serve_process(
        tmp_path, "--model", str(tiny_model_dir), *split, hooks=("--pace", "0.02"), new_session=True
    )
    (worker,) = worker_pids(stderr)
    family = children(process.pid) | {worker}
    try:
        body = {
            "model": "tiny",
            "prompt": [3, 4, 5],
            "max_tokens": 60,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        lines = []
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                lines.append(line)
                if len(lines) == 10:  # streaming: Ctrl-C at the terminal
                    os.killpg(process.pid, signal.SIGINT)
        events = sse_payloads(lines)
        assert events[-1] == "[DONE]"
        assert events[-2]["usage"]["completion_tokens"] == 60, events[-2]
        assert [event["choices"][0]["finish_reason"] for event in events[:-2]][-1] == "length", events[-3]
        assert process.wait(timeout=60) == 0, stderr.read_text()[-3000:]
        assert "KeyboardInterrupt" not in stderr.read_text()
    finally:
        process.kill()
    assert_all_gone(family, "processes left behind")


def test_a_second_ctrl_c_exits_at_once_and_takes_the_workers_with_it(tmp_path, tiny_model_dir):
    process, url, stderr = serve_process(
        tmp_path,
        "--model",
        str(tiny_model_dir),
        "--tensor-parallel-size",
        "2",
        hooks=("--pace", "0.05"),
        new_session=True,
    )
    (worker,) = worker_pids(stderr)
    family = children(process.pid) | {worker}
    try:
        body = {"model": "tiny", "prompt": [3, 4, 5], "max_tokens": 200, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
            for count, _ in enumerate(response.iter_lines()):
                if count == 6:
                    os.killpg(process.pid, signal.SIGINT)
                    time.sleep(0.5)
                    os.killpg(process.pid, signal.SIGINT)
                    break
        assert process.wait(timeout=30) == 130
    finally:
        process.kill()
    assert_all_gone(family, "workers outlived a server that exited at once")
