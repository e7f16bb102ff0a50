"""On a CUDA device with flash-attn (skipped without either): the flash backend agrees with the torch backend
(and with the float64 reference) on random paged steps in bfloat16, and writes the same cache.

Values have a standard deviation of 0.5, so outputs stay below 2 in magnitude, where a bfloat16 step
is at most 2**-7: the 2e-2 bound then allows a few roundings, not a wrong mask or scale."""

import pytest
import torch

from engine.attention.layer_attention import LayerAttention
from engine.attention.flash_backend import FlashAttentionBackend, find_flash_kernel
from engine.attention.torch_backend import TorchAttentionBackend
from engine.attention.kv_cache import KVCacheSpec
from tests.engine.paged_steps import random_paged_step, reference_attention

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

MAX_ABS_ERROR = 2e-2
STEPS = {  # (seq_len, query_len) per request, decodes first; number of decodes
    "prefill": ([(300, 300), (77, 77), (1, 1)], 0),
    "chunked prefill over a cached prefix": ([(700, 180), (530, 530), (261, 5)], 0),
    "decode": ([(1, 1), (17, 1), (256, 1), (257, 1), (999, 1), (2048, 1)], 6),
    "mixed": ([(40, 1), (513, 1), (600, 100), (33, 33)], 2),
}


@pytest.fixture(params=[16, 256], ids=lambda size: f"block{size}")
def flash(request) -> tuple[FlashAttentionBackend, int]:
    """The flash backend for a block size (flash-attn 4 takes both; flash-attn 2 only 256), and that size."""
    search = find_flash_kernel(torch.device("cuda"), torch.bfloat16, request.param)
    if search.kernel is None:
        pytest.skip(f"no flash-attn kernel for block size {request.param} here: {search.summary}")
    return FlashAttentionBackend(search.kernel), request.param


@pytest.mark.parametrize("heads, kv_heads, head_dim", [(8, 2, 128), (4, 4, 64), (14, 2, 64)])
@pytest.mark.parametrize("name", list(STEPS))
def test_flash_matches_torch_in_bf16(flash, name, heads, kv_heads, head_dim):
    backend, block_size = flash
    shapes, num_decodes = STEPS[name]
    outputs, caches = [], []
    for each in (backend, TorchAttentionBackend()):
        step = random_paged_step(
            shapes,
            num_decodes,
            block_size=block_size,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            num_blocks=2 * sum(-(-s // block_size) for s, _ in shapes) + 8,
            dtype=torch.bfloat16,
            device=torch.device("cuda"),
            value_std=0.5,
        )  # same step twice
        metadata = each.build_metadata(step.metadata, KVCacheSpec(1, block_size, kv_heads, head_dim, torch.bfloat16))
        each.write_kv(step.key, step.value, step.key_cache, step.value_cache, metadata)
        outputs.append(
            each.attend(
                step.query,
                step.key,
                step.value,
                step.key_cache,
                step.value_cache,
                metadata,
                LayerAttention(head_dim**-0.5),
            )
        )
        caches.append((step.key_cache, step.value_cache))
    torch.cuda.synchronize()
    flash_out, torch_out = outputs
    assert flash_out.shape == torch_out.shape and flash_out.dtype == torch.bfloat16
    error = (flash_out.float() - torch_out.float()).abs().max().item()
    reference_error = (flash_out.double().cpu() - reference_attention(step, head_dim**-0.5)).abs().max().item()
    print(
        f"{backend.name}, block {block_size}, {name}, heads {heads}/{kv_heads}, head_dim {head_dim}: "
        f"max abs error {error:.2e} vs torch, {reference_error:.2e} vs float64"
    )
    assert error < MAX_ABS_ERROR and reference_error < MAX_ABS_ERROR
    assert torch.equal(caches[0][0], caches[1][0]) and torch.equal(caches[0][1], caches[1][1])
