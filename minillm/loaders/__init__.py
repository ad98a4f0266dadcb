"""Loading weights into :class:`~minillm.model.llama.LlamaForCausalLM`: from a GGUF file or a Hugging Face directory.

vLLM counterpart: ``vllm/model_executor/model_loader/`` (``gguf_loader.py``, ``default_loader.py``).
"""
from minillm.loaders.gguf_loader import load_gguf_model, read_gguf_config, unpermute_qk
from minillm.loaders.hf_loader import load_hf_model
from minillm.loaders.model_path import DEFAULT_GGUF_FILE, default_model_path

__all__ = ["DEFAULT_GGUF_FILE", "default_model_path", "load_gguf_model", "load_hf_model", "read_gguf_config",
           "unpermute_qk"]
