"""One rank of the engine: its shard of the model, its share of the paged KV cache, and the model runner that steps
them.

With one rank the worker holds the whole model; with tensor parallelism rank ``r`` holds its shard
(:class:`~minillm.model.llama_tp.TensorParallelLlamaForCausalLM`) and caches only its KV heads. Every rank runs every
step on the same plan (a block id names the same tokens everywhere), all-gathers the logits and samples with the
same seeds, so each appends the same token unprompted; only rank 0's output returns. vLLM sizes each GPU's cache from
its free memory and takes the minimum over the ranks; here every rank has the same budget.

vLLM counterpart: ``vllm/v1/worker/gpu_worker.py:Worker`` (``init_device``, ``load_model``,
``determine_available_memory``, ``execute_model``).
"""
from __future__ import annotations

from typing import Unpack

from minillm.core.sched.output import ModelRunnerOutput, SchedulerOutput
from minillm.distributed.parallel_state import TensorParallelGroup
from minillm.model.llama import LlamaForCausalLM
from minillm.model.llama_tp import TensorParallelDecoderLayer, TensorParallelLlamaForCausalLM
from minillm.model.parallel_layers import QKVParallelLinear
from minillm.worker.model_runner import ModelRunner, ModelRunnerArgs


class Worker:
    """One rank: the model (or its shard), the paged KV cache of its KV heads, and the runner that steps them.

    Args:
        model: the full model; a rank of a group of several builds its shard from it (and holds no reference to it
            afterwards).
        rank: this worker's rank (``0 ... tp_size - 1``).
        tp_group: the tensor-parallel group (``None``: one rank, the whole model).
        runner_kwargs: the :class:`~minillm.worker.model_runner.ModelRunner`'s arguments (``num_blocks``,
            ``block_size``, ``attention_backend``, ...), the same on every rank.

    Attributes:
        model_runner: this rank's runner, with its persistent batch and its KV cache.
    """

    def __init__(self, model: LlamaForCausalLM, rank: int = 0, tp_group: TensorParallelGroup | None = None,
                 **runner_kwargs: Unpack[ModelRunnerArgs]) -> None:
        self.rank = rank
        self.tp_group = tp_group
        self.tp_size = 1 if tp_group is None else tp_group.world_size
        if tp_group is not None and self.tp_size > 1:
            shard = TensorParallelLlamaForCausalLM(model, tp_group)
            runner_kwargs["num_kv_heads"] = shard.num_kv_heads
            connector = runner_kwargs.get("kv_connector")
            if connector is not None:  # this rank's own copy of the worker side: it moves only this rank's heads
                connector.bind_tensor_parallel(tp_group, _qkv_proj(shard).kv_heads)
            self.model_runner = ModelRunner(shard, **runner_kwargs)
        else:
            self.model_runner = ModelRunner(model, **runner_kwargs)

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
        """What this rank holds: its heads, its KV cache's shape and bytes, its weights' bytes, what it has sent (and
        what its KV connector moved, if it has one)."""
        runner = self.model_runner
        key_cache = runner.kv_caches[0][0]
        model = runner.model
        info: dict[str, object] = {
            "rank": self.rank, "tp_size": self.tp_size,
            "kv_cache_shape": tuple(key_cache.shape),
            "kv_cache_bytes": sum(k.numel() * k.element_size() + v.numel() * v.element_size()
                                  for k, v in runner.kv_caches),
            "param_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
        }
        if isinstance(model, TensorParallelLlamaForCausalLM):
            attn = _qkv_proj(model)
            info.update(query_heads=list(attn.query_heads), kv_heads=list(attn.kv_heads))
        if self.tp_group is not None:
            info.update(self.tp_group.stats())
        if runner.kv_connector is not None and hasattr(runner.kv_connector, "stats"):
            info["kv_connector_stats"] = dict(runner.kv_connector.stats)
        return info


def _qkv_proj(shard: TensorParallelLlamaForCausalLM) -> QKVParallelLinear:
    """The first layer's QKV projection: which query and KV heads this rank holds (the same in every layer)."""
    layer = shard.model.layers[0]
    assert isinstance(layer, TensorParallelDecoderLayer)
    return layer.self_attn.qkv_proj
