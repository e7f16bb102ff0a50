"""2 MB pages for the KV cache and the weights (engine/huge_pages.py): what is advised, read back from the
kernel's own account of this process's mappings (/proc/self/smaps: `hg` among a mapping's VmFlags once
MADV_HUGEPAGE applies to it)."""

from __future__ import annotations

import gc
import weakref
from pathlib import Path

import pytest
import torch

from engine.attention.kv_cache import KVCache, KVCacheSpec
from engine.huge_pages import (
    HUGE_PAGE,
    advise_huge_pages,
    huge_pages_available,
    large_tensors,
    pack_small_weights,
    reachable_tensors,
)

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
    assert pack_small_weights([one, one[1:]]) == 0  # one storage
    tiny = [torch.randn(16, 16) for _ in range(4)]
    assert pack_small_weights(tiny) == 0  # under 2 MB in all: nothing a 2 MB page would hold
    assert one.data_ptr() == at and pack_small_weights([]) == 0


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
