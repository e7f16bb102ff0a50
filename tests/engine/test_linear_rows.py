"""CPU products run at bucketed row counts (oneDNN caches a compiled primitive per shape: unbounded shapes
grew a server's memory by ~1 MiB per request)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import engine.layers.linear as linear_module
from engine.layers.linear import padded_rows, select_linear


def test_rows_are_exact_up_to_16_then_multiples_of_32():
    assert [padded_rows(n) for n in (1, 7, 16, 17, 32, 33, 64, 2047, 2048)] == [1, 7, 16, 32, 32, 64, 64, 2048, 2048]
    shapes = {padded_rows(n) for n in range(1, 2049)}
    assert len(shapes) == 16 + 2048 // 32


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_bucketed_products_give_each_row_its_product(dtype, monkeypatch):
    linear = select_linear(torch.device("cpu"), dtype)
    weight = torch.randn(40, 24).to(dtype)
    bias = torch.randn(40).to(dtype)
    prepared = linear.prepare(weight)
    seen = []
    real = F.linear

    def spy(x, w, b=None):
        seen.append(x.shape[0])
        return real(x, w, b)

    monkeypatch.setattr(linear_module.F, "linear", spy)
    for rows in (1, 16, 17, 45):
        x = torch.randn(rows, 24).to(dtype)
        got = linear(x, prepared, bias)
        assert got.shape == (rows, 40) and got.is_contiguous()
        expected = x.double() @ weight.double().t() + bias.double()
        tolerance = 1e-4 if dtype == torch.float32 else 3e-2
        torch.testing.assert_close(got.double(), expected, rtol=tolerance, atol=tolerance)
    if linear.name == "torch":
        assert seen == [1, 16, 32, 64]
