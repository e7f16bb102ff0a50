"""LoRA over quantized bases (GGUF blocks, int8, int4) and llama.cpp's GGUF adapters.

The reference of a quantized base is its own weights dequantized into a float checkpoint with the adapter
merged by PEFT, in float32: the deltas are added beside the quantized product, so served tokens are that
model's. The GGUF adapter is the PEFT adapter written as llama.cpp's converter writes it (q/k rows of
lora_b permuted): both forms give identical tokens over every base.
"""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from engine import LoRAMix, LoRARequest, SamplingParams
from engine.errors import LoRAAdapterError, LoRARankError
from engine.lora.gguf_adapter import GgufTarget, load_gguf_adapter
from engine.lora.lora_config import LoRAConfig
from engine.lora.lora_manager import LoRAManager
from engine.lora.peft_adapter import load_peft_adapter
from engine.quantization.quantized_weight import QuantizedWeight
from tests.engine.factories import make_tiny_gguf, tiny_config_dict
from tests.engine.references import NEW_TOKENS, assert_idle, hf_model, hf_prompt_logprobs, make_llm
from tests.lora.adapters import merged_model_dir
from tests.lora.fused_steps import fused_then_unfused
from tests.lora.gguf_adapters import write_gguf_adapter

CONFIG = tiny_config_dict()
LAYERS, HEADS, KV_HEADS = CONFIG["num_hidden_layers"], CONFIG["num_attention_heads"], CONFIG["num_key_value_heads"]
TARGET = GgufTarget("llama", HEADS, KV_HEADS)
PROMPTS = [random.Random(7).choices(range(3, 512), k=70), random.Random(8).choices(range(3, 512), k=9)]
"""A prefill of one dense step (64 rows or more take the dequantized matrix), and a short prompt to generate from."""
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, logprobs=0, prompt_logprobs=0)
ONE_TOKEN = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0)
INT8_ACTIVATION_GAP = 0.1
"""The largest logprob gap allowed where GGUF blocks multiply int8-rounded activations (measured up to ~0.03
on the tiny model)."""


