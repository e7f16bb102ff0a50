"""The runner's step inputs: persistent buffers, and the StepMetadata every backend builds from."""

from __future__ import annotations

import torch

from engine import SamplingParams
from engine.attention.step_metadata import shared_context_decode_metadata, single_prefill_metadata
from engine.runner import memory_profile
from tests.engine.references import assert_idle, make_llm


def test_step_metadata_describes_the_scheduled_step_from_persistent_buffers(tiny_llama_dir):
    llm = make_llm(tiny_llama_dir, block_size=4, max_num_batched_tokens=16, max_num_seqs=4)
    engine = llm.engine
    runner, backend = engine.runner, engine.runner.backend
    seen = []
    build = backend.build_metadata

    def recording_build(step, spec):
        seen.append((step, check_step(step, runner, engine.scheduler)))
        return build(step, spec)

    backend.build_metadata = recording_build
    prompts = [list(range(3, 30)), list(range(3, 30)) + [9, 9], [5, 6, 7]]
    llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(max_tokens=5, temperature=0, ignore_eos=True),
        use_tqdm=False,
    )
    assert_idle(llm)
    kinds = {checked for _, checked in seen}
    assert {"decodes only", "mixed"} <= kinds  # both shapes of step were seen
    pointers = {step.block_table.data_ptr() for step, _ in seen} | {step.seq_lens.data_ptr() for step, _ in seen}
    assert len(pointers) == 2  # every step's table and lengths live in the same two buffers


def check_step(step, runner, scheduler) -> str:
    """The StepMetadata agrees with the scheduler's view of the step (read before update_from_output)."""
    assert step.query_start_loc.dtype == step.seq_lens.dtype == step.block_table.dtype == torch.int32
    starts = step.query_start_loc_cpu.tolist()
    assert starts[0] == 0 and starts[-1] == step.num_tokens and len(starts) == step.num_reqs + 1
    query_lens = [b - a for a, b in zip(starts, starts[1:])]
    assert all(n == 1 for n in query_lens[: step.num_decodes]) and step.max_query_len == max(query_lens)
    assert step.max_seq_len == int(step.seq_lens.max())
    kv = scheduler.kv_cache_manager
    block_size = kv.block_size
    by_row = {state.row: request_id for request_id, state in runner.requests.items()}
    slots = step.slot_mapping.tolist()
    for i in range(step.num_reqs):
        seq_len = int(step.seq_lens_cpu[i])
        table = step.block_table[i].tolist()
        matches = [
            rid
            for rid in by_row.values()
            if list(kv.get_block_ids(rid)[0][: -(-seq_len // block_size)]) == table[: -(-seq_len // block_size)]
        ]
        assert matches, f"row {i}: no request holds blocks {table}"
        for token, position in zip(range(starts[i], starts[i + 1]), range(seq_len - query_lens[i], seq_len)):
            assert slots[token] == table[position // block_size] * block_size + position % block_size
    return "decodes only" if step.num_decodes == step.num_reqs else "mixed" if step.num_decodes else "prefills"


def test_profiling_steps_cover_the_largest_prefill_and_decode():
    prefill = single_prefill_metadata(10, 4, torch.device("cpu"))
    assert prefill.num_reqs == 1 and prefill.num_tokens == 10 and prefill.block_table.tolist() == [[0, 1, 2]]
    decode = shared_context_decode_metadata(3, 9, 4, torch.device("cpu"))
    assert decode.num_decodes == decode.num_reqs == 3 and decode.max_seq_len == 9
    assert decode.block_table.tolist() == [[0, 1, 2]] * 3 and decode.slot_mapping.tolist() == [8, 8, 8]


def test_the_cuda_kv_budget_sets_aside_weights_activations_and_memory_outside_torch(monkeypatch):
    gib = 2**30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (60 * gib, 100 * gib))  # 40 GiB in use
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 30 * gib)  # 10 GiB outside torch
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: 16 * gib)  # the weights
    budget = memory_profile.cuda_kv_budget(0.9, 4 * gib, torch.device("cuda"))
    assert budget == 90 * gib - (16 + 4 + 10) * gib
