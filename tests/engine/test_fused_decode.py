"""The fused small-batch decode (engine/layers/fused_decode.py, csrc/decode_layer.cpp) against the unfused
ops it replaces: the same tokens and bit-identical logprobs, for decode batches of 1 to 8 rows (and, with
the column-block product, 16), with q/k/v biases (qwen2), per-head q/k norms (qwen3), and the generic decoder's
families (granite: its multipliers; olmo2: norms after the branches and over the whole q and k projections; phi3
without a window: LongRoPE; gemma2 and gemma3: GeGLU, soft-caps, sliding layers in a KV group of their own, two
RoPEs; mistral: one windowed group), with every norm made distinct, on weights packed in
column blocks (AVX512-BF16 builds) and plain ones (the small-batch kernel elsewhere), and with the embedded
model's GGUF blocks kept quantized (`quantization="gguf"`, in bf16 and float32, with biases or q/k norms added
to its layers or neither); and on the embedded model in bf16 the same greedy tokens as torch's
products with the unfused ops (the numerics before it). The comparisons run on the native build and on an
AVX2 (-march=haswell) one."""

from __future__ import annotations

import platform

import pytest
import torch

from engine import LLM, SamplingParams
from engine import platform as engine_platform
from engine.kernels.cpu import DECODE_WEIGHT_COLUMNS, NATIVE_ARCH, load_cpu_kernels
from engine.kernels.quant import load_quant_kernels
from engine.layers.fused_decode import MATRIX_COLUMNS, _model_fits
from engine.kernels.column_block_weight import PackedWeight
from engine.layers.invariant_linear import ColumnBlockLinear
from engine.layers.linear import GEMV_MAX_ROWS, GemvLinear, Linear
from engine.layers.rotary import RotaryEmbedding
from engine.quantization.gguf_formats import X16
from engine.quantization.gguf_weight import GgufWeight
from tests.engine.cpu_flags import FLOAT32_TILE_ARCHES, cpu_has
from tests.engine.factories import make_tiny_model_dir
from tests.engine.references import assert_idle, make_llm as one_thread_llm


def make_llm(model_dir, **overrides):
    """references.make_llm on the machine's team (not one thread): these tests check the native kernels' work
    split over threads."""
    return one_thread_llm(model_dir, **{"cpu_threads": None, **overrides})


PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a land far away,",
    "List three primary colors:",
    "Translate to French: Good morning, my friend.",
    "1, 2, 3, 4,",
    "The quick brown fox",
    "Water boils at",
]


def _generate(llm: LLM, prompts: list[str], max_tokens: int, logprobs=None):
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, logprobs=logprobs)
    results = llm.generate(prompts, params, use_tqdm=False)
    assert_idle(llm)
    return [(r.outputs[0].token_ids, r.outputs[0].logprobs) for r in results]


def _counting_fused(model, monkeypatch) -> list[int]:
    """Records the row count of every step the fused path runs; decode steps only (a step admitting prompts
    beside decodes, fused too, sums their attention in another order: `test_mixed_steps_...`)."""
    monkeypatch.setattr(model.fused, "mixed_prefill_tokens", 0)
    rows: list[int] = []
    forward = model.fused.forward
    monkeypatch.setattr(
        model.fused,
        "forward",
        lambda m, input_ids, *args: rows.append(input_ids.shape[0]) or forward(m, input_ids, *args),
    )
    return rows


def _use_kernels(llm: LLM, kernels) -> None:
    """Every native kernel of the model (products, fused decode, per-token ops, attention) from `kernels`."""
    runner = llm.engine.runner
    runner.model.linear.kernels = runner.model.fused.kernels = runner.model.ops.kernels = kernels
    runner.backend.kernels = kernels


def _with_product(product: str, cpu_kernels, monkeypatch) -> type:
    """Makes the cpu backend choose `product` as it would on a machine with AVX512-BF16 ("column-blocks": on
    vdpbf16ps; "column-blocks-tiles": on AMX tiles) or without it ("gemv"); its class."""
    if product.startswith("column-blocks"):
        if not cpu_kernels.bf16_column_blocks:
            pytest.skip("the column-block product is the bf16 product on AVX512-BF16 builds only")
        tiles = product == "column-blocks-tiles"
        if tiles and not cpu_kernels.amx_tiles:
            pytest.skip("no AMX tiles here")
        monkeypatch.setattr(
            engine_platform, "cpu_linear", lambda backend, dtype: ColumnBlockLinear(backend.kernels, amx=tiles)
        )
        return ColumnBlockLinear
    monkeypatch.setattr(engine_platform, "cpu_linear", lambda backend, dtype: GemvLinear(backend.kernels))
    return GemvLinear


