"""Batched logits transformations used by the sampler, one job per module."""
