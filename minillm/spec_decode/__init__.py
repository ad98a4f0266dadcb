"""Speculative decoding: cheap draft tokens, verified by the target model in one step."""
