"""Builders for engine tests: tiny random-weight checkpoints (HF layout and GGUF) with a real tokenizer.

Everything is built in memory in a second or two; nothing touches the network.
"""

from __future__ import annotations

import copy
import json
from typing import Optional
from pathlib import Path
import yaml

TINY_PRESET = Path(__file__).resolve().parents[2] / "configs" / "tiny.yaml"

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # ids 0, 1, 2
EOS_ID = 2
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

TRAINING_TEXT = (
    "The quick brown fox jumps over the lazy dog. A paged key-value cache splits every sequence "
    "into blocks of tokens, so memory is handed out in small pieces and freed the moment a request "
    "finishes. The scheduler decides, at every step, which requests run and how many tokens each "
    "one computes; decodes go first, then chunks of prompts.\n",
    "Once upon a time, in a small town by the sea, there lived an old engineer who repaired clocks. "
    "Every morning she opened the shop at eight o'clock, drank her coffee, and listened to the "
    "ticking of a hundred machines. Numbers like 3.14159, 2048 and 65536 were written on the wall.\n",
    "Hello, world! How are you today? I'm fine, thanks. What's the weather like? It's sunny and warm, "
    "with a light breeze from the west. Let's go for a walk in the park and talk about language models, "
    "tokenizers, attention, and the meaning of life.\n",
    "Café crème, naïve façade, résumé, jalapeño, Ångström, Straße, smörgåsbord, déjà vu, "
    "Zürich, São Paulo, Kraków, Œuvre complète.\n",
    "東京は日本の首都です。北京是中国的首都。서울은 한국의 수도입니다。今日は良い天気ですね。我喜欢学习语言模型。\n",
    "Emoji too: 🙂 😀 🚀 🎉 👍🏽 ❤️ 🌍 — and symbols: €, £, ¥, ©, ™, ±, ≤, ≥, ∞, →.\n",
    "def add(a, b):\n    return a + b\n\nfor i in range(10):\n    print(i, add(i, i))\n",
)