@pytest.mark.parametrize("arch", [NATIVE_ARCH, "haswell"])
@pytest.mark.parametrize("product", ["column-blocks", "column-blocks-tiles", "gemv"])
@pytest.mark.parametrize(
    "model_dir_fixture",
    [
        "tiny_llama_dir",
        "tiny_qwen2_dir",
        "tiny_qwen3_dir",
        "tiny_mistral_dir",
        "tiny_granite_dir",
        "tiny_olmo2_dir",
        "tiny_phi3_dir",
        "tiny_phi4mini_dir",  # RoPE over the first 12 of 16 dimensions
        "tiny_gemma2_dir",
        "tiny_gemma3_dir",
    ],
)
def test_fused_decode_equals_the_unfused_ops(model_dir_fixture, product, arch, request, cpu_kernels, monkeypatch):
    linear_class = _with_product(product, cpu_kernels, monkeypatch)
    llm = make_llm(
        request.getfixturevalue(model_dir_fixture),
        dtype="bfloat16",
        attention_backend="cpu",
        enable_prefix_caching=False,
        max_num_seqs=16,
    )  # both runs compute every prompt token the same way
    model = llm.engine.runner.model
    assert type(model.linear) is linear_class and model.fused is not None
    _randomize_norms(model)  # all ones as made: each its own, in place
    if product.startswith("column-blocks"):
        assert model.linear.amx == (product == "column-blocks-tiles")
    if product != "gemv":
        assert all(isinstance(getattr(layer, name), PackedWeight) for layer in model.layers for name in MATRIX_COLUMNS)
    if arch != NATIVE_ARCH:  # the AVX2 code paths, built into their own cache key
        if platform.machine() not in ("x86_64", "AMD64"):
            pytest.skip(f"-march={arch} is an x86 target")
        _use_kernels(llm, load_cpu_kernels(arch=arch))
    rows = _counting_fused(model, monkeypatch)
    prompts = PROMPTS if not product.startswith("column-blocks") else PROMPTS + [p + " and" for p in PROMPTS]
    # staggered lengths: decode steps of every size from all the prompts' down to 1
    params = [
        SamplingParams(max_tokens=3 + 2 * i, temperature=0, ignore_eos=True, logprobs=3) for i in range(len(prompts))
    ]
    fused = _generate_each(llm, prompts, params)
    limit = GEMV_MAX_ROWS if product == "gemv" else 16  # 16: every prompt
    assert set(rows) == set(range(1, limit + 1))
    assert fused == _unfused(llm, prompts, params)


