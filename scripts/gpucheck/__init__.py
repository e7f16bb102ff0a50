"""The parts of the GPU check (`scripts/gpu_check.py`): environment, tests/gpu, numerics, greedy tokens, single
stream, throughput.

Each part is a function `run(ctx: PartContext) -> None` that fills `ctx.result` and saves it as it
goes (`ctx.save()`), so a part killed at its deadline still leaves what it measured.
"""
