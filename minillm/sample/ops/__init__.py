"""Batched logits transformations used by the sampler, one job per module.

vLLM counterpart: ``vllm/v1/sample/ops/``.
"""