@pytest.fixture(scope="module")
def gguf_adapter(adapter_a, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("gguf-adapter") / "adapter_a.gguf"
    return write_gguf_adapter(adapter_a, path, num_heads=HEADS, num_kv_heads=KV_HEADS, num_layers=LAYERS)


def test_a_gguf_adapter_reads_back_the_peft_deltas(adapter_a, gguf_adapter, lora_base_dir, tmp_path):
    peft = load_peft_adapter("a", str(adapter_a), 8, LAYERS)
    gguf = load_gguf_adapter("a", str(gguf_adapter), 8, LAYERS, TARGET)
    assert gguf.rank == peft.rank == 4 and sorted(gguf.a) == sorted(peft.a)
    for module in peft.a:  # alpha / rank folded into B as PEFT's scale is; q/k rows back in HF order
        assert torch.equal(gguf.a[module], peft.a[module]) and torch.equal(gguf.b[module], peft.b[module]), module
    refusals = [
        (lambda: load_gguf_adapter("a", str(gguf_adapter), 2, LAYERS, TARGET), LoRARankError, "above max_lora_rank"),
        (
            lambda: load_gguf_adapter("a", str(gguf_adapter), 8, LAYERS, TARGET._replace(model_type="qwen2")),
            LoRAAdapterError,
            "converted for a 'llama' model; the base is 'qwen2'",
        ),
        (
            lambda: load_gguf_adapter("a", str(make_tiny_gguf(lora_base_dir, tmp_path / "m.gguf")), 8, LAYERS, TARGET),
            LoRAAdapterError,
            "general.type None, not an adapter",
        ),
        (
            lambda: load_gguf_adapter("a", str(_embedding_adapter(tmp_path / "e.gguf")), 8, LAYERS, TARGET),
            LoRAAdapterError,
            "LoRA on 'token_embd.weight' is not served",
        ),
    ]
    for load, error, message in refusals:
        with pytest.raises(error, match=message):
            load()
    # registered without loading (a --lora-modules entry past --max-cpu-loras): its header and shapes checked
    manager = LoRAManager(LoRAConfig(enable_lora=True, max_lora_rank=2), LAYERS, TARGET)
    with pytest.raises(LoRARankError, match="rank 4, above max_lora_rank 2"):
        manager.register(LoRARequest("a", str(gguf_adapter)))
    manager = LoRAManager(LoRAConfig(enable_lora=True, max_lora_rank=8), LAYERS, TARGET)
    manager.register(LoRARequest("a", str(gguf_adapter)))
    assert [request.name for request in manager.list_loras()] == ["a"]


def _embedding_adapter(path: Path) -> Path:
    """llama.cpp's LoRA on the token embedding (which the engine serves as PEFT's whole-matrix replacement)."""
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_type(gguf.GGUFType.ADAPTER)
    writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
    writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, 4.0)
    writer.add_tensor("token_embd.weight.lora_a", np.ones((CONFIG["vocab_size"], 2), np.float32))
    writer.add_tensor("token_embd.weight.lora_b", np.ones((CONFIG["hidden_size"], 2), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


FUSED = {
    "qkv": ("self_attn", ("q_proj", "k_proj", "v_proj")),
    "o_proj": ("self_attn", ("o_proj",)),
    "gate_up": ("mlp", ("gate_proj", "up_proj")),
    "down": ("mlp", ("down_proj",)),
}
"""The model's fused projections and the HF matrices along their output rows."""


def dequantized_dir(model, base_dir: Path, out_dir: Path) -> Path:
    """`base_dir` with its projections replaced by the served model's quantized ones, dequantized (float32)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(base_dir, out_dir)
    state = load_file(str(base_dir / "model.safetensors"))
    for index, layer in enumerate(model.layers):
        for fused, (parent, names) in FUSED.items():
            weight = getattr(layer, fused)
            assert isinstance(weight, QuantizedWeight), fused
            keys = [f"model.layers.{index}.{parent}.{name}.weight" for name in names]
            matrices = weight.dequantize(torch.float32).split([state[key].shape[0] for key in keys])
            state.update((key, matrix.contiguous()) for key, matrix in zip(keys, matrices))
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    return out_dir


@pytest.fixture(scope="module")
def q8_gguf(lora_base_dir, tmp_path_factory) -> Path:
    """The tiny Llama as llama.cpp writes it, its projections in Q8_0 blocks."""
    return make_tiny_gguf(lora_base_dir, tmp_path_factory.mktemp("q8") / "tiny-q8_0.gguf", "Q8_0")


def teacher_forced(model_dir: Path, prompt: list[int], result) -> tuple[list[float], list[float]]:
    """The HF model's logprobs of a result's generated tokens, each given the tokens before it, and its best
    logprob at each of those positions (one forward over prompt + tokens: greedy generation's checks at once)."""
    tokens = result.outputs[0].token_ids
    model = hf_model(str(model_dir))
    ids = torch.tensor([prompt + tokens])
    with torch.inference_mode():
        logprobs = torch.log_softmax(model(ids).logits[0, len(prompt) - 1 : -1].float(), -1)
    chosen = logprobs.gather(1, torch.tensor(tokens)[:, None])[:, 0]
    return chosen.tolist(), logprobs.max(-1).values.tolist()


@pytest.mark.parametrize("storage", ["int8", "int4", "gguf"])
def test_tokens_are_the_dequantized_base_with_the_adapter_merged(
    storage, lora_base_dir, q8_gguf, adapter_a, gguf_adapter, tmp_path
):
    """One batch of base, PEFT-adapter and GGUF-adapter requests over a base stored as `storage`: the two
    adapter forms give the same tokens, which are the float32 greedy tokens of the dequantized base with the
    adapter merged by PEFT, logprobs within 1e-4 (GGUF blocks: where the native products take int8-rounded
    activations, decode and short steps, each served token the reference's best or within that rounding of
    it; a dense prefill's prompt logprobs within 1e-4)."""
    model_path = q8_gguf if storage == "gguf" else lora_base_dir
    with make_llm(model_path, quantization=storage, enable_lora=True, max_loras=2, max_lora_rank=8) as llm:
        llm.engine.lora_manager.add_lora(LoRARequest("peft", str(adapter_a)))
        llm.engine.lora_manager.add_lora(LoRARequest("gguf", str(gguf_adapter)))
        model = llm.engine.runner.model
        assert model.quantization == storage
        base = dequantized_dir(model, lora_base_dir, tmp_path / "dequantized")
        choices = [None, LoRAMix.single("peft"), LoRAMix.single("gguf")]
        results = llm.generate([PROMPTS[1]] * 3, GREEDY, use_tqdm=False, lora_request=choices)
        # a 70-token prefill alone: a dense product (the dequantized matrix) in every projection
        (scored,) = llm.generate(PROMPTS[:1], ONE_TOKEN, use_tqdm=False, lora_request=choices[2])
        assert_idle(llm)
    merged = merged_model_dir(base, [(adapter_a, 1.0)], tmp_path / "merged")
    assert [lp.logprob for lp in scored.prompt_logprobs[1:]] == pytest.approx(
        hf_prompt_logprobs(merged, PROMPTS[0]), abs=1e-4
    )
    plain, peft, gguf = results
    assert gguf.outputs[0].token_ids == peft.outputs[0].token_ids
    assert [lp.logprob for lp in gguf.outputs[0].logprobs] == pytest.approx(
        [lp.logprob for lp in peft.outputs[0].logprobs], abs=1e-5
    )
    tolerance = INT8_ACTIVATION_GAP if storage == "gguf" else 1e-4
    for result, reference in ((peft, merged), (plain, base)):
        chosen, best = teacher_forced(reference, PROMPTS[1], result)
        assert np.max(np.subtract(best, chosen)) <= tolerance  # (0 unless the best two are that close)
        served = [lp.logprob for lp in result.outputs[0].logprobs]
        assert served == pytest.approx(chosen, abs=tolerance)


def test_fused_gguf_decode_with_adapters_equals_the_unfused_path(q8_gguf, adapter_a, gguf_adapter):
    """float32 over GGUF blocks (the fused step a CPU without native bf16 runs): decode steps holding base, PEFT
    and GGUF adapter requests run fused, the deltas inside the native step, and give the unfused path's tokens
    and logprobs bit for bit."""
    with make_llm(
        q8_gguf,
        quantization="gguf",
        dtype="float32",
        attention_backend="cpu",
        enable_prefix_caching=False,
        enable_lora=True,
        max_loras=2,
        max_lora_rank=8,
    ) as llm:
        llm.engine.lora_manager.add_lora(LoRARequest("peft", str(adapter_a)))
        llm.engine.lora_manager.add_lora(LoRARequest("gguf", str(gguf_adapter)))
        choices = [None, LoRAMix.single("peft"), LoRAMix.single("gguf")]
        fused, unfused, fused_rows = fused_then_unfused(llm, [PROMPTS[1]] * 3, choices, GREEDY)
        assert fused_rows and max(fused_rows) == len(choices)  # every request's decodes in one fused step
        assert fused[1] != fused[0] and fused[1][0] == fused[2][0]  # the adapter moves the output; both forms alike
        assert unfused == fused
