"""The disk KV tier (--kv-cache-dir): blocks written through, restored after a restart with the same tokens,
bad files recomputed, other models' files never read, the size bound, and no KV left behind."""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from engine.kv_tier.block_copy import payload_bytes
from engine.kv_tier.identity import model_identity
from engine.sampling.params import SamplingParams
from scheduler import SchedulerStats
from scheduler.block_hash import BlockHash, extend_block_hashes
from scheduler.kv_tier_file import HEADER, BlockFileKey, block_file_path, write_block_file
from scheduler.kv_tier_index import KVTierIndex, KVTierStats
from server.observability.metrics import ServerMetrics, cache_info
from tests.engine.references import assert_idle, make_llm

PROMPT = [random.Random(28).randrange(3, 500) for _ in range(150)]  # 37 full blocks of 4, and 2 tokens
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


def generate(llm, prompt=PROMPT):
    return llm.generate({"prompt_token_ids": prompt}, GREEDY, use_tqdm=False)[0]


def block_files(directory: Path) -> list[Path]:
    return sorted(p for p in directory.rglob("*.r0"))


def prompt_files(directory: Path) -> list[Path]:
    """The files of the prompt's full blocks, in prompt order."""
    hashes: list[BlockHash] = []
    extend_block_hashes(hashes, PROMPT, 4)
    folder = block_files(directory)[0].parent
    return [folder / f"{h.value.hex()}.r0" for h in hashes]


@pytest.fixture(scope="module")
def cold(llm):
    """Greedy tokens of the prompt without any tier (the reference)."""
    return generate(llm).outputs[0].token_ids


@pytest.fixture(scope="module")
def tier_dir(tiny_llama_dir, tmp_path_factory, cold):
    """A tier directory that one engine filled with the prompt's blocks and was then shut down."""
    directory = tmp_path_factory.mktemp("kv-tier")
    with make_llm(tiny_llama_dir, kv_cache_dir=str(directory)) as llm:
        assert generate(llm).outputs[0].token_ids == cold
        stats = llm.engine.stats().kv_tier("disk")
        assert stats is not None and stats.hit_blocks == 0 and stats.written_bytes > 0
    return directory


def test_restart_restores_the_prompt_with_identical_tokens(tiny_llama_dir, tier_dir, cold):
    assert len(block_files(tier_dir)) == (len(PROMPT) + GREEDY.max_tokens - 1) // 4  # every full block, written
    with make_llm(tiny_llama_dir, kv_cache_dir=str(tier_dir)) as llm:
        result = generate(llm)
        assert result.outputs[0].token_ids == cold
        stats = llm.engine.stats()
        disk = stats.kv_tier("disk")
        assert disk is not None and stats.kv_tier("memory") is None
        assert disk.hit_blocks == (len(PROMPT) - 1) // 4  # all but the token the step must compute
        assert disk.hit_tokens == result.num_cached_tokens == stats.prefix_cache_hits == 148
        assert disk.read_bytes > 0 and disk.corrupt_files == 0
        assert_idle(llm)
        # Aborted while its blocks are being restored and prefilled: every block goes back to the pool.
        engine = llm.engine
        engine.add_request("a", PROMPT + [7, 8, 9, 10, 11], GREEDY)
        engine.add_request("b", PROMPT[:60] + [5] * 70, GREEDY)
        engine.step()
        engine.abort(["a", "b"])
        engine.step()
        assert_idle(llm)


