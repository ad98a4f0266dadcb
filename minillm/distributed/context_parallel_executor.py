"""Chapter 7's executor: one process per rank, each prefilling its share of one prompt at the same time.

:class:`ContextParallelExecutor` is a :class:`~minillm.distributed.jobs.JobExecutor` (the engine's
:class:`~minillm.executor.multiproc_executor.MultiprocExecutor` with full models on every rank) with one job:
:meth:`~ContextParallelExecutor.prefill` runs :func:`~minillm.distributed.context_parallel.context_parallel_forward`
on the first ``k`` ranks and puts their outputs back in position order (:class:`ContextParallelResult`).

vLLM counterpart: ``vllm/v1/executor/multiproc_executor.py:MultiprocExecutor`` runs every worker's step; with
``prefill_context_parallel_size`` (``vllm/config/parallel.py:ParallelConfig``) the workers' model runners split each
prefill among the ranks of ``get_pcp_group()``.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from minillm.distributed.context_parallel import STRATEGIES, RankPrefillOutput, context_parallel_forward
from minillm.distributed.jobs import JobExecutor, WorkerContext, check_input_ids
from minillm.distributed.splits import ContextSplit, make_split
from minillm.executor.multiproc_executor import WorkerError
from minillm.sampling_params import is_int

if TYPE_CHECKING:
    from minillm.model.llama import LlamaForCausalLM


class ContextParallelError(WorkerError):
    """A worker rank of a context-parallel prefill failed (chapter 7's name for
    :class:`~minillm.executor.multiproc_executor.WorkerError`)."""


@dataclass
class ContextParallelResult:
    """The outputs of every rank of one context-parallel prefill, put back in position order.

    Attributes:
        split: who held which positions.
        strategy: ``"allgather"`` or ``"ring"``.
        ranks: one :class:`~minillm.distributed.context_parallel.RankPrefillOutput` per rank, by rank.
        wall_s: wall time of the job seen from the parent (sending the job to the last output received).
    """

    split: ContextSplit
    strategy: str
    ranks: list[RankPrefillOutput]
    wall_s: float

    @property
    def logits(self) -> torch.Tensor:
        """``[vocab]`` next-token logits, from the rank holding the last position."""
        out = self.ranks[self.split.last_token_rank].logits
        assert out is not None
        return out

    def hidden_states(self) -> torch.Tensor:
        """``[num_tokens, hidden]`` final hidden states of every position, gathered from the ranks."""
        return self._assemble([r.hidden_states for r in self.ranks], dim=0)

    def last_layer_kv(self) -> torch.Tensor:
        """``[2, num_tokens, num_kv_heads, head_dim]``: the last layer's K and V of every position (the shards of
        the KV cache that the ranks keep), in position order."""
        return self._assemble([r.last_layer_kv for r in self.ranks], dim=1)

    def _assemble(self, parts: list[torch.Tensor], dim: int) -> torch.Tensor:
        shape = list(parts[0].shape)
        shape[dim] = self.split.num_tokens
        full = parts[0].new_empty(shape)
        for r, part in enumerate(parts):
            full.index_copy_(dim, self.split.positions(r), part)
        return full


def prefill_job(ctx: WorkerContext, model: str, input_ids: list[int], split: str, strategy: str,
                fail_rank: int | None, fail_at_layer: int, fail_mode: str) -> RankPrefillOutput:
    """One rank's job (module-level, so each rank imports it by name): its share of the prefill."""
    the_split = make_split(len(input_ids), ctx.world_size, split)
    fail = fail_at_layer if fail_rank == ctx.rank else None
    return context_parallel_forward(ctx.models[model], torch.tensor(input_ids), the_split, ctx.group, strategy,
                                    ctx.timeout_s, fail, fail_mode)


class ContextParallelExecutor(JobExecutor):
    """``world_size`` worker processes that prefill prompts together (chapter 7). Use as a context manager.

    Takes :class:`~minillm.distributed.jobs.JobExecutor`'s arguments.

    Example::

        with ContextParallelExecutor({"smollm": model}, world_size=4) as cp:
            result = cp.prefill("smollm", input_ids, strategy="ring", split="zigzag")
            next_token = int(result.logits.argmax())
    """

    def __init__(self, models: dict[str, LlamaForCausalLM], world_size: int, timeout_s: float = 60.0,
                 start_timeout_s: float = 180.0) -> None:
        super().__init__(models, world_size, timeout_s, start_timeout_s, error_cls=ContextParallelError)

    def prefill(self, model: str, input_ids: torch.Tensor | list[int], world_size: int | None = None,
                strategy: str = "allgather", split: str = "plain", timeout_s: float | None = None,
                fail_rank: int | None = None, fail_at_layer: int = 0, fail_mode: str = "raise"
                ) -> ContextParallelResult:
        """Prefill ``input_ids`` on ranks ``0 ... world_size-1``.

        Args:
            model: a name given to the constructor.
            input_ids: ``[num_tokens]`` prompt ids.
            world_size: ranks to use, ``1 ... self.world_size`` (default all).
            strategy: ``"allgather"`` or ``"ring"``.
            split: ``"plain"`` or ``"zigzag"``.
            timeout_s: timeout of every collective of this job (default: the executor's).
            fail_rank, fail_at_layer, fail_mode: for tests, make that rank raise (``"raise"``) or stall (``"hang"``)
                at that layer (``fail_rank`` in ``[0, world_size)`` or ``None``, ``fail_at_layer`` in ``[0,
                num_layers)``).

        Raises:
            ValueError: a bad argument (unknown model or strategy or split, ids that are not a 1-D list of ids in
                ``[0, vocab_size)``, fewer tokens than the split has pieces, a bad ``world_size``, ``timeout_s`` or
                fault setting). Checked here before anything is sent, so the executor stays usable.
            ContextParallelError: a rank failed (its traceback is in the message); the executor is then closed.
        """
        self.check_health()
        # Every check happens here, in the parent: a bad argument that reached the workers would fail there, come
        # back as a worker traceback and end the executor for good.
        world_size = self.check_world_size(world_size)
        if model not in self._configs:
            raise ValueError(f"unknown model {model!r}; have {sorted(self._configs)}")
        config = self._configs[model]
        if strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
        if fail_rank is not None and (not is_int(fail_rank) or not 0 <= fail_rank < world_size):
            raise ValueError(f"fail_rank must be None or an int in [0, {world_size}), got {fail_rank!r}")
        if not is_int(fail_at_layer) or not 0 <= fail_at_layer < config.num_hidden_layers:
            raise ValueError(f"fail_at_layer must be an int in [0, {config.num_hidden_layers}), got "
                             f"{fail_at_layer!r}")
        if fail_mode not in ("raise", "hang"):
            raise ValueError(f"fail_mode must be 'raise' or 'hang', got {fail_mode!r}")
        ids = check_input_ids(input_ids, config.vocab_size)
        the_split = make_split(len(ids), world_size, split)  # the split kind, and enough tokens for its pieces
        t0 = time.perf_counter()
        ranks = self.run_job(prefill_job, world_size, timeout_s=timeout_s, kwargs=dict(
            model=model, input_ids=ids, split=split, strategy=strategy,
            fail_rank=None if fail_rank is None else int(fail_rank), fail_at_layer=int(fail_at_layer),
            fail_mode=fail_mode))
        return ContextParallelResult(the_split, strategy, ranks, time.perf_counter() - t0)
