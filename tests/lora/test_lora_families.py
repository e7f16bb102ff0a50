"""LoRA on every family beside Llama's: a PEFT adapter over each family's linear layers (PEFT's `all-linear`, by the
family's own module names: Phi-3's fused qkv_proj and gate_up_proj, StarCoder2's c_fc, Phi-2's dense and fc1,
GPT-NeoX's query_key_value, ...), served beside base requests in the same batch, against PEFT's merge_and_unload
of the tiny random checkpoint: float32 greedy tokens identical, logprobs within 1e-4. Mixtures of experts take
adapters of their attention and their experts (PEFT's target_parameters, or per-expert modules); a dense MLP
beside the experts, another family's experts, other parameters are refused by name."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import LoRAMix, LoRARequest, SamplingParams
from engine.errors import LoRAAdapterError, LoRARankError, SettingsConflictError
from tests.engine.factories import DENSE_FAMILIES, make_tiny_model_dir
from tests.engine.references import NEW_TOKENS, assert_idle, check_against_hf, hf_greedy, hf_greedy_of, make_llm
from tests.engine.test_model_equivalence import mixed_prompts
from tests.engine.test_moe_equivalence import FAMILIES as MOE_FAMILIES
from tests.engine.test_moe_equivalence import make_moe_dir
from tests.lora.adapters import make_adapter, merged_model_dir
from tests.lora.expert_adapters import EXPERT_PARAMETERS, as_per_expert_modules, copy_adapter, without_experts
from tests.lora.fused_steps import fused_then_unfused

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, logprobs=0)
# the Llama-loop MoE, one with a dense layer, the generic decoder's; Llama 4's (q and k rows reordered for its
# interleaved RoPE, B's too)
MOE = ("mixtral", "qwen3_moe", "olmoe", "llama4")


def _base(tmp_path_factory, family: str):
    if family in MOE_FAMILIES:
        return make_moe_dir(tmp_path_factory.mktemp(family), family)
    return make_tiny_model_dir(tmp_path_factory.mktemp(family), family)


@pytest.mark.parametrize("family", sorted(DENSE_FAMILIES) + list(MOE))
def test_adapter_beside_base_requests_matches_peft_merged(family, tmp_path_factory):
    base = _base(tmp_path_factory, family)
    targets = ATTENTION if family in MOE else "all-linear"
    adapter = make_adapter(base, tmp_path_factory.mktemp("adapter"), seed=7, r=4, alpha=8, targets=targets)
    merged = merged_model_dir(base, [(adapter, 1.0)], tmp_path_factory.mktemp("merged"))
    prompts = mixed_prompts(3)[4:7]  # 17, 33 and 60 tokens: prompt chunks and decodes of both kinds in a step
    with make_llm(base, enable_lora=True, max_loras=1, max_lora_rank=4, max_num_batched_tokens=32) as llm:
        llm.engine.lora_manager.add_lora(LoRARequest("a", str(adapter)))
        loras = [LoRAMix.single("a"), None, LoRAMix.single("a")]
        results = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False, lora_request=loras)
        assert_idle(llm)
    check_against_hf(merged, prompts[::2], results[::2])
    check_against_hf(base, prompts[1:2], results[1:2])
    # the adapter changes what the model says (else the check above would hold for the base too)
    _, base_logprobs = hf_greedy(base, prompts[2], NEW_TOKENS)
    assert [lp.logprob for lp in results[2].outputs[0].logprobs] != pytest.approx(base_logprobs, abs=1e-2)


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "qwen2_moe", "olmoe", "llama4"])
def test_expert_adapter_beside_base_requests_matches_peft_merged(family, tmp_path_factory):
    """An adapter of the attention and every expert's gate|up and down (PEFT's target_parameters on transformers'
    stacked experts; Llama 4's stored transposed), beside a base request, the same adapter without its experts and
    a 0.5 / 0.5 mix of the two, against PEFT's merge_and_unload. Qwen3-MoE's layer 1 and Llama 4's 0 and 2 are dense MLPs, Qwen2-MoE's and
    Llama 4's shared experts are not adapted."""
    base = _base(tmp_path_factory, family)
    adapter = make_adapter(
        base,
        tmp_path_factory.mktemp("adapter"),
        seed=7,
        r=4,
        alpha=8,
        targets=ATTENTION,
        target_parameters=EXPERT_PARAMETERS,
    )
    attention = without_experts(adapter, tmp_path_factory.mktemp("attention"))
    merged = merged_model_dir(base, [(adapter, 1.0)], tmp_path_factory.mktemp("merged"))
    mix = merged_model_dir(base, [(adapter, 0.5), (attention, 0.5)], tmp_path_factory.mktemp("mix"))
    prompts = mixed_prompts(3)[4:7]  # 17, 33 and 60 tokens: prompt chunks and decodes of both kinds in a step
    prompts += [prompts[2], prompts[0]]
    with make_llm(base, enable_lora=True, max_loras=2, max_lora_rank=4, max_num_batched_tokens=32) as llm:
        llm.engine.lora_manager.add_lora(LoRARequest("a", str(adapter)))
        llm.engine.lora_manager.add_lora(LoRARequest("attention", str(attention)))
        loras = [LoRAMix.single("a"), None, LoRAMix.single("a"), LoRAMix.single("attention")]
        loras.append(LoRAMix((("a", 0.5), ("attention", 0.5))))
        results = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False, lora_request=loras)
        assert_idle(llm)
    check_against_hf(merged, prompts[:3:2], results[:3:2])
    check_against_hf(base, prompts[1:2], results[1:2])
    check_against_hf(mix, prompts[4:], results[4:])  # a weighted mix: half the experts' deltas
    # the experts' deltas change what the model says (else the check above would hold without them)
    with_experts, attention_only = ([lp.logprob for lp in r.outputs[0].logprobs] for r in results[2:4])
    assert with_experts != pytest.approx(attention_only, abs=1e-2)


