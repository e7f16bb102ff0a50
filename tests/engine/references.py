"""Engine builders with the tiny preset, and HF transformers references to compare against."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Sequence

import pytest
import torch
import yaml

from engine import LLM

TINY_PRESET = Path(__file__).resolve().parents[2] / "configs" / "tiny.yaml"


def make_llm(model_dir: Path, **overrides) -> LLM:
    """An LLM over a checkpoint with configs/tiny.yaml's cache and scheduler settings, fp32 on CPU, one thread:
    a tiny model's operators are microseconds long, and on 2 cores with `make test`'s two workers a team of two
    waits at every barrier for a thread the other worker holds (the suite's model matrices ran 2x slower)."""
    preset = yaml.safe_load(TINY_PRESET.read_text())
    kwargs = {**preset["cache"], **preset["scheduler"], "dtype": "float32", "device": "cpu", "cpu_threads": 1}
    kwargs.update(overrides)
    return LLM(str(model_dir), **kwargs)


def assert_idle(llm: LLM) -> None:
    """Nothing left running and every KV block back in the free pool."""
    engine = llm.engine
    assert not engine.has_unfinished_requests
    assert engine.scheduler.kv_cache_manager.usage == 0
    pool = engine.scheduler.kv_cache_manager.block_pool
    assert pool.num_free_blocks == pool.num_blocks


def record_peak_blocks(llm: LLM) -> list[int]:
    """A one-element list that holds the most blocks the engine's pool has had in use after any allocation from
    now on (a test of what the KV groups free)."""
    kv = llm.engine.scheduler.kv_cache_manager
    peak, allocate = [0], kv.allocate_slots

    def recording_allocate(*args, **kwargs):
        new = allocate(*args, **kwargs)
        peak[0] = max(peak[0], kv.block_pool.num_blocks - kv.block_pool.num_free_blocks)
        return new

    kv.allocate_slots = recording_allocate
    return peak


@lru_cache(maxsize=4)
def hf_model(model_dir: str):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    return model


def hf_greedy(model_dir: Path, prompt_ids: Sequence[int], max_new_tokens: int) -> tuple[list[int], list[float]]:
    """HF `generate` greedy tokens (eos ignored) and the raw log-softmax of each chosen token."""
    return hf_greedy_of(hf_model(str(model_dir)), prompt_ids, max_new_tokens)


def hf_greedy_of(model, prompt_ids: Sequence[int], max_new_tokens: int) -> tuple[list[int], list[float]]:
    """`hf_greedy` of an in-memory HF model (a PEFT model included)."""
    from transformers import GenerationConfig

    ids = torch.tensor([list(prompt_ids)])
    with torch.inference_mode():
        # No eos at all: [] (None falls back to the model's; min_new_tokens would mask eos out).
        config = GenerationConfig(
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=[],
            pad_token_id=0,
            output_logits=True,
            return_dict_in_generate=True,
        )
        out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
    assert out.sequences.shape[1] == ids.shape[1] + max_new_tokens
    tokens = out.sequences[0, ids.shape[1] :].tolist()
    logprobs = [torch.log_softmax(step[0].float(), -1)[t].item() for step, t in zip(out.logits, tokens)]
    return tokens, logprobs


def hf_prompt_logprobs(model_dir: Path, prompt_ids: Sequence[int]) -> list[float]:
    """log p(prompt[i] | prompt[:i]) for i >= 1."""
    model = hf_model(str(model_dir))
    ids = torch.tensor([list(prompt_ids)])
    with torch.inference_mode():
        logits = model(ids).logits[0].float()
    logprobs = torch.log_softmax(logits[:-1], -1)
    return logprobs.gather(1, ids[0, 1:, None])[:, 0].tolist()


NEW_TOKENS = 12
"""Greedy tokens the equivalence tests compare with HF `generate`."""


@lru_cache(maxsize=None)
def _hf_greedy_once(model_dir: str, prompt: tuple[int, ...], max_new_tokens: int) -> tuple[list[int], list[float]]:
    return hf_greedy(Path(model_dir), prompt, max_new_tokens)


def check_against_hf(model_dir, prompts, results, max_new_tokens: int = NEW_TOKENS) -> None:
    """Each result's greedy tokens are HF's and its logprobs within 1e-4 (HF's run once per prompt)."""
    for prompt, result in zip(prompts, results):
        expected, expected_lps = _hf_greedy_once(str(model_dir), tuple(prompt), max_new_tokens)
        out = result.outputs[0]
        assert out.token_ids == expected, f"prompt of {len(prompt)} tokens diverged"
        assert [lp.logprob for lp in out.logprobs] == pytest.approx(expected_lps, abs=1e-4)
