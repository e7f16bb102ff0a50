"""Tensors: model runner, models, attention backends, paged KV cache, sampler, loader, the step loop."""
