"""The OpenMP runtime of a `pagedserve serve` process, set up before torch loads.

torch's CPU build and the native kernels run on GNU libgomp (`torch.__config__.parallel_info()`), which reads
its settings from the environment once, when the library loads, i.e. at `import torch`:

    OMP_NUM_THREADS   the default team size: the engine's thread count (engine/cpu_threads.py), so that a
                      native kernel's parallel region on a fresh thread sizes its team like torch's pool does
    GOMP_SPINCOUNT    how long an idle worker spins before it sleeps on a futex (libgomp's default: 300,000
                      spins, milliseconds); WAIT_SPIN_COUNT below is the measured choice (docs/performance.md).

The variables the user set are left alone (OMP_WAIT_POLICY or GOMP_SPINCOUNT: their own policy); spawned ranks
inherit the environment. The CLI imports nothing that imports torch before `prepare_cpu_runtime` (a test checks).
"""

from __future__ import annotations

import logging
import sys
from typing import MutableMapping, Optional

from engine.cpu_contention import ThreadGovernor
from engine.cpu_threads import OMP_NUM_THREADS, CpuThreads, machine_cpu_threads
from engine.engine_config import EngineConfig

logger = logging.getLogger(__name__)

WAIT_SPIN_COUNT = "100000"
"""GOMP_SPINCOUNT pagedserve sets: a third of libgomp's default. Measured on 2 cores (docs/performance.md): as fast
as the default on a quiet machine, where shorter spins were not (30,000 cost ~10%, 10,000 ~25%, passive 3x: each
sleep costs a wake-up at the next parallel region); a third of the CPU time burnt spinning between steps. Beside
a busy neighbour no spin count saved a 2-thread team (4-6x slower); the team shrinks instead
(engine/cpu_contention.py)."""
WAIT_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")


def openmp_environment(threads: CpuThreads, environ: MutableMapping[str, str]) -> dict[str, str]:
    """The variables to set for `threads`: the team size, and the spin count unless the user chose a wait
    policy."""
    wanted = {OMP_NUM_THREADS: str(threads.count)}
    if not any(environ.get(name) for name in WAIT_VARIABLES):
        wanted["GOMP_SPINCOUNT"] = WAIT_SPIN_COUNT
    return wanted


def prepare_cpu_runtime(requested: Optional[int], environ: MutableMapping[str, str]) -> CpuThreads:
    """Size the engine's threads from the machine (or `requested`), set the OpenMP variables in `environ` (the
    process's own) and log both; the thread count."""
    threads = machine_cpu_threads(requested, environ)
    environ.update(openmp_environment(threads, environ))
    wait = ", ".join(f"{name}={environ[name]}" for name in WAIT_VARIABLES if environ.get(name))
    logger.info("CPU threads: %s; OpenMP wait: %s", threads.describe(), wait)
    if "torch" in sys.modules:  # (a caller that imported torch first: libgomp has read its settings already)
        logger.warning("torch was imported before the OpenMP settings were made: they apply to child processes only")
    return threads


def thread_governor(threads: CpuThreads, config: EngineConfig, device_type: str) -> Optional[ThreadGovernor]:
    """The engine thread's team size adapted to other processes' use of its CPUs (engine/cpu_contention.py), when
    the count came from the machine, on CPU, with one process and outside batch-invariant mode; else None."""
    if threads.chosen or threads.count < 2 or device_type != "cpu":
        return None
    if config.parallel.world_size > 1 or config.batch_invariant:
        return None
    import torch

    return ThreadGovernor(threads.count, torch.set_num_threads)
