"""A rank's part of an adapter (engine/lora_shard.py) against the whole adapter's deltas: column-parallel
ranks' deltas are the whole delta's columns of their heads, row-parallel ranks' partial deltas sum to the whole
one (a mixture of experts' experts' alike), a pipeline stage holds its own layers; a worker rank reads an adapter from the step message's sources."""

from __future__ import annotations

import pickle
import shutil

import pytest
import torch

from engine.distributed.parallel_group import ParallelGroup
from engine.errors import LoRAAdapterError
from engine.loading.loader import load_hf_config
from engine.loading.rope_settings import rope_settings
from engine.lora.adapter_layout import AdapterLayout
from engine.lora.adapter_source import AdapterSource
from engine.lora.expert_stack import ExpertLoRAStack
from engine.lora.lora_graph_inputs import LoRAGraphInputs
from engine.lora.lora_manager import LoRARef, adapter_key
from engine.lora_shard import AdapterShard
from engine.lora.lora_slots import LoRASlots
from engine.lora.lora_stack import LoRAStack
from engine.lora.lora_step import LoRASegment, LoRAStep
from engine.lora.peft_adapter import LoRAWeights, load_peft_adapter
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


def _expert_stack(arch, shard=None, width: int = 16) -> LoRAStack:
    """Slots over ARCH's attention and 4 experts of `width` in every one of the stack's layers."""
    layers = len(shard.layers) if shard is not None else arch.num_layers
    experts = ExpertLoRAStack(tuple(range(layers)), 4, arch.hidden_size, width, 2, 4, torch.float32, CPU)
    layout = AdapterLayout(mlp="none")
    return LoRAStack(
        arch, max_loras=2, max_rank=4, dtype=torch.float32, device=CPU, shard=shard, layout=layout, experts=experts
    )


def _expert_delta(stack: LoRAStack, layer: int, expert: int, proj: str, x: torch.Tensor) -> torch.Tensor:
    step = LoRAStep.build(stack, T, [LoRASegment(0, T, ((1, 0.5),))])
    assert step is not None and step.experts is not None
    assert stack.experts is not None
    width = stack.experts.b[layer][proj].shape[-1]
    out = torch.zeros(T, width)
    step.experts.at(layer).add(expert, proj, x, torch.arange(T), out)
    return out


def _expert_adapter() -> LoRAWeights:
    """Random deltas of 4 experts 32 wide (rank 3) in each of ARCH's layers."""
    generator = torch.Generator().manual_seed(3)
    adapter = LoRAWeights("x", "", 3)
    for layer in range(ARCH.num_layers):
        for proj in ("gate_proj", "up_proj", "down_proj"):
            adapter.a[(layer, "experts." + proj)] = torch.randn(4, 3, 32, generator=generator)
            adapter.b[(layer, "experts." + proj)] = torch.randn(4, 32, 3, generator=generator)
    return adapter


def test_a_step_of_expert_adapters_runs_eagerly():
    """A decode graph's captured step adds no expert deltas: a step with an adapter of the experts does not replay
    one; a step of attention-only adapters does (and builds no expert deltas)."""
    stack = _expert_stack(ARCH, width=32)
    stack.load(0, random_weights("attention", 2, 1, skip="up_proj"))
    stack.load(1, _expert_adapter())
    attention, experts = [LoRASegment(0, 2, ((0, 1.0),))], [LoRASegment(0, 1, ()), LoRASegment(1, 1, ((1, 1.0),))]
    assert LoRAGraphInputs.takes(stack, attention) and not LoRAGraphInputs.takes(stack, experts)
    step = LoRAStep.build(stack, 2, attention)
    assert step is not None and step.experts is None


def test_expert_parts_add_up_to_the_whole_delta():
    """Each expert's gate|up: a rank's columns are its share of the gate's and of the up's; its down: the ranks'
    partial deltas (their shares of the inputs) sum to the whole one. A pipeline stage holds its own layer's."""
    adapter = _expert_adapter()
    whole = _expert_stack(ARCH, width=32)
    whole.load(1, adapter)
    ranks = [
        _expert_stack(shard_arch(ARCH, 2), AdapterShard(ARCH, ParallelGroup(r, 2), range(2), True)) for r in (0, 1)
    ]
    for stack in ranks:
        stack.load(1, adapter)
    x, h = torch.randn(T, 32), torch.randn(T, 32)
    for layer in range(2):
        expected = _expert_delta(whole, layer, 2, "gate_up", x)  # [T, gate 32 | up 32]
        for rank, stack in enumerate(ranks):
            mine = torch.cat([torch.arange(16) + 16 * rank, torch.arange(16) + 32 + 16 * rank])
            torch.testing.assert_close(_expert_delta(stack, layer, 2, "gate_up", x), expected[:, mine])
        partial = [_expert_delta(stack, layer, 2, "down", h[:, 16 * r : 16 * (r + 1)]) for r, stack in enumerate(ranks)]
        torch.testing.assert_close(partial[0] + partial[1], _expert_delta(whole, layer, 2, "down", h))
    stage = _expert_stack(ARCH, AdapterShard(ARCH, ParallelGroup.single(), range(1, 2), False), width=32)
    stage.load(1, adapter)
    torch.testing.assert_close(_expert_delta(stage, 0, 3, "gate_up", x), _expert_delta(whole, 1, 3, "gate_up", x))


def test_expert_parts_are_padded_as_the_base_experts_are():
    """Experts 32 wide on 2 ranks whose shares must hold whole units of 24 (int4 groups, say): the base experts'
    width is padded to 48 at its end, rank 0 holding units 0..23 and rank 1 units 24..31 and 16 zeros; each rank's
    gate and up rows of B, and down's columns of A, are cut alike, so they meet the base rows and columns they
    belong to."""
    adapter = _expert_adapter()
    for rank, real in ((0, slice(0, 24)), (1, slice(24, 32))):
        part = AdapterShard(ARCH, ParallelGroup(rank, 2), range(2), True, expert_unit=24).cut(adapter)
        count = real.stop - real.start
        for proj in ("experts.gate_proj", "experts.up_proj"):
            b = part.b[(0, proj)]  # [E, this rank's rows, r]
            assert b.shape == (4, 24, 3)
            assert torch.equal(b[:, :count], adapter.b[(0, proj)][:, real]) and not b[:, count:].any()
        a = part.a[(0, "experts.down_proj")]  # [E, r, this rank's inputs]
        assert a.shape == (4, 3, 24)
        assert torch.equal(a[..., :count], adapter.a[(0, "experts.down_proj")][..., real]) and not a[..., count:].any()