def test_per_expert_modules_serve_as_the_stacked_form(tmp_path_factory):
    """Mixtral's per-expert `block_sparse_moe.experts.{e}.w1|w3|w2` modules (older transformers' linears, vLLM's
    loader's layout), each expert's A and B cut out of a target_parameters adapter: the same tokens and logprobs
    as the stacked form, in one batch."""
    base = _base(tmp_path_factory, "mixtral")
    adapter = make_adapter(
        base,
        tmp_path_factory.mktemp("adapter"),
        seed=5,
        r=4,
        alpha=16,
        targets=("q_proj",),
        target_parameters=EXPERT_PARAMETERS,
    )
    per_expert = as_per_expert_modules(
        adapter, tmp_path_factory.mktemp("per-expert"), 8, 64, "block_sparse_moe", ("w1", "w3", "w2")
    )
    prompt = mixed_prompts(3)[5]
    with make_llm(base, enable_lora=True, max_loras=2, max_lora_rank=4) as llm:
        llm.engine.lora_manager.add_lora(LoRARequest("stacked", str(adapter)))
        llm.engine.lora_manager.add_lora(LoRARequest("per-expert", str(per_expert)))
        loras = [LoRAMix.single("stacked"), LoRAMix.single("per-expert"), None]
        results = llm.generate([{"prompt_token_ids": prompt}] * 3, GREEDY, use_tqdm=False, lora_request=loras)
        assert_idle(llm)
    stacked, modules, plain = (r.outputs[0] for r in results)
    assert modules.token_ids == stacked.token_ids
    assert [lp.logprob for lp in modules.logprobs] == pytest.approx([lp.logprob for lp in stacked.logprobs], abs=1e-5)
    assert [lp.logprob for lp in plain.logprobs] != pytest.approx([lp.logprob for lp in stacked.logprobs], abs=1e-2)


