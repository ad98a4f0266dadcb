"""One-off jobs on the first ``k`` ranks of an executor whose ranks hold full models.

:class:`JobWorker` holds whole models (sent once, as shared memory) and one gloo sub-group per size ``k`` (ranks
``0 ... k-1``), so one set of processes serves 2-, 3- and 4-rank jobs alike. :class:`JobExecutor` is the engine's
:class:`~minillm.executor.multiproc_executor.MultiprocExecutor` with that worker; :meth:`JobExecutor.run_job` runs
``fn(ctx, **kwargs)`` on ranks ``0 ... k-1`` with a :class:`WorkerContext` (rank, group, models, timeout).

vLLM counterpart: ``MultiprocExecutor.collective_rpc`` with a callable (``vllm/v1/executor/multiproc_executor.py``),
run as ``fn(worker, *args, **kwargs)`` on every worker (``vllm/v1/serial_utils.py:run_method``); vLLM has no
sub-groups of the first ``k`` ranks.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch

from minillm.config import LlamaConfig
from minillm.distributed.parallel_state import TensorParallelGroup, check_timeout
from minillm.executor.multiproc_executor import MultiprocExecutor, WorkerError, check_importable_function
from minillm.sampling_params import is_int

if TYPE_CHECKING:
    from minillm.model.llama import LlamaForCausalLM

# Beyond the job's own timeout (which every collective inside it uses), how long the caller waits for its answer:
# loading nothing, a job may still spend a while after its last collective (building an engine, gathering outputs).
_JOB_MARGIN_S = 30.0


@dataclass
class WorkerContext:
    """What a job function run by :meth:`JobExecutor.run_job` gets on its rank.

    Attributes:
        rank: this process's rank in the job (``0 ... world_size - 1``).
        world_size: ranks in the job.
        group: the ``torch.distributed`` process group of the job's ranks (gloo).
        models: name -> the models the executor was given (the parent's weights, shared memory).
        timeout_s: the job's timeout: every collective the function makes should wait at most this long.
    """

    rank: int
    world_size: int
    group: Any
    models: dict[str, LlamaForCausalLM]
    timeout_s: float


class JobWorker:
    """One rank of a :class:`JobExecutor`: full models and a gloo group for every job size.

    Args:
        rank: this rank.
        tp_group: the group of every rank (the executor's).
        models: name -> model (already in this process: the executor sent them).
    """

    def __init__(self, rank: int, tp_group: TensorParallelGroup, models: dict[str, LlamaForCausalLM]) -> None:
        import torch.distributed as dist

        self.rank = rank
        self.models = {name: m.eval() for name, m in models.items()}
        timeout = timedelta(seconds=tp_group.timeout_s)
        # One group per size k: ranks 0 ... k-1. new_group is collective: every rank creates every group, in order.
        self.groups = {k: dist.new_group(list(range(k)), timeout=timeout) for k in range(1, tp_group.world_size)}
        self.groups[tp_group.world_size] = tp_group.group

    def run_job(self, fn: Callable[..., Any], world_size: int, kwargs: dict[str, Any], timeout_s: float) -> Any:
        """``fn(ctx, **kwargs)`` if this rank is one of the job's ``world_size``; else ``None`` at once."""
        if self.rank >= world_size:
            return None
        ctx = WorkerContext(self.rank, world_size, self.groups[world_size], self.models, timeout_s)
        return fn(ctx, **kwargs)


class JobExecutor(MultiprocExecutor):
    """``world_size`` worker processes, each holding the given models in full, that run jobs together (chapters 7
    and 9). Use as a context manager.

    Args:
        models: name -> :class:`~minillm.model.llama.LlamaForCausalLM`; their weights go to every rank once, as
            shared memory (not a copy each).
        world_size: processes (the largest group a job may use).
        timeout_s: the default timeout of every collective of a job.
        start_timeout_s: how long the workers may take to start (import torch, join the group, map the weights).

    Example::

        with JobExecutor({"smollm": model}, world_size=3) as ex:
            outs = ex.run_job(my_module.my_function, world_size=3, kwargs={"n": 4})  # one result per rank
    """

    def __init__(self, models: dict[str, LlamaForCausalLM], world_size: int, timeout_s: float = 60.0,
                 start_timeout_s: float = 180.0, error_cls: type[Exception] = WorkerError) -> None:
        if not models:
            raise ValueError("give at least one model")
        self._configs = {name: m.config for name, m in models.items()}
        # One thread per rank: several ranks share few cores, and per-rank CPU time stays meaningful.
        super().__init__(world_size, JobWorker, {"models": dict(models)}, num_threads=1, timeout_s=timeout_s,
                         start_timeout_s=start_timeout_s, error_cls=error_cls)

    @property
    def configs(self) -> dict[str, LlamaConfig]:
        """Model name -> its :class:`~minillm.config.LlamaConfig` (what the workers hold)."""
        return dict(self._configs)

    def check_world_size(self, world_size: object) -> int:
        """``world_size`` (``None``: all ranks) as an int in ``[1, self.world_size]``, else a ValueError."""
        world_size = self.world_size if world_size is None else world_size
        if not is_int(world_size) or not 1 <= world_size <= self.world_size:
            raise ValueError(f"world_size must be an int in [1, {self.world_size}], got {world_size!r}")
        return int(world_size)

    def run_job(self, fn: Callable[..., Any], world_size: int | None = None, kwargs: dict[str, Any] | None = None,
                timeout_s: float | None = None) -> list[Any]:
        """Run ``fn(ctx, **kwargs)`` on ranks ``0 ... world_size-1`` at once; return their results, by rank.

        Args:
            fn: a module-level function of an importable module (each rank imports it by name). It gets a
                :class:`WorkerContext` and ``kwargs``.
            world_size: ranks to use, ``1 ... self.world_size`` (default all).
            kwargs: keyword arguments, the same for every rank (they travel pickled).
            timeout_s: the job's timeout (default: the executor's); the caller waits that long plus 30 s.

        Returns:
            One result per rank of the job: what ``fn`` returned there.

        Raises:
            ValueError: a bad argument, checked here before anything is sent (the executor stays usable).
            WorkerError: a rank failed (its traceback is in the message) or died; the executor's ranks are then
                gone and every later job raises it again.
        """
        check_importable_function(fn)
        world_size = self.check_world_size(world_size)
        timeout_s = self.timeout_s if timeout_s is None else check_timeout("timeout_s", timeout_s)
        outs = self.collective_rpc("run_job", (fn, world_size, dict(kwargs or {}), timeout_s),
                                   timeout_s=timeout_s + _JOB_MARGIN_S)
        return outs[:world_size]


def check_input_ids(input_ids: object, vocab_size: int) -> list[int]:
    """``input_ids`` (a 1-D integer tensor or a list/tuple of ints) as a list of ints in ``[0, vocab_size)``.

    Checked in the caller, so that a bad prompt is a ValueError there, not a traceback from a worker and a failed
    executor.
    """
    if isinstance(input_ids, torch.Tensor):
        if input_ids.dim() != 1:
            raise ValueError(f"input_ids must be a 1-D tensor [num_tokens], got shape {tuple(input_ids.shape)}")
        if input_ids.dtype.is_floating_point or input_ids.dtype.is_complex or input_ids.dtype == torch.bool:
            raise ValueError(f"input_ids must hold integer token ids, got dtype {input_ids.dtype}")
        ids = [int(t) for t in input_ids.tolist()]
    elif isinstance(input_ids, (list, tuple)):
        bad = next((t for t in input_ids if not is_int(t)), None)
        if bad is not None:
            raise ValueError(f"input_ids must be a flat list of int token ids [num_tokens], got an element {bad!r} "
                             f"of type {type(bad).__name__}")
        ids = [int(t) for t in input_ids]
    else:
        raise ValueError(f"input_ids must be a 1-D integer tensor or a list of ints, got {type(input_ids).__name__}")
    out_of_range = [t for t in ids if not 0 <= t < vocab_size]
    if out_of_range:
        raise ValueError(f"token ids must be in [0, {vocab_size}) for this model, got {out_of_range[0]} "
                         f"({len(out_of_range)} id(s) out of range)")
    return ids
