"""The Tokenizer wrapper on the tiny test tokenizer and on the embedded SmolLM2 one."""

from __future__ import annotations

import json
import shutil

import pytest

from engine.loading.loader import CheckpointError
from engine.text.tokenizer import Tokenizer, load_tokenizer
from tests.engine.factories import EOS_ID, make_tiny_tokenizer

MULTI_BYTE = "Crème brûlée in Zürich, 東京と北京, emoji 🙂🚀👍🏽 and ❤️."
MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi! 🙂"},
]
CHATML = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi! 🙂<|im_end|>\n"


@pytest.fixture(scope="module")
def tiny_tokenizer(tiny_llama_dir) -> Tokenizer:
    return load_tokenizer(tiny_llama_dir)


def test_round_trip_with_multi_byte_text(tiny_tokenizer):
    ids = tiny_tokenizer.encode(MULTI_BYTE)
    assert tiny_tokenizer.decode(ids) == MULTI_BYTE
    assert len(tiny_tokenizer.encode("🙂", add_special_tokens=False)) > 1  # one character, several tokens
    assert all(0 <= i <= tiny_tokenizer.max_token_id for i in ids)


def test_vocab_and_special_tokens(tiny_tokenizer):
    assert tiny_tokenizer.vocab_size == 512 and tiny_tokenizer.max_token_id == 511
    assert tiny_tokenizer.hf.convert_ids_to_tokens([0, 1, 2]) == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    assert tiny_tokenizer.eos_token_ids == frozenset({EOS_ID})
    ids = tiny_tokenizer.encode("done") + [EOS_ID]
    assert tiny_tokenizer.decode(ids) == "done"
    assert tiny_tokenizer.decode(ids, skip_special_tokens=False) == "done<|im_end|>"


def test_chat_template_is_chatml_with_generation_prompt(tiny_tokenizer):
    assert tiny_tokenizer.render_chat(MESSAGES) == CHATML + "<|im_start|>assistant\n"
    assert tiny_tokenizer.render_chat(MESSAGES, add_generation_prompt=False) == CHATML
    ids = tiny_tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True)
    assert ids[0] == 1 and ids.count(EOS_ID) == 2
    assert ids == tiny_tokenizer.encode(CHATML + "<|im_start|>assistant\n", add_special_tokens=False)
    assert tiny_tokenizer.decode(ids, skip_special_tokens=False) == CHATML + "<|im_start|>assistant\n"


def test_no_chat_template_is_a_clear_error(tmp_path):
    hf = make_tiny_tokenizer()
    hf.chat_template = None
    hf.save_pretrained(tmp_path)
    tokenizer = load_tokenizer(tmp_path)
    assert not tokenizer.has_chat_template
    with pytest.raises(ValueError, match="no chat template"):
        tokenizer.apply_chat_template(MESSAGES)


def test_eos_ids_include_generation_config_list(tiny_llama_dir, tmp_path):
    shutil.copytree(tiny_llama_dir, tmp_path, dirs_exist_ok=True)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, 2]}))
    assert load_tokenizer(tmp_path).eos_token_ids == frozenset({0, 2})


def test_missing_tokenizer_is_a_clear_error(tmp_path):
    with pytest.raises(CheckpointError, match="cannot load a tokenizer"):
        load_tokenizer(tmp_path / "nothing-here")


@pytest.mark.slow
def test_embedded_tokenizer(embedded_checkpoint):
    tokenizer = load_tokenizer(embedded_checkpoint.path)
    assert tokenizer.has_chat_template and tokenizer.vocab_size == 49152
    assert tokenizer.hf.eos_token == "<|im_end|>" and 2 in tokenizer.eos_token_ids
    assert tokenizer.decode(tokenizer.encode(MULTI_BYTE)) == MULTI_BYTE
    prompt = tokenizer.render_chat([{"role": "user", "content": "Hi"}])
    assert prompt.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True)
    assert ids == tokenizer.encode(prompt, add_special_tokens=False)
    assert ids[-4:] == [1, *tokenizer.encode("assistant\n", add_special_tokens=False)]