def test_what_a_mixture_of_experts_does_not_serve_is_refused_by_name(tmp_path_factory):
    """The dense MLP of a layer beside experts, target_parameters other than the experts', expert matrices of
    another size, a rank over the limit, and the experts of a family whose experts take no adapters (Phi-3.5-MoE)."""
    base = _base(tmp_path_factory, "qwen3_moe")  # layer 1 is a dense MLP (mlp_only_layers)
    experts = make_adapter(
        base, tmp_path_factory.mktemp("experts"), seed=1, r=2, targets=("q_proj",), target_parameters=EXPERT_PARAMETERS
    )
    dense = make_adapter(base, tmp_path_factory.mktemp("dense"), seed=1, targets=("q_proj",))
    weights = load_file(dense / "adapter_model.safetensors")
    module = "base_model.model.model.layers.1.mlp.gate_proj"
    weights[f"{module}.lora_A.weight"], weights[f"{module}.lora_B.weight"] = torch.randn(4, 32), torch.randn(64, 4)
    save_file(weights, dense / "adapter_model.safetensors")
    other_parameter = copy_adapter(
        experts, tmp_path_factory.mktemp("other"), target_parameters=["self_attn.q_proj.weight"]
    )
    other_size = copy_adapter(experts, tmp_path_factory.mktemp("size"))
    weights = load_file(other_size / "adapter_model.safetensors")
    key = "base_model.model.model.layers.0.mlp.experts.lora_A.weight"
    weights[key] = weights[key][:, :-8].clone()  # an expert width of another model
    save_file(weights, other_size / "adapter_model.safetensors")
    with make_llm(base, enable_lora=True, max_lora_rank=8) as llm:
        with pytest.raises(LoRAAdapterError, match=r"'model\.layers\.1\.mlp\.gate_proj' is not served on qwen3_moe"):
            llm.engine.lora_manager.add_lora(LoRARequest("dense", str(dense)))
        with pytest.raises(LoRAAdapterError, match=r"target_parameters \['self_attn\.q_proj\.weight'\] are not served"):
            llm.engine.lora_manager.add_lora(LoRARequest("other", str(other_parameter)))
        with pytest.raises(LoRAAdapterError, match=r"layers\.0\.mlp\.experts'.*an adapter of another model"):
            llm.engine.lora_manager.add_lora(LoRARequest("size", str(other_size)))
        assert_idle(llm)
    with make_llm(base, enable_lora=True, max_lora_rank=1) as llm:
        with pytest.raises(LoRARankError):
            llm.engine.lora_manager.add_lora(LoRARequest("experts", str(experts)))
    phimoe = _base(tmp_path_factory, "phimoe")
    phimoe_experts = make_adapter(
        phimoe, tmp_path_factory.mktemp("phimoe"), seed=1, r=2, targets=("q_proj",), target_parameters=EXPERT_PARAMETERS
    )
    with make_llm(phimoe, enable_lora=True, max_lora_rank=8) as llm:
        with pytest.raises(LoRAAdapterError, match="LoRA on the experts is not served on phimoe"):
            llm.engine.lora_manager.add_lora(LoRARequest("experts", str(phimoe_experts)))


def test_latent_attention_is_refused_at_start_up(tmp_path):
    from tests.engine.test_deepseek_equivalence import COMMON, FAMILIES

    base = make_tiny_model_dir(tmp_path, "llama", **COMMON, **FAMILIES["deepseek_v3"])
    with pytest.raises(SettingsConflictError, match="latent attention"):
        make_llm(base, enable_lora=True)


@pytest.mark.parametrize("family", ["granite", "gemma"])
def test_replacement_embedding_and_lm_head_take_the_familys_scales(family, tmp_path_factory):
    """modules_to_save: Granite's embedding multiplier and logits divisor, Gemma's sqrt(hidden) apply to the
    adapter's matrices as to the base's; Gemma ties its LM head to the embedding, and the adapter's own LM head
    serves, as in PEFT's model (a merged checkpoint re-ties them on load: the PEFT model is the reference)."""
    base = _base(tmp_path_factory, family)
    adapter, peft_model = make_adapter(
        base,
        tmp_path_factory.mktemp("saved"),
        seed=3,
        r=2,
        targets=("v_proj",),
        modules_to_save=["embed_tokens", "lm_head"],
        keep=True,
    )
    prompts = mixed_prompts(3)[4:6]
    with make_llm(base, enable_lora=True, max_loras=1, max_lora_rank=4) as llm:
        llm.engine.lora_manager.add_lora(LoRARequest("saved", str(adapter)))
        loras = [LoRAMix.single("saved"), None]
        results = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False, lora_request=loras)
        assert_idle(llm)
    tokens, logprobs = hf_greedy_of(peft_model, prompts[0], NEW_TOKENS)
    assert results[0].outputs[0].token_ids == tokens
    assert [lp.logprob for lp in results[0].outputs[0].logprobs] == pytest.approx(logprobs, abs=1e-4)
    check_against_hf(base, prompts[1:], results[1:])


def test_fused_decode_with_an_adapter_equals_the_unfused_path(tmp_path_factory, cpu_kernels):
    """bf16 on the cpu backend, Gemma 3 (GeGLU, q/k norms, sliding layers): decode steps of base and adapter
    requests run fused with the deltas inside the native step and give the unfused path's bits."""
    base = _base(tmp_path_factory, "gemma3")
    adapter = make_adapter(base, tmp_path_factory.mktemp("adapter"), seed=2, r=4, targets="all-linear")
    settings = dict(dtype="bfloat16", attention_backend="cpu", enable_prefix_caching=False)
    with make_llm(base, **settings, enable_lora=True, max_loras=1, max_lora_rank=4) as llm:
        llm.engine.lora_manager.add_lora(LoRARequest("a", str(adapter)))
        prompts = [{"prompt_token_ids": p} for p in mixed_prompts(5)[3:5]] * 2
        fused, unfused, rows = fused_then_unfused(
            llm, prompts, [None, None, LoRAMix.single("a"), LoRAMix.single("a")], GREEDY
        )
    assert max(rows) == 4 and unfused == fused
    assert fused[0] != fused[2]  # the adapter changes the output


