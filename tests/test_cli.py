import subprocess
import sys

from server.cli import main


def test_bench_scheduler_runs(capsys):
    assert main(["bench", "scheduler", "--num-running", "8", "--steps", "20", "--output-len", "16"]) == 0
    assert "median" in capsys.readouterr().out


def test_console_script_is_installed():
    result = subprocess.run(
        [sys.executable, "-m", "server.cli", "--help"], capture_output=True, text=True, check=True
    )
    assert "serve" in result.stdout and "bench" in result.stdout
