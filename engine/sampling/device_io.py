"""Moving the sampler's small inputs up and its results down without stalling the device's queue.

`torch.tensor(values, device="cuda")` copies from pageable memory and waits for the stream (a host
sync per call); `.tolist()` on a device tensor waits too. The sampler instead stages its inputs in
pinned memory and copies them up without waiting, and brings every result of a step down in one
go: non-blocking copies into pinned memory, then one synchronization. On CPU both are plain tensors.
"""

from __future__ import annotations

from typing import Sequence

import torch


def to_device(values: Sequence, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list as a tensor on `device`, copied up asynchronously (from pinned memory) on CUDA."""
    tensor = torch.tensor(values, dtype=dtype)
    if device.type == "cpu":
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)


def to_host(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """Host copies of the tensors, after one wait for the device (none when they are on the host)."""
    devices = {t.device for t in tensors if t.device.type != "cpu"}
    if not devices:
        return list(tensors)
    copies = [t.to("cpu", non_blocking=True) for t in tensors]  # into pinned memory
    for device in devices:
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(device))
        done.synchronize()
    return copies
