"""GPU utilization and memory read through NVML (`pynvml`, the `gpu` extra) on a thread of its own.

    sampler thread, every period               event loop, GET /metrics
    ----------------------------               ------------------------
    NVML reads -> tuple[GpuSample] --swap-->   GpuMonitor.samples (a tuple read; no NVML call)

Only the GPUs the engine runs on are watched, each named by its NVML index (as nvidia-smi numbers
them). Without CUDA, without `pynvml`, or when NVML does not initialise there is no monitor, and
/metrics has no GPU family at all.

From torch's device to NVML's: by the device UUID torch reports, which holds whatever
CUDA_VISIBLE_DEVICES and CUDA_DEVICE_ORDER say. Without a UUID, the ordinal is looked up in
CUDA_VISIBLE_DEVICES' list of indices (or taken as the NVML index when it is unset), which assumes
CUDA numbers devices in PCI bus order as NVML does (CUDA_DEVICE_ORDER=PCI_BUS_ID, or alike GPUs).
"""

from __future__ import annotations

import importlib
import logging
import os
import threading
from dataclasses import dataclass
from types import ModuleType
from typing import Callable, Mapping, Optional, Sequence, TypeVar

import torch

logger = logging.getLogger(__name__)

SAMPLE_PERIOD_S = 1.0
_JOIN_TIMEOUT_S = 5.0

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class GpuSample:
    """One GPU's readings at one time; a reading the device does not report is None."""

    gpu: str  # the NVML index
    utilization: Optional[float]  # fraction of the last sample period in which a kernel ran, 0 to 1
    memory_used: Optional[int]  # bytes, every process's
    memory_total: Optional[int]  # bytes


@dataclass(frozen=True, slots=True)
class CudaDevice:
    """A device as torch sees it: its ordinal (cuda:N) and, when torch reports it, NVML's UUID for it."""

    ordinal: int
    uuid: Optional[str]


class GpuMonitor:
    """Reads `handles` ((NVML index, NVML handle) pairs) every `period` seconds on a daemon thread."""

    def __init__(self, nvml: ModuleType, handles: Sequence[tuple[str, object]], period: float = SAMPLE_PERIOD_S):
        self._nvml = nvml
        self._handles = tuple(handles)
        self._period = period
        self._samples: tuple[GpuSample, ...] = ()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._logged: set[tuple[str, str]] = set()  # (gpu, reading) whose failure was logged

    @property
    def samples(self) -> tuple[GpuSample, ...]:
        """The latest round of readings (empty before the first and after `close`); calls no NVML."""
        return self._samples

    @property
    def gpus(self) -> tuple[str, ...]:
        return tuple(gpu for gpu, _ in self._handles)

    def sample(self) -> None:
        """One round of NVML reads, on the calling thread."""
        samples = tuple(self._read(gpu, handle) for gpu, handle in self._handles)
        if not self._stop.is_set():
            self._samples = samples

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="gpu-metrics", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stops the thread, forgets the readings and shuts NVML down. Blocking: call it off the event loop."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(_JOIN_TIMEOUT_S)
        self._samples = ()
        try:
            self._nvml.nvmlShutdown()
        except self._nvml.NVMLError as error:
            logger.debug("nvmlShutdown: %s", error)

    def _run(self) -> None:
        try:
            while not self._stop.wait(self._period):
                self.sample()
        except Exception:  # outside NVML's own errors: stop, rather than export frozen readings
            logger.exception("GPU metrics off: the sampler thread failed")
            self._samples = ()

    def _read(self, gpu: str, handle: object) -> GpuSample:
        nvml = self._nvml
        rates = self._reading(gpu, "utilization", lambda: nvml.nvmlDeviceGetUtilizationRates(handle))
        memory = self._reading(gpu, "memory", lambda: nvml.nvmlDeviceGetMemoryInfo(handle))
        return GpuSample(
            gpu=gpu,
            utilization=None if rates is None else rates.gpu / 100,
            memory_used=None if memory is None else int(memory.used),
            memory_total=None if memory is None else int(memory.total),
        )

    def _reading(self, gpu: str, what: str, read: Callable[[], T]) -> Optional[T]:
        try:
            return read()
        except self._nvml.NVMLError as error:
            if (gpu, what) not in self._logged:
                self._logged.add((gpu, what))
                logger.warning("GPU %s: NVML cannot read its %s (%s); that metric is left out", gpu, what, error)
            return None


