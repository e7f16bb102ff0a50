"""Tests of what runs a model over several processes."""
