"""Tensors: model runner, models, attention backends, paged KV cache, sampler, loader, the step loop.

from engine import LLM, SamplingParams (PoolingParams: a pooling model's, LLM.embed and LLM.classify)
"""

from engine.sampling.beam_search import BeamSearchParams
from engine.lora.request import LoRAMix, LoRARequest
from engine.pooling.params import PoolingParams
from engine.sampling.params import SamplingParams


def __getattr__(name: str):
    # LLM pulls in torch and transformers; load it on first use.
    if name == "LLM":
        from engine.llm import LLM

        return LLM
    raise AttributeError(f"module 'engine' has no attribute {name!r}")


__all__ = ["LLM", "BeamSearchParams", "LoRAMix", "LoRARequest", "PoolingParams", "SamplingParams"]
