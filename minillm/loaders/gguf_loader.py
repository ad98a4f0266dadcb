"""Read a Llama GGUF file (llama.cpp's format) into our PyTorch model.

Three things happen between the file and the model:

1. **Dequantization.** SmolLM2's weights are stored as Q4_1 (4-bit, blocks of 32 with a scale and a minimum) and
   the embedding as Q8_0; ``gguf.quants.dequantize`` turns them into fp32.
2. **Undoing the Q/K row permutation.** llama.cpp applies RoPE to *adjacent* pairs ``(x0, x1), (x2, x3) ...``, Hugging
   Face to the two *halves* ``(x_i, x_{i+d/2})``. Its converter therefore reorders the rows of ``attn_q`` and
   ``attn_k`` within each head; we put them back so the "rotate half" RoPE of :mod:`minillm.model.layers` is right.
3. **Renaming.** ``blk.{i}.attn_q.weight`` -> ``model.layers.{i}.self_attn.q_proj.weight`` and so on.

vLLM counterpart: ``vllm/model_executor/model_loader/`` loads safetensors checkpoints; v0.33.0 has no GGUF loader.
"""
from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar, cast

import numpy as np
import torch

from minillm.config import LlamaConfig
from minillm.model.llama import LlamaDecoderLayer, LlamaForCausalLM

if TYPE_CHECKING:
    import gguf  # imported where it is used: only GGUF files need it

ArrayT = TypeVar("ArrayT", np.ndarray, torch.Tensor)

_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def unpermute_qk(weight: ArrayT, num_heads: int) -> ArrayT:
    """Undo llama.cpp's Q/K row order: ``[num_heads * head_dim, hidden]`` rows interleaved pairwise -> halves.

    Within each head, GGUF stores rows ``0, d/2, 1, d/2+1, ...``; we return rows ``0, 1, ..., d/2-1, d/2, ...``.
    """
    rows, cols = weight.shape
    head_dim = rows // num_heads
    w = weight.reshape(num_heads, head_dim // 2, 2, cols)
    w = w.swapaxes(1, 2) if isinstance(w, np.ndarray) else w.transpose(1, 2)
    return w.reshape(rows, cols)


def _field(reader, key: str, default=None):
    field = reader.fields.get(key)
    if field is None:
        return default
    return field.contents()


def read_gguf_config(reader: gguf.GGUFReader) -> LlamaConfig:
    """Build a :class:`LlamaConfig` from a ``gguf.GGUFReader``'s metadata (``llama.*`` keys)."""
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"only the llama architecture is supported, this GGUF file is {arch!r}")
    hidden = int(_field(reader, "llama.embedding_length"))
    heads = int(_field(reader, "llama.attention.head_count"))
    embd = next(t for t in reader.tensors if t.name == "token_embd.weight")
    has_output = any(t.name == "output.weight" for t in reader.tensors)
    return LlamaConfig(
        vocab_size=int(_field(reader, "llama.vocab_size", embd.shape[-1])),
        hidden_size=hidden,
        intermediate_size=int(_field(reader, "llama.feed_forward_length")),
        num_hidden_layers=int(_field(reader, "llama.block_count")),
        num_attention_heads=heads,
        num_key_value_heads=int(_field(reader, "llama.attention.head_count_kv", heads)),
        head_dim=int(_field(reader, "llama.rope.dimension_count", hidden // heads)),
        rms_norm_eps=float(_field(reader, "llama.attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(_field(reader, "llama.rope.freq_base", 10000.0)),
        max_position_embeddings=int(_field(reader, "llama.context_length", 2048)),
        tie_word_embeddings=not has_output,
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=_field(reader, "tokenizer.ggml.eos_token_id"),
    )


def _hf_name(gguf_name: str) -> str:
    base, _, suffix = gguf_name.rpartition(".")  # suffix: "weight"
    parts = base.split(".")
    if parts[0] == "blk":
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{suffix}"
    return f"{_GLOBAL_NAMES[base]}.{suffix}"


def load_gguf_model(path: str | Path, dtype: torch.dtype = torch.float32,
                    device: torch.device | str = "cpu") -> LlamaForCausalLM:
    """Load a Llama GGUF file into a :class:`LlamaForCausalLM` (dequantized to ``dtype``), in eval mode.

    The fp32 result is kept on disk after the first load (:mod:`minillm.loaders.gguf_cache`) and read from there
    afterwards."""
    from minillm.loaders import gguf_cache

    cached = gguf_cache.load_state(path)
    if cached is not None:
        config, state = cached
    else:
        config, state = read_gguf_state(path)
        gguf_cache.save_state(path, config, state)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model.to_empty(device=device)
    _load_state(model, state, dtype)
    return model.eval()


def read_gguf_state(path: str | Path) -> tuple[LlamaConfig, dict[str, torch.Tensor]]:
    """The config and the fp32 state dict (our parameter names, Q/K rows unpermuted) of a Llama GGUF file."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    reader = GGUFReader(str(path))
    config = read_gguf_config(reader)
    state: dict[str, torch.Tensor] = {}
    for tensor in reader.tensors:
        weight = dequantize(tensor.data, tensor.tensor_type)
        # GGUF lists dims fastest-first; dequantize already returns numpy's [rows, cols] order.
        if tensor.name.endswith("attn_q.weight"):
            weight = unpermute_qk(weight, config.num_attention_heads)
        elif tensor.name.endswith("attn_k.weight"):
            weight = unpermute_qk(weight, config.num_key_value_heads)
        state[_hf_name(tensor.name)] = torch.from_numpy(np.array(weight, dtype=np.float32, order="C", copy=True))
    return config, state


def _load_state(model: LlamaForCausalLM, state: dict[str, torch.Tensor], dtype: torch.dtype) -> None:
    """Copy ``state`` into ``model`` and re-create the non-persistent RoPE buffers lost on the meta device."""
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    missing = [m for m in missing if not (m == "lm_head.weight" and model.config.tie_word_embeddings)]
    if missing or unexpected:
        raise ValueError(f"checkpoint does not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}")
    if model.config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.to(dtype)
    for layer in cast(Iterable[LlamaDecoderLayer], model.model.layers):
        rope = layer.self_attn.rotary_emb
        rope.inv_freq = 1.0 / (rope.theta ** (
            torch.arange(0, rope.head_dim, 2, dtype=torch.float32, device=model.device) / rope.head_dim))
