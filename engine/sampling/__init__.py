"""Sampling: per-request parameters and state, the batched sampler, n > 1 fan-out."""