def test_corrupt_and_truncated_files_are_recomputed_not_served(tiny_llama_dir, tier_dir, cold, tmp_path):
    files = prompt_files(tier_dir)
    num_files = len(block_files(tier_dir))
    data = bytearray(files[5].read_bytes())
    data[HEADER.size + 100] ^= 0xFF  # a bit flip in the payload of the prompt's 6th block
    files[5].write_bytes(data)
    with make_llm(tiny_llama_dir, kv_cache_dir=str(tier_dir)) as llm:
        result = generate(llm)
        assert result.outputs[0].token_ids == cold
        stats = llm.engine.stats().kv_tier("disk")
        assert stats is not None and stats.corrupt_files == 1 and stats.hit_blocks == 5
    # the bad block was deleted and computed, then written again (whole)
    assert len(block_files(tier_dir)) == num_files and files[5].read_bytes() != data
    # Truncated, and renamed under another block's name: detected by the index, and deleted.
    index = KVTierIndex.open(tier_dir, bytes.fromhex(files[0].parent.name), 1, 1 << 30, 0)
    files[2].write_bytes(files[2].read_bytes()[:-10])
    os.replace(files[4], files[3])
    blocks = [bytes.fromhex(f.name.split(".")[0]) for f in files]
    assert index.verified_run(blocks[:2] + blocks[3:]) == 2  # the renamed file fails its header's key
    assert index.verified_run(blocks[2:]) == 0  # the truncated one its length
    assert index.stats.corrupt_files == 2 and not files[2].exists() and not files[3].exists()


def test_another_block_size_or_weights_never_reads_the_files(tiny_llama_dir, tier_dir, llm, tmp_path, caplog):
    caplog.set_level("INFO", logger="engine.kv_tier_setup")
    # (--swap-space on CPU: a second bounded pool in host memory, and the log says so)
    with make_llm(tiny_llama_dir, kv_cache_dir=str(tier_dir), block_size=8, swap_space=0.01) as other:
        generate(other)
        stats = other.engine.stats().kv_tier("disk")
        assert stats is not None and stats.hit_blocks == 0 and stats.corrupt_files == 0
    assert "KV memory tier" in caplog.text and "second bounded pool" in caplog.text
    assert len({p.parent for p in block_files(tier_dir)}) == 2  # one folder per identity
    # the weights' identity: any change to a weight file (size, mtime) names another folder
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"x" * 10)
    spec = llm.engine.runner.kv_cache.spec
    kwargs = dict(num_layers=2, dtype="float32", quantization="none", tensor_parallel_size=1, pipeline_parallel_size=1)
    before = model_identity(tmp_path, None, spec, **kwargs)
    os.utime(weights, ns=(1, 1))
    assert model_identity(tmp_path, None, spec, **kwargs) != before
    assert model_identity(tmp_path, None, spec, **{**kwargs, "dtype": "bfloat16"}) != model_identity(
        tmp_path, None, spec, **kwargs
    )


def test_the_prompt_used_last_survives_a_bound_and_a_restart(tiny_llama_dir, tier_dir, cold, tmp_path):
    """Prompts A, B, A (a pool hit), C, A under a bound of about 1.5 prompts: A's second run counts as a use of
    its files, and its tail is evicted before its head, so after a restart A's head restores (it was A's head that
    went first: the later blocks left behind could never be restored)."""
    file_bytes = block_files(tier_dir)[0].stat().st_size
    others = [[random.Random(seed).randrange(3, 500) for _ in range(len(PROMPT))] for seed in (1, 2)]
    directory = tmp_path / "bounded"
    bound = 60 * file_bytes / 2**30
    with make_llm(tiny_llama_dir, kv_cache_dir=str(directory), kv_cache_dir_size=bound) as llm:
        for prompt in (PROMPT, others[0], PROMPT, others[1], PROMPT):
            generate(llm, prompt)
        index = llm.engine.scheduler.kv_cache_manager.kv_tiers.disk
        hashes: list[BlockHash] = []
        extend_block_hashes(hashes, PROMPT, 4)
        held = sum(h.value in index for h in hashes)
        assert held >= 10 and all(h.value in index for h in hashes[:held])  # a head, whole
    with make_llm(tiny_llama_dir, kv_cache_dir=str(directory), kv_cache_dir_size=bound) as llm:
        result = generate(llm)
        assert result.outputs[0].token_ids == cold
        assert llm.engine.stats().kv_tier("disk").hit_blocks == held
        assert_idle(llm)


