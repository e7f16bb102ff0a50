"""2 MB pages for the KV cache and the weights (engine/huge_pages.py): what is advised, read back from the
kernel's own account of this process's mappings (/proc/self/smaps: `hg` among a mapping's VmFlags once
MADV_HUGEPAGE applies to it)."""

from __future__ import annotations

import gc
import weakref
from pathlib import Path

import numpy as np
import pytest
import torch

from engine import SamplingParams, huge_pages
from engine.attention.kv_cache import KVCache, KVCacheSpec
from engine.huge_pages import (
    HUGE_PAGE,
    advise_huge_pages,
    huge_pages_available,
    large_tensors,
    pack_small_weights,
    reachable_tensors,
)
from tests.engine.factories import make_tiny_gguf, make_tiny_model_dir
from tests.engine.references import make_llm

needs_thp = pytest.mark.skipif(not huge_pages_available(), reason="this kernel gives no transparent huge pages")


def _flags_at(address: int) -> list[str]:
    """The VmFlags of the mapping of this process that holds `address`."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            low, high = (int(part, 16) for part in head.split("-"))
            inside = low <= address < high
        elif inside and head == "VmFlags:":
            return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


def _first_whole_page(tensor: torch.Tensor) -> int:
    return -(-tensor.data_ptr() // HUGE_PAGE) * HUGE_PAGE


@needs_thp
def test_a_large_tensor_is_advised_in_whole_pages_and_keeps_its_values():
    tensor = torch.arange(3 * HUGE_PAGE // 4, dtype=torch.float32)  # 6 MB, written before the advice
    expected = tensor.clone()
    advised = advise_huge_pages([tensor, tensor[10:]], collapse=True)  # one storage: advised once
    start, end = tensor.data_ptr(), tensor.data_ptr() + tensor.nbytes
    assert advised == (end // HUGE_PAGE * HUGE_PAGE - _first_whole_page(tensor))
    assert advised >= 2 * HUGE_PAGE
    assert "hg" in _flags_at(_first_whole_page(tensor))
    assert start <= _first_whole_page(tensor)
    assert torch.equal(tensor, expected)


def test_small_tensors_and_other_kernels_get_nothing(tmp_path):
    assert advise_huge_pages([torch.zeros(1000)], collapse=True) == 0
    setting = tmp_path / "enabled"
    setting.write_text("always madvise [never]\n")
    assert not huge_pages_available(setting)
    assert advise_huge_pages([torch.zeros(4 * HUGE_PAGE // 4)], collapse=False, setting=setting) == 0
    setting.write_text("always [madvise] never\n")
    assert huge_pages_available(setting)
    setting.write_text("[always] madvise never\n")
    assert huge_pages_available(setting)
    assert not huge_pages_available(tmp_path / "absent")


@needs_thp
def test_the_cpu_kv_cache_is_advised_before_it_is_written():
    spec = KVCacheSpec(2, 16, 4, 64, torch.bfloat16)
    cache = KVCache(spec, 512, torch.device("cpu"))  # 512 x 16 x 4 x 64 x 2 bytes = 4 MiB per tensor
    for keys, values in cache.layers:
        for tensor in (keys, values):
            assert not tensor.any()
            assert "hg" in _flags_at(_first_whole_page(tensor))


class _Slotted:
    __slots__ = ("matrix", "scales")

    def __init__(self, matrix, scales):
        self.matrix = matrix
        self.scales = scales


class _Model:
    def __init__(self):
        big = torch.zeros(HUGE_PAGE // 2)  # 4 MB
        self.layers = [_Slotted(big, torch.zeros(8)), _Slotted(torch.zeros(HUGE_PAGE // 4), None)]
        self.tied = {"lm_head": big[1:]}  # the same storage as a layer's: found once
        self.embed = torch.zeros(HUGE_PAGE // 4, dtype=torch.float16)  # 1 MB: under the minimum
        self.name = "model"


def test_tensors_without_storage_of_their_own_are_passed_over():
    opaque = torch.randn(64, 64).to_mkldnn()  # oneDNN's layout: no storage to reach
    assert large_tensors({"packed": opaque, "meta": torch.empty(1 << 22, device="meta")}, min_bytes=1) == []
    assert advise_huge_pages([opaque], collapse=True) == 0


def test_large_tensors_finds_each_storage_once_whatever_holds_it():
    model = _Model()
    found = large_tensors(model)
    assert sorted(t.untyped_storage().data_ptr() for t in found) == sorted(
        [model.layers[0].matrix.data_ptr(), model.layers[1].matrix.data_ptr()]
    )
    assert len(large_tensors(model, min_bytes=HUGE_PAGE // 2)) == 3  # the 1 MB embedding too


class _Blocks:
    """A quantized weight's shape: a byte buffer and a float16 view into it (an X16 weight's scales)."""

    __slots__ = ("records", "scales")

    def __init__(self, rows: int):
        self.records = torch.randint(0, 255, (rows, 320), dtype=torch.uint8)
        self.scales = self.records[:, 256:288].view(torch.float16)


def test_small_matrices_are_packed_together_in_the_order_given():
    small = [torch.randn(256, 512) for _ in range(6)]  # 512 KB each
    blocks = _Blocks(1024)  # 320 KB, a view into it
    large = torch.randn(HUGE_PAGE // 2)  # 4 MB: backed on its own, not moved
    opaque = torch.randn(64, 64).to_mkldnn()
    with torch.inference_mode():
        made_in_inference_mode = torch.randn(128, 256)  # as loaded weights may be
    weights = [small[0], blocks, large, opaque, *small[1:], made_in_inference_mode, small[0]]
    expected = [t.clone() for t in (*small, blocks.records, blocks.scales, made_in_inference_mode)]
    large_at = large.data_ptr()

    packed = pack_small_weights(weights)

    moved = [small[0], blocks.records, *small[1:], made_in_inference_mode]  # first-met order, each storage once
    assert packed == sum(-(-t.nbytes // 64) * 64 for t in moved)
    assert len({t.untyped_storage().data_ptr() for t in moved}) == 1  # one arena
    addresses = [t.data_ptr() for t in moved]
    assert addresses == sorted(addresses) and all(a % 64 == 0 for a in addresses)
    assert addresses[0] % HUGE_PAGE == 0  # the arena starts on a 2 MB page
    assert blocks.scales.data_ptr() == blocks.records.data_ptr() + 256  # the view moved with its buffer
    for got, want in zip((*small, blocks.records, blocks.scales, made_in_inference_mode), expected):
        assert (
            torch.equal(got.view(torch.int16), want.view(torch.int16))
            if got.dtype == torch.float16
            else (torch.equal(got, want))
        )  # random bytes as float16 hold NaNs: compared bit for bit
    blocks.records[0, 256:258] = torch.tensor([0, 64], dtype=torch.uint8)  # float16 2.0: still one memory
    assert blocks.scales[0, 0].item() == 2.0
    assert large.data_ptr() == large_at
    if huge_pages_available():
        assert "hg" in _flags_at(addresses[0])


def test_too_little_to_pack_is_left_where_it_is():
    one = torch.randn(256, 512)
    at = one.data_ptr()
    tiny = [torch.randn(16, 16) for _ in range(4)]
    assert pack_small_weights([one, one[1:], *tiny]) == 0  # under 2 MB in all: nothing a 2 MB page would hold
    assert one.data_ptr() == at and pack_small_weights([]) == 0


def test_views_reached_from_the_whole_model_move_with_their_storage_and_only_used_bytes_are_copied():
    source = torch.randn(1000, 256)  # 1 MB: a shard's source
    shard = source[100:300]  # a contiguous row shard: 200 KB of it
    stacked = torch.randn(4, 256, 256)  # an expert stack, 1 MB
    experts = list(stacked.unbind(0))  # the per-expert matrices: views of the stack
    others = [torch.randn(256, 512) for _ in range(4)]
    elsewhere = torch.randn(256, 256)  # reachable from the model only: not a step's matrix, not moved
    model = {"stack": stacked, "elsewhere": elsewhere, "weights": [shard, *experts, *others]}
    expected = [t.clone() for t in (shard, stacked, *others)]
    at = elsewhere.data_ptr()

    packed = pack_small_weights([shard, *experts, *others], also=model)

    assert packed == shard.nbytes + stacked.nbytes + sum(t.nbytes for t in others)  # not the shard's source
    assert stacked.untyped_storage().data_ptr() == shard.untyped_storage().data_ptr()  # the stack moved too
    assert [e.data_ptr() for e in experts] == [stacked[i].data_ptr() for i in range(4)]
    for got, want in zip((shard, stacked, *others), expected):
        assert torch.equal(got, want)
    assert elsewhere.data_ptr() == at and shard.untyped_storage().data_ptr() != source.untyped_storage().data_ptr()


def test_parameters_and_storages_sharing_an_address_are_packed_correctly():
    base = np.random.default_rng(0).standard_normal(300_000).astype(np.float32)  # 1.2 MB
    whole, head = torch.from_numpy(base), torch.from_numpy(base[:1000])  # two storages, one address
    parameter = torch.nn.Parameter(torch.randn(512, 512), requires_grad=False)  # 1 MB
    expected = [whole.clone(), head.clone(), parameter.detach().clone()]
    assert pack_small_weights([head, whole, parameter]) > 0
    assert torch.equal(whole, expected[0]) and torch.equal(head, expected[1])
    assert torch.equal(parameter, expected[2]) and type(parameter) is torch.nn.Parameter
    assert parameter.untyped_storage().data_ptr() == whole.untyped_storage().data_ptr()  # moved with the rest


@pytest.fixture(scope="module")
def wide_llama_dir(tmp_path_factory):
    """A tiny llama whose matrices, each under 2 MB, add up to more than 2 MB in bf16 and in Q8_0."""
    return make_tiny_model_dir(
        tmp_path_factory.mktemp("wide-llama"), "llama", hidden_size=256, intermediate_size=512, num_hidden_layers=6
    )


@pytest.mark.parametrize("storage", ["bf16", "gguf"])
def test_a_model_on_packed_weights_gives_the_same_tokens(wide_llama_dir, storage, monkeypatch, tmp_path):
    """Loading packs the matrices (column blocks in bf16, X16 records with their scale views in GGUF) into one
    storage; greedy tokens and logprobs are bit for bit those of the same model left unpacked, fused decode
    steps included."""
    path, options = wide_llama_dir, {"dtype": "bfloat16"}
    if storage == "gguf":
        path = make_tiny_gguf(wide_llama_dir, tmp_path / "wide.gguf", "Q8_0", "Q8_0")
        options["quantization"] = "gguf"
    prompts = [[5, 6, 7], list(range(10, 60))]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=1)

    def run() -> tuple[list, set[int]]:
        with make_llm(path, **options) as llm:
            model = llm.engine.runner.model
            layers = model.weight_tensors()[:-1]
            storages = {t.untyped_storage().data_ptr() for w in layers for t in reachable_tensors(w)}
            outs = llm.generate(prompts, params, use_tqdm=False)
            return [(o.outputs[0].token_ids, [lp.logprob for lp in o.outputs[0].logprobs]) for o in outs], storages

    packed, storages = run()
    assert len(storages) == 1
    monkeypatch.setattr(huge_pages, "pack_small_weights", lambda weights, **options: 0)
    unpacked, storages = run()
    assert len(storages) > 1
    assert packed == unpacked


def test_reachable_tensors_meets_every_tensor_object_once_and_holds_none_after():
    model = _Model()
    found = reachable_tensors(model)
    assert len(found) == len({id(t) for t in found})
    assert any(t is model.tied["lm_head"] for t in found) and any(t is model.embed for t in found)
    weight = torch.zeros(4)
    gone = weakref.ref(weight)
    enabled = gc.isenabled()
    gc.disable()  # an engine's weights must go with their last reference, cyclic GC or not
    try:
        assert reachable_tensors({"layers": [weight]})[0] is weight
        del weight
        assert gone() is None
    finally:
        if enabled:
            gc.enable()
