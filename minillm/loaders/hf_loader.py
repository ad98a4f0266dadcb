"""Load a local Hugging Face Llama checkpoint directory (``config.json`` + ``*.safetensors``).

vLLM counterpart: ``vllm/model_executor/model_loader/default_loader.py`` (``DefaultModelLoader``).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from minillm.config import LlamaConfig
from minillm.loaders.gguf_loader import _load_state
from minillm.model.llama import LlamaForCausalLM


def config_from_hf(cfg: dict) -> LlamaConfig:
    """Translate a Hugging Face ``config.json`` dict of the Llama family into :class:`LlamaConfig`."""
    if cfg.get("model_type") not in ("llama", None):
        raise ValueError(f"only Llama-family checkpoints are supported, got model_type={cfg.get('model_type')!r}")
    heads = cfg["num_attention_heads"]
    rope = cfg.get("rope_parameters") or {}
    theta = cfg.get("rope_theta", rope.get("rope_theta", 10000.0))
    if rope.get("rope_type", "default") != "default" or cfg.get("rope_scaling"):
        raise ValueError("RoPE scaling (e.g. llama3, yarn) is not implemented in minillm; use a default-RoPE model")
    eos = cfg.get("eos_token_id")
    return LlamaConfig(
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_hidden_layers=cfg["num_hidden_layers"],
        num_attention_heads=heads,
        num_key_value_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_theta=float(theta),
        max_position_embeddings=cfg.get("max_position_embeddings", 2048),
        tie_word_embeddings=cfg.get("tie_word_embeddings", False),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_id=eos[0] if isinstance(eos, list) else eos,
    )


def load_hf_model(path: str | Path, dtype: torch.dtype = torch.float32,
                  device: torch.device | str = "cpu") -> LlamaForCausalLM:
    """Load ``path/config.json`` and every ``path/*.safetensors`` into a :class:`LlamaForCausalLM`, in eval mode."""
    from safetensors.torch import load_file

    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} has no config.json; expected a Hugging Face checkpoint directory")
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path} has no *.safetensors files")
    config = config_from_hf(json.loads((path / "config.json").read_text()))
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update({k: v.float() for k, v in load_file(str(f), device=str(device)).items()})
    state = {k: v for k, v in state.items() if not k.endswith("rotary_emb.inv_freq")}
    model.to_empty(device=device)
    _load_state(model, state, dtype)
    return model.eval()
