"""The Llama model in plain PyTorch (``llama``) and its building blocks (``layers``)."""
from minillm.model.llama import LlamaForCausalLM

__all__ = ["LlamaForCausalLM"]
