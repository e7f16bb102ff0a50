"""`--profile`: the step's phases are timed, and the offline bench reports the physical floor."""

from __future__ import annotations

import pytest
import torch

from engine import SamplingParams
from engine.profiling.memory_bandwidth import kv_read_bytes, read_bandwidth, tensor_bytes
from engine.profiling.step_profile import PHASES, StepProfile
from tests.engine.references import assert_idle, make_llm


def test_every_phase_of_a_step_is_timed(tiny_llama_dir):
    llm = make_llm(tiny_llama_dir, profile=True)
    profile = llm.engine.profile
    assert isinstance(profile, StepProfile) and llm.engine.runner.profile is profile
    llm.generate([[3, 4, 5, 6], [7, 8]], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True), use_tqdm=False)
    assert profile.steps == llm.engine.num_steps >= 5
    assert all(profile.totals[phase] > 0 for phase in PHASES if phase != "between")
    table = profile.table()
    assert all(phase in table for phase in PHASES) and f"over {profile.steps} steps" in table
    assert_idle(llm)


def test_profile_is_off_by_default(tiny_llama_dir):
    llm = make_llm(tiny_llama_dir)
    assert llm.engine.profile is None and llm.engine.runner.profile is None


def test_floor_arithmetic_and_a_measured_bandwidth():
    assert (
        kv_read_bytes(num_layers=30, context_tokens=100, num_kv_heads=3, head_dim=64, dtype=torch.bfloat16)
        == 2 * 30 * 100 * 3 * 64 * 2
    )
    assert tensor_bytes([torch.zeros(10, 4), torch.zeros(3, dtype=torch.bfloat16)]) == 160 + 6
    assert read_bandwidth(torch.device("cpu"), nbytes=1 << 24, repeats=2) > 1e8  # > 0.1 GB/s anywhere


@pytest.mark.parametrize(
    "extra",
    [[], ["--batch-invariant"], ["--quantization", "int8", "--dtype", "bfloat16"]],
    ids=["plain", "batch-invariant", "int8"],
)
def test_offline_bench_reports_the_step_next_to_its_floor(tiny_llama_dir, capsys, monkeypatch, extra):
    import engine.bench
    from engine.bench import main

    # the bandwidth measured over 16 MiB, not the bench's default buffer: this checks the report, and the
    # default buffer alone would set the suite's peak memory
    measure = engine.bench.read_bandwidth
    monkeypatch.setattr(engine.bench, "read_bandwidth", lambda device: measure(device, nbytes=1 << 24, repeats=2))

    main(
        [
            "--model",
            str(tiny_llama_dir),
            "--num-prompts",
            "2",
            "--input-len",
            "8",
            "--output-len",
            "4",
            "--single-steps",
            "4",
            "--skip-hf",
            "--profile",
            "--dtype",
            "float32",
            *extra,
        ]
    )
    out = capsys.readouterr().out
    assert "floor" in out and "GB/s streaming read" in out and "step profile over" in out
