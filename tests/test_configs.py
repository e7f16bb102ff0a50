"""The YAML presets stay valid against the config models that own each section."""

from pathlib import Path

import pytest
import yaml

from engine.cache_config import EngineCacheConfig
from scheduler import SchedulerConfig

CONFIGS = sorted((Path(__file__).resolve().parents[1] / "configs").glob("*.yaml"))


def test_presets_exist():
    assert {p.name for p in CONFIGS} >= {"default.yaml", "tiny.yaml"}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_cache_and_scheduler_sections_validate(path):
    preset = yaml.safe_load(path.read_text())
    EngineCacheConfig(**preset.get("cache", {}))
    SchedulerConfig(**preset.get("scheduler", {}))
