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


SCHEDULING_POLICIES = ("fcfs", "priority")


@dataclass
class SchedulerConfig:
    """The scheduler's limits: how many tokens and sequences one step may carry, and in what order requests go.

    Attributes:
        max_num_batched_tokens: the token budget of one step, summed over every request scheduled in it (prefill
            chunks and decodes alike).
        max_num_seqs: how many requests may be RUNNING at once (the "seats").
        max_model_len: the longest sequence (prompt + output) a request may reach.
        enable_chunked_prefill: whether a prompt may be split across steps when it does not fit the budget left.
        long_prefill_token_threshold: the most tokens one request gets in a step (0: no cap). Keeps one long
            prompt from taking the whole budget; needs chunked prefill.
        policy: ``"fcfs"`` (waiting queue in arrival order; preempt the most recently admitted request) or
            ``"priority"`` (lowest ``(priority, arrival_time)`` first; preempt the largest).

    vLLM counterpart: ``vllm/config/scheduler.py`` (``SchedulerConfig``), same field names.
    """

    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 128
    max_model_len: int = 2048
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0
    policy: str = "fcfs"

    def __post_init__(self) -> None:
        for name in ("max_num_batched_tokens", "max_num_seqs", "max_model_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.policy not in SCHEDULING_POLICIES:
            raise ValueError(f"policy must be one of {SCHEDULING_POLICIES}, got {self.policy!r}")
        if not isinstance(self.long_prefill_token_threshold, int) or self.long_prefill_token_threshold < 0:
            raise ValueError(f"long_prefill_token_threshold must be an integer >= 0 (0: no cap), "
                             f"got {self.long_prefill_token_threshold!r}")
        if self.long_prefill_token_threshold > self.max_model_len:
            raise ValueError(f"long_prefill_token_threshold ({self.long_prefill_token_threshold}) must not exceed "
                             f"max_model_len ({self.max_model_len})")
        if not self.enable_chunked_prefill:
            if self.max_num_batched_tokens < self.max_model_len:
                raise ValueError(
                    f"max_num_batched_tokens ({self.max_num_batched_tokens}) is smaller than max_model_len "
                    f"({self.max_model_len}) with chunked prefill off: a prompt longer than the budget could never "
                    f"be scheduled. Raise max_num_batched_tokens, lower max_model_len, or enable chunked prefill")
            if self.long_prefill_token_threshold > 0:
                raise ValueError(f"long_prefill_token_threshold ({self.long_prefill_token_threshold}) splits prompts "
                                 f"into chunks, so it needs enable_chunked_prefill=True")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs "
                             f"({self.max_num_seqs}): every running request needs at least one token per step")
