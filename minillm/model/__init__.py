"""The Llama model in plain PyTorch (``llama``) and its building blocks (``layers``).

vLLM counterpart: ``vllm/model_executor/models/llama.py``.
"""
from minillm.model.llama import LlamaForCausalLM

__all__ = ["LlamaForCausalLM"]
