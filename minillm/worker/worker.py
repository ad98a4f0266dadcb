"""One rank of the engine: it loads its shard of the model, says how much KV cache it can hold, allocates it when told,
and steps.

The executor builds a worker from ``(Worker, kwargs)``, in the engine core's process (one rank) or in a process of
its own per rank, and the engine core starts it in vLLM's order: :meth:`Worker.init_device`, :meth:`Worker.load_model`
(one rank: the whole model; rank ``r`` of several: only its shard, read slice by slice from the checkpoint,
:func:`~minillm.loaders.sharded_loader.load_tensor_parallel_model`), then :meth:`Worker.get_kv_cache_spec` and
:meth:`Worker.determine_available_memory` (this rank's bytes per block and its budget), and, once the core has taken
the smallest count over the ranks, :meth:`Worker.initialize_from_config`, which builds the model runner and its KV
cache. Every rank then runs every step on the same plan; only rank 0's output returns.

vLLM counterpart: ``vllm/v1/worker/gpu_worker.py:Worker`` and ``cpu_worker.py:CPUWorker`` (``init_device``,
``load_model``, ``determine_available_memory``, ``get_kv_cache_spec``, ``initialize_from_config``,
``compile_or_warm_up_model``, ``execute_model``), built through ``vllm/v1/worker/worker_base.py:WorkerWrapperBase``.
"""
from __future__ import annotations

from pathlib import Path
from typing import Unpack

import torch

from minillm.core.sched.output import ModelRunnerOutput, SchedulerOutput
from minillm.distributed.parallel_state import TensorParallelGroup
from minillm.kv_cache_interface import FullAttentionSpec, KVCacheConfig, bytes_per_block
from minillm.model.llama import LlamaForCausalLM
from minillm.model.llama_tp import TensorParallelDecoderLayer, TensorParallelLlamaForCausalLM
from minillm.model.parallel_layers import QKVParallelLinear
from minillm.platforms.memory import kv_cache_budget_bytes
from minillm.worker.model_runner import ModelRunner, ModelRunnerArgs


