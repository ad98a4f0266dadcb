"""Loading weights into :class:`~minillm.model.llama.LlamaForCausalLM`: from a GGUF file or a Hugging Face directory.

vLLM counterpart: ``vllm/model_executor/model_loader/`` (``default_loader.py``: ``DefaultModelLoader`` for Hugging
Face checkpoints). v0.33.0 has no GGUF model loader; older releases had one in that folder (``gguf_loader.py``).
"""
from minillm.loaders.gguf_loader import load_gguf_model, read_gguf_config, unpermute_qk
from minillm.loaders.hf_loader import load_hf_model
from minillm.loaders.model_path import DEFAULT_GGUF_FILE, default_model_path

__all__ = ["DEFAULT_GGUF_FILE", "default_model_path", "load_gguf_model", "load_hf_model", "read_gguf_config",
           "unpermute_qk"]