@pytest.mark.parametrize("arch", [NATIVE_ARCH, "haswell"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize(
    "model_dir_fixture", ["tiny_llama_dir", "tiny_llama_head64_dir", "tiny_mistral_head64_dir", "tiny_gemma2_dir"]
)
def test_fused_decode_over_an_fp8_cache_equals_the_unfused_ops(
    model_dir_fixture, dtype, arch, request, cpu_kernels, monkeypatch
):
    """`--kv-cache-dtype fp8`: the fused step writes each new K/V as e4m3 (its own rounding, saturating at
    +-448) and attends over the cache as the unfused step does (torch's conversion on write, the same paged
    kernel): identical tokens and logprobs (the rounding itself: test_cpu_kernels' every-bf16 test); with
    windows starting mid-block too (mistral: every layer; gemma2: every other one, in a KV group of its own)."""
    if dtype == "float32":  # the small-batch product (the fused step's float32 row functions on plain weights)
        _with_product("gemv", cpu_kernels, monkeypatch)
    llm = make_llm(
        request.getfixturevalue(model_dir_fixture),  # heads of 16: the portable attention loops; 64: AVX-512's
        dtype=dtype,
        attention_backend="cpu",
        kv_cache_dtype="fp8",
        enable_prefix_caching=False,
        max_num_seqs=8,
    )
    model = llm.engine.runner.model
    assert llm.engine.runner.kv_cache.layers[0][0].dtype == torch.float8_e4m3fn
    if arch != NATIVE_ARCH:
        if platform.machine() not in ("x86_64", "AMD64"):
            pytest.skip(f"-march={arch} is an x86 target")
        _use_kernels(llm, load_cpu_kernels(arch=arch))
    rows: list[int] = []
    forward = model.fused.forward
    model.fused.forward = lambda m, input_ids, *args: rows.append(input_ids.shape[0]) or forward(m, input_ids, *args)
    params = [SamplingParams(max_tokens=3 + 2 * i, temperature=0, ignore_eos=True, logprobs=3) for i in range(8)]
    fused = _generate_each(llm, PROMPTS, params)
    assert rows and fused == _unfused(llm, PROMPTS, params)


def _randomize_norms(model) -> None:
    """Every norm of every layer its own weights (a kernel that swaps two of them, or skips one, then differs)."""
    generator = torch.Generator().manual_seed(2)
    for layer in model.layers:
        names = ("input_norm", "post_norm", "attn_post_norm", "mlp_post_norm", "q_norm", "k_norm")
        for norm in (getattr(layer, name) for name in names):
            if norm is not None:
                norm.copy_(1 + torch.randn(norm.shape, generator=generator) * 0.2)


def test_fused_decode_refuses_qk_norms_it_does_not_compute(tiny_qwen3_dir):
    """Per-head q/k norms, both, or none: one alone, or a norm over the whole projection, keeps the general path."""
    llm = make_llm(tiny_qwen3_dir, dtype="bfloat16", attention_backend="cpu", enable_prefix_caching=False)
    runner = llm.engine.runner
    model, caches = runner.model, runner.kv_cache.layers
    layer = model.layers[-1]
    assert _model_fits(model, caches)
    k_norm, layer.k_norm = layer.k_norm, None
    assert not _model_fits(model, caches)
    layer.k_norm = k_norm
    q_norm, layer.q_norm = layer.q_norm, layer.q_norm.repeat(model.arch.num_heads)  # [heads * head_dim]
    assert not _model_fits(model, caches)
    layer.q_norm = q_norm
    assert _model_fits(model, caches)


@pytest.mark.parametrize(
    "family, overrides",
    [
        ("granite", {}),
        ("phi3", {"sliding_window": 256}),  # a window spanning max_model_len (the config's 256): none
        ("phi3", {}),  # a window on every layer
        ("phi4mini", {}),  # RoPE over part of each head
        ("olmo2", {}),  # norms after the branches, q/k norms over the whole projection
        ("gemma2", {}),  # GeGLU, soft-caps, windowed layers in a KV group of their own
        ("gemma3", {}),  # the same, per-head q/k norms, two RoPEs
        ("gemma", {}),  # GeGLU, norms of (1 + w) folded at load, scaled embeddings
        ("glm", {}),  # partial rotary whose interleaved pairs were put in halves at load, q/k/v biases
        ("glm4", {}),  # the same with norms after the branches
        ("olmo3", {}),  # OLMo 2's with windowed layers and two RoPEs
        ("ernie4_5", {}),  # interleaved pairs put in halves at load, biases on every projection
        # without a window every layer rotates: post-norms, per-head q/k norms
        ("exaone4", {"sliding_window": None, "layer_types": ["full_attention"] * 4}),
        ("seed_oss", {}),  # biases on q/k/v, o and the MLP; heads wider than hidden / heads
    ],
    ids=[
        *("granite", "phi3-long-window", "phi3-window", "phi4mini", "olmo2", "gemma2", "gemma3", "gemma", "glm"),
        *("glm4", "olmo3", "ernie4_5", "exaone4-global", "seed_oss"),
    ],
)
def test_generic_decoders_fuse_in_every_family(family, overrides, tmp_path):
    """The generic decoder (engine/models/decoder.py) takes the fused step in every family, Phi-4-mini's RoPE over
    part of each head included (their equality with HF: tests/engine/test_dense_families.py)."""
    llm = make_llm(
        make_tiny_model_dir(tmp_path / family, family, **overrides),
        dtype="bfloat16",
        attention_backend="cpu",
        enable_prefix_caching=False,
    )
    runner = llm.engine.runner
    model = runner.model
    assert model.fused is not None and _model_fits(model, runner.kv_cache.layers)


@pytest.mark.parametrize(
    "family",
    [
        "cohere",
        "cohere2",
        "starcoder2",
        "smollm3",
        "arcee",
        "exaone4",
        "phi",
        "gpt_neox",
        "apertus",
        "gptj",
        "gpt_bigcode",
        "falcon",
    ],
)
def test_fused_decode_declines_recipes_it_does_not_compute(family, tmp_path):
    """Cohere's LayerNorms and attention beside the MLP, Cohere 2's, SmolLM3's and EXAONE 4's layers without RoPE,
    StarCoder2's LayerNorms with shifts and its plain MLP (Phi-2's and GPT-NeoX's too, their branches side by side),
    Arcee's plain relu^2 MLP, Apertus's plain xIELU MLP: the native step computes none of them, so the model says so (`fused_recipe`) and its
    bf16 decode steps take the general path (their equality with HF: tests/engine/test_dense_families.py)."""
    model_dir = make_tiny_model_dir(tmp_path / family, family)
    with make_llm(model_dir, dtype="bfloat16", attention_backend="cpu", enable_prefix_caching=False) as llm:
        runner = llm.engine.runner
        model = runner.model
        assert model.fused is not None and not model.fused_recipe
        assert not _model_fits(model, runner.kv_cache.layers)
        params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
        (result,) = llm.generate([{"prompt_token_ids": [5, 6, 7, 8, 9]}], params, use_tqdm=False)
        assert len(result.outputs[0].token_ids) == 8 and model.fused._model_ok is False  # decided, and declined


@pytest.mark.parametrize("family", ["gemma", "glm", "glm4", "olmo3", "ernie4_5"])
def test_fused_steps_equal_the_unfused_ones(family, tmp_path):
    """bfloat16 decode steps, fused, give the unfused path's tokens and logprobs bit for bit: Gemma's norms folded
    at load, GLM's rotary pairs reordered into halves at load, GLM-4-0414's post-branch norms, OLMo 3's windowed
    layers with their own RoPE, ERNIE 4.5's biases on every projection."""
    model_dir = make_tiny_model_dir(tmp_path / family, family)
    with make_llm(model_dir, dtype="bfloat16", attention_backend="cpu", enable_prefix_caching=False) as llm:
        assert llm.engine.runner.model.fused is not None and llm.engine.runner.model.fused_recipe
        prompts = [[5, 6, 7, 8] * 4, list(range(30, 50))]
        params = [SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=2)] * 2
        assert _generate_each(llm, prompts, params) == _unfused(llm, prompts, params)


def test_fused_decode_refuses_rope_tables_of_two_widths(tiny_gemma3_dir):
    """The kernel takes one rotary width for every layer's tables: a model whose layers rotate different widths
    (none is made so; a guard for one that would be) keeps the general path."""
    llm = make_llm(tiny_gemma3_dir, dtype="bfloat16", attention_backend="cpu", enable_prefix_caching=False)
    runner = llm.engine.runner
    model, caches = runner.model, runner.kv_cache.layers
    assert _model_fits(model, caches) and len({id(model.rotary_of(i)) for i in range(len(model.layers))}) == 2
    local = model.rotaries[-1]
    narrow = RotaryEmbedding(
        model.arch.head_dim,
        local.cos.shape[0],
        10000.0,
        None,
        model.dtype,
        torch.device("cpu"),
        model.arch.head_dim - 2,
    )
    model.rotaries[-1] = narrow
    assert not _model_fits(model, caches)
    model.rotaries[-1] = local
    assert _model_fits(model, caches)


def test_each_step_reads_its_own_kv_groups(tiny_gemma2_dir, cpu_kernels, monkeypatch):
    """A speculative config times a step at start-up with one metadata object for every layer; the runner's steps
    then pass one per KV group (gemma2: sliding layers in their own): each step's layers read their own group's
    tables and slots, the same tokens and logprobs as the unfused path."""
    _with_product("gemv", cpu_kernels, monkeypatch)
    ngram = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 2, "prompt_lookup_max": 3}
    llm = make_llm(
        tiny_gemma2_dir,
        dtype="bfloat16",
        attention_backend="cpu",
        enable_prefix_caching=False,
        speculative_config=ngram,
    )
    assert llm.engine.runner.model.fused is not None
    prompts = [[5, 6, 7, 8] * 4, list(range(30, 50))]
    params = [SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=2)] * 2
    assert _generate_each(llm, prompts, params) == _unfused(llm, prompts, params)