_ARCHITECTURES = {
    "llama": {"architectures": ["LlamaForCausalLM"], "model_type": "llama"},
    "qwen2": {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2"},
    "qwen3": {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "head_dim": 16,
        "attention_bias": False,
    },
}

_ARCHITECTURES["mistral"] = {"architectures": ["MistralForCausalLM"], "model_type": "mistral", "sliding_window": 8}

_HEAD_SHORT_FACTORS = [1.0, 1.05, 1.1, 1.2, 1.4, 1.6, 2.0, 2.5]  # per rotary pair of a 16-wide head
DENSE_FAMILIES = {
    # every window shorter than the tests' prompts; every scale and cap set off its default so it is exercised
    "gemma2": {
        "architectures": ["Gemma2ForCausalLM"],
        "model_type": "gemma2",
        "num_hidden_layers": 4,
        "head_dim": 16,
        "sliding_window": 8,
        "query_pre_attn_scalar": 24,
        "attn_logit_softcapping": 2.0,
        "final_logit_softcapping": 4.0,
        "hidden_activation": "gelu_pytorch_tanh",
        "tie_word_embeddings": True,
        "pad_token_id": 0,
    },
    "gemma3": {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "num_hidden_layers": 4,
        "head_dim": 16,
        "sliding_window": 8,
        "query_pre_attn_scalar": 24,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        "rope_parameters": {
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 500.0},
        },
        "tie_word_embeddings": True,
        "pad_token_id": 0,
    },
    "phi3": {
        "architectures": ["Phi3ForCausalLM"],
        "model_type": "phi3",
        "sliding_window": 12,
        "pad_token_id": 0,
        # max_model_len (the config's 256) within the original context: the short factors, as HF takes them for
        # the tests' sequences; `factor` sets LongRoPE's attention factor
        "original_max_position_embeddings": 256,
        "rope_parameters": {
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "factor": 2.0,
            "short_factor": _HEAD_SHORT_FACTORS,
            "long_factor": [f * 2 for f in _HEAD_SHORT_FACTORS],
            "original_max_position_embeddings": 256,
        },
    },
    "olmo2": {"architectures": ["Olmo2ForCausalLM"], "model_type": "olmo2", "pad_token_id": 0},
    "granite": {
        "architectures": ["GraniteForCausalLM"],
        "model_type": "granite",
        # Granite 3's own values: 0.22 and 1/64 are not powers of two, so a product left unrounded before its
        # add (an FMA) shows in the logprobs
        "embedding_multiplier": 12.0,
        "residual_multiplier": 0.22,
        "attention_multiplier": 0.015625,
        "logits_scaling": 2.0,
        "pad_token_id": 0,
    },
    "cohere": {
        "architectures": ["CohereForCausalLM"],
        "model_type": "cohere",
        "use_qk_norm": True,
        "attention_bias": True,
        "logit_scale": 0.5,
        "layer_norm_eps": 1e-3,  # not the preset's rms_norm_eps, which the config also carries: the wrong one shows
        "tie_word_embeddings": True,
        "pad_token_id": 0,
    },
    "cohere2": {
        "architectures": ["Cohere2ForCausalLM"],
        "model_type": "cohere2",
        "num_hidden_layers": 4,
        "sliding_window": 8,
        "sliding_window_pattern": 2,  # sliding, full, sliding, full: the config turns it into layer_types
        "logit_scale": 0.5,
        "layer_norm_eps": 1e-3,
        "tie_word_embeddings": True,
        "pad_token_id": 0,
    },
}
_ARCHITECTURES.update(DENSE_FAMILIES)
RANDOM_NORMS_AND_BIASES = (
    "cohere",
    "cohere2",
    "gemma",
    "glm",
    "glm4",
    "starcoder2",
    "glm4_moe",
    "smollm3",
    "olmo3",
    "arcee",
    "phi",
    "gpt_neox",
    "gpt_neox_sequential",
    "seed_oss",
    "apertus",
    "gptj",
    "gpt_bigcode",
    "gpt_bigcode_mha",
    "falcon",
    "falcon_new",
    "falcon_sequential",
)
"""Families whose tiny checkpoints get random norm weights and biases: HF initialises them to ones and zeros (Gemma's
norms to 0, of 1 + w; GLM-4.5's e_score_correction_bias to 0), under which a norm or bias dropped or read in the wrong place (q/k rows reordered for an
interleaved RoPE) goes unseen."""
_ROTARY_SHORT_FACTORS = [1.0, 1.1, 1.3, 1.6, 2.0, 2.5]  # per rotary pair of 12 rotated dimensions
_ARCHITECTURES["phi4mini"] = {
    # Phi-4-mini's shape: RoPE over the first 0.75 of each 16-wide head (12 dimensions), LongRoPE past an original
    # context of 32 tokens, under max_model_len 256 (the config's context): the long factors serve every position
    "architectures": ["Phi3ForCausalLM"],
    "model_type": "phi3",
    "pad_token_id": 0,
    "original_max_position_embeddings": 32,
    "rope_parameters": {
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.75,
        "short_factor": _ROTARY_SHORT_FACTORS,
        "long_factor": [f * 3 for f in _ROTARY_SHORT_FACTORS],
        "original_max_position_embeddings": 32,
    },
}

