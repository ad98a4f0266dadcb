"""The model's shape: what a Llama-family checkpoint says about itself.

vLLM counterpart: the Hugging Face ``PretrainedConfig`` that ``vllm/config/model.py`` (``ModelConfig``) wraps.
"""
from __future__ import annotations

from dataclasses import dataclass, field


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


KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")


@dataclass
class KVTransferConfig:
    """Which KV connector an engine uses, and in which role (chapter 9: disaggregated prefill).

    Attributes:
        kv_connector: the connector's class name, e.g. ``"SharedStorageConnector"`` or
            ``"TorchDistributedConnector"`` (see :mod:`minillm.distributed.kv_transfer.factory`).
        kv_role: ``"kv_producer"`` (a prefill engine: it saves or sends each prompt's KV), ``"kv_consumer"`` (a
            decode engine: it loads KV computed elsewhere and counts those tokens as computed) or ``"kv_both"``.
        kv_connector_extra_config: the connector's own settings (e.g. ``{"shared_storage_path": "/tmp/kv"}``).
        kv_connector_module_path: import the connector class from this module instead of the built-in ones (how a
            test or a user plugs in their own connector).

    vLLM counterpart: ``vllm/config/kv_transfer.py:KVTransferConfig`` (same field names; vLLM also has
    ``kv_load_failure_policy``, default ``"fail"``; minillm always recomputes what failed to load, vLLM's
    ``"recompute"``).
    """

    kv_connector: str
    kv_role: str = "kv_both"
    kv_connector_extra_config: dict = field(default_factory=dict)
    kv_connector_module_path: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.kv_connector, str) or not self.kv_connector:
            raise ValueError(f"kv_connector must be a connector class name, got {self.kv_connector!r}")
        if self.kv_role not in KV_ROLES:
            raise ValueError(f"kv_role must be one of {KV_ROLES}, got {self.kv_role!r}")
        if not isinstance(self.kv_connector_extra_config, dict):
            raise ValueError(f"kv_connector_extra_config must be a dict, got {self.kv_connector_extra_config!r}")

    @property
    def is_kv_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_kv_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    @classmethod
    def from_any(cls, value: KVTransferConfig | dict | str | None) -> KVTransferConfig | None:
        """A config from itself, a dict of its fields, or their JSON text (vLLM's ``--kv-transfer-config``)."""
        if value is None or isinstance(value, KVTransferConfig):
            return value
        if isinstance(value, str):
            import json

            try:
                value = json.loads(value)
            except ValueError as e:
                raise ValueError(f"kv_transfer_config must be a dict or its JSON text, got {value!r} ({e})") from None
        if not isinstance(value, dict):
            raise ValueError(f"kv_transfer_config must be a KVTransferConfig, a dict or None, got {value!r}")
        unknown = sorted(set(value) - {"kv_connector", "kv_role", "kv_connector_extra_config",
                                       "kv_connector_module_path"})
        if unknown:
            raise ValueError(f"kv_transfer_config has unknown key(s) {unknown}; allowed: kv_connector, kv_role, "
                             f"kv_connector_extra_config, kv_connector_module_path")
        if "kv_connector" not in value:
            raise ValueError("kv_transfer_config needs 'kv_connector' (a connector class name)")
        return cls(**value)


SPECULATIVE_METHODS = ("ngram",)


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding by prompt lookup: each step a decoding request proposes drafts that the model verifies.

    Attributes:
        method: ``"ngram"`` (drafts found by looking the sequence's last n-gram up earlier in it).
        num_speculative_tokens: the most drafts a request proposes per step.
        prompt_lookup_max / prompt_lookup_min: the longest and shortest n-gram looked up.

    vLLM counterpart: ``vllm/config/speculative.py:SpeculativeConfig`` (same field names; vLLM adds draft models,
    EAGLE and MTP, and defaults both lookup lengths to 5 when neither is given).
    """

    method: str
    num_speculative_tokens: int = 3
    prompt_lookup_max: int = 3
    prompt_lookup_min: int = 1

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative_config: method must be one of {SPECULATIVE_METHODS}, got {self.method!r}")
        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"speculative_config: {name} must be a positive integer, got {value!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"speculative_config: prompt_lookup_min ({self.prompt_lookup_min}) must be <= "
                             f"prompt_lookup_max ({self.prompt_lookup_max})")

    @classmethod
    def from_any(cls, value: SpeculativeConfig | dict | str | None) -> SpeculativeConfig | None:
        """A config from itself, a dict of its fields, or their JSON text (vLLM's ``--speculative-config``)."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            import json

            try:
                value = json.loads(value)
            except ValueError as e:
                raise ValueError(f"speculative_config must be a dict or its JSON text, got {value!r} ({e})") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a SpeculativeConfig, a dict or None, got {value!r}")
        allowed = ("method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min")
        unknown = sorted(set(value) - set(allowed))
        if unknown:
            raise ValueError(f"speculative_config has unknown key(s) {unknown}; allowed: {sorted(allowed)}")
        if "method" not in value:
            raise ValueError(f"speculative_config needs 'method', one of {SPECULATIVE_METHODS}")
        return cls(**value)
