"""Every PromQL expression of the Grafana dashboard and of the alert rules, evaluated by a real Prometheus
server (Debian's, a plain process on 127.0.0.1) that scrapes two real `pagedserve serve` replicas after a
short workload, with the shipped prometheus.yml and alerts.yml (targets and intervals adapted). Each
expression must return data, so a renamed metric or label breaks this test instead of a panel going blank.
Grafana itself cannot be installed here (no registry has it): its dashboard is checked through its queries."""

from __future__ import annotations

import json
import math
import re
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import yaml

from tests.deploy.tools import DEPLOY, require_binary, start_replicas, stop, wait_for_port
from tests.ports import free_port
from tests.promtool import require_promtool

pytestmark = pytest.mark.timeout(300)

RATE_INTERVAL = "30s"  # what Grafana's $__rate_interval becomes (scrapes every second here)
GPU_ONLY = "pagedserve_gpu_"  # those series exist only where the engine runs on CUDA with NVML
SPEC_ONLY = "pagedserve_spec_decode_"  # and those where it speculates (--speculative-config): not these replicas
SIGNAL = re.compile(r"^(?P<signal>.+?)\s*(?:>|<|>=|<=|==|!=)\s*(?:bool\s+)?[0-9.e+-]+\s*$", re.DOTALL)


@pytest.fixture(scope="module")
def replicas(deploy_model_dir, tmp_path_factory):
    started = start_replicas(deploy_model_dir, tmp_path_factory.mktemp("prom-replicas"))
    yield started
    for replica in started:
        stop(replica.process)


