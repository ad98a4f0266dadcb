"""The engine's arguments in one dataclass: the model, the KV cache size, the scheduler's limits, the backend.

Every knob of an ``LLMEngine``, ``AsyncLLM``, ``LLM`` or ``python -m minillm serve`` lives here under vLLM's name and
is checked before anything heavy happens; the ``resolved_*`` and ``create_*`` methods give what depends on the model
and the device. Differences from vLLM: ``num_gpu_blocks`` is vLLM's ``num_gpu_blocks_override``;
``kv_cache_memory_fraction`` is a fraction of the device's free memory for the KV cache alone (vLLM's
``gpu_memory_utilization`` covers weights and activations too); ``dtype`` defaults to fp32 on a CPU (vLLM:
``"auto"``), what the lessons compare with transformers in.

vLLM counterpart: ``vllm/engine/arg_utils.py`` (``EngineArgs``, ``EngineArgs.create_engine_config``).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from minillm.attention.paged import BACKENDS
from minillm.config import SCHEDULING_POLICIES, KVTransferConfig, LlamaConfig, SchedulerConfig, SpeculativeConfig
from minillm.model.llama import LlamaForCausalLM
from minillm.model.llama_tp import check_tensor_parallel_config
from minillm.model.parallel_layers import num_kv_heads_per_rank
from minillm.platforms.cpu import DtypeChoice
from minillm.platforms.dtype import parse_dtype, resolve_dtype  # noqa: F401 (re-exported)
from minillm.platforms.memory import kv_cache_budget_bytes

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def default_device() -> str:
    """``"cuda"`` when a GPU is visible, else ``"cpu"``."""
    return "cuda" if torch.cuda.is_available() else "cpu"


EXECUTOR_BACKENDS = ("uni", "mp")


@dataclass
class EngineArgs:
    """Everything that configures an engine (vLLM's names).

    Attributes:
        model: a ``.gguf`` file or a Hugging Face directory; ``None`` is the course's SmolLM2-135M-Instruct.
        tokenizer: where the tokenizer comes from (default: the model's own file or directory).
        block_size: tokens per KV cache block.
        num_gpu_blocks: how many KV blocks to allocate, the reserved null block included (vLLM:
            ``num_gpu_blocks_override``). Wins over the two memory settings below.
        kv_cache_memory_bytes: size the cache to this many bytes (K and V of every layer).
        kv_cache_memory_fraction: size the cache to this fraction of the device's free memory, in ``(0, 1]``.
            When none of the three is given, the cache gets 512 MiB (about 11,000 tokens of SmolLM2 in fp32), or
            more if ``max_model_len`` needs it.
        max_num_batched_tokens: the token budget of one step (prefill chunks and decodes together). ``None``:
            2048, or ``max_model_len`` when chunked prefill is off.
        max_num_seqs: the most requests running at once; ``None``: 128, or the token budget if that is smaller.
        max_model_len: the longest sequence (prompt + output); ``None``: the model's ``max_position_embeddings``.
        enable_chunked_prefill: split long prompts across steps.
        enable_prefix_caching: reuse KV blocks of a prompt prefix seen before.
        long_prefill_token_threshold: the most tokens one request may take in a step (0: no cap).
        scheduling_policy: ``"fcfs"`` or ``"priority"``.
        attention_backend: ``"torch"`` (vectorized PyTorch SDPA over the paged cache) or ``"triton"`` (the
            chapter-3 kernels); ``None``: ``"triton"`` on a GPU, ``"torch"`` on a CPU (where Triton is interpreted,
            hence very slow).
        speculative_config: speculative decoding, off when ``None``. A dict (or its JSON text, as on vLLM's
            command line) ``{"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": n_max,
            "prompt_lookup_min": n_min}``: each step, every decoding request proposes up to ``k`` drafts by prompt
            lookup and the model verifies them in the same forward pass (defaults ``k=3``, ``n_max=3``,
            ``n_min=1``).
        kv_transfer_config: a KV connector (chapter 9: disaggregated prefill), off when ``None``. A
            :class:`~minillm.config.KVTransferConfig`, a dict of its fields or their JSON text (vLLM's
            ``--kv-transfer-config``), e.g. ``{"kv_connector": "SharedStorageConnector", "kv_role": "kv_producer",
            "kv_connector_extra_config": {"shared_storage_path": "/tmp/kv"}}``.
        dtype: weights, activations and KV cache (the cache follows the model, as vLLM's ``kv_cache_dtype="auto"``).
            ``None`` (default, also ``LLM()``'s): fp32 on a CPU, exact against transformers' fp32 model, fp16 on a
            GPU. ``"auto"`` (the default of ``serve`` and ``bench``): the dtype the machine is built for, bf16 on a
            CPU with AMX-BF16 or AVX512-BF16, else fp32 (fp16 on a GPU). Or ``"float32"``, ``"bfloat16"``,
            ``"float16"`` (also ``fp32``, ``bf16``, ``fp16``, ``half``).
        device: ``"cpu"``, ``"cuda"``; ``None``: a GPU if there is one.
        seed: seeds the global generator that unseeded random sampling uses.
        async_scheduling: schedule step N+1 while step N runs (:mod:`minillm.core.sched.async_scheduler`).
            ``None`` (default): what vLLM v0.33.0 resolves on the device the model runs on. On a GPU, on unless
            something incompatible is configured (n-gram speculative decoding), in-process or not
            (``vllm/config/vllm.py:VllmConfig.__post_init__``). On a CPU, off: the platform hook has the last word
            and sets it to ``False`` ("async scheduling is not required on CPU",
            ``vllm/platforms/cpu.py:CpuPlatform.check_and_update_config``). ``True`` asks for it on either device
            (vLLM's CPU hook turns even an explicit ``True`` off; minillm honours it so that chapter 10 can show
            it); with n-gram drafts it raises vLLM's error.
        distributed_executor_backend: where the worker(s) run. ``"uni"``: one worker in the engine core's process
            (:class:`~minillm.executor.uniproc_executor.UniProcExecutor`); ``"mp"``: one worker process per rank
            (:class:`~minillm.executor.multiproc_executor.MultiprocExecutor`). ``None`` (default): ``"uni"`` for
            one rank, ``"mp"`` for several, as v0.33.0's ``ParallelConfig`` resolves it. vLLM's CPU hook then turns
            ``"uni"`` into ``"mp"`` when the engine core has its own process ("OMP requires the MP executor"):
            ask for ``"mp"`` to run that layout. minillm keeps ``"uni"`` by default: on a 2-core CPU a worker
            process costs each engine 1.3 to 2.5 s of start-up and about 6 % of its throughput
            (``bench/engine_core.py``, engine (d)), and minillm's engine core already runs every PyTorch op on the
            one thread that set the threads up, which is what vLLM's worker process is for ("OMP requires the MP
            executor").
        tensor_parallel_size: ranks (worker processes) the model is split over, Megatron-style (chapter 10); 1: the
            whole model in the engine core's process. Each rank caches only its KV heads, so a memory budget holds
            ``tensor_parallel_size`` times the blocks while ranks do not outnumber the KV heads. CPU only here
            (gloo). The model must split: heads that do not give vLLM's message
            (``vllm/config/model.py:ModelConfig.verify_with_parallel_config``); an MLP that does not, minillm's own,
            before any process starts (vLLM checks only the heads there, and the MLP's split fails later inside each
            worker, ``vllm/distributed/utils.py:ensure_divisibility``). SmolLM2 runs on 1 or 3 (9 would split its 9
            heads but not its 1,536 MLP features).
    """

    model: str | None = None
    tokenizer: str | None = None
    block_size: int = 16
    num_gpu_blocks: int | None = None
    kv_cache_memory_bytes: int | None = None
    kv_cache_memory_fraction: float | None = None
    max_num_batched_tokens: int | None = None
    max_num_seqs: int | None = None
    max_model_len: int | None = None
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    long_prefill_token_threshold: int = 0
    scheduling_policy: str = "fcfs"
    attention_backend: str | None = None
    speculative_config: SpeculativeConfig | dict[str, Any] | str | None = None
    kv_transfer_config: KVTransferConfig | dict[str, Any] | str | None = None
    dtype: str | torch.dtype | None = None
    device: str | None = None
    seed: int = 0
    async_scheduling: bool | None = None
    distributed_executor_backend: str | None = None
    tensor_parallel_size: int = 1

    def __post_init__(self) -> None:
        self.verify()

    @classmethod
    def field_names(cls) -> list[str]:
        """The argument names (what ``LLM(**engine_args)`` and the CLI accept)."""
        return [f.name for f in dataclasses.fields(cls) if f.init]

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineArgs:
        """Build from keyword arguments, with a clear error for an unknown name."""
        unknown = sorted(set(kwargs) - set(cls.field_names()))
        if unknown:
            raise ValueError(f"unknown engine argument(s) {unknown}; allowed: {cls.field_names()}")
        return cls(**kwargs)

    def verify(self) -> None:
        """Check every value that can be checked without the model; raise :class:`ValueError` naming it."""
        def positive_int(name: str, allow_none: bool = False) -> None:
            v = getattr(self, name)
            if v is None and allow_none:
                return
            if not _is_int(v) or v <= 0:
                raise ValueError(f"{name} must be a positive integer{' or None' if allow_none else ''}, got {v!r}")

        positive_int("block_size")
        positive_int("max_num_seqs", allow_none=True)
        positive_int("max_num_batched_tokens", allow_none=True)
        positive_int("max_model_len", allow_none=True)
        positive_int("kv_cache_memory_bytes", allow_none=True)
        if self.num_gpu_blocks is not None and (not _is_int(self.num_gpu_blocks) or self.num_gpu_blocks < 2):
            raise ValueError(f"num_gpu_blocks must be an integer >= 2 (block 0 is the reserved null block) or None, "
                             f"got {self.num_gpu_blocks!r}")
        f = self.kv_cache_memory_fraction
        if f is not None and (isinstance(f, bool) or not isinstance(f, (int, float)) or not 0 < f <= 1):
            raise ValueError(f"kv_cache_memory_fraction must be in (0, 1] or None, got {f!r}")
        if not _is_int(self.long_prefill_token_threshold) or self.long_prefill_token_threshold < 0:
            raise ValueError(f"long_prefill_token_threshold must be an integer >= 0, got "
                             f"{self.long_prefill_token_threshold!r}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {SCHEDULING_POLICIES}, got {self.scheduling_policy!r}")
        if self.attention_backend is not None and self.attention_backend not in BACKENDS:
            raise ValueError(f"attention_backend must be one of {BACKENDS} or None, got {self.attention_backend!r}")
        for name in ("enable_chunked_prefill", "enable_prefix_caching"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        self.speculative_config = self.create_speculative_config()
        self.kv_transfer_config = self.create_kv_transfer_config()
        if not _is_int(self.seed):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        if self.async_scheduling is not None and not isinstance(self.async_scheduling, bool):
            raise ValueError(f"async_scheduling must be True, False or None (vLLM's rule), got "
                             f"{self.async_scheduling!r}")
        self.resolved_async_scheduling("cpu")  # an explicit True must be possible
        device = self.device or default_device()
        if not isinstance(device, str) or not (device == "cpu" or device.startswith("cuda")):
            raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {self.device!r}")
        if device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError(f"device {device!r} was asked for, but torch sees no CUDA device")
        parse_dtype(self.dtype, device)
        if not _is_int(self.tensor_parallel_size) or self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be an integer >= 1, got {self.tensor_parallel_size!r}")
        backend = self.distributed_executor_backend
        if backend is not None and backend not in EXECUTOR_BACKENDS:
            raise ValueError(f"distributed_executor_backend must be one of {EXECUTOR_BACKENDS} or None, "
                             f"got {backend!r}")
        if backend == "uni" and self.tensor_parallel_size > 1:
            raise ValueError(f"distributed_executor_backend='uni' runs one worker in the engine core's process; "
                             f"tensor_parallel_size={self.tensor_parallel_size} needs 'mp' (or None)")
        if backend == "mp" and device != "cpu":
            raise ValueError(f"distributed_executor_backend='mp' runs its workers on the CPU over gloo here; device "
                             f"{device!r} needs 'uni' (or None)")
        if self.tensor_parallel_size > 1 and device != "cpu":
            raise ValueError(f"tensor_parallel_size={self.tensor_parallel_size} runs its ranks on the CPU over "
                             f"gloo here; device {device!r} is not supported with it (vLLM uses NCCL on GPUs)")
        if self.kv_transfer_config is not None and self.resolved_distributed_executor_backend() == "mp":
            from minillm.distributed.kv_transfer.factory import KVConnectorFactory

            connector = KVConnectorFactory.get_connector_class(self.kv_transfer_config)
            if not connector.supports_tensor_parallel:
                raise ValueError(f"the KV connector {connector.__name__} does not support tensor_parallel_size > "
                                 f"1 or worker processes (SharedStorageConnector does); use tensor_parallel_size=1 "
                                 f"and distributed_executor_backend='uni' with it")

    def async_scheduling_incompatibility(self) -> str | None:
        """What configured here rules async scheduling out, as vLLM v0.33.0 words it; ``None`` if nothing."""
        spec = self.create_speculative_config()
        if spec is not None:
            # vLLM's V1 runner runs async scheduling with EAGLE, draft models and "ngram_gpu" only.
            return f"{spec.method}-based speculative decoding"
        return None

    def resolved_async_scheduling(self, device: str | None = None) -> bool:
        """Whether the engine core schedules one step ahead, for a model on ``device`` (``None``:
        :meth:`resolved_device`'s; see ``async_scheduling``).

        vLLM v0.33.0's rule: ``VllmConfig.__post_init__`` fails an explicit ``True`` on an incompatible option with
        ``"Async scheduling is not supported by the V1 model runner with ..."`` and turns ``None`` on unless such an
        option is set; then ``CpuPlatform.check_and_update_config`` sets it to ``False`` on a CPU.

        Raises:
            ValueError: ``async_scheduling=True`` with an incompatible option.
        """
        incompatible = self.async_scheduling_incompatibility()
        if self.async_scheduling:
            if incompatible is not None:
                raise ValueError(f"Async scheduling is not supported by the V1 model runner with {incompatible}. "
                                 f"Leave async_scheduling unset (or False, --no-async-scheduling) to use it.")
            return True
        if self.async_scheduling is None:
            on_gpu = (device or self.resolved_device()).startswith("cuda")
            return on_gpu and incompatible is None
        return False

    def resolved_distributed_executor_backend(self) -> str:
        """``"uni"`` or ``"mp"`` (see ``distributed_executor_backend``)."""
        if self.distributed_executor_backend is not None:
            return self.distributed_executor_backend
        return "mp" if self.tensor_parallel_size > 1 else "uni"

    # -- loading ---------------------------------------------------------------------------------------------------
    def load_model(self) -> LlamaForCausalLM:
        """The model ``model`` names, in ``resolved_dtype()`` on ``resolved_device()``."""
        from minillm.loaders.load import load_model

        model = load_model(self.model, dtype=self.resolved_dtype(), device=self.resolved_device(), tokenizer=False)
        assert isinstance(model, LlamaForCausalLM)
        return model

    def create_model_config(self) -> LlamaConfig:
        """The :class:`~minillm.config.LlamaConfig` of ``model``, read without its weights (a directory's
        ``config.json``, a GGUF file's metadata): what the engine core needs when its workers load the model."""
        from minillm.loaders.model_path import default_model_path
        from minillm.loaders.sharded_loader import read_model_config

        return read_model_config(default_model_path() if self.model is None else self.model)

    def load_tokenizer(self) -> PreTrainedTokenizerBase | None:
        """The tokenizer ``tokenizer`` names, else the model's own (``None`` for a directory without one); loads no
        weights."""
        from minillm.loaders.load import load_model_tokenizer
        from minillm.tokenizer import load_tokenizer

        return load_tokenizer(self.tokenizer) if self.tokenizer is not None else load_model_tokenizer(self.model)

    # -- what depends on the model -------------------------------------------------------------------------------
    def resolved_device(self) -> str:
        return self.device or default_device()

    def resolved_dtype(self) -> torch.dtype:
        return parse_dtype(self.dtype, self.resolved_device())

    def dtype_choice(self) -> DtypeChoice:
        """:meth:`resolved_dtype` and why (what ``serve`` and ``bench`` print at start-up)."""
        return resolve_dtype(self.dtype, self.resolved_device())

    def resolved_attention_backend(self) -> str:
        if self.attention_backend is not None:
            return self.attention_backend
        return "triton" if self.resolved_device().startswith("cuda") else "torch"

    def resolved_max_model_len(self, model_config: LlamaConfig) -> int:
        limit = model_config.max_position_embeddings
        if self.max_model_len is None:
            return limit
        if self.max_model_len > limit:
            raise ValueError(f"max_model_len ({self.max_model_len}) is larger than the model's "
                             f"max_position_embeddings ({limit})")
        return self.max_model_len

    def create_speculative_config(self) -> SpeculativeConfig | None:
        """The :class:`~minillm.config.SpeculativeConfig` of ``speculative_config`` (given as one, a dict of its
        fields or their JSON text); ``None``: off."""
        return SpeculativeConfig.from_any(self.speculative_config)

    def create_kv_transfer_config(self) -> KVTransferConfig | None:
        """The :class:`~minillm.config.KVTransferConfig` of ``kv_transfer_config``; ``None``: no KV connector."""
        return KVTransferConfig.from_any(self.kv_transfer_config)

    def create_scheduler_config(self, model_config: LlamaConfig) -> SchedulerConfig:
        """The :class:`SchedulerConfig` these arguments describe (its own checks apply too)."""
        max_model_len = self.resolved_max_model_len(model_config)
        budget = self.max_num_batched_tokens
        if budget is None:
            budget = 2048 if self.enable_chunked_prefill else max(2048, max_model_len)
            budget = max(budget, self.max_num_seqs or 0)
        max_num_seqs = self.max_num_seqs if self.max_num_seqs is not None else min(128, budget)
        return SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_num_seqs,
                               max_model_len=max_model_len, enable_chunked_prefill=self.enable_chunked_prefill,
                               long_prefill_token_threshold=self.long_prefill_token_threshold,
                               policy=self.scheduling_policy)

    def resolved_num_gpu_blocks(self, model_config: LlamaConfig, max_model_len: int,
                                kv_cache_dtype: torch.dtype | None = None) -> int:
        """KV blocks to allocate (null block included), from the explicit count or a memory budget.

        ``kv_cache_dtype`` is the dtype of the cache (the engine passes its model's: a bf16 model gets twice the
        blocks of an fp32 one in the same bytes); ``None``: :meth:`resolved_dtype`. A budget is per rank: with
        tensor parallelism each rank caches only its KV heads (:func:`~minillm.model.parallel_layers.
        num_kv_heads_per_rank`), so the same bytes hold more blocks, and every rank allocates this many.
        """
        if self.num_gpu_blocks is not None:
            return self.num_gpu_blocks
        if self.tensor_parallel_size > 1:
            check_tensor_parallel_config(model_config, self.tensor_parallel_size)  # no count for a split that can't be
        dtype_bytes = torch.empty((), dtype=kv_cache_dtype or self.resolved_dtype()).element_size()
        # Per rank: a tensor-parallel rank caches only its KV heads, and the budget is each rank's.
        kv_heads = num_kv_heads_per_rank(model_config.num_key_value_heads, self.tensor_parallel_size)
        block_bytes = (self.block_size * model_config.kv_cache_bytes_per_token(dtype_bytes) * kv_heads
                       // model_config.num_key_value_heads)
        # The same budget each worker reports at start-up (the default holds at least one request of max_model_len).
        return kv_cache_budget_bytes(block_bytes, self.block_size, max_model_len, self.resolved_device(),
                                     self.kv_cache_memory_bytes, self.kv_cache_memory_fraction) // block_bytes

