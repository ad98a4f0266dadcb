"""The model's shape: what a Llama-family checkpoint says about itself.

vLLM counterpart: the Hugging Face ``PretrainedConfig`` that ``vllm/config/model.py`` (``ModelConfig``) wraps.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LlamaConfig:
    """Hyper-parameters of a Llama-architecture decoder.

    Defaults are SmolLM2-135M-Instruct's, the course's model.
    """

    vocab_size: int = 49152
    hidden_size: int = 576
    intermediate_size: int = 1536
    num_hidden_layers: int = 30
    num_attention_heads: int = 9
    num_key_value_heads: int = 3
    head_dim: int = 64
    rms_norm_eps: float = 1e-5
    rope_theta: float = 100000.0
    max_position_embeddings: int = 8192
    tie_word_embeddings: bool = True
    bos_token_id: int | None = 1
    eos_token_id: int | None = 2

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads}) for grouped-query attention"
            )
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")

    @property
    def num_queries_per_kv(self) -> int:
        """How many query heads share one K/V head (3 for SmolLM2: 9 query heads, 3 KV heads)."""
        return self.num_attention_heads // self.num_key_value_heads

    def kv_cache_bytes_per_token(self, dtype_bytes: int = 4) -> int:
        """Bytes of K and V one token occupies across all layers: 2 x layers x KV heads x head_dim x dtype size."""
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * dtype_bytes
