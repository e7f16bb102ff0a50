"""`pagedserve bench serve`: the metric arithmetic, the arrival process, the datasets, the client against a
fake server with known delays, and a run against the tiny model's real server."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import statistics
import threading
import time

import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from engine.text.tokenizer import load_tokenizer
from server.benchmark.client import RequestResult, Target
from server.benchmark.datasets import (
    BenchRequest,
    jsonl_requests,
    prefix_shared_requests,
    random_requests,
    sharegpt_requests,
)
from server.benchmark.metrics import compute, format_table, meets, parse_slos, tpot
from server.benchmark.serve import LoadShape, arrival_gaps, main, run_load
from tests.ports import free_port


# ---------------------------------------------------------------------- metrics


def _result(ttft, itl, output_tokens, prompt_len=10, success=True, error=""):
    latency = ttft + sum(itl) + 0.004  # the stream ends a little after its last chunk
    return RequestResult(success, error, prompt_len, output_tokens, ttft, list(itl), latency, 0.0)


def test_metrics_follow_vllms_definitions():
    results = [
        _result(0.100, [0.010, 0.020, 0.030], 4, prompt_len=10),
        _result(0.300, [0.040], 2, prompt_len=20),
        _result(0.200, [], 1, prompt_len=30),  # one token: no TPOT
        _result(0.0, [], 0, success=False, error="HTTP 500: boom"),
    ]
    m = compute(results, duration_s=2.0, slos_ms={"ttft": 250.0})
    assert (m.completed, m.failed) == (3, 1)
    assert (m.total_input_tokens, m.total_output_tokens) == (60, 7)
    assert m.request_throughput == pytest.approx(1.5)
    assert m.output_throughput == pytest.approx(3.5)
    assert m.total_token_throughput == pytest.approx(33.5)
    assert m.request_goodput == pytest.approx(1.0)  # two of three meet TTFT <= 250 ms
    assert m.ttft_ms.mean == pytest.approx(200.0) and m.ttft_ms.median == pytest.approx(200.0)
    tpots = [(0.064 - 0.0) / 3 * 1000 + 0, 0.044 / 1 * 1000]  # (latency - ttft) / (tokens - 1)
    assert tpot(results[0]) == pytest.approx((results[0].latency - 0.1) / 3)
    assert m.tpot_ms.mean == pytest.approx(statistics.mean(tpots))
    assert m.itl_ms.mean == pytest.approx(25.0) and m.itl_ms.median == pytest.approx(25.0)
    assert m.itl_ms.p99 == pytest.approx(39.7)  # linear percentile of 10, 20, 30, 40
    assert m.e2el_ms.median == pytest.approx(results[2].latency * 1000)
    assert m.errors == {"HTTP 500": 1}
    assert meets(results[0], {"tpot": 22.0, "e2el": 170.0}) and not meets(results[0], {"tpot": 21.0})
    table = format_table(m)
    assert "Successful requests" in table and "P99 ITL (ms)" in table and "Request goodput" in table


def test_goodput_slos_parse_and_refuse_nonsense():
    assert parse_slos(["ttft:500", "tpot:50.5"]) == {"ttft": 500.0, "tpot": 50.5}
    assert parse_slos(None) == {}
    for bad in ("ttft", "latency:5", "tpot:x", "e2el:-1"):
        with pytest.raises(ValueError):
            parse_slos([bad])


def test_arrivals_are_gamma_gaps_with_the_asked_mean_rate():
    assert arrival_gaps(5, LoadShape()) == [0.0] * 5
    for burstiness in (0.5, 1.0, 4.0):
        gaps = arrival_gaps(20_000, LoadShape(request_rate=8.0, burstiness=burstiness, seed=1))
        assert statistics.mean(gaps) == pytest.approx(1 / 8.0, rel=0.05)
        # gamma(k, theta): variance k theta^2 = mean^2 / k, so burstier (smaller k) means more spread
        assert statistics.pvariance(gaps) == pytest.approx((1 / 8.0) ** 2 / burstiness, rel=0.1)
    assert arrival_gaps(3, LoadShape(request_rate=2.0, seed=5)) == arrival_gaps(3, LoadShape(request_rate=2.0, seed=5))


# ---------------------------------------------------------------------- datasets


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return load_tokenizer(tiny_model_dir)


def test_random_prompts_have_exact_token_lengths(tokenizer):
    requests = random_requests(tokenizer, 12, input_len=40, output_len=16, range_ratio=0.5, seed=3)
    for r in requests:
        assert len(tokenizer.encode(r.prompt, add_special_tokens=False)) == r.prompt_len
        assert 20 <= r.prompt_len <= 60 and 8 <= r.output_len <= 24
    exact = random_requests(tokenizer, 5, input_len=33, output_len=7, seed=4)
    assert {r.prompt_len for r in exact} == {33} and {r.output_len for r in exact} == {7}
    assert random_requests(tokenizer, 5, 33, 7, seed=4) == exact  # seeded


def test_prefix_shared_prompts_share_their_prefix(tokenizer):
    requests = prefix_shared_requests(tokenizer, 4, prefix_len=64, suffix_len=8, output_len=5, seed=0)
    head = requests[0].prompt[: len(requests[0].prompt) // 2]
    assert all(r.prompt.startswith(head) for r in requests) and len({r.prompt for r in requests}) == 4
    assert all(70 <= r.prompt_len <= 74 for r in requests)


def test_sharegpt_and_jsonl_files(tokenizer, tmp_path):
    conversations = [
        {
            "conversations": [
                {"from": "human", "value": f"Tell me about number {i} in detail."},
                {"from": "gpt", "value": "It is a number. " * (i + 2)},
            ]
        }
        for i in range(5)
    ]
    conversations.append({"conversations": [{"from": "human", "value": "hi"}]})  # no reply: skipped
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(conversations))
    requests = sharegpt_requests(path, tokenizer, 7, seed=0)
    assert len(requests) == 7 and len({r.prompt for r in requests}) == 5  # cycled to the number asked
    assert all(r.output_len >= 4 for r in requests)
    lines = tmp_path / "prompts.jsonl"
    lines.write_text('{"prompt": "one two three", "output_len": 9}\n\n{"prompt": "four"}\n')
    got = jsonl_requests(lines, tokenizer, 2)
    assert [(r.prompt, r.output_len) for r in got] == [("one two three", 9), ("four", 128)]
    lines.write_text('{"text": "no prompt key"}\n')
    with pytest.raises(ValueError, match="prompts.jsonl:1"):
        jsonl_requests(lines, tokenizer, 1)


# ---------------------------------------------------------------------- the client, against a fake server

CHUNKS = 5


def _fake_app(in_flight: dict) -> Starlette:
    async def completions(request):
        body = await request.json()
        if body.get("model") == "broken":
            return JSONResponse({"error": {"message": "no such model"}}, status_code=404)

        async def stream():
            in_flight["now"] += 1
            in_flight["max"] = max(in_flight["max"], in_flight["now"])
            try:
                yield 'data: {"choices": [{"index": 0, "text": ""}]}\n\n'  # a role/empty chunk: not content
                for i in range(CHUNKS):
                    await asyncio.sleep(0.01)  # let the other requests in flight
                    yield f'data: {{"choices": [{{"index": 0, "text": "t{i}"}}]}}\n\n'
                usage = {"prompt_tokens": 11, "completion_tokens": CHUNKS + 2, "total_tokens": CHUNKS + 13}
                yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
                yield "data: [DONE]\n\n"
            finally:
                in_flight["now"] -= 1

        return StreamingResponse(stream(), media_type="text/event-stream")

    return Starlette(routes=[Route("/v1/completions", completions, methods=["POST"])])


@pytest.fixture(scope="module")
def fake_server():
    port = free_port()
    in_flight = {"now": 0, "max": 0}
    server = uvicorn.Server(uvicorn.Config(_fake_app(in_flight), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    yield f"http://127.0.0.1:{port}", in_flight
    server.should_exit = True
    thread.join(10)


def _ticks():
    """A clock that advances by one at every reading: the timings become counts of readings."""
    counter = iter(range(1_000_000))
    return lambda: float(next(counter))


def test_client_times_content_chunks(fake_server):
    """One request at a time on a clock that ticks per reading: sent (0), an empty chunk (1), five content
    chunks (2-6), the usage chunk (7), the end (8). TTFT is 2 ticks, the ITLs 1 each (content chunks only),
    the latency 8; output tokens come from usage."""
    url, _ = fake_server
    requests = [BenchRequest("p", 3, 8)] * 3
    results, duration = asyncio.run(
        run_load(Target(url, "m"), requests, LoadShape(max_concurrency=1), progress=False, clock=_ticks())
    )
    for r in results:
        assert r.success, r.error
        assert (r.ttft, r.itl, r.latency) == (2.0, [1.0] * (CHUNKS - 1), 8.0)
        assert (r.output_tokens, r.prompt_len) == (CHUNKS + 2, 11)
    assert duration == 1 + 3 * 9  # the start, then nine readings per request


def test_client_keeps_to_the_concurrency_cap_and_records_failures(fake_server):
    url, in_flight = fake_server
    in_flight["max"] = 0
    results, _ = asyncio.run(
        run_load(Target(url, "m"), [BenchRequest("p", 3, 8)] * 6, LoadShape(max_concurrency=2), progress=False)
    )
    assert all(r.success for r in results) and in_flight["max"] == 2
    broken = asyncio.run(run_load(Target(url, "broken"), [BenchRequest("p", 3, 8)], LoadShape(), progress=False))[0][0]
    assert not broken.success and broken.error.startswith("HTTP 404") and "no such model" in broken.error


# ---------------------------------------------------------------------- against pagedserve


def test_bench_serve_loads_the_embeddings_route(tmp_path, capsys):
    """--endpoint /v1/embeddings against a pooling model: every prompt one input, answered whole (TTFT = latency),
    the input lengths the server counted, no output tokens."""
    from server.config.server_config import ServerConfig
    from tests.engine.factories import make_tiny_embedding_dir
    from tests.server.conftest import serving

    model_dir = make_tiny_embedding_dir(tmp_path / "embed")
    out = tmp_path / "result.json"
    with serving(model_dir, ServerConfig(served_model_name="tiny-embed")) as running:
        code = main(
            ["--base-url", running.base_url, "--tokenizer", str(model_dir), "--endpoint", "/v1/embeddings"]
            + ["--num-prompts", "6", "--input-len", "24", "--max-concurrency", "3", "--disable-tqdm"]
            + ["--result-json", str(out)]
        )
        running.wait_idle()
    assert code == 0
    record = json.loads(out.read_text())
    assert record["model"] == "tiny-embed" and record["completed"] == 6 and record["failed"] == 0
    assert record["input_lens"] == [24] * 6 and record["total_output_tokens"] == 0
    assert record["ttft_ms"]["mean"] == pytest.approx(record["e2el_ms"]["mean"])
    assert "Request throughput (req/s)" in capsys.readouterr().out


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_bench_serve_against_the_tiny_model(server, tiny_model_dir, tmp_path, capsys, caplog, endpoint):
    out = tmp_path / "result.json"
    with caplog.at_level(logging.INFO):
        code = main(
            [
                "--base-url",
                server.base_url,
                "--tokenizer",
                str(tiny_model_dir),
                "--endpoint",
                endpoint,
                "--num-prompts",
                "6",
                "--input-len",
                "24",
                "--output-len",
                "5",
                "--max-concurrency",
                "3",
                "--ignore-eos",
                "--goodput",
                "e2el:600000",
                "--result-json",
                str(out),
                "--disable-tqdm",
            ]
        )
    assert code == 0
    assert not [r for r in caplog.records if r.name.startswith("httpx")]  # no line per request over the bar
    record = json.loads(out.read_text())
    assert record["model"] == "tiny" and record["completed"] == 6 and record["failed"] == 0
    assert record["output_lens"] == [5] * 6 and record["total_output_tokens"] == 30
    if endpoint == "completions":
        assert record["input_lens"] == [24] * 6  # exact lengths, as the server counted them
    assert record["request_goodput"] == record["request_throughput"]  # all six within the 600 s SLO
    assert record["ttft_ms"]["mean"] <= record["e2el_ms"]["mean"]
    assert all(len(itl) <= 4 for itl in record["itls_s"])  # a chunk per token, unless a token adds no text yet
    assert "Output token throughput (tok/s)" in capsys.readouterr().out

    # benchmarks.report reads the file: one row, the dataset and load shape its workload, the model its server
    from benchmarks.report import main as report_main

    assert report_main([str(out)]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| random")]
    assert len(rows) == 1 and rows[0].startswith("| random (3 concurrent) | tiny | ")
    assert "| 5.0 (5) | 100% of requests |" in rows[0]  # 5 tokens each as asked; all within the SLO


def test_benchmarks_report_says_what_it_reads(tmp_path, capsys):
    from benchmarks.report import main as report_main

    other = tmp_path / "other.json"
    other.write_text(json.dumps({"model": "m", "runs": []}))
    assert report_main([str(other)]) == 2
    err = capsys.readouterr().err
    assert f"{other} is not a `pagedserve bench serve --result-json` file (no dataset" in err
    assert "RESULTS_DIR" in err and "RUN.json" in err
    assert report_main([str(tmp_path)]) == 2
    assert f"{tmp_path} has no results.json (python -m benchmarks.peers writes one)" in capsys.readouterr().err


def _bench_parsers() -> dict[str, argparse.ArgumentParser]:
    from engine.bench import build_parser as offline_parser
    from scheduler.bench import build_parser as scheduler_parser
    from server.benchmark.serve import build_parser as serve_parser

    return {"serve": serve_parser(), "offline": offline_parser(), "scheduler": scheduler_parser()}


@pytest.mark.parametrize("kind", ["serve", "offline", "scheduler"])
def test_every_bench_option_says_what_it_does(kind):
    parser = _bench_parsers()[kind]
    assert parser.prog == f"pagedserve bench {kind}"
    for action in parser._actions:
        assert action.help and "see above" not in action.help, f"{kind}: {action.option_strings} has no help"
    assert "python -m" not in (parser.description or "").split("\n")[0]


def test_pagedserve_bench_help_points_to_its_own_commands(capsys):
    from server.cli import main as cli_main

    with pytest.raises(SystemExit) as exit_:
        cli_main(["bench", "--help"])
    out = capsys.readouterr().out
    assert exit_.value.code == 0 and "python -m" not in out
    words = " ".join(out.split())  # argparse wraps the lines
    assert all(f"(flags: pagedserve bench {kind} --help)" in words for kind in ("scheduler", "offline", "serve"))


def test_bench_serve_reports_an_unreachable_server(capsys):
    code = main(
        [
            "--base-url",
            f"http://127.0.0.1:{free_port()}",
            "--model",
            "x",
            "--num-prompts",
            "1",
            "--disable-tqdm",
            "--input-len",
            "4",
        ]
    )
    assert code == 1 and "first request failed" in capsys.readouterr().err


def test_bench_serve_takes_vllms_spellings():
    """`vllm bench serve --host H --port P --dataset-name random --random-input-len N ...` is how vLLM users
    run it; `pagedserve bench serve` refused each of those as unrecognized arguments (exit 2)."""
    from server.benchmark.serve import parse_args

    args = parse_args(
        [
            "--host",
            "10.0.0.2",
            "--port",
            "8011",
            "--dataset-name",
            "random",
            "--random-input-len",
            "24",
            "--random-output-len",
            "5",
            "--random-range-ratio",
            "0.5",
            "--endpoint",
            "/v1/chat/completions",
        ]
    )
    assert args.base_url == "http://10.0.0.2:8011" and args.dataset == "random" and args.endpoint == "chat"
    assert (args.input_len, args.output_len, args.range_ratio) == (24, 5, 0.5)
    assert parse_args(["--endpoint", "/v1/completions"]).endpoint == "completions"
    assert parse_args([]).base_url == "http://127.0.0.1:8000"  # the default as before
    assert parse_args(["--base-url", "http://a:1", "--port", "2"]).base_url == "http://a:1"  # as vLLM: it wins
    assert parse_args(["--host", "::1", "--port", "9"]).base_url == "http://[::1]:9"
    assert parse_args(["--endpoint", "/v1/embeddings"]).endpoint == "embeddings"
    with pytest.raises(SystemExit):
        parse_args(["--endpoint", "/v1/audio/transcriptions"])
