"""A rank's part of an adapter (engine/lora_shard.py) against the whole adapter's deltas: column-parallel
ranks' deltas are the whole delta's columns of their heads, row-parallel ranks' partial deltas sum to the whole
one, a pipeline stage holds its own layers; a worker rank reads an adapter from the step message's sources."""

from __future__ import annotations

import pickle
import shutil

import pytest
import torch

from engine.distributed.parallel_group import ParallelGroup
from engine.errors import LoRAAdapterError
from engine.loading.loader import load_hf_config
from engine.loading.rope_settings import rope_settings
from engine.lora.adapter_source import AdapterSource
from engine.lora.lora_manager import LoRARef, adapter_key
from engine.lora_shard import AdapterShard
from engine.lora.lora_slots import LoRASlots
from engine.lora.lora_stack import LoRAStack
from engine.lora.lora_step import LoRASegment, LoRAStep
from engine.lora.peft_adapter import load_peft_adapter
from engine.lora.request import LoRAMix
from engine.models.llama_arch import LlamaArch
from engine.models.tensor_parallel import shard_arch
from tests.lora.adapters import ARCH, random_weights

CPU = torch.device("cpu")
T = 5


def stack_of(arch, shard=None) -> LoRAStack:
    return LoRAStack(arch, max_loras=2, max_rank=4, dtype=torch.float32, device=CPU, shard=shard)


def delta(stack: LoRAStack, layer: int, proj: str, x: torch.Tensor) -> torch.Tensor:
    """Slot 1's delta of `proj` at `layer` for x [T, in] (scale 0.5)."""
    step = LoRAStep.build(stack, T, [LoRASegment(0, T, ((1, 0.5),))])
    assert step is not None
    out = torch.zeros(T, sum(stack.shapes[proj][1]))
    step.add(layer, proj, x, out)
    return out


def head_columns(rank: int) -> torch.Tensor:
    """The whole q|k|v output's columns that rank `rank` of 2 computes: its 2 query heads, its KV head of each."""
    d, q, kv = ARCH.head_dim, ARCH.num_heads * ARCH.head_dim, ARCH.num_kv_heads * ARCH.head_dim
    mine = [range(rank * 2 * d, (rank + 1) * 2 * d), range(q + rank * d, q + (rank + 1) * d)]
    mine.append(range(q + kv + rank * d, q + kv + (rank + 1) * d))
    return torch.tensor([c for r in mine for c in r])


def test_tensor_parallel_parts_add_up_to_the_whole_delta():
    adapter = random_weights("x", 3, 0, skip="up_proj")
    whole = stack_of(ARCH)
    whole.load(1, adapter)
    ranks = [stack_of(shard_arch(ARCH, 2), AdapterShard(ARCH, ParallelGroup(r, 2), range(2), True)) for r in (0, 1)]
    for stack in ranks:
        stack.load(1, adapter)
    generator = torch.Generator().manual_seed(0)
    inter = ARCH.intermediate_size
    for layer in range(2):
        x = torch.randn(T, ARCH.hidden_size, generator=generator)
        want = delta(whole, layer, "qkv", x)
        for rank, stack in enumerate(ranks):  # column-parallel: this rank's heads' columns
            torch.testing.assert_close(delta(stack, layer, "qkv", x), want[:, head_columns(rank)])
        want = delta(whole, layer, "gate_up", x)
        for rank, stack in enumerate(ranks):
            columns = torch.cat(
                [torch.arange(rank * 24, rank * 24 + 24), inter + torch.arange(rank * 24, rank * 24 + 24)]
            )
            torch.testing.assert_close(delta(stack, layer, "gate_up", x), want[:, columns])
        for proj, width in (("o_proj", ARCH.num_heads * ARCH.head_dim), ("down", inter)):  # row-parallel: sums
            x = torch.randn(T, width, generator=generator)
            half = width // 2
            parts = [delta(stack, layer, proj, x[:, r * half : (r + 1) * half]) for r, stack in enumerate(ranks)]
            torch.testing.assert_close(parts[0] + parts[1], delta(whole, layer, proj, x))


def test_a_pipeline_stage_holds_its_own_layers():
    adapter = random_weights("x", 4, 1, skip="q_proj")
    adapter.embed = adapter.lm_head = torch.randn(ARCH.vocab_size, ARCH.hidden_size)
    whole = stack_of(ARCH)
    whole.load(1, adapter)
    last = stack_of(ARCH, AdapterShard(ARCH, ParallelGroup.single(), range(1, 2), holds_vocab=False))
    last.load(1, adapter)
    assert len(last.a) == 1 and last.embed[1] is None and last.lm_head[1] is None
    x = torch.randn(T, ARCH.hidden_size)
    torch.testing.assert_close(delta(last, 0, "gate_up", x), delta(whole, 1, "gate_up", x))


def test_a_worker_reads_the_adapter_the_step_message_names(lora_base_dir, adapter_a, tmp_path):
    """A LoRARef pickled (the step message) carries its adapters' sources; a worker's slot reads the files, and
    refuses them once they differ from what rank 0 read."""
    weights = load_peft_adapter("a", str(adapter_a), 8, 2)
    ref = LoRARef(LoRAMix.single("a"), (weights,), (adapter_key(weights),), b"key")
    sent = pickle.loads(pickle.dumps(ref))
    assert sent.adapters == (AdapterSource("a", str(adapter_a), weights.content_hash),)
    assert (sent.mix, sent.keys, sent.cache_key) == (ref.mix, ref.keys, ref.cache_key)
    config = load_hf_config(lora_base_dir)
    arch = LlamaArch.from_hf_config(config, rope_settings(config))
    rank0, worker = LoRAStack(arch, 1, 8, torch.float32, CPU), LoRAStack(arch, 1, 8, torch.float32, CPU)
    assert LoRASlots(rank0).acquire(ref) == LoRASlots(worker).acquire(sent) == ((0, 1.0),)
    for layer_a, layer_b in zip(rank0.a + rank0.b, worker.a + worker.b):
        for proj, tensor in layer_a.items():
            assert torch.equal(tensor, layer_b[proj])
    changed = tmp_path / "changed"
    shutil.copytree(adapter_a, changed)
    (changed / "adapter_config.json").write_text((changed / "adapter_config.json").read_text() + " ")
    moved = pickle.loads(pickle.dumps(ref._replace(adapters=(AdapterSource("a", str(changed), weights.content_hash),))))
    with pytest.raises(LoRAAdapterError, match="changed after the engine loaded them"):
        LoRASlots(LoRAStack(arch, 1, 8, torch.float32, CPU)).acquire(moved)