def _unfused(llm: LLM, prompts, params):
    model = llm.engine.runner.model
    fused_path, model.fused = model.fused, None
    try:
        return _generate_each(llm, prompts, params)
    finally:
        model.fused = fused_path


def _generate_each(llm: LLM, prompts, params):
    results = llm.generate(prompts, params, use_tqdm=False)
    assert_idle(llm)
    return [(r.outputs[0].token_ids, r.outputs[0].logprobs) for r in results]


def _embedded_gguf(dtype: str, max_num_seqs: int) -> LLM:
    """The embedded model with its GGUF blocks kept, on the cpu backend, every prompt computed alike."""
    return LLM(
        None,
        quantization="gguf",
        dtype=dtype,
        device="cpu",
        max_model_len=256,
        kv_cache_memory="32MiB",
        attention_backend="cpu",
        enable_prefix_caching=False,
        max_num_seqs=max_num_seqs,
    )


# Pairs, not the whole product (each case loads the embedded model): every arch meets every extra and both
# dtypes, and every extra both dtypes.
GGUF_CASES = [
    (NATIVE_ARCH, "none", torch.bfloat16),
    (NATIVE_ARCH, "bias", torch.float32),
    (NATIVE_ARCH, "qk_norm", torch.bfloat16),
    ("haswell", "none", torch.float32),
    ("haswell", "bias", torch.bfloat16),
    ("haswell", "qk_norm", torch.float32),
]