@pytest.fixture(scope="module")
def prometheus(replicas, tmp_path_factory):
    """The shipped prometheus.yml scraping the two replicas every second, with the shipped alerts.yml."""
    binary = require_binary("prometheus", "prometheus")
    work = tmp_path_factory.mktemp("prometheus")
    port = free_port()
    config = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    config["global"].update(scrape_interval="1s", evaluation_interval="1s")
    config["rule_files"] = [str(DEPLOY / "prometheus" / "alerts.yml")]
    for job in config["scrape_configs"]:
        if job["job_name"] == "pagedserve":
            del job["dns_sd_configs"]  # compose's DNS names: here the two loopback replicas
            job["static_configs"] = [{"targets": [f"127.0.0.1:{replica.port}" for replica in replicas]}]
        else:
            job["static_configs"] = [{"targets": [f"127.0.0.1:{port}"]}]
    (work / "prometheus.yml").write_text(yaml.safe_dump(config))
    check = subprocess.run(
        [require_promtool(), "check", "config", str(work / "prometheus.yml")],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert check.returncode == 0, check.stdout + check.stderr
    log = work / "prometheus.log"
    with log.open("w") as out:
        process = subprocess.Popen(
            [
                binary,
                f"--config.file={work / 'prometheus.yml'}",
                f"--storage.tsdb.path={work / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        wait_for_port(port, process, 60, log)
        yield f"http://127.0.0.1:{port}", log
    finally:
        stop(process)


def query(prometheus_url: str, expr: str) -> list[dict]:
    response = httpx.get(f"{prometheus_url}/api/v1/query", params={"query": expr}, timeout=30)
    body = response.json()
    assert response.status_code == 200 and body["status"] == "success", f"{expr}\n{body}"
    return body["data"]["result"]


def wait_until(prometheus_url: str, expr: str, check, timeout: float = 60) -> list[dict]:
    deadline = time.monotonic() + timeout
    while True:
        result = query(prometheus_url, expr)
        if check(result) or time.monotonic() > deadline:
            return result
        time.sleep(0.3)


def _request(client: httpx.Client, prompt: str) -> None:
    reply = client.post(
        "/v1/completions",
        json={"model": "tiny", "prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True},
    )
    assert reply.status_code == 200, reply.text


def _first_requests(url: str) -> int:
    """One completion and one rejected request: the series exist from here on. (The per-request series exist at 0
    from start, but pagedserve_http_requests_total gets a series per route and status on its first response, and
    rate() over a series born with its final value is 0, so the workload proper comes after Prometheus has
    scraped these.)"""
    with httpx.Client(base_url=url, timeout=120) as client:
        _request(client, "first")
        assert (
            client.post("/v1/completions", json={"model": "tiny", "prompt": "x", "temperature": -1}).status_code == 400
        )
    return 1


def _workload(url: str) -> int:
    """Completions sharing a long prefix (prefix-cache hits), a streamed chat, a rejected request; the
    number of requests that finish."""
    prefix = "The quick brown fox jumps over the lazy dog. " * 6
    with httpx.Client(base_url=url, timeout=120) as client:
        for index in range(3):
            _request(client, prefix + str(index))
        with client.stream(
            "POST",
            "/v1/chat/completions",
            json={
                "model": "tiny",
                "stream": True,
                "max_tokens": 12,
                "ignore_eos": True,
                "messages": [{"role": "user", "content": "hello there"}],
            },
        ) as stream:
            assert stream.status_code == 200 and "data: [DONE]" in stream.read().decode()
        assert (
            client.post("/v1/completions", json={"model": "tiny", "prompt": "x", "temperature": -1}).status_code == 400
        )
    return 4


def _run_on_each(replicas, work) -> int:
    with ThreadPoolExecutor(len(replicas)) as pool:
        return sum(pool.map(work, [replica.url for replica in replicas]))


def _wait_for_successes(url: str, count: int) -> None:
    done = wait_until(
        url,
        "sum(pagedserve_request_success_total)",
        lambda result: bool(result) and float(result[0]["value"][1]) >= count,
    )
    assert done and float(done[0]["value"][1]) >= count, done
    time.sleep(2)  # a few more scrapes, and the rules evaluated (every second) on them


@pytest.fixture(scope="module")
def scraped(prometheus, replicas):
    """Prometheus URL once it has scraped both replicas through a short workload."""
    url, log = prometheus
    up = wait_until(url, 'up{job="pagedserve"} == 1', lambda result: len(result) == 2)
    assert len(up) == 2, f"Prometheus did not scrape both replicas:\n{log.read_text()[-3000:]}"
    finished = _run_on_each(replicas, _first_requests)
    _wait_for_successes(url, finished)
    finished += _run_on_each(replicas, _workload)
    _wait_for_successes(url, finished)
    return url


def _dashboard_exprs() -> list[tuple[str, str]]:
    dashboard = json.loads((DEPLOY / "grafana" / "dashboards" / "pagedserve.json").read_text())
    exprs = [
        (f"{panel['title']} [{target['refId']}]", target["expr"])
        for panel in dashboard["panels"]
        for target in panel.get("targets", [])
    ]
    for variable in dashboard["templating"]["list"]:
        match = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", variable["definition"])
        assert match, variable["definition"]
        exprs.append((f"variable ${variable['name']}", f"group by ({match[2]}) ({match[1]})"))
    return exprs


def _grafana_to_promql(expr: str) -> str:
    text = (
        expr.replace("$__rate_interval", RATE_INTERVAL).replace('"$model_name"', '".*"').replace('"$instance"', '".*"')
    )
    assert "$" not in text, f"a Grafana variable the test does not know: {expr}"
    return text


def test_every_dashboard_query_returns_data(scraped):
    exprs = _dashboard_exprs()
    assert len(exprs) >= 20
    empty, absent_checked = [], 0
    for name, expr in exprs:
        result = query(scraped, _grafana_to_promql(expr))
        if GPU_ONLY in expr or SPEC_ONLY in expr:
            # No GPU and no speculation here: those families are absent (not zero), by design; the query still
            # had to parse and run (test_static checks their names against what /metrics serves).
            assert result == [], (name, result)
            absent_checked += 1
            continue
        values = [float(sample["value"][1]) for sample in result]
        if not values or not any(math.isfinite(value) for value in values):
            empty.append((name, expr, result))
    assert not empty, "dashboard queries without data:\n" + "\n".join(f"{n}: {e} -> {r}" for n, e, r in empty)
    assert absent_checked == 3 + 3  # GPU, speculative decoding


def test_variables_list_the_model_and_both_replicas(scraped):
    models = query(scraped, "group by (model_name) (pagedserve_num_requests_running)")
    assert [sample["metric"]["model_name"] for sample in models] == ["tiny"]
    instances = query(scraped, 'group by (instance) (pagedserve_num_requests_running{model_name=~".*"})')
    assert len(instances) == 2


def test_every_alert_signal_returns_data(scraped):
    rules = yaml.safe_load((DEPLOY / "prometheus" / "alerts.yml").read_text())["groups"][0]["rules"]
    for rule in rules:
        match = SIGNAL.match(rule["expr"].strip())
        assert match, f"{rule['alert']}: not '<signal> <comparison> <threshold>': {rule['expr']}"
        result = query(scraped, match["signal"])
        values = [float(sample["value"][1]) for sample in result]
        assert len(result) >= 1 and any(math.isfinite(value) for value in values), (rule["alert"], result)
        assert query(scraped, rule["expr"]) == [], f"{rule['alert']} would fire on a healthy, idle server"


def test_prometheus_evaluates_the_rules_without_errors(scraped):
    groups = httpx.get(f"{scraped}/api/v1/rules", timeout=30).json()["data"]["groups"]
    rules = [rule for group in groups for rule in group["rules"]]
    assert len(rules) == 6
    for rule in rules:
        assert rule["health"] == "ok" and not rule.get("lastError"), rule
        assert rule["state"] == "inactive", rule


def test_the_server_down_alert_sees_a_stopped_replica(scraped, replicas):
    """`up == 0` for a replica that stops: the PagedserveDown signal as Prometheus evaluates it."""
    stopped = replicas[1]
    stop(stopped.process)
    down = wait_until(scraped, 'up{job="pagedserve"} == 0', lambda result: len(result) == 1)
    assert [sample["metric"]["instance"] for sample in down] == [f"127.0.0.1:{stopped.port}"]