# More dense families, appended here (and served by the generic decoder): each as its HF release has it, with
# what it adds set off its default
DENSE_FAMILIES.update(
    {
        "gemma": {
            "architectures": ["GemmaForCausalLM"],
            "model_type": "gemma",
            "head_dim": 16,
            "hidden_act": "gelu_pytorch_tanh",
            "tie_word_embeddings": True,
            "pad_token_id": 0,
        },
        # RoPE over half (glm: 4 interleaved pairs, as the releases) and three quarters (glm4) of each 16-wide head
        "glm": {
            "architectures": ["GlmForCausalLM"],
            "model_type": "glm",
            "head_dim": 16,
            "partial_rotary_factor": 0.5,
            "attention_bias": True,
            "pad_token_id": 0,
        },
        "glm4": {
            "architectures": ["Glm4ForCausalLM"],
            "model_type": "glm4",
            "head_dim": 16,
            "partial_rotary_factor": 0.75,
            "attention_bias": True,
            "pad_token_id": 0,
        },
        "starcoder2": {
            "architectures": ["Starcoder2ForCausalLM"],
            "model_type": "starcoder2",
            "sliding_window": 12,
            "norm_epsilon": 1e-5,
            "use_bias": True,
            "hidden_act": "gelu_pytorch_tanh",
            "pad_token_id": 0,
        },
        # RoPE over half of each 16-wide head; Phi-2's GQA-less releases aside, its config takes KV groups
        "phi": {
            "architectures": ["PhiForCausalLM"],
            "model_type": "phi",
            "partial_rotary_factor": 0.5,
            "qk_layernorm": True,
            "hidden_act": "gelu_new",
            "layer_norm_eps": 1e-3,
            "pad_token_id": 0,
        },
        # Pythia's recipe (RoPE over a quarter of each head: 4 dimensions, parallel residual, erf GELU), and its
        # sequential variant; one KV head per query head, as GPT-NeoX has
        "gpt_neox": {
            "architectures": ["GPTNeoXForCausalLM"],
            "model_type": "gpt_neox",
            "num_key_value_heads": 4,
            "rotary_pct": 0.25,
            "layer_norm_eps": 1e-3,
            "pad_token_id": 0,
        },
        "gpt_neox_sequential": {
            "architectures": ["GPTNeoXForCausalLM"],
            "model_type": "gpt_neox",
            "num_key_value_heads": 4,
            "rotary_pct": 0.5,
            "use_parallel_residual": False,
            "hidden_act": "gelu_new",
            "pad_token_id": 0,
        },
    }
)
# Families whose releases transformers added since, each with what it adds set off its default
DENSE_FAMILIES.update(
    {
        # NoPE on layers 1 and 3, windows on layers 0 and 1: each pairing of RoPE and window; every bias there
        "smollm3": {
            "architectures": ["SmolLM3ForCausalLM"],
            "model_type": "smollm3",
            "num_hidden_layers": 4,
            "no_rope_layers": [1, 0, 1, 0],
            "use_sliding_window": True,
            "sliding_window": 8,
            "layer_types": ["sliding_attention", "sliding_attention", "full_attention", "full_attention"],
            "attention_bias": True,
            "mlp_bias": True,
            "tie_word_embeddings": False,
            "pad_token_id": 0,
        },
        # a window on layers 0 and 2; the full layers' RoPE scaled (linear) and of another base than the sliding ones'
        "olmo3": {
            "architectures": ["Olmo3ForCausalLM"],
            "model_type": "olmo3",
            "num_hidden_layers": 4,
            "sliding_window": 8,
            "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
            "rope_parameters": {
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 500.0},
            },
            "pad_token_id": 0,
        },
        # AFM-4.5B's YaRN (past an original context of 64 tokens: the tests' longer sequences) and MLP biases
        "arcee": {
            "architectures": ["ArceeForCausalLM"],
            "model_type": "arcee",
            "hidden_act": "relu2",
            "mlp_bias": True,
            "rope_parameters": {
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 64,
                "rope_theta": 10000.0,
            },
            "pad_token_id": 0,
        },
        "ernie4_5": {
            "architectures": ["Ernie4_5ForCausalLM"],
            "model_type": "ernie4_5",
            "head_dim": 16,
            "use_bias": True,
            "tie_word_embeddings": True,
            "pad_token_id": 0,
        },
        "exaone4": {
            "architectures": ["Exaone4ForCausalLM"],
            "model_type": "exaone4",
            "num_hidden_layers": 4,
            "head_dim": 16,
            "sliding_window": 8,
            "sliding_window_pattern": 2,  # sliding, full, sliding, full: the config turns it into layer_types
            "pad_token_id": 0,
        },
        # every bias Seed-OSS can have; heads wider than hidden / heads (q and o not square)
        "seed_oss": {
            "architectures": ["SeedOssForCausalLM"],
            "model_type": "seed_oss",
            "head_dim": 32,
            "attention_bias": True,
            "attention_out_bias": True,
            "mlp_bias": True,
            "pad_token_id": 0,
        },
        # its llama3 RoPE past an original context of 64 tokens (the tests' longer sequences); xIELU's learned
        # scalars drawn off their initial values per layer below (RANDOM_NORMS_AND_BIASES: `act_fn`)
        "apertus": {
            "architectures": ["ApertusForCausalLM"],
            "model_type": "apertus",
            "hidden_act": "xielu",
            "attention_bias": True,
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 64,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
            },
            "pad_token_id": 0,
        },
        # RoPE over half of each 16-wide head in interleaved pairs; the MLP 4 x hidden wide (n_inner None), not the
        # preset's intermediate_size, which GPT-J's config carries unread; one KV head per query head, as GPT-J has
        "gptj": {
            "architectures": ["GPTJForCausalLM"],
            "model_type": "gptj",
            "num_key_value_heads": 4,
            "rotary_dim": 8,
            "n_inner": None,
            "activation_function": "gelu_new",
            "layer_norm_epsilon": 1e-3,
            "pad_token_id": 0,
        },
        # StarCoder's recipe: one KV head (multi_query), learned positions; and its multi-head variant (SantaCoder's
        # successors' option), whose c_attn rows are per head
        "gpt_bigcode": {
            "architectures": ["GPTBigCodeForCausalLM"],
            "model_type": "gpt_bigcode",
            "multi_query": True,
            "num_key_value_heads": 1,  # (the preset's 2 would be saved unread by HF: refused)
            "n_inner": None,
            "activation_function": "gelu_pytorch_tanh",
            "layer_norm_epsilon": 1e-3,
            "pad_token_id": 0,
        },
        # Falcon-7B's recipe (one KV head, attention beside the MLP on one norm); Falcon-40B's (KV groups, two norms,
        # another RoPE base); the old sequential layer with every bias, per-head query_key_value
        "falcon": {
            "architectures": ["FalconForCausalLM"],
            "model_type": "falcon",
            "new_decoder_architecture": False,
            "multi_query": True,
            "parallel_attn": True,
            "num_key_value_heads": 1,
            "layer_norm_epsilon": 1e-3,
            "pad_token_id": 0,
        },
        "falcon_new": {
            "architectures": ["FalconForCausalLM"],
            "model_type": "falcon",
            "new_decoder_architecture": True,
            "num_kv_heads": 2,
            "num_key_value_heads": 2,
            "ffn_hidden_size": 96,
            "rope_parameters": {"rope_type": "default", "rope_theta": 500.0},
            "tie_word_embeddings": False,
            "pad_token_id": 0,
        },
        "falcon_sequential": {
            "architectures": ["FalconForCausalLM"],
            "model_type": "falcon",
            "new_decoder_architecture": False,
            "multi_query": False,
            "parallel_attn": False,
            "bias": True,
            "num_key_value_heads": 4,
            "activation": "gelu_new",
            "pad_token_id": 0,
        },
        "gpt_bigcode_mha": {
            "architectures": ["GPTBigCodeForCausalLM"],
            "model_type": "gpt_bigcode",
            "multi_query": False,
            "num_key_value_heads": 4,
            "n_inner": 96,
            "activation_function": "gelu",
            "tie_word_embeddings": False,
            "pad_token_id": 0,
        },
    }
)
_ARCHITECTURES.update(DENSE_FAMILIES)
_ARCHITECTURES["glm4_moe"] = {
    # GLM-4.5-Air's recipe at the tiny size: a dense first layer, then 8 experts (top 2) and a shared one, RoPE over
    # half of each head, q/k/v biases; tests/engine/test_glm4_moe.py varies the groups and the q/k norms
    "architectures": ["Glm4MoeForCausalLM"],
    "model_type": "glm4_moe",
    "num_hidden_layers": 3,
    "head_dim": 16,
    "partial_rotary_factor": 0.5,
    "attention_bias": True,
    "first_k_dense_replace": 1,
    "moe_intermediate_size": 24,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "n_group": 1,
    "topk_group": 1,
    "pad_token_id": 0,
}