def cuda_devices(device: torch.device) -> list[CudaDevice]:
    """The CUDA device the engine runs on, or none when it runs elsewhere. An index-less `cuda` is the
    calling thread's current device: call this on the thread that built the engine (the event loop's)."""
    if device.type != "cuda":
        return []
    ordinal = device.index if device.index is not None else torch.cuda.current_device()
    uuid = getattr(torch.cuda.get_device_properties(ordinal), "uuid", None)
    return [CudaDevice(ordinal, nvml_uuid(uuid))]


def nvml_uuid(uuid: object) -> Optional[str]:
    """NVML's spelling of a device UUID: torch prints it bare, NVML wants the `GPU-` prefix."""
    if uuid is None:
        return None
    text = str(uuid)
    return text if text.startswith(("GPU-", "MIG-")) else f"GPU-{text}"


def start_gpu_monitor(
    devices: Sequence[CudaDevice],
    nvml: Optional[ModuleType] = None,
    period: float = SAMPLE_PERIOD_S,
    environ: Mapping[str, str] = os.environ,
) -> Optional[GpuMonitor]:
    """A running monitor of `devices`, one round already read; None (and a log line) when there is no
    device, no `pynvml`, or NVML does not work. Blocking (NVML calls): call it off the event loop."""
    if not devices:
        logger.info("GPU metrics off: the engine does not run on CUDA")
        return None
    if nvml is None:
        try:
            nvml = importlib.import_module("pynvml")
        except ImportError:
            logger.warning("GPU metrics off: pynvml is missing (pip install 'pagedserve[gpu]' or nvidia-ml-py)")
            return None
    try:
        nvml.nvmlInit()
    except nvml.NVMLError as error:
        logger.warning("GPU metrics off: NVML did not initialise (%s)", error)
        return None
    handles = [pair for pair in (_nvml_handle(nvml, device, environ) for device in devices) if pair is not None]
    monitor = GpuMonitor(nvml, handles, period)
    if not handles:
        logger.warning("GPU metrics off: NVML knows none of the engine's devices")
        monitor.close()
        return None
    monitor.sample()
    monitor.start()
    logger.info("GPU metrics on: NVML GPU %s, read every %g s", ", ".join(monitor.gpus), period)
    return monitor


def _nvml_handle(nvml: ModuleType, device: CudaDevice, environ: Mapping[str, str]) -> Optional[tuple[str, object]]:
    """(NVML index, handle) of `device`: by its UUID, else by its place in CUDA_VISIBLE_DEVICES."""
    if device.uuid is not None:
        try:
            handle = nvml.nvmlDeviceGetHandleByUUID(device.uuid)
            return str(nvml.nvmlDeviceGetIndex(handle)), handle
        except nvml.NVMLError as error:
            logger.info("GPU metrics: NVML does not know UUID %s (%s); trying CUDA_VISIBLE_DEVICES", device.uuid, error)
    index = visible_nvml_index(device.ordinal, environ.get("CUDA_VISIBLE_DEVICES"))
    if index is None:
        logger.warning(
            "GPU metrics: cuda:%d has no NVML index in CUDA_VISIBLE_DEVICES=%s; it is left out",
            device.ordinal,
            environ.get("CUDA_VISIBLE_DEVICES"),
        )
        return None
    try:
        handle = nvml.nvmlDeviceGetHandleByIndex(index)
        return str(nvml.nvmlDeviceGetIndex(handle)), handle
    except nvml.NVMLError as error:
        logger.warning("GPU metrics: no NVML device %d for cuda:%d (%s); it is left out", index, device.ordinal, error)
        return None


def visible_nvml_index(ordinal: int, visible: Optional[str]) -> Optional[int]:
    """The NVML index of CUDA ordinal `ordinal` under CUDA_VISIBLE_DEVICES=`visible`, when it is a list of
    indices (None for a UUID entry or an ordinal past the list). CUDA reads the list up to its first
    invalid entry."""
    if visible is None:
        return ordinal
    entries: list[int] = []
    for entry in visible.split(","):
        entry = entry.strip()
        if not entry.isdigit():
            break
        entries.append(int(entry))
    return entries[ordinal] if 0 <= ordinal < len(entries) else None
