"""Tensor-parallel prefill on real worker processes: the job each rank runs, the caller's helper, and the formulas.

:func:`tp_prefill` is the job: on ranks ``0 ... tp_size-1`` each cuts its shard out of the full model it holds, runs
the prompt (all-reducing over gloo) and returns the last token's logits and what it communicated.
:func:`run_tensor_parallel` checks every argument in the caller's process, sends the job and collects the results;
:func:`expected_all_reduce_bytes` and :func:`expected_all_gather_bytes` are what the counted bytes must equal::

    with JobExecutor({"smollm": model}, world_size=3) as ex:
        res = run_tensor_parallel(ex, "smollm", input_ids, tp_size=3)

vLLM counterparts: ``tensor_parallel_size`` in ``vllm/config/parallel.py:ParallelConfig``;
``vllm/v1/executor/multiproc_executor.py:MultiprocExecutor.collective_rpc`` sends the same work to every TP worker,
whose model uses the parallel layers of ``vllm/model_executor/layers/linear.py``.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from minillm.config import LlamaConfig
from minillm.distributed.parallel_state import TensorParallelGroup, check_tp_rank
from minillm.sampling_params import is_int

if TYPE_CHECKING:  # the executor's package imports the tensor-parallel model, which imports this package
    from minillm.distributed.jobs import JobExecutor, WorkerContext


def expected_num_all_reduces(config: LlamaConfig, tp_size: int) -> int:
    """All-reduces per forward pass on each rank: the embedding's, then two per layer (after ``o_proj`` and after
    ``down_proj``); none on one rank."""
    _, tp_size = check_tp_rank(0, tp_size)
    return 0 if tp_size == 1 else 1 + 2 * config.num_hidden_layers


def expected_all_reduce_bytes(config: LlamaConfig, num_tokens: int, tp_size: int, dtype_bytes: int = 4) -> int:
    """Payload bytes each rank all-reduces in one forward pass of ``num_tokens`` tokens.

    Every all-reduce is of the residual update ``[num_tokens, hidden]``, so the total is ``(1 + 2 L) * n * hidden *
    dtype_bytes``, the same on every rank and independent of ``tp_size`` (as long as it is > 1; one rank sends
    nothing). SmolLM2, 20 tokens, fp32: ``61 * 20 * 576 * 4`` = 2,810,880 bytes. The wire traffic of a ring
    all-reduce is ``2 (N-1)/N`` times the payload.
    """
    if not is_int(num_tokens) or num_tokens < 0:
        raise ValueError(f"num_tokens must be an int >= 0, got {num_tokens!r}")
    return expected_num_all_reduces(config, tp_size) * num_tokens * config.hidden_size * dtype_bytes


def expected_all_gather_bytes(config: LlamaConfig, num_rows: int, tp_size: int, dtype_bytes: int = 4) -> int:
    """Payload bytes each rank all-gathers to compute ``num_rows`` rows of logits: its own ``[num_rows,
    ceil(vocab / tp_size)]`` slice (fp32 logits: ``dtype_bytes=4``); none on one rank."""
    _, tp_size = check_tp_rank(0, tp_size)
    if not is_int(num_rows) or num_rows < 0:
        raise ValueError(f"num_rows must be an int >= 0, got {num_rows!r}")
    return 0 if tp_size == 1 else num_rows * -(-config.vocab_size // tp_size) * dtype_bytes


def tp_prefill(ctx: WorkerContext, model: str, input_ids: list[int], return_hidden: bool = False) -> dict[str, Any]:
    """The job of one rank (module-level, for ``run_job``): tensor-parallel prefill of one prompt.

    Args:
        ctx: this rank, the job's gloo group (its ``world_size`` is ``tp_size``), the loaded models, the timeout.
        model: the name of a model the executor was given.
        input_ids: ``[num_tokens]`` prompt ids (the same on every rank).
        return_hidden: also return the final hidden states.

    Returns:
        A dict: ``"logits"`` ``[vocab]`` fp32 last-token logits (the same on every rank after the all-gather),
        ``"hidden"`` ``[num_tokens, hidden]`` if asked, ``"rank"``, ``"tp_size"``, the counters of
        :meth:`~minillm.distributed.parallel_state.TensorParallelGroup.stats` (``bytes_all_reduced``,
        ``num_all_reduces``, ``bytes_all_gathered``, ``num_all_gathers``, ``comm_wait_s``), ``"param_bytes"``
        (weights this rank holds), ``"build_s"`` (cutting the shards) and ``"forward_s"`` (the forward pass and
        logits, communication included).

    vLLM: what each TP worker does for a prefill step, ``vllm/v1/worker/gpu_worker.py:Worker.execute_model``, on a
    model built with the parallel layers.
    """
    # Imported here, not at the top: minillm.model.llama_tp imports minillm.distributed.parallel_state, whose
    # package __init__ imports this module, so a top-level import would be circular.
    from minillm.model.llama_tp import TensorParallelLlamaForCausalLM

    group = TensorParallelGroup(ctx.group, timeout_s=ctx.timeout_s)
    t0 = time.perf_counter()
    tp_model = TensorParallelLlamaForCausalLM(ctx.models[model], group).eval()
    t1 = time.perf_counter()
    with torch.inference_mode():
        hidden = tp_model(torch.tensor(input_ids, dtype=torch.long))
        logits = tp_model.compute_logits(hidden[-1:])[0]
    t2 = time.perf_counter()
    out: dict[str, Any] = {"rank": ctx.rank, "tp_size": ctx.world_size, "logits": logits.clone(),
                           "param_bytes": tp_model.param_bytes(), "build_s": t1 - t0, "forward_s": t2 - t1,
                           **group.stats()}
    if return_hidden:
        out["hidden"] = hidden.clone()
    return out


@dataclass
class TensorParallelResult:
    """What the ranks of one tensor-parallel prefill returned.

    Attributes:
        tp_size: ranks used.
        ranks: one dict per rank, by rank (see :func:`tp_prefill`).
        wall_s: wall time seen from the parent (sending the job to the last result).
    """

    tp_size: int
    ranks: list[dict[str, Any]]
    wall_s: float

    @property
    def logits(self) -> torch.Tensor:
        """``[vocab]`` fp32 last-token logits (rank 0's; every rank has the same after the all-gather)."""
        return self.ranks[0]["logits"]

    @property
    def hidden(self) -> torch.Tensor:
        """``[num_tokens, hidden]`` final hidden states (rank 0's), if the job was asked for them."""
        if "hidden" not in self.ranks[0]:
            raise AttributeError("run with return_hidden=True to get the hidden states")
        return self.ranks[0]["hidden"]


def run_tensor_parallel(executor: JobExecutor, model: str, input_ids: torch.Tensor | list[int], tp_size: int,
                        timeout_s: float | None = None, return_hidden: bool = False) -> TensorParallelResult:
    """Prefill ``input_ids`` with ``model`` split over ranks ``0 ... tp_size-1`` of ``executor``.

    Args:
        executor: worker processes that loaded ``model`` (at least ``tp_size`` of them).
        model: a name given to the executor.
        input_ids: ``[num_tokens]`` prompt ids (a 1-D integer tensor or a list of ints), at least one.
        tp_size: ranks to split the model over.
        timeout_s: timeout of every collective (default: the executor's).
        return_hidden: also bring back the final hidden states.

    Raises:
        ValueError: checked here, before anything is sent, so the executor stays usable: ``tp_size`` not an int in
            ``[1, executor.world_size]``; an unknown model; a model its heads cannot split over ``tp_size`` ranks
            (SmolLM2 on 2 ranks: "Total number of attention heads (9) must be divisible by tensor parallel size
            (2).", vLLM's own message); ids that are not a non-empty 1-D list of ids in ``[0, vocab_size)``.
        WorkerError: a rank failed (the executor is then closed).

    vLLM: the checks of ``vllm/config/model.py:ModelConfig.verify_with_parallel_config`` happen before any worker
    starts; the executor then broadcasts the step to the TP workers
    (``vllm/v1/executor/multiproc_executor.py:MultiprocExecutor.collective_rpc``).
    """
    if not is_int(tp_size) or not 1 <= tp_size <= executor.world_size:
        raise ValueError(f"tp_size must be an int in [1, {executor.world_size}] (the executor's world_size), got "
                         f"{tp_size!r}")
    # The executor keeps each model's config; the parent needs it to check the split before sending anything.
    configs: dict[str, LlamaConfig] = executor.configs
    if model not in configs:
        raise ValueError(f"unknown model {model!r}; have {sorted(configs)}")
    config = configs[model]
    from minillm.distributed.jobs import check_input_ids
    from minillm.model.llama_tp import check_tensor_parallel_config  # see the note in tp_prefill

    check_tensor_parallel_config(config, tp_size)
    ids = check_input_ids(input_ids, config.vocab_size)
    if not ids:
        raise ValueError("input_ids must hold at least one token")
    t0 = time.perf_counter()
    ranks = executor.run_job(tp_prefill, world_size=int(tp_size), timeout_s=timeout_s,
                             kwargs={"model": model, "input_ids": ids, "return_hidden": bool(return_hidden)})
    return TensorParallelResult(int(tp_size), ranks, time.perf_counter() - t0)
