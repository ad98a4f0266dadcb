"""The worker side of the engine: turning a scheduler's plan into one forward pass and sampled tokens.

vLLM counterpart: ``vllm/v1/worker/`` (``gpu_model_runner.py``, ``gpu_input_batch.py``, ``block_table.py``).
"""
from minillm.worker.model_runner import BatchInputs, CachedRequestState, ModelRunner

__all__ = ["BatchInputs", "CachedRequestState", "ModelRunner"]