def test_a_file_gone_between_the_check_and_the_read_is_computed(tiny_llama_dir, cold, tmp_path):
    """Another process deletes a block file in the moment between the scheduler's check and the runner's read:
    that request goes back to the queue and computes what it cannot restore (never wrong K/V), the one beside it
    in the step is scheduled again, both finish with their own tokens, and the engine goes on; the step that never
    ran leaves no block marked saved or cached that was not (the neighbour's prompt is a hit afterwards)."""
    directory = tmp_path / "tier"
    other = [random.Random(5).randrange(3, 500) for _ in range(40)]
    with make_llm(tiny_llama_dir, kv_cache_dir=str(directory)) as first:  # (a directory of its own: others edit theirs)
        generate(first)
        other_tokens = generate(first, other).outputs[0].token_ids
    for path in block_files(directory):
        if path not in prompt_files(directory):
            path.unlink()  # only the prompt's blocks on disk
    with make_llm(tiny_llama_dir, kv_cache_dir=str(directory)) as llm:
        engine = llm.engine
        tier = engine.runner.kv_tier
        read = tier.restore

        def deleted_first(kv_cache, restores):
            block_file_path(directory, BlockFileKey(tier.identity, 0, restores[3][0])).unlink()
            tier.restore = read  # once
            read(kv_cache, restores)

        tier.restore = deleted_first
        engine.add_request("tiered", list(PROMPT), GREEDY)
        engine.add_request("other", list(other), GREEDY)
        outputs = {}
        while engine.has_work:
            for out in engine.step():
                outputs.setdefault(out.request_id, []).append(out)
        assert [t for out in outputs["tiered"] for t in out.new_token_ids] == cold
        assert all(out.finish_reason in (None, "length") for out in outputs["tiered"])
        assert [t for out in outputs["other"] for t in out.new_token_ids] == other_tokens
        stats = engine.stats()
        assert stats.kv_tier("disk").corrupt_files == 1 and stats.num_preemptions == 1
        assert_idle(llm)
        index = engine.scheduler.kv_cache_manager.kv_tiers.disk
        hashes: list[BlockHash] = []
        extend_block_hashes(hashes, other, 4)
        engine.runner.kv_tier.writer.flush()
        assert index.verified_run([h.value for h in hashes]) == len(hashes)  # written by the step that ran
        assert generate(llm, other).num_cached_tokens == (len(other) - 1) // 4 * 4  # pool hits
        engine.scheduler.kv_cache_manager.reset_prefix_cache()
        result = generate(llm)  # from disk: blocks 0-2 and the ones computed after the lost one
        assert result.outputs[0].token_ids == cold and result.num_cached_tokens == (len(PROMPT) - 1) // 4 * 4
        assert_idle(llm)


def test_a_directory_that_cannot_be_made_is_a_setting_error(tiny_llama_dir, tmp_path):
    """A bad setting (the CLI exits 2 naming the flag), not a traceback from the first scan."""
    from engine.errors import SettingsConflictError

    (tmp_path / "a-file").write_bytes(b"")
    with pytest.raises(SettingsConflictError, match="--kv-cache-dir .*cannot make it"):
        make_llm(tiny_llama_dir, kv_cache_dir=str(tmp_path / "a-file" / "tier"))


def test_size_bound_evicts_least_recently_used(tmp_path):
    identity, payload = b"i" * 32, memoryview(bytes(1000))
    file_bytes = HEADER.size + len(payload)
    blocks = [bytes([n]) * 32 for n in range(5)]
    for n, block in enumerate(blocks[:3]):
        write_block_file(tmp_path, BlockFileKey(identity, 0, block), payload)
        os.utime(block_file_path(tmp_path, BlockFileKey(identity, 0, block)), ns=(n * 10**9, n * 10**9))
    index = KVTierIndex.open(tmp_path, identity, 1, 3 * file_bytes, file_bytes)
    assert index.num_blocks == 3 and index.total_bytes == 3 * file_bytes
    assert index.verified_run(blocks[:1]) == 1  # asked for: not a use (a request waiting for pool blocks asks)
    index.touch(blocks[:1])  # block 0 used: now the most recent
    assert index.plan_saves(blocks[3:5] + blocks[:1]) == blocks[3:5]  # two new blocks evict blocks 1 and 2
    assert [b in index for b in blocks] == [True, False, False, True, True]
    assert not block_file_path(tmp_path, BlockFileKey(identity, 0, blocks[1])).exists()
    assert index.total_bytes == 3 * file_bytes and index.stats.written_bytes == 2 * file_bytes
    # a step's restores are never evicted by its own saves (the runner reads them after the scheduling); a step's
    # saves are older the later they come (a prompt's tail leaves before its head): block 4 goes before block 3
    assert index.plan_saves([bytes([9]) * 32], keep=[blocks[0]]) == [bytes([9]) * 32]  # block 0: the oldest
    assert [b in index for b in blocks] == [True, False, False, True, False]
    # a restart scans the same order: block 0 (touched) outlives block 3 and 4 only by its mtime
    (tmp_path / identity.hex() / "stray.r0.1.tmp").write_bytes(b"cut short")
    again = KVTierIndex.open(tmp_path, identity, 1, file_bytes, file_bytes)
    assert again.num_blocks == 1 and not (tmp_path / identity.hex() / "stray.r0.1.tmp").exists()


