"""Shared engine fixtures: tiny random checkpoints per architecture, and an LLM over the llama one."""

from __future__ import annotations

import pytest

from tests.engine.factories import make_tiny_model_dir
from tests.engine.references import make_llm


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny-llama"), "llama")


@pytest.fixture(scope="session")
def tiny_llama_head64_dir(tmp_path_factory):
    """The tiny llama with heads of 64 (16 otherwise): the head sizes the native kernels' AVX-512 decode and the
    prefill attention kernel are built for."""
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny-llama-head64"), "llama", head_dim=64)


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny-qwen2"), "qwen2")


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny-qwen3"), "qwen3")


@pytest.fixture(scope="session")
def tiny_granite_dir(tmp_path_factory):
    """Granite: Llama's layer with embedding, residual and attention multipliers and a logits divisor."""
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny-granite"), "granite")


@pytest.fixture(scope="session")
def tiny_olmo2_dir(tmp_path_factory):
    """OLMo 2: norms after the branches only, q/k norms over the whole projection."""
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny-olmo2"), "olmo2")


@pytest.fixture(scope="session")
def tiny_mistral_dir(tmp_path_factory):
    """Mistral: a sliding window of 8 on every layer (one KV group, windowed)."""
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny-mistral"), "mistral")


@pytest.fixture(scope="session")
def tiny_mistral_head64_dir(tmp_path_factory):
    """Mistral with heads of 64: its window on the AVX2 and AVX-512 attention paths."""
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny-mistral-head64"), "mistral", head_dim=64)


@pytest.fixture(scope="session")
def tiny_gemma2_dir(tmp_path_factory):
    """Gemma 2: sandwich norms, GeGLU, soft-caps, every other layer in a window of 8 (two KV groups)."""
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny-gemma2"), "gemma2")


@pytest.fixture(scope="session")
def tiny_gemma3_dir(tmp_path_factory):
    """Gemma 3: Gemma 2's layer with per-head q/k norms, its sliding layers on a RoPE of their own."""
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny-gemma3"), "gemma3")


@pytest.fixture(scope="session")
def tiny_phi3_dir(tmp_path_factory):
    """Phi-3 (LongRoPE) without a sliding window: Llama's layer from fused projections."""
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny-phi3"), "phi3", sliding_window=None)


@pytest.fixture(scope="session")
def tiny_phi4mini_dir(tmp_path_factory):
    """Phi-4-mini's shape: RoPE over the first 0.75 of each head, LongRoPE (tests/engine/factories.py)."""
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny-phi4mini"), "phi4mini")


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    """One LLM per test module over the tiny llama (configs/tiny.yaml settings, fp32 on CPU)."""
    with make_llm(tiny_llama_dir) as llm:
        yield llm  # shut down after the module: engines do not pile up over the run