def test_alpha_pattern_takes_the_first_matching_key_as_peft_does(tmp_path_factory):
    """PEFT scales a module by the first alpha_pattern key matching its full name (get_pattern_key), in the order
    of the saved adapter_config.json (written with sorted keys): Phi-3's layer 0 qkv_proj takes the layer's key,
    listed before the bare module name that also matches it; the other layers the bare name's."""
    base = _base(tmp_path_factory, "phi3")
    pattern = {"qkv_proj": 2, "layers.0.self_attn.qkv_proj": 32}
    adapter = make_adapter(
        base, tmp_path_factory.mktemp("adapter"), seed=4, r=4, targets=("qkv_proj",), alpha_pattern=pattern
    )
    merged = merged_model_dir(base, [(adapter, 1.0)], tmp_path_factory.mktemp("merged"))
    prompts = mixed_prompts(3)[4:6]
    with make_llm(base, enable_lora=True, max_loras=1, max_lora_rank=4) as llm:
        llm.engine.lora_manager.add_lora(LoRARequest("a", str(adapter)))
        results = llm.generate(
            [{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False, lora_request=LoRAMix.single("a")
        )
        assert_idle(llm)
    check_against_hf(merged, prompts, results)


def test_a_tied_embedding_saved_with_ensure_weight_tying(tmp_path_factory):
    """PEFT's ensure_weight_tying (which PEFT asks for when a tied embedding is saved) writes modules_to_save as
    ["embed_tokens", "model.embed_tokens"] and stores the LM head beside the embedding: served as PEFT's loaded
    model runs it, the adapter's embedding and LM head both replaced (Gemma ties them)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = _base(tmp_path_factory, "gemma")
    adapter = make_adapter(
        base,
        tmp_path_factory.mktemp("tied"),
        seed=3,
        r=2,
        targets=("v_proj",),
        modules_to_save=["embed_tokens"],
        ensure_weight_tying=True,
    )
    reference = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(base)), str(adapter)).eval()
    prompts = mixed_prompts(3)[4:6]
    with make_llm(base, enable_lora=True, max_loras=1, max_lora_rank=4) as llm:
        llm.engine.lora_manager.add_lora(LoRARequest("tied", str(adapter)))
        loras = [LoRAMix.single("tied"), None]
        results = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False, lora_request=loras)
        assert_idle(llm)
    tokens, logprobs = hf_greedy_of(reference, prompts[0], NEW_TOKENS)
    assert results[0].outputs[0].token_ids == tokens
    assert [lp.logprob for lp in results[0].outputs[0].logprobs] == pytest.approx(logprobs, abs=1e-4)
    check_against_hf(base, prompts[1:], results[1:])


@pytest.mark.parametrize("family", ["gpt_neox", "cohere", "llama"])
def test_an_adapter_of_another_size_is_refused_by_name(family, tmp_path_factory):
    """B's rows regrouped by the family's transform (GPT-NeoX's per-head query_key_value, Cohere's interleaved RoPE
    pairs) that do not fit the model's heads, or matrices of another width (any family): a LoRAAdapterError naming
    the module as the adapter loads (a 400), not the transform's ValueError or torch's RuntimeError (a 500, or a
    start-up traceback instead of a named flag), nor a failure when a slot first takes it."""
    base = _base(tmp_path_factory, family)
    other = make_tiny_model_dir(tmp_path_factory.mktemp("other"), family, hidden_size=40, intermediate_size=64)
    adapter = make_adapter(other, tmp_path_factory.mktemp("adapter"), seed=1, r=2, targets="all-linear")
    with make_llm(base, enable_lora=True, max_loras=1, max_lora_rank=4) as llm:
        with pytest.raises(
            LoRAAdapterError, match=r"layers\.0\..*(does not fit the model|an adapter of another model)"
        ):
            llm.engine.lora_manager.add_lora(LoRARequest("other", str(adapter)))
        assert_idle(llm)
