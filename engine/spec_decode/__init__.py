"""Speculative decoding: the proposers that guess draft tokens (the scheduler asks them; the runner verifies)."""
