"""Weights kept in a quantized form and the products that read them (see `quantized_weight.py`)."""