def test_use_order_survives_a_restart_and_files_are_read_once(tmp_path):
    """Two prompts that do not both fit: the one used last (a pool hit's end touches it) survives, whole, and a
    restart scans the order `close` wrote; a file read back once is not read again while its stat holds."""
    identity, payload = b"i" * 32, memoryview(bytes(1000))
    file_bytes = HEADER.size + len(payload)
    a, b, c = ([bytes([n]) * 32 for n in range(k, k + 2)] for k in (0, 2, 4))
    index = KVTierIndex.open(tmp_path, identity, 1, 4 * file_bytes, file_bytes)

    def save(prompt: list[bytes]) -> None:
        for block in index.plan_saves(prompt):  # (what the runner's writer does)
            write_block_file(tmp_path, BlockFileKey(identity, 0, block), payload)

    save(a)
    save(b)
    index.touch(a[::-1])  # prompt A ended again (its blocks pool hits): its head now the most recent
    save(c)
    assert [x in index for x in a + b + c] == [True, True, False, False, True, True]  # B went, tail first
    assert index.verified_run(a) == 2 and index.stats.read_bytes == 2 * len(payload)
    assert index.verified_run(a) == 2 and index.stats.read_bytes == 2 * len(payload)  # not read again
    index.touch(a[::-1])
    index.close()
    again = KVTierIndex.open(tmp_path, identity, 1, 2 * file_bytes, file_bytes)  # room for two: A's, as last used
    assert [x in again for x in a + b + c] == [True, True, False, False, False, False]
    assert again.verified_run(a) == 2
    path = block_file_path(tmp_path, BlockFileKey(identity, 0, a[1]))
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data))  # altered since it was read: its stat moved, so it is read and refused
    assert again.verified_run(a) == 1 and again.stats.corrupt_files == 1 and a[1] not in again
    path = block_file_path(tmp_path, BlockFileKey(identity, 0, a[0]))
    path.unlink()  # gone since it was read
    assert again.verified_run(a) == 0 and a[0] not in again


def test_a_step_larger_than_the_bound_saves_its_head(tmp_path):
    """The directory never holds more than the bound, even for one step's blocks: the first ones are saved."""
    identity, file_bytes = b"i" * 32, 1000
    index = KVTierIndex.open(tmp_path, identity, 1, 3 * file_bytes, file_bytes)
    blocks = [bytes([n]) * 32 for n in range(5)]
    assert index.plan_saves(blocks) == blocks[:3] and index.total_bytes == 3 * file_bytes
    assert [b in index for b in blocks] == [True, True, True, False, False]
    assert index.stats.written_bytes == 3 * file_bytes
    assert index.plan_saves(blocks[3:], keep=blocks[:3]) == []  # nothing else may go: nothing saved


