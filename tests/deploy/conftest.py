"""Fixtures of the deployment tests: the tiny model that the real `pagedserve serve` replicas load."""

import pytest

from tests.engine.factories import make_tiny_model_dir


@pytest.fixture(scope="session")
def deploy_model_dir(tmp_path_factory):
    """Context for streams of a thousand tokens or more: one lasts long enough to be caught in flight."""
    return make_tiny_model_dir(tmp_path_factory.mktemp("deploy-tiny"), "llama", max_position_embeddings=4096)