@pytest.mark.parametrize("arch, extra, dtype", GGUF_CASES, ids=lambda value: str(value).removeprefix("torch."))
def test_fused_decode_with_gguf_blocks_equals_the_unfused_ops(
    embedded_checkpoint, arch, extra, dtype, cpu_kernels, monkeypatch
):
    """float32 too (dtype auto on CPUs without native bf16; column blocks on AVX2 and AVX-512 builds, elsewhere
    oneDNN beside them, engine/platform.py), the GGUF blocks fused.
    `extra`: the projections' biases of a qwen2 GGUF, or the per-head q/k norms of a qwen3 one, added to the
    embedded model's layers."""
    llm = _embedded_gguf(str(dtype).removeprefix("torch."), max_num_seqs=8)
    model = llm.engine.runner.model
    layers = model.layers
    assert model.fused is not None and all(isinstance(getattr(layers[0], name), GgufWeight) for name in MATRIX_COLUMNS)
    assert all(getattr(layer, name).packed.layout == X16 for layer in layers for name in MATRIX_COLUMNS)
    if arch != NATIVE_ARCH:  # the AVX2 code paths
        if platform.machine() not in ("x86_64", "AMD64"):
            pytest.skip(f"-march={arch} is an x86 target")
        _use_kernels(llm, load_cpu_kernels(arch=arch))
        quant_kernels = load_quant_kernels(march=arch)
        for weight in [model.embed, *(getattr(layer, name) for layer in layers for name in MATRIX_COLUMNS)]:
            weight.kernels = quant_kernels
    # the unfused path's integer product up to here (beyond, tiles or a dense product): the fused path too
    integer_rows = next(
        rows
        for rows in range(1, GEMV_MAX_ROWS + 2)
        if layers[0].qkv.product(rows, dtype) != "integer" or rows > GEMV_MAX_ROWS
    )
    generator = torch.Generator().manual_seed(1)
    if extra == "bias":  # on the blocks
        for layer in layers:
            for matrix, name in zip(MATRIX_COLUMNS, ("qkv_bias", "o_bias", "gate_up_bias", "down_bias")):
                rows = getattr(layer, matrix).out_features
                setattr(layer, name, (torch.randn(rows, generator=generator) * 0.05).to(dtype))
    if extra == "qk_norm":  # before RoPE, each head of q and of k
        head_dim = model.arch.head_dim
        for layer in layers:
            layer.q_norm = (1 + torch.randn(head_dim, generator=generator) * 0.2).to(dtype)
            layer.k_norm = (1 + torch.randn(head_dim, generator=generator) * 0.2).to(dtype)
    rows = _counting_fused(model, monkeypatch)
    # staggered lengths: decode batches of every size from 8 rows down to 1
    params = [SamplingParams(max_tokens=3 + 2 * i, temperature=0, ignore_eos=True, logprobs=3) for i in range(8)]
    fused = _generate_each(llm, PROMPTS, params)
    max_rows = getattr(model.linear, "max_rows", GEMV_MAX_ROWS)  # float32's oneDNN product: the fused step's own
    assert set(rows) == set(range(1, min(integer_rows - 1, max_rows, GEMV_MAX_ROWS) + 1))
    assert fused == _unfused(llm, PROMPTS, params)


