"""Sampling: from logits to tokens (``Sampler``), and verifying draft tokens (``RejectionSampler``).

vLLM counterpart: ``vllm/v1/sample/``.
"""
from minillm.sample.logits_indices import compute_logits_indices, compute_spec_decode_logits_indices
from minillm.sample.metadata import SamplingMetadata, make_generator
from minillm.sample.rejection_sampler import RejectionSampler, assemble_spec_output
from minillm.sample.sampler import Sampler

__all__ = ["RejectionSampler", "Sampler", "SamplingMetadata", "assemble_spec_output", "compute_logits_indices",
           "compute_spec_decode_logits_indices", "make_generator"]
