"""Speculative decoding: cheap draft tokens, verified by the target model in one step.

vLLM counterpart: ``vllm/v1/spec_decode/``.
"""
