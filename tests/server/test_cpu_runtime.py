"""--cpu-threads / PAGEDSERVE_CPU_THREADS, and the OpenMP variables `pagedserve serve` sets before torch loads
(libgomp reads them once, at load): checked in a fresh process at the moment torch is imported."""

import json
import subprocess
import sys

import pytest

from engine.cpu_threads import CpuThreads
from server.config.settings import SettingsError, load_settings
from server.cpu_runtime import WAIT_SPIN_COUNT, openmp_environment
from tests.conftest import server_environment


def test_the_flag_and_the_variable_set_the_engines_threads():
    assert load_settings([], {}).engine.cpu_threads is None
    assert load_settings(["--cpu-threads", "3"], {}).engine.cpu_threads == 3
    assert load_settings([], {"PAGEDSERVE_CPU_THREADS": "2"}).engine.cpu_threads == 2
    assert load_settings(["--cpu-threads", "1"], {"PAGEDSERVE_CPU_THREADS": "2"}).engine.cpu_threads == 1
    with pytest.raises(SettingsError, match="--cpu-threads"):
        load_settings(["--cpu-threads", "0"], {})
    with pytest.raises(SettingsError, match="PAGEDSERVE_CPU_THREADS"):
        load_settings([], {"PAGEDSERVE_CPU_THREADS": "many"})


def test_a_wait_policy_the_user_chose_is_kept():
    threads = CpuThreads(2, "affinity mask")
    assert openmp_environment(threads, {}) == {"OMP_NUM_THREADS": "2", "GOMP_SPINCOUNT": WAIT_SPIN_COUNT}
    assert openmp_environment(threads, {"OMP_WAIT_POLICY": "active"}) == {"OMP_NUM_THREADS": "2"}
    assert openmp_environment(threads, {"GOMP_SPINCOUNT": "5"}) == {"OMP_NUM_THREADS": "2"}


# Runs the CLI and, at the moment anything first imports torch, prints the OpenMP variables and exits (cheaply:
# torch is never loaded). A model path that does not exist: if the import came later, serving would fail.
WATCH_TORCH = """
import json, os, sys
class WatchTorch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch":
            names = ("OMP_NUM_THREADS", "GOMP_SPINCOUNT", "OMP_WAIT_POLICY")
            print(json.dumps({k: os.environ.get(k) for k in names}), flush=True)
            sys.stderr.flush()
            os._exit(0)
sys.meta_path.insert(0, WatchTorch())
from server.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_serve_sets_openmp_before_torch_loads_and_logs_where_the_threads_came_from(tmp_path):
    env = server_environment(PAGEDSERVE_CPU_THREADS="1")
    for name in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT"):
        env.pop(name, None)
    argv = ["serve", "--model", str(tmp_path / "absent"), "--port", "0"]
    result = subprocess.run([sys.executable, "-c", WATCH_TORCH, *argv], env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr  # (it reached the torch import)
    at_torch_import = json.loads(result.stdout.strip().splitlines()[-1])
    assert at_torch_import == {"OMP_NUM_THREADS": "1", "GOMP_SPINCOUNT": WAIT_SPIN_COUNT, "OMP_WAIT_POLICY": None}
    expected = (
        f"CPU threads: 1 thread: --cpu-threads / PAGEDSERVE_CPU_THREADS; OpenMP wait: GOMP_SPINCOUNT={WAIT_SPIN_COUNT}"
    )
    assert expected in result.stderr
