"""Executors: how the engine core runs a step on its worker(s).

:class:`~minillm.executor.abstract.Executor` is the interface the engine core calls;
:class:`~minillm.executor.uniproc_executor.UniProcExecutor` runs one worker in the engine core's own process,
on a thread of its own when asked not to block (async scheduling: on a CPU the step must leave the caller's thread
to overlap, where a GPU runner only launches kernels and returns);
:class:`~minillm.executor.multiproc_executor.MultiprocExecutor` runs one worker process per tensor-parallel rank
(``distributed_executor_backend="mp"``: also one rank, vLLM v0.33.0's layout on a CPU).

vLLM counterpart: ``vllm/v1/executor/`` (``abstract.py``, ``uniproc_executor.py``, ``multiproc_executor.py``).
"""
from minillm.executor.abstract import Executor
from minillm.executor.multiproc_executor import MultiprocExecutor
from minillm.executor.uniproc_executor import UniProcExecutor

__all__ = ["Executor", "MultiprocExecutor", "UniProcExecutor"]