def test_fused_gguf_decode_beside_torchs_float32_product(embedded_checkpoint, monkeypatch):
    """float32 where oneDNN is missing (torch's own product): the GGUF blocks still fused, with the unfused ops'
    tokens and logprobs; a plain-weight model keeps the unfused path there, as beside oneDNN."""
    import engine.models.llama as llama_module

    # (the cpu backend's own float32 product declined, as on builds without float32 column blocks)
    monkeypatch.setattr(engine_platform, "cpu_linear", lambda backend, dtype: None)
    monkeypatch.setattr(llama_module, "select_linear", lambda device, dtype: Linear())
    llm = _embedded_gguf("float32", max_num_seqs=4)
    model = llm.engine.runner.model
    assert type(model.linear) is Linear and model.fused is not None
    rows = _counting_fused(model, monkeypatch)
    params = [SamplingParams(max_tokens=3 + 2 * i, temperature=0, ignore_eos=True, logprobs=3) for i in range(4)]
    fused = _generate_each(llm, PROMPTS[:4], params)
    assert rows and fused == _unfused(llm, PROMPTS[:4], params)


def test_plain_float32_weights_keep_the_unfused_path_beside_torchs_product(tiny_llama_dir, monkeypatch):
    import engine.models.llama as llama_module

    monkeypatch.setattr(engine_platform, "cpu_linear", lambda backend, dtype: None)
    monkeypatch.setattr(llama_module, "select_linear", lambda device, dtype: Linear())
    llm = make_llm(tiny_llama_dir, dtype="float32", attention_backend="cpu", enable_prefix_caching=False)
    assert type(llm.engine.runner.model.linear) is Linear and llm.engine.runner.model.fused is None


@pytest.mark.parametrize("arch", [NATIVE_ARCH, "haswell", "skylake-avx512"])
def test_float32_engines_fuse_their_decode_on_column_blocks(
    arch, tiny_llama_dir, tiny_gemma3_dir, cpu_kernels, monkeypatch
):
    """float32 on AVX2 and AVX-512 builds: the column-block product at every row count, so that an engine of any
    size fuses its decode steps (20 sequences here: past the small-batch product's rows), at every batch size bit
    for bit the unfused ops' on the same packed weights (the haswell build: the AVX2 tiles on any x86 machine;
    skylake-avx512: the AVX-512 ones without BF16, as on Skylake-SP and Cascade Lake, where float32 is what
    `dtype auto` gives)."""
    if arch == NATIVE_ARCH and not cpu_kernels.f32_column_blocks:
        pytest.skip("float32 column blocks are the float32 product of AVX2 and AVX-512 builds only")
    if arch != NATIVE_ARCH:
        if platform.machine() not in ("x86_64", "AMD64"):
            pytest.skip(f"-march={arch} is an x86 target")
        if not cpu_has(*FLOAT32_TILE_ARCHES[arch]):
            pytest.skip(f"this CPU cannot run -march={arch} code")
        monkeypatch.setattr(
            engine_platform,
            "cpu_linear",
            lambda backend, dtype: ColumnBlockLinear(backend.kernels, amx=False),
        )
    prompts = PROMPTS + [p + " and" for p in PROMPTS] + [p + " or" for p in PROMPTS[:4]]
    for model_dir in (tiny_llama_dir, tiny_gemma3_dir):
        llm = make_llm(
            model_dir, dtype="float32", attention_backend="cpu", enable_prefix_caching=False, max_num_seqs=20
        )
        model = llm.engine.runner.model
        assert type(model.linear) is ColumnBlockLinear and model.linear.amx is False and model.fused is not None
        assert all(isinstance(getattr(layer, name), PackedWeight) for layer in model.layers for name in MATRIX_COLUMNS)
        if arch != NATIVE_ARCH:
            kernels = load_cpu_kernels(arch=arch)
            assert kernels is not None and kernels.f32_column_blocks
            _use_kernels(llm, kernels)
        rows = _counting_fused(model, monkeypatch)
        params = [
            SamplingParams(max_tokens=3 + 2 * i, temperature=0, ignore_eos=True, logprobs=3)
            for i in range(len(prompts))
        ]
        fused = _generate_each(llm, prompts, params)
        assert set(range(1, 17)) <= set(rows) and max(rows) > 16
        assert fused == _unfused(llm, prompts, params)


