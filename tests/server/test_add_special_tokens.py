"""vLLM's `add_special_tokens` on the generation routes, over a real server whose tokenizer adds a BOS token (as
Llama's does): completions add it by default and leave it out when asked; chat leaves it to the template by
default and adds it when asked. The field was ignored (a warning in the log) on both routes."""

from __future__ import annotations

import json
import shutil

import pytest
from tokenizers import Tokenizer
from tokenizers.processors import TemplateProcessing

from server.config.server_config import ServerConfig
from tests.server.conftest import serving

BOS = "<|im_start|>"
MESSAGES = [{"role": "user", "content": "hello there"}]


@pytest.fixture(scope="module")
def bos_server(tiny_model_dir, tmp_path_factory):
    path = shutil.copytree(tiny_model_dir, tmp_path_factory.mktemp("bos") / "model")
    tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
    bos_id = tokenizer.token_to_id(BOS)
    tokenizer.post_processor = TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    tokenizer.save(str(path / "tokenizer.json"))
    config_path = path / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**config, "bos_token": BOS, "add_bos_token": True}))
    with serving(path, ServerConfig(served_model_name="tiny")) as running:
        yield running


def test_completions_add_special_tokens_by_default_and_leave_them_out_when_asked(bos_server):
    client = bos_server.sdk()

    def usage(**extra) -> int:
        return client.completions.create(
            model="tiny", prompt="hello there", max_tokens=1, extra_body=extra
        ).usage.prompt_tokens

    with_bos, default, without = usage(add_special_tokens=True), usage(), usage(add_special_tokens=False)
    assert with_bos == default == without + 1
    echoed = client.completions.create(
        model="tiny",
        prompt="hello there",
        max_tokens=0,
        echo=True,
        logprobs=0,
        extra_body={"add_special_tokens": False},
    )
    assert BOS not in "".join(echoed.choices[0].logprobs.tokens)


def test_chat_leaves_special_tokens_to_the_template_unless_asked(bos_server):
    client = bos_server.sdk()

    def usage(**extra) -> int:
        return client.chat.completions.create(
            model="tiny", messages=MESSAGES, max_tokens=1, extra_body=extra
        ).usage.prompt_tokens

    default, without, with_bos = usage(), usage(add_special_tokens=False), usage(add_special_tokens=True)
    assert default == without == with_bos - 1
