"""GPU metrics from NVML, with a fake `pynvml` at its API boundary (no GPU needed).

The fake records every call with the thread that made it, so the tests can show that a scrape
never calls NVML: only the start-up round (off the event loop) and the sampler thread do.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from dataclasses import dataclass, field
from types import ModuleType, SimpleNamespace

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from scheduler import SchedulerStats
from server.config.server_config import ServerConfig
from server.observability.gpu_monitor import (
    CudaDevice,
    GpuMonitor,
    cuda_devices,
    nvml_uuid,
    start_gpu_monitor,
    visible_nvml_index,
)
from server.observability.metrics import ServerMetrics, cache_info
from tests.promtool import check_metrics
from tests.server.conftest import start_server

GPU_FAMILIES = {
    "pagedserve_gpu_utilization_ratio": "gauge",
    "pagedserve_gpu_memory_used_bytes": "gauge",
    "pagedserve_gpu_memory_total_bytes": "gauge",
}
GIB = 1 << 30


class NVMLError(Exception):
    pass


@dataclass
class FakeGpu:
    uuid: str
    utilization_percent: int = 37
    memory_used: int = 3 * GIB
    memory_total: int = 141 * GIB
    utilization_supported: bool = True


@dataclass
class FakeNvml:
    """The part of pynvml the monitor uses, over `gpus` (list position = NVML index)."""

    gpus: list[FakeGpu]
    init_error: bool = False
    calls: list[tuple[str, str]] = field(default_factory=list)  # (function, thread name)
    initialised: bool = False
    shut_down: bool = False

    def module(self) -> ModuleType:
        module = ModuleType("pynvml")
        module.NVMLError = NVMLError
        for name in (
            "nvmlInit",
            "nvmlShutdown",
            "nvmlDeviceGetHandleByUUID",
            "nvmlDeviceGetHandleByIndex",
            "nvmlDeviceGetIndex",
            "nvmlDeviceGetUtilizationRates",
            "nvmlDeviceGetMemoryInfo",
        ):
            setattr(module, name, self._recorded(name, getattr(self, name)))
        return module

    def _recorded(self, name, function):
        def call(*args):
            self.calls.append((name, threading.current_thread().name))
            return function(*args)

        return call

    def nvmlInit(self):
        if self.init_error:
            raise NVMLError("Driver Not Loaded")
        self.initialised = True

    def nvmlShutdown(self):
        self.shut_down = True

    def nvmlDeviceGetHandleByUUID(self, uuid):
        for index, gpu in enumerate(self.gpus):
            if gpu.uuid == uuid:
                return ("handle", index)
        raise NVMLError("Not Found")

    def nvmlDeviceGetHandleByIndex(self, index):
        if not 0 <= index < len(self.gpus):
            raise NVMLError("Invalid Argument")
        return ("handle", index)

    def nvmlDeviceGetIndex(self, handle):
        return handle[1]

    def nvmlDeviceGetUtilizationRates(self, handle):
        gpu = self.gpus[handle[1]]
        if not gpu.utilization_supported:
            raise NVMLError("Not Supported")
        return SimpleNamespace(gpu=gpu.utilization_percent, memory=5)

    def nvmlDeviceGetMemoryInfo(self, handle):
        gpu = self.gpus[handle[1]]
        return SimpleNamespace(total=gpu.memory_total, used=gpu.memory_used, free=gpu.memory_total - gpu.memory_used)

    def count(self, name: str) -> int:
        return sum(1 for called, _ in self.calls if called == name)


def four_gpus() -> FakeNvml:
    return FakeNvml([FakeGpu(f"GPU-{i}000-aaaa", utilization_percent=10 * i, memory_used=i * GIB) for i in range(4)])


def make_metrics(model_name: str = "tiny") -> ServerMetrics:
    stats = SchedulerStats(
        num_running=0, num_waiting=0, kv_cache_usage=0.0, num_preemptions=0, prefix_cache_queries=0, prefix_cache_hits=0
    )
    return ServerMetrics(
        model_name,
        lambda: stats,
        cache_info(
            num_blocks=8,
            block_size=16,
            enable_prefix_caching=True,
            dtype="bfloat16",
            attention_backend="flash",
            max_model_len=128,
        ),
    )


def gpu_samples(text: str) -> dict[str, dict[str, float]]:
    """{family: {gpu label: value}} of the GPU families in an exposition; each sample has model_name "tiny"."""
    found: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(text):
        if family.name.startswith("pagedserve_gpu_"):
            assert family.type == GPU_FAMILIES[family.name]
            for sample in family.samples:
                assert sample.labels.keys() == {"model_name", "gpu"} and sample.labels["model_name"] == "tiny"
                found.setdefault(family.name, {})[sample.labels["gpu"]] = sample.value
    return found


@pytest.fixture
def monitor_of():
    """Starts monitors (long period unless told) and closes them after the test."""
    started: list[GpuMonitor] = []

    def start(fake: FakeNvml, devices, period: float = 3600.0, environ=None):
        monitor = start_gpu_monitor(devices, fake.module(), period=period, environ=environ or {})
        if monitor is not None:
            started.append(monitor)
        return monitor

    yield start
    for monitor in started:
        monitor.close()


# ---------------------------------------------------------------------------------------------- exposition


def test_families_names_types_labels_values_and_promtool(monitor_of):
    fake = four_gpus()
    metrics = make_metrics()
    metrics.gpu_monitor = monitor_of(fake, [CudaDevice(0, "GPU-2000-aaaa"), CudaDevice(1, "GPU-3000-aaaa")])
    text = metrics.render().decode()
    assert gpu_samples(text) == {
        "pagedserve_gpu_utilization_ratio": {"2": 0.2, "3": 0.3},
        "pagedserve_gpu_memory_used_bytes": {"2": 2 * GIB, "3": 3 * GIB},
        "pagedserve_gpu_memory_total_bytes": {"2": 141 * GIB, "3": 141 * GIB},
    }
    assert "# TYPE pagedserve_gpu_memory_total_bytes gauge" in text
    result = check_metrics(text)
    assert result.returncode == 0 and result.stdout.strip() == result.stderr.strip() == "", (
        f"promtool check metrics:\n{result.stdout}{result.stderr}"
    )


def test_no_monitor_no_families():
    assert gpu_samples(make_metrics().render().decode()) == {}


def test_a_reading_the_device_lacks_is_left_out_and_logged_once(monitor_of, caplog):
    fake = FakeNvml([FakeGpu("GPU-a", utilization_supported=False), FakeGpu("GPU-b", utilization_percent=50)])
    metrics = make_metrics()
    with caplog.at_level(logging.WARNING, logger="server.observability.gpu_monitor"):
        metrics.gpu_monitor = monitor = monitor_of(fake, [CudaDevice(0, "GPU-a"), CudaDevice(1, "GPU-b")])
        monitor.sample()
        monitor.sample()
    found = gpu_samples(metrics.render().decode())
    assert found["pagedserve_gpu_utilization_ratio"] == {"1": 0.5}
    assert found["pagedserve_gpu_memory_used_bytes"].keys() == {"0", "1"}
    assert len([r for r in caplog.records if "utilization" in r.getMessage()]) == 1


def test_only_utilization_unsupported_everywhere_drops_that_family(monitor_of):
    fake = FakeNvml([FakeGpu("GPU-a", utilization_supported=False)])
    metrics = make_metrics()
    metrics.gpu_monitor = monitor_of(fake, [CudaDevice(0, "GPU-a")])
    assert set(gpu_samples(metrics.render().decode())) == {
        "pagedserve_gpu_memory_used_bytes",
        "pagedserve_gpu_memory_total_bytes",
    }


# ---------------------------------------------------------------------------------------------- sampling


def test_a_scrape_calls_no_nvml(monitor_of):
    fake = four_gpus()
    metrics = make_metrics()
    metrics.gpu_monitor = monitor_of(fake, [CudaDevice(0, "GPU-0000-aaaa")])  # the period is an hour
    calls = len(fake.calls)
    for _ in range(5):
        assert gpu_samples(metrics.render().decode())
    assert len(fake.calls) == calls


def test_the_sampler_thread_reads_every_period_and_scrapes_see_it(monitor_of):
    fake = four_gpus()
    metrics = make_metrics()
    metrics.gpu_monitor = monitor_of(fake, [CudaDevice(0, "GPU-1000-aaaa")], period=0.01)
    assert fake.count("nvmlDeviceGetMemoryInfo") == 1  # the first round, taken before start returns
    fake.gpus[1].memory_used = 7 * GIB
    deadline = time.monotonic() + 5
    while gpu_samples(metrics.render().decode())["pagedserve_gpu_memory_used_bytes"]["1"] != 7 * GIB:
        assert time.monotonic() < deadline, "the sampler thread did not take a new reading"
        time.sleep(0.01)
    later = [thread for name, thread in fake.calls[fake.calls.index(("nvmlDeviceGetMemoryInfo", "MainThread")) + 1 :]]
    assert later and set(later) == {"gpu-metrics"}


def test_close_stops_the_thread_shuts_nvml_down_and_drops_the_families(monitor_of):
    fake = four_gpus()
    metrics = make_metrics()
    monitor = start_gpu_monitor([CudaDevice(0, "GPU-0000-aaaa")], fake.module(), period=0.01, environ={})
    metrics.gpu_monitor = monitor
    assert gpu_samples(metrics.render().decode())
    monitor.close()
    assert fake.shut_down
    assert gpu_samples(metrics.render().decode()) == {}
    assert not any(t.name == "gpu-metrics" and t.is_alive() for t in threading.enumerate())
    calls = len(fake.calls)
    time.sleep(0.05)
    assert len(fake.calls) == calls


def test_a_sampler_failure_outside_nvml_drops_the_families_instead_of_freezing_them(monitor_of, caplog):
    fake = four_gpus()
    metrics = make_metrics()
    metrics.gpu_monitor = monitor = monitor_of(fake, [CudaDevice(0, "GPU-0000-aaaa")], period=0.01)
    assert gpu_samples(metrics.render().decode())
    fake.gpus[0].memory_used = None  # int(None): a TypeError on the sampler thread
    deadline = time.monotonic() + 5
    while monitor.samples:
        assert time.monotonic() < deadline, "the sampler kept its old readings"
        time.sleep(0.01)
    assert gpu_samples(metrics.render().decode()) == {}
    assert "the sampler thread failed" in caplog.text


# ---------------------------------------------------------------------------------------------- off, and why


def test_nvml_init_failure_means_no_families_and_one_log_line(caplog):
    fake = FakeNvml([FakeGpu("GPU-a")], init_error=True)
    with caplog.at_level(logging.INFO, logger="server.observability.gpu_monitor"):
        assert start_gpu_monitor([CudaDevice(0, "GPU-a")], fake.module(), environ={}) is None
    records = [r for r in caplog.records if r.name == "server.observability.gpu_monitor"]
    assert len(records) == 1 and records[0].levelno == logging.WARNING
    assert "NVML did not initialise" in records[0].getMessage() and "Driver Not Loaded" in records[0].getMessage()
    assert fake.calls == [("nvmlInit", "MainThread")]
    assert not any(t.name == "gpu-metrics" for t in threading.enumerate())


def test_missing_pynvml_means_no_monitor_and_a_log_line(monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # `import pynvml` raises ImportError
    with caplog.at_level(logging.INFO, logger="server.observability.gpu_monitor"):
        assert start_gpu_monitor([CudaDevice(0, "GPU-a")], environ={}) is None
    assert [r.levelno for r in caplog.records if r.name == "server.observability.gpu_monitor"] == [logging.WARNING]
    assert "pynvml is missing" in caplog.text


def test_pynvml_is_imported_when_no_module_is_passed(monkeypatch):
    fake = FakeNvml([FakeGpu("GPU-a")])
    monkeypatch.setitem(sys.modules, "pynvml", fake.module())
    monitor = start_gpu_monitor([CudaDevice(0, "GPU-a")], period=3600, environ={})
    try:
        assert monitor is not None and monitor.gpus == ("0",)
    finally:
        monitor.close()


def test_on_cpu_there_is_no_device_to_watch(caplog):
    assert cuda_devices(torch.device("cpu")) == []
    fake = four_gpus()
    with caplog.at_level(logging.INFO, logger="server.observability.gpu_monitor"):
        assert start_gpu_monitor([], fake.module(), environ={}) is None
    assert fake.calls == []  # NVML is not even initialised
    assert "does not run on CUDA" in caplog.text


def test_no_known_device_means_no_monitor_and_nvml_shut_down(caplog):
    fake = four_gpus()
    with caplog.at_level(logging.WARNING, logger="server.observability.gpu_monitor"):
        assert start_gpu_monitor([CudaDevice(7, None)], fake.module(), environ={}) is None
    assert fake.shut_down
    assert "none of the engine's devices" in caplog.text


# ---------------------------------------------------------------------------------------------- which GPU


def test_the_uuid_names_the_nvml_device_whatever_the_ordinal(monitor_of):
    fake = four_gpus()
    monitor = monitor_of(fake, [CudaDevice(0, "GPU-3000-aaaa")], environ={"CUDA_VISIBLE_DEVICES": "3"})
    assert monitor.gpus == ("3",)
    assert fake.count("nvmlDeviceGetHandleByIndex") == 0


def test_without_a_uuid_cuda_visible_devices_maps_the_ordinal(monitor_of):
    fake = four_gpus()
    assert monitor_of(fake, [CudaDevice(1, None)], environ={"CUDA_VISIBLE_DEVICES": "2,3"}).gpus == ("3",)
    assert monitor_of(four_gpus(), [CudaDevice(1, None)]).gpus == ("1",)  # unset: the ordinal is the index


def test_an_unknown_uuid_falls_back_to_cuda_visible_devices(monitor_of):
    monitor = monitor_of(four_gpus(), [CudaDevice(0, "GPU-gone")], environ={"CUDA_VISIBLE_DEVICES": "2"})
    assert monitor.gpus == ("2",)


@pytest.mark.parametrize(
    "ordinal, visible, expected",
    [
        (0, None, 0),
        (3, None, 3),
        (0, "2,3", 2),
        (1, " 2, 3 ", 3),
        (2, "2,3", None),
        (0, "GPU-8f2e,1", None),
        (1, "1,foo,2", None),
        (0, "1,foo,2", 1),
    ],
)
def test_visible_nvml_index(ordinal, visible, expected):
    assert visible_nvml_index(ordinal, visible) == expected


def test_nvml_uuid_spelling():
    assert nvml_uuid("6bd6c8b7-9d38-4d8c") == "GPU-6bd6c8b7-9d38-4d8c"
    assert nvml_uuid("GPU-6bd6") == "GPU-6bd6" and nvml_uuid("MIG-1234") == "MIG-1234"
    assert nvml_uuid(None) is None


# ---------------------------------------------------------------------------------------------- the app


def test_cpu_server_exports_no_gpu_family(server):
    with server.client() as http:
        text = http.get("/metrics").text
    assert "pagedserve_gpu_" not in text
    assert server.state.metrics.gpu_monitor is None


def test_the_lifespan_starts_and_stops_the_monitor_and_scrapes_never_call_nvml(tiny_model_dir, monkeypatch):
    """A CPU engine made to look as if on cuda:0: the app's start-up and shutdown, over HTTP."""
    fake = four_gpus()
    monkeypatch.setitem(sys.modules, "pynvml", fake.module())
    monkeypatch.setattr("server.app.cuda_devices", lambda device: [CudaDevice(0, "GPU-2000-aaaa")])
    uv, thread, running = start_server(tiny_model_dir, ServerConfig(served_model_name="tiny"))
    try:
        with running.client() as http:
            scrapes = [http.get("/metrics").text for _ in range(3)]
        for text in scrapes:
            assert gpu_samples(text)["pagedserve_gpu_memory_used_bytes"] == {"2": 2 * GIB}
            assert check_metrics(text).returncode == 0
        assert fake.initialised and not fake.shut_down
        callers = {name for _, name in fake.calls}
        assert "uvicorn" not in callers  # the event loop's thread (start_server names it) called no NVML
        assert callers and all(name.startswith("asyncio_") or name == "gpu-metrics" for name in callers)
    finally:
        uv.should_exit = True
        thread.join(30)
    assert fake.shut_down
    assert running.state.metrics.gpu_monitor is None
    assert not any(t.name == "gpu-metrics" and t.is_alive() for t in threading.enumerate())