class Worker:
    """One rank: its model (or shard), the paged KV cache of its KV heads, and the runner that steps them.

    Args:
        model: what to load. A :class:`~minillm.model.llama.LlamaForCausalLM` object (in the core's process, or sent
            to a single rank): used as it is, or, on a rank of several, cut into its shard (no reference kept). A
            checkpoint path (a Hugging Face directory or a ``.gguf`` file; ``None``: the course's SmolLM2): loaded by
            :meth:`load_model`, only this rank's shard when there are several.
        rank: this worker's rank (``0 ... tp_size - 1``).
        tp_group: the tensor-parallel group (``None``: one rank, the whole model).
        dtype: the weights' dtype when loading from a path (default fp32); ignored for a model object.
        device: where the weights and the KV cache go when loading from a path (default ``"cpu"``).
        kv_cache_memory_bytes, kv_cache_memory_fraction: this rank's KV cache budget
            (:meth:`determine_available_memory`), as ``EngineArgs`` takes them.
        runner_kwargs: the :class:`~minillm.worker.model_runner.ModelRunner`'s arguments but ``num_blocks`` (which
            :meth:`initialize_from_config` gives): ``block_size``, ``attention_backend``, ``max_model_len``, ...,
            the same on every rank.

    Attributes:
        model: the loaded model or shard (``None`` before :meth:`load_model`).
        checkpoint_bytes_read: bytes this rank read from the checkpoint (0 for a model object).
    """

    def __init__(self, model: LlamaForCausalLM | str | Path | None = None, rank: int = 0,
                 tp_group: TensorParallelGroup | None = None, *, dtype: torch.dtype | None = None,
                 device: str | None = None, kv_cache_memory_bytes: int | None = None,
                 kv_cache_memory_fraction: float | None = None, **runner_kwargs: Unpack[ModelRunnerArgs]) -> None:
        if "num_blocks" in runner_kwargs:
            raise TypeError("a Worker sizes its KV cache at initialize_from_config, not from num_blocks")
        self.rank = rank
        self.tp_group = tp_group
        self.tp_size = 1 if tp_group is None else tp_group.world_size
        self._source: LlamaForCausalLM | str | Path | None = model
        self.load_dtype = dtype if dtype is not None else torch.float32
        self.device = str(model.device) if isinstance(model, LlamaForCausalLM) else (device or "cpu")
        self.kv_cache_memory_bytes = kv_cache_memory_bytes
        self.kv_cache_memory_fraction = kv_cache_memory_fraction
        self.runner_kwargs = runner_kwargs
        self.model: LlamaForCausalLM | TensorParallelLlamaForCausalLM | None = None
        self.checkpoint_bytes_read = 0
        self._runner: ModelRunner | None = None

    # -- start-up, in the engine core's order -----------------------------------------------------------------------
    def init_device(self) -> None:
        """Make this rank's device current (a GPU); nothing to do on a CPU, where the executor has already set the
        rank's threads and joined its group (vLLM: ``Worker.init_device`` also sets up the distributed groups)."""
        if self.device.startswith("cuda"):
            torch.cuda.set_device(torch.device(self.device))

    def load_model(self) -> None:
        """Load this rank's weights: the whole model with one rank, only its shard with several (vLLM:
        ``Worker.load_model``). A shard from a path reads only its slices of the checkpoint; a model object is cut
        and then dropped."""
        source, self._source = self._source, None
        if self.tp_size > 1:
            assert self.tp_group is not None
            if isinstance(source, LlamaForCausalLM):
                shard = TensorParallelLlamaForCausalLM(source, self.tp_group)
            else:
                from minillm.loaders.model_path import default_model_path
                from minillm.loaders.sharded_loader import load_tensor_parallel_model

                shard, self.checkpoint_bytes_read = load_tensor_parallel_model(
                    default_model_path() if source is None else source, self.tp_group, dtype=self.load_dtype,
                    device=self.device)
            del source
            connector = self.runner_kwargs.get("kv_connector")
            if connector is not None:  # this rank's own copy of the worker side: it moves only this rank's heads
                connector.bind_tensor_parallel(self.tp_group, _qkv_proj(shard).kv_heads)
            self.model = shard
        elif isinstance(source, LlamaForCausalLM):
            self.model = source
        else:
            from minillm.loaders.load import load_model

            self.model = load_model(source, dtype=self.load_dtype, device=self.device, tokenizer=False)

    def get_kv_cache_spec(self) -> dict[str, FullAttentionSpec]:
        """Layer name -> the spec of its KV cache on this rank: ``block_size`` tokens of this rank's KV heads, in
        the cache's dtype (vLLM: ``Worker.get_kv_cache_spec``)."""
        model = self._loaded()
        config = model.config
        spec = FullAttentionSpec(block_size=self.runner_kwargs["block_size"], num_kv_heads=self._num_kv_heads(),
                                 head_size=config.head_dim,
                                 dtype=self.runner_kwargs.get("kv_cache_dtype") or model.dtype)
        return {f"model.layers.{i}.self_attn": spec for i in range(config.num_hidden_layers)}

    def determine_available_memory(self) -> int:
        """The bytes this rank can give its KV cache: ``kv_cache_memory_bytes``, else ``kv_cache_memory_fraction`` of
        the free memory of its device measured now (weights loaded), else the default budget (512 MiB, or one
        request of ``max_model_len`` if more). vLLM: ``CPUWorker.determine_available_memory`` (the configured
        space, ``VLLM_CPU_KVCACHE_SPACE``), ``Worker.determine_available_memory`` on a GPU (a profiling run)."""
        model = self._loaded()
        block_bytes = bytes_per_block(self.get_kv_cache_spec())
        max_model_len = self.runner_kwargs.get("max_model_len") or model.config.max_position_embeddings
        return kv_cache_budget_bytes(block_bytes, self.runner_kwargs["block_size"], max_model_len, self.device,
                                     self.kv_cache_memory_bytes, self.kv_cache_memory_fraction)

    def initialize_from_config(self, kv_cache_config: KVCacheConfig | list[KVCacheConfig]) -> None:
        """Allocate this rank's KV cache, ``num_blocks`` blocks per layer, and build its model runner (vLLM:
        ``Worker.initialize_from_config``; given one config per rank, as the executor sends them, it takes its own,
        as ``WorkerWrapperBase.initialize_from_config`` does)."""
        config = kv_cache_config[self.rank] if isinstance(kv_cache_config, list) else kv_cache_config
        model = self._loaded()
        kwargs = dict(self.runner_kwargs)
        if self.tp_size > 1:
            kwargs["num_kv_heads"] = self._num_kv_heads()
        self._runner = ModelRunner(model, num_blocks=config.num_blocks, **kwargs)  # type: ignore[arg-type]

    def compile_or_warm_up_model(self) -> None:
        """Nothing to compile or capture here (vLLM: ``Worker.compile_or_warm_up_model``, CUDA graphs and
        ``torch.compile`` warm-up)."""

    @property
    def model_runner(self) -> ModelRunner:
        """This rank's runner, with its request states and its KV cache (after :meth:`initialize_from_config`)."""
        if self._runner is None:
            raise RuntimeError("this worker has no model runner yet: its KV cache is allocated by "
                               "initialize_from_config, after load_model")
        return self._runner

    def _loaded(self) -> LlamaForCausalLM | TensorParallelLlamaForCausalLM:
        if self.model is None:
            raise RuntimeError("load_model() first")
        return self.model

    def _num_kv_heads(self) -> int:
        model = self._loaded()
        if isinstance(model, TensorParallelLlamaForCausalLM):
            return model.num_kv_heads
        return model.config.num_key_value_heads

    # -- steps ----------------------------------------------------------------------------------------------------
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        """The first half of a step on this rank: the forward pass (every rank runs every step; the executor keeps
        rank 0's output). ``None`` when :meth:`sample_tokens` has tokens to sample."""
        return self.model_runner.execute_model(scheduler_output)

    def sample_tokens(self, grammar_output: object | None = None) -> ModelRunnerOutput:
        """The second half of a step on this rank: sampling (vLLM v0.33.0: ``Worker.sample_tokens``)."""
        return self.model_runner.sample_tokens(grammar_output)

    def remove_requests(self, request_ids: list[str]) -> None:
        """Drop finished requests from this rank's runner at once (see ``ModelRunner.remove_requests``)."""
        self.model_runner.remove_requests(request_ids)

    def check_health(self) -> None:
        """Nothing to check inside a live process: the executor watches the processes themselves."""

    def describe(self) -> dict[str, object]:
        """What this rank holds: its heads, its weights' bytes and what it read of the checkpoint, its KV cache's
        shape and bytes (``None`` before :meth:`initialize_from_config`), what it has sent (and what its KV
        connector moved, if it has one)."""
        model = self.model
        info: dict[str, object] = {
            "rank": self.rank, "tp_size": self.tp_size,
            "param_bytes": 0 if model is None else sum(p.numel() * p.element_size() for p in model.parameters()),
            "checkpoint_bytes_read": self.checkpoint_bytes_read,
            "kv_cache_shape": None, "kv_cache_bytes": 0,
        }
        runner = self._runner
        if runner is not None:
            info["kv_cache_shape"] = tuple(runner.kv_caches[0][0].shape)
            info["kv_cache_bytes"] = sum(k.numel() * k.element_size() + v.numel() * v.element_size()
                                         for k, v in runner.kv_caches)
        if isinstance(model, TensorParallelLlamaForCausalLM):
            attn = _qkv_proj(model)
            info.update(query_heads=list(attn.query_heads), kv_heads=list(attn.kv_heads))
        if self.tp_group is not None:
            info.update(self.tp_group.stats())
        if runner is not None and runner.kv_connector is not None and hasattr(runner.kv_connector, "stats"):
            info["kv_connector_stats"] = dict(runner.kv_connector.stats)
        return info


def _qkv_proj(shard: TensorParallelLlamaForCausalLM) -> QKVParallelLinear:
    """The first layer's QKV projection: which query and KV heads this rank holds (the same in every layer)."""
    layer = shard.model.layers[0]
    assert isinstance(layer, TensorParallelDecoderLayer)
    return layer.self_attn.qkv_proj
