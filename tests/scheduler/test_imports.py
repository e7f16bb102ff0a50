import subprocess
import sys


def test_scheduler_imports_no_torch_engine_or_server():
    code = (
        "import sys, scheduler, scheduler.bench\n"
        "bad = [m for m in ('torch', 'engine', 'server', 'numpy') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
