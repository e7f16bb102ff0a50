"""The model's own sampling defaults: what its generation_config.json recommends, as vLLM applies them.

vLLM (`--generation-config auto`, its default) reads the checkpoint's generation_config.json and takes its
`repetition_penalty`, `temperature`, `top_k`, `top_p` and `min_p` as the defaults of every request that leaves
them unset (a request's own value wins); `--generation-config vllm` keeps the neutral defaults, and a
directory reads that directory's generation_config.json instead. The same here: the server's requests and the
offline `LLM.generate` / `LLM.chat` without sampling parameters (`LLM.get_default_sampling_params()`).
(The file's `eos_token_id` list is read separately: it ends generation, engine/text/tokenizer.py.)
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Mapping, Optional

from engine.errors import SettingsConflictError
from engine.loading.loader import CheckpointError

logger = logging.getLogger(__name__)

SAMPLING_KEYS = ("repetition_penalty", "temperature", "top_k", "top_p", "min_p")
"""The generation_config.json keys taken as request defaults (vLLM's, but for max_new_tokens)."""

GENERATION_CONFIG_NAME = "generation_config.json"


def read_sampling_defaults(
    source: str, model_path: Path, overrides: Optional[Mapping[str, Any]] = None
) -> dict[str, Any]:
    """The sampling defaults `source` names: "auto" the model directory's generation_config.json (none when it
    has none), "vllm" none, else a directory holding a generation_config.json; `overrides` (vLLM's
    --override-generation-config) set over them, with "vllm" too. A value SamplingParams refuses, or a file that
    cannot be read, is a CheckpointError naming the file; a directory without the file, or an override of another
    key or value, a SettingsConflictError naming the flag."""
    overrides = dict(overrides or {})
    unknown = sorted(set(overrides) - set(SAMPLING_KEYS))
    if unknown:
        raise SettingsConflictError(
            f"--override-generation-config: {', '.join(map(repr, unknown))} cannot be overridden (the sampling "
            f"defaults are {', '.join(SAMPLING_KEYS)})"
        )
    try:
        check_sampling_defaults(overrides, "--override-generation-config")
    except CheckpointError as error:
        raise SettingsConflictError(str(error)) from None
    defaults = {**_file_defaults(source, model_path), **overrides}
    if overrides:
        logger.info(
            "sampling defaults (--override-generation-config over --generation-config %s): %s",
            source,
            ", ".join(f"{key}={value}" for key, value in defaults.items()),
        )
    return defaults


def _file_defaults(source: str, model_path: Path) -> dict[str, Any]:
    if source == "vllm":
        return {}
    directory = model_path if source == "auto" else Path(source).expanduser()
    path = directory / GENERATION_CONFIG_NAME
    if not path.is_file():
        if source == "auto":
            return {}
        # a bad setting (exit 2, as a bad flag), not a model that cannot be loaded (exit 1)
        raise SettingsConflictError(f"--generation-config {source!r}: no {GENERATION_CONFIG_NAME} in that directory")
    try:
        config = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise CheckpointError(f"cannot read {str(path)!r}: {exc}") from exc
    if not isinstance(config, dict):
        raise CheckpointError(f"{str(path)!r} is not a JSON object")
    defaults = {key: config[key] for key in SAMPLING_KEYS if config.get(key) is not None}
    check_sampling_defaults(defaults, str(path))
    if defaults:
        logger.info(
            "sampling defaults from %s (requests that leave them unset take them; --generation-config vllm "
            "turns them off): %s",
            path,
            ", ".join(f"{key}={value}" for key, value in defaults.items()),
        )
    return defaults


def check_sampling_defaults(defaults: Mapping[str, Any], where: str) -> None:
    """CheckpointError naming `where` unless SamplingParams takes every value of `defaults`."""
    from engine.sampling.params import SamplingParams
    from scheduler import RequestRejectedError

    try:
        SamplingParams(**defaults)
    except RequestRejectedError as exc:
        raise CheckpointError(f"{where}: {exc}") from exc