def tiny_config_dict(arch: str = "llama", **overrides) -> dict:
    """The HF config of the tiny test model: configs/tiny.yaml's `tiny_model`, the arch, overrides."""
    config = dict(yaml.safe_load(TINY_PRESET.read_text())["tiny_model"])
    config.update(copy.deepcopy(_ARCHITECTURES[arch]))  # a test may change a config's nested dicts in place
    if "rope_parameters" in config:
        config.pop("rope_theta")
    config["initializer_range"] = 0.15  # large enough that greedy logits are not near-ties
    config.update(overrides)
    return config


def make_tiny_model_dir(
    path: Path,
    arch: str = "llama",
    *,
    seed: int = 0,
    random_norms: Optional[bool] = None,
    **overrides,
) -> Path:
    """Write a tiny random-weight model (safetensors, config, generation config, tokenizer) to `path`; its norm
    weights and biases drawn at random where `random_norms` says (by default: the arch is in
    RANDOM_NORMS_AND_BIASES)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    config_dict = tiny_config_dict(arch, **overrides)
    config = AutoConfig.for_model(**config_dict)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if arch in RANDOM_NORMS_AND_BIASES if random_norms is None else random_norms:
        _randomize_norms_and_biases(model)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id, pad_token_id=0
    ).save_pretrained(path)
    make_tiny_tokenizer().save_pretrained(path)
    return path


def _randomize_norms_and_biases(model) -> None:
    import torch

    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias") or "norm" in name:  # (GLM-4.5: e_score_correction_bias)
                param.add_(torch.randn_like(param) * 0.2)
            elif ".act_fn." in name:  # Apertus's xIELU alpha_p, alpha_n: each layer's own
                param.add_(torch.randn_like(param) * 0.5)
        for name, buffer in model.named_buffers():
            # (xIELU's beta; a router's correction bias where it is a buffer, Nemotron 3's: saved, read back)
            if name.endswith((".act_fn.beta", "e_score_correction_bias")):
                buffer.add_(torch.randn_like(buffer) * 0.2)


def make_tiny_tokenizer():
    """A byte-level BPE (vocab 512) trained on TRAINING_TEXT, ChatML template, eos `<|im_end|>`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=512,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(TRAINING_TEXT, trainer)
    hf = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
    )
    hf.chat_template = CHATML_TEMPLATE
    return hf


