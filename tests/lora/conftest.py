"""A tiny Llama and random adapters over it, built once per session."""

from __future__ import annotations

import pytest

from tests.engine.factories import make_tiny_model_dir
from tests.lora.adapters import make_adapter


@pytest.fixture(scope="session")
def lora_base_dir(tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("lora-base"), "llama")


@pytest.fixture(scope="session")
def adapter_a(lora_base_dir, tmp_path_factory):
    """Rank 4, every projection, alpha / r scaling."""
    return make_adapter(lora_base_dir, tmp_path_factory.mktemp("adapter-a"), seed=1, r=4, alpha=8)


@pytest.fixture(scope="session")
def adapter_b(lora_base_dir, tmp_path_factory):
    """Rank 8, rsLoRA, some projections only (v and up untouched: their slices of the fused products stay)."""
    return make_adapter(
        lora_base_dir,
        tmp_path_factory.mktemp("adapter-b"),
        seed=2,
        r=8,
        alpha=4,
        targets=("q_proj", "k_proj", "o_proj", "gate_proj", "down_proj"),
        use_rslora=True,
    )
