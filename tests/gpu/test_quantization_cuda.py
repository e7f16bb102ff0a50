"""On a CUDA device (skipped without one): int8/int4 products through torch's CUDA kernels against float64
references of their dequantized matrices, the quantized tiny model against the same model dequantized,
and an fp8 KV cache (torch backend) close to the bf16 one."""

import pytest
import torch

from engine import SamplingParams
from engine.quantization.int4_groups import Int4Groups
from engine.quantization.int4_weight import Int4Weight
from engine.quantization.int8_weight import Int8Weight
from tests.engine.factories import make_tiny_model_dir
from tests.engine.references import make_llm

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
CUDA = torch.device("cuda")


@pytest.mark.parametrize("rows", [1, 7, 64])
@pytest.mark.parametrize("shape", [(960, 576), (256, 1536)])
def test_int4_cuda_kernel_matches_the_dequantized_matrix(rows, shape):
    groups = Int4Groups.quantize(torch.randn(*shape, generator=torch.Generator().manual_seed(0)), 128)
    weight = Int4Weight(groups, CUDA)
    assert weight.kernel == "cuda"
    x = torch.randn(rows, shape[1], device=CUDA, dtype=torch.bfloat16)
    reference = x.double() @ groups.dequantize().to(CUDA).double().t()
    error = (weight.matmul(x).double() - reference).abs().max() / reference.abs().max()
    assert error < 2e-2


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_int8_on_cuda_matches_the_dequantized_matrix(dtype):
    weight = Int8Weight.quantize(torch.randn(384, 576, generator=torch.Generator().manual_seed(1))).to(CUDA)
    x = torch.randn(9, 576, device=CUDA).to(dtype)
    reference = x.double() @ weight.dequantize().double().t()
    error = (weight.matmul(x).double() - reference).abs().max() / reference.abs().max()
    assert error < (1e-3 if dtype == torch.float32 else 2e-2)


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_quantized_tiny_model_on_cuda_agrees_with_cpu(tmp_path, quantization):
    model_dir = make_tiny_model_dir(tmp_path, "llama")
    prompts = [[5, 6, 7], list(range(10, 50))]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    settings = {"quantization": quantization}  # int4: the default group, 32 (int8 refuses a group size)
    cpu = make_llm(model_dir, **settings).generate(prompts, params, use_tqdm=False)
    cuda = make_llm(model_dir, device="cuda", **settings).generate(prompts, params, use_tqdm=False)
    same = sum(a == b for x, y in zip(cpu, cuda) for a, b in zip(x.outputs[0].token_ids, y.outputs[0].token_ids))
    assert same >= 0.9 * 16


def test_fp8_kv_cache_with_the_torch_backend(tmp_path):
    model_dir = make_tiny_model_dir(tmp_path, "llama")
    prompts = [list(range(10, 50)), [7, 8, 9, 10]]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    common = {"device": "cuda", "dtype": "bfloat16", "attention_backend": "torch", "max_num_batched_tokens": 16}
    fp8 = make_llm(model_dir, kv_cache_dtype="fp8", **common)
    assert fp8.engine.runner.kv_cache.layers[0][0].dtype == torch.float8_e4m3fn
    got = fp8.generate(prompts, params, use_tqdm=False)
    want = make_llm(model_dir, **common).generate(prompts, params, use_tqdm=False)
    same = sum(a == b for x, y in zip(got, want) for a, b in zip(x.outputs[0].token_ids, y.outputs[0].token_ids))
    assert same >= 0.75 * 16