def make_tiny_gguf(model_dir: Path, gguf_path: Path, matrix_type: str = "F32", embedding_type: str = "F32") -> Path:
    """Write a tiny Llama checkpoint directory as a GGUF, the way llama.cpp's converter lays it out: the layers'
    matrices in `matrix_type`, the embedding and LM head in `embedding_type` (GGML type names: F32, Q4_0, Q4_1,
    Q8_0, ...), norms in F32."""
    import gguf
    from gguf.quants import quantize
    from safetensors.torch import load_file

    config = json.loads((model_dir / "config.json").read_text())
    if config["model_type"] != "llama":
        raise ValueError("make_tiny_gguf writes llama checkpoints only")
    writer = gguf.GGUFWriter(str(gguf_path), "llama")
    _write_gguf_hparams(writer, config)
    _write_gguf_tokenizer(writer, model_dir)
    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, config["num_hidden_layers"])
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    for name, tensor in load_file(str(model_dir / "model.safetensors")).items():
        base, suffix = name.rsplit(".", 1)
        array = tensor.float().numpy()
        if base.endswith("q_proj"):
            array = _llama_cpp_permute(array, heads)
        elif base.endswith("k_proj"):
            array = _llama_cpp_permute(array, kv_heads)
        qtype = gguf.GGMLQuantizationType[embedding_type if "embed" in base or "lm_head" in base else matrix_type]
        gguf_name = f"{name_map.get_name(base)}.{suffix}"
        if array.ndim == 2 and qtype != gguf.GGMLQuantizationType.F32:
            writer.add_tensor(gguf_name, quantize(array, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(gguf_name, array)
    rope = config.get("rope_parameters") or {}
    if rope.get("rope_type") == "llama3":  # as llama.cpp's converter: baked into per-pair frequency divisors
        writer.add_tensor("rope_freqs.weight", _llama_cpp_rope_freqs(config))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return gguf_path


SMALL_DRAFT = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
}
"""Overrides of the tiny model's config that make a smaller model of its vocabulary (a draft model)."""


def make_noisy_copy(model_dir: Path, path: Path, sigma: float, seed: int = 0) -> Path:
    """A copy of a checkpoint with Gaussian noise of std `sigma` added to every weight: a draft model that
    agrees with the original often, not always."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(model_dir, path)
    generator = torch.Generator().manual_seed(seed)
    weights = load_file(str(model_dir / "model.safetensors"))
    noisy = {name: w + sigma * torch.randn(w.shape, generator=generator) for name, w in weights.items()}
    save_file(noisy, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


def swap_token_ids(model_dir: Path, first: str, second: str) -> None:
    """Swap two tokens' ids in the checkpoint's tokenizer.json: a vocabulary that differs from the original."""
    path = model_dir / "tokenizer.json"
    tokenizer = json.loads(path.read_text())
    vocab = tokenizer["model"]["vocab"]
    vocab[first], vocab[second] = vocab[second], vocab[first]
    path.write_text(json.dumps(tokenizer))


def _llama_cpp_permute(weights, n_head: int):
    """llama.cpp's q/k row order: each head's rotary halves interleaved."""
    rows = weights.shape[0]
    return weights.reshape(n_head, 2, rows // n_head // 2, *weights.shape[1:]).swapaxes(1, 2).reshape(weights.shape)


def _llama_cpp_rope_freqs(config: dict):
    """llama.cpp's convert_hf_to_gguf.py for a llama3 rope scaling: each rotary pair's frequency divisor."""
    import math

    import numpy as np

    rope = config["rope_parameters"]
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old_context = rope["original_max_position_embeddings"]
    freqs = 1.0 / (rope["rope_theta"] ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    divisors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old_context / high:
            divisors.append(1.0)
        elif wavelen > old_context / low:
            divisors.append(factor)
        else:
            smooth = (old_context / wavelen - low) / (high - low)
            divisors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(divisors, dtype=np.float32)


def _write_gguf_hparams(writer, config: dict) -> None:
    import gguf

    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    writer.add_name("tiny-llama")
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_vocab_size(config["vocab_size"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_rope_dimension_count(head_dim)
    rope = config.get("rope_parameters") or {}
    writer.add_rope_freq_base(rope.get("rope_theta", config.get("rope_theta", 10000.0)))
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])


def _write_gguf_tokenizer(writer, model_dir: Path) -> None:
    import gguf

    model = json.loads((model_dir / "tokenizer.json").read_text())["model"]
    tokens = [token for token, _ in sorted(model["vocab"].items(), key=lambda item: item[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    types = [gguf.TokenType.CONTROL if token in SPECIAL_TOKENS else gguf.TokenType.NORMAL for token in tokens]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(SPECIAL_TOKENS.index("<|im_start|>"))
    writer.add_eos_token_id(EOS_ID)
    writer.add_pad_token_id(0)
    writer.add_chat_template(CHATML_TEMPLATE)


def make_tiny_embedding_dir(
    path: Path,
    arch: str = "llama",
    *,
    pooling_mode: Optional[str] = None,
    normalize: bool = True,
    seed: int = 0,
    **overrides,
) -> Path:
    """A tiny random embedding model as such checkpoints are saved: the HF base model without its LM head
    (`AutoModel`: architectures ["LlamaModel"], unprefixed tensor names), a tokenizer; with `pooling_mode`
    ("lasttoken", "mean_tokens", "cls_token") also Sentence Transformers' modules.json and pooling config,
    with a Normalize module when `normalize`."""
    import torch
    from transformers import AutoConfig, AutoModel

    config = AutoConfig.for_model(**tiny_config_dict(arch, **overrides))
    torch.manual_seed(seed)
    model = AutoModel.from_config(config, dtype=torch.float32)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    make_tiny_tokenizer().save_pretrained(path)
    if pooling_mode is not None:
        modules = [
            {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
            {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        ]
        if normalize:
            modules.append(
                {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}
            )
        (path / "modules.json").write_text(json.dumps(modules))
        (path / "1_Pooling").mkdir(exist_ok=True)
        modes = ("cls_token", "mean_tokens", "max_tokens", "mean_sqrt_len_tokens", "weightedmean_tokens", "lasttoken")
        pooling = {f"pooling_mode_{mode}": mode == pooling_mode for mode in modes}
        (path / "1_Pooling" / "config.json").write_text(
            json.dumps({"word_embedding_dimension": config.hidden_size, **pooling})
        )
    return path


def make_tiny_classifier_dir(
    path: Path, arch: str = "llama", *, num_labels: int = 3, seed: int = 0, **overrides
) -> Path:
    """A tiny random sequence classifier as HF saves one (`AutoModelForSequenceClassification`: architectures
    ["LlamaForSequenceClassification"], the decoder and its `score` matrix over the last token), a tokenizer."""
    import torch
    from transformers import AutoConfig, AutoModelForSequenceClassification

    labels = {i: f"label_{i}" for i in range(num_labels)}
    config = AutoConfig.for_model(**{"pad_token_id": 0, **tiny_config_dict(arch, **overrides)}, id2label=labels)
    torch.manual_seed(seed)
    model = AutoModelForSequenceClassification.from_config(config, dtype=torch.float32)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    make_tiny_tokenizer().save_pretrained(path)
    return path
