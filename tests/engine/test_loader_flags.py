"""vLLM's loading flags: --trust-remote-code, --revision, --download-dir, --chat-template."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from engine.loading.loader import CheckpointError, load_hf_config, prepare_checkpoint
from engine.loading.model_config import ModelConfig
from engine.text.tokenizer import load_tokenizer, read_chat_template
from tests.engine.factories import make_tiny_model_dir

CUSTOM_CONFIG = """
from transformers import LlamaConfig


class TinyCustomConfig(LlamaConfig):
    model_type = "tiny_custom"
"""


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return make_tiny_model_dir(tmp_path_factory.mktemp("flags") / "tiny", "llama")


def test_remote_config_code_runs_only_when_trusted(tiny_dir, tmp_path):
    custom = tmp_path / "custom"
    shutil.copytree(tiny_dir, custom)
    (custom / "configuration_tiny_custom.py").write_text(CUSTOM_CONFIG)
    config = json.loads((custom / "config.json").read_text())
    config.update(model_type="tiny_custom", auto_map={"AutoConfig": "configuration_tiny_custom.TinyCustomConfig"})
    (custom / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="trust_remote_code"):
        load_hf_config(custom)
    loaded = load_hf_config(custom, trust_remote_code=True)
    assert type(loaded).__name__ == "TinyCustomConfig" and loaded.num_hidden_layers == 2


def _hub_cache(root: Path, repo_id: str, snapshots: dict[str, Path], refs: dict[str, str]) -> Path:
    """An offline Hugging Face cache layout: models--org--name/{snapshots/<commit>, refs/<name>}."""
    repo = root / f"models--{repo_id.replace('/', '--')}"
    for commit, source in snapshots.items():
        shutil.copytree(source, repo / "snapshots" / commit)
    (repo / "refs").mkdir(parents=True)
    for name, commit in refs.items():
        (repo / "refs" / name).write_text(commit)
    return root


def test_download_dir_and_revision_pick_the_snapshot(tiny_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    main_commit, tagged_commit = "a" * 40, "b" * 40
    cache = _hub_cache(
        tmp_path / "downloads",
        "org/tiny",
        {main_commit: tiny_dir, tagged_commit: tiny_dir},
        {"main": main_commit, "v1": tagged_commit},
    )
    checkpoint = prepare_checkpoint("org/tiny", download_dir=cache)
    assert checkpoint.path.name == main_commit and checkpoint.source == "org/tiny"
    assert prepare_checkpoint("org/tiny", download_dir=cache, revision="v1").path.name == tagged_commit
    with pytest.raises(CheckpointError, match="revision 'v2'") as error:
        prepare_checkpoint("org/tiny", download_dir=cache, revision="v2")
    assert str(cache) in str(error.value)
    with pytest.raises(CheckpointError, match="local Hugging Face cache"):  # not in the default cache
        prepare_checkpoint("org/tiny", download_dir=None)


TEMPLATE = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}{% if add_generation_prompt %}>{% endif %}"


@pytest.mark.parametrize("as_file", [False, True])
def test_chat_template_from_a_file_or_inline_replaces_the_tokenizers(tiny_dir, tmp_path, as_file):
    value = TEMPLATE
    if as_file:
        (tmp_path / "t.jinja").write_text(TEMPLATE)
        value = str(tmp_path / "t.jinja")
    tokenizer = load_tokenizer(tiny_dir, chat_template=value)
    messages = [{"role": "user", "content": "hi"}]
    assert tokenizer.render_chat(messages) == "<user>hi>"
    assert "im_start" in load_tokenizer(tiny_dir).render_chat(messages)  # the tokenizer's own is untouched


def test_a_long_inline_chat_template_is_not_taken_for_a_path(tiny_dir):
    """A template with a stretch between slashes longer than a file name may be (255 bytes) was a crash: Python
    3.11's Path.is_file raised ENAMETOOLONG from the config's check and from the tokenizer's read."""
    long = TEMPLATE.replace(">{% endif %}", ">" + "x" * 300 + "{% endif %}")
    assert ModelConfig(chat_template=long).chat_template == long
    tokenizer = load_tokenizer(tiny_dir, chat_template=long)
    assert tokenizer.render_chat([{"role": "user", "content": "hi"}]) == "<user>hi>" + "x" * 300


def test_a_bad_chat_template_is_refused_naming_it(tmp_path):
    with pytest.raises(ValueError, match="not valid Jinja"):
        read_chat_template("{% for m in messages %}")
    with pytest.raises(ValueError, match="neither a file nor a Jinja template"):
        read_chat_template(str(tmp_path / "missing.jinja"))
