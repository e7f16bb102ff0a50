"""Fixtures shared by every test package."""

import pytest
import torch


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny tensors: torch's intra-op thread barriers cost more than the work (opt in per module)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
