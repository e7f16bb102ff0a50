"""On a CUDA device with NVML (skipped without them): the GPU monitor reads the device torch uses."""

import importlib.util

import pytest
import torch

from server.observability.gpu_monitor import cuda_devices, start_gpu_monitor

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(importlib.util.find_spec("pynvml") is None, reason="needs pynvml (the gpu extra)"),
]


def test_the_monitor_reads_torchs_device_through_nvml():
    devices = cuda_devices(torch.device("cuda"))
    assert len(devices) == 1 and devices[0].uuid is not None
    monitor = start_gpu_monitor(devices, period=3600)
    assert monitor is not None
    try:
        (sample,) = monitor.samples
        _, total = torch.cuda.mem_get_info(devices[0].ordinal)
        # not equal: the driver reserves some memory from what the CUDA runtime reports (an H100 80GB:
        # 81,251 MiB through torch, 81,559 MiB through NVML)
        assert abs(sample.memory_total - total) <= 0.02 * total
        assert 0 < sample.memory_used <= sample.memory_total
        assert sample.utilization is not None and 0 <= sample.utilization <= 1
    finally:
        monitor.close()
    assert monitor.samples == ()