def test_tier_counters_are_exposed():
    tier = KVTierStats("disk", hit_blocks=3, hit_tokens=48, read_bytes=4096, written_bytes=8192, corrupt_files=1)
    memory = KVTierStats("memory", hit_blocks=5, hit_tokens=80, read_bytes=512, written_bytes=1024)
    stats = SchedulerStats(0, 0, 0.0, 0, 100, 60, kv_tiers=(memory, tier))
    info = cache_info(
        num_blocks=8,
        block_size=16,
        enable_prefix_caching=True,
        dtype="float32",
        attention_backend="cpu",
        max_model_len=64,
    )
    text = ServerMetrics("tiny", lambda: stats, info).render().decode()
    values = {
        s.name: s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name.startswith("pagedserve_kv_tier") and s.labels.get("tier") == "disk"
    }
    assert values == {
        "pagedserve_kv_tier_hit_blocks_total": 3,
        "pagedserve_kv_tier_hit_tokens_total": 48,
        "pagedserve_kv_tier_read_bytes_total": 4096,
        "pagedserve_kv_tier_written_bytes_total": 8192,
        "pagedserve_kv_tier_corrupt_files_total": 1,
    }
    memory_values = {
        s.name: s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name.startswith("pagedserve_kv_tier") and s.labels.get("tier") == "memory"
    }
    assert memory_values["pagedserve_kv_tier_hit_blocks_total"] == 5
    assert memory_values["pagedserve_kv_tier_read_bytes_total"] == 512


@pytest.mark.parametrize("prompt_attention", ["native", "torch"])
def test_an_fp8_cache_restores_from_disk_with_identical_tokens(
    tiny_llama_head64_dir, tmp_path, prompt_attention, monkeypatch, cpu_kernels
):
    """`--kv-cache-dtype fp8`: the blocks go to disk as their e4m3 bytes (half a bf16 cache's), come back after a
    restart, and the prompt gives the tokens and logprobs of a cold run (every attention reads K/V as the cache holds them,
    computed or restored), whether prompt chunks run on the native kernel or, as on AMX CPUs, on torch's."""
    import engine.attention.cpu_backend as cpu_backend
    from engine.kernels.cpu import CpuKernels

    if prompt_attention == "torch":
        monkeypatch.setattr(cpu_backend, "torch_bf16_products_use_amx", lambda: True)
    elif (
        cpu_kernels is None
        or not cpu_kernels.prefill_attention_serves(torch.bfloat16, torch.float8_e4m3fn)
        or cpu_backend.torch_bf16_products_use_amx()
    ):
        pytest.skip("prompt chunks run on torch's attention here")
    native_calls = []
    native = CpuKernels.prefill_attention
    monkeypatch.setattr(CpuKernels, "prefill_attention", lambda *a: native_calls.append(1) or native(*a))
    settings = {"dtype": "bfloat16", "kv_cache_dtype": "fp8"}
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=2)

    def tokens_and_logprobs(llm):
        (output,) = llm.generate({"prompt_token_ids": PROMPT}, params, use_tqdm=False)[0].outputs
        return output.token_ids, output.logprobs

    with make_llm(tiny_llama_head64_dir, **settings) as llm:
        cold = tokens_and_logprobs(llm)
    payloads = {}
    for kv_cache_dtype in ("fp8", "bfloat16"):
        with make_llm(tiny_llama_head64_dir, **{**settings, "kv_cache_dtype": kv_cache_dtype}) as llm:
            payloads[kv_cache_dtype] = payload_bytes(llm.engine.runner.kv_cache)
    assert 2 * payloads["fp8"] == payloads["bfloat16"]
    with make_llm(tiny_llama_head64_dir, **settings, kv_cache_dir=str(tmp_path)) as llm:
        assert tokens_and_logprobs(llm) == cold
        assert llm.engine.stats().kv_tier("disk").written_bytes > 0
    with make_llm(tiny_llama_head64_dir, **settings, kv_cache_dir=str(tmp_path)) as llm:
        # restarted
        restored = tokens_and_logprobs(llm)
        disk = llm.engine.stats().kv_tier("disk")
        assert disk.hit_blocks == (len(PROMPT) - 1) // 4 and disk.corrupt_files == 0
        assert restored == cold  # the logprobs too, bit for bit
        assert_idle(llm)
    assert bool(native_calls) == (prompt_attention == "native")