def _staggered(llm: LLM, prompts: list[list[int]], every: int) -> dict[str, tuple[list[int], list[float]]]:
    """Each prompt admitted `every` steps after the one before, beside its decodes: tokens and logprobs. 16 tokens
    each: the first sequences' contexts pass the tiny models' windows of 8 while the later prompts join, and
    their sliding layers' blocks behind the window are freed."""
    engine = llm.engine
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=1)
    results: dict[str, tuple[list[int], list[float]]] = {}
    step = 0
    while step == 0 or engine.has_work:
        if step % every == 0 and step // every < len(prompts):
            engine.add_request(f"r{step // every}", prompts[step // every], params)
        for out in engine.step():
            tokens, logprobs = results.setdefault(out.request_id, ([], []))
            tokens += out.new_token_ids
            logprobs += [entry.logprob for entry in out.logprobs or []]
        step += 1
    assert_idle(llm)
    return results


@pytest.mark.parametrize(
    "model_dir_fixture", ["tiny_llama_dir", "tiny_mistral_dir", "tiny_gemma2_dir", "tiny_gemma3_dir"]
)
def test_mixed_steps_run_fused_with_the_same_tokens(model_dir_fixture, request, cpu_kernels, monkeypatch):
    """Prompts admitted beside running decodes: their tokens become rows of the fused step (each query over the
    cache up to itself, within its window: mistral; each KV group's rows over its own blocks, some freed behind
    the window: gemma2, gemma3 with its second RoPE), float32 greedy tokens identical to the unfused path,
    logprobs within 1e-5; a chunk above the limit keeps the step unfused."""
    _with_product("gemv", cpu_kernels, monkeypatch)  # float32 products the fused step takes (up to 8 rows)
    llm = make_llm(request.getfixturevalue(model_dir_fixture), attention_backend="cpu", enable_prefix_caching=False)
    model = llm.engine.runner.model
    assert model.fused is not None
    mixed: list[int] = []
    forward = model.fused.forward

    def counting(m, input_ids, positions, kv_caches, metadata):
        if metadata[0].prefills:
            mixed.append(input_ids.shape[0])
        return forward(m, input_ids, positions, kv_caches, metadata)

    monkeypatch.setattr(model.fused, "forward", counting)
    prompts = [[5, 17, 42, 9], [7, 8, 9, 10, 11], [300, 12, 13]]  # short: running decodes + a prompt in 8 rows
    fused = _staggered(llm, prompts, every=2)
    assert len(mixed) == len(prompts) - 1  # every prompt after the first joined running decodes, fused
    monkeypatch.setattr(model.fused, "mixed_prefill_tokens", 2)  # below every prompt's length: unfused
    mixed.clear()
    assert _staggered(llm, prompts, every=2).keys() == fused.keys() and mixed == []
    model.fused = None
    unfused = _staggered(llm, prompts, every=2)
    for request_id, (tokens, logprobs) in unfused.items():
        assert fused[request_id][0] == tokens
        assert fused[request_id][1] == pytest.approx(logprobs, abs=1e-5)


NEAR_TIE = 0.5
"""Top-2 logprob gap (nats) under which bf16 products summed in another order may pick the other token:
four bf16 steps of a logit between 16 and 32 (the logits are rounded to bf16 before the softmax). Two
were not enough: against oneDNN's bf16 products on a Xeon with AMX, a 0.25-nat lead flipped."""


def test_embedded_bf16_greedy_tokens_match_torch_products(embedded_checkpoint, cpu_kernels, monkeypatch):
    def embedded_llm() -> LLM:
        return LLM(
            None,
            dtype="bfloat16",
            device="cpu",
            max_model_len=512,
            kv_cache_memory="64MiB",
            attention_backend="cpu",
            enable_prefix_caching=False,
        )

    llm = embedded_llm()
    model = llm.engine.runner.model
    assert model.fused is not None
    if isinstance(model.linear, ColumnBlockLinear):  # tied: the embedding is looked up in the packed LM head
        assert model.embed is model.lm_head and isinstance(model.embed, PackedWeight)
    del model
    fused = _generate(llm, PROMPTS[:4], 24)
    del llm
    monkeypatch.setattr(engine_platform, "cpu_linear", lambda backend, dtype: None)  # torch's products, unfused:
    torch_llm = embedded_llm()  # the numerics before the native products
    assert type(torch_llm.engine.runner.model.linear) is Linear and torch_llm.engine.runner.model.fused is None
    reference = _generate(torch_llm, PROMPTS[:4], 24, logprobs=2)
    for (tokens, _), (expected, logprobs) in zip(fused, reference):
        for got, want, entry in zip(tokens, expected, logprobs):
            gap = entry.top[0][1] - entry.top[1][1]
            assert got == want or gap < NEAR_TIE, f"token {want} (lead {gap:.3f} nats) became {got}"
            if got != want:
                break  # past a near tie the continuations differ


def test_decode_layers_rejects_wrong_index_types(cpu_kernels):
    residual = torch.zeros(2, 8, dtype=torch.bfloat16)
    weights = torch.zeros(1, DECODE_WEIGHT_COLUMNS, dtype=torch.int64)
    caches = [torch.zeros(4, 4, 1, 8, dtype=torch.bfloat16)]
    tables, lens = torch.zeros(2, 1, dtype=torch.int32), torch.ones(2, dtype=torch.int32)
    cos = torch.zeros(16, 8, dtype=torch.bfloat16)
    args = dict(cos=cos, sin_signed=cos, heads=1, inter=8, eps=1e-5, scale=1.0)
    with pytest.raises(ValueError, match="int64 positions"):
        cpu_kernels.decode_layers(
            residual,
            weights,
            caches,
            caches,
            torch.zeros(2, dtype=torch.int32),
            slots=torch.zeros(2, dtype=torch.int64),
            block_tables=tables,
            context_lens=lens,
            **args,
        )
    with pytest.raises(ValueError, match="int32 block tables"):
        cpu_kernels.decode_layers(
            residual,
            weights,
            caches,
            caches,
            torch.zeros(2, dtype=torch.int64),
            slots=torch.zeros(2, dtype=torch.int64),
            block_tables=tables.long(),
            context_lens=lens,
            **args,
        )
    with pytest.raises(ValueError, match="1 layers of weights for 2 caches"):
        cpu_kernels.decode_layers(
            residual,
            weights,
            caches * 2,
            caches * 2,
            torch.zeros(2, dtype=torch.int64),
            slots=torch.zeros(2, dtype=torch.int64),
            block_tables=tables,
            context_lens=lens,
            **args,
        )
    with pytest.raises(ValueError, match=f"weight table of {DECODE_WEIGHT_COLUMNS} columns"):  # 30: before q/k norms
        cpu_kernels.decode_layers(
            residual,
            torch.zeros(1, 30, dtype=torch.int64),
            caches,
            caches,
            torch.zeros(2, dtype=torch.int64),
            slots=torch.zeros(2, dtype=torch.int64),
            block_tables=tables,
            context_lens=lens,
            **args,
        )


@pytest.mark.parametrize(
    "cos, sin",
    [
        (torch.zeros(16, 10), None),  # wider than the heads' 8
        (torch.zeros(16, 7), None),  # an odd width: no halves to rotate
        (torch.zeros(16, 6), torch.zeros(16, 4)),  # sin not cos's shape
        (torch.zeros(16), None),  # not [positions, rotary_dim]
        (torch.zeros(6, 16).t(), None),  # not contiguous
    ],
    ids=["wide", "odd", "mismatched", "flat", "strided"],
)
def test_decode_layers_rejects_rope_tables_it_cannot_read(cos, sin, cpu_kernels):
    """The kernel rotates each head's first cos.shape[1] dimensions, reading that many per position: a table wider
    than a head, of an odd width, or unlike its sin table is refused before the call (a narrower one passes:
    partial rotary, tests above)."""
    cos = cos.to(torch.bfloat16)
    sin = cos if sin is None else sin.to(torch.bfloat16)
    with pytest.raises(ValueError, match="RoPE tables"):
        cpu_kernels.decode_layers(
            torch.zeros(2, 8, dtype=torch.bfloat16),
            torch.zeros(1, DECODE_WEIGHT_COLUMNS, dtype=torch.int64),
            [torch.zeros(4, 4, 1, 8, dtype=torch.bfloat16)],
            [torch.zeros(4, 4, 1, 8, dtype=torch.bfloat16)],
            torch.zeros(2, dtype=torch.int64),
            cos,
            sin,
            torch.zeros(2, dtype=torch.int64),
            torch.zeros(2, 1, dtype=torch.int32),
            torch.ones(2, dtype=torch.int32),
            heads=1,
            inter=8,
            eps=1e-5,
            scale=1.0,
        )
