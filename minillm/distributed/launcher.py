"""Start one process per rank, hand them jobs, collect their outputs, and fail fast when one fails.

:class:`MultiprocExecutor` spawns ``world_size`` worker processes (``torch.multiprocessing``, start method
``spawn``) that join one gloo process group over loopback and load the model weights the parent saved once (memory
mapped, so the processes share one copy). Each job runs on the first ``k`` ranks (a sub-group), so one set of
processes serves 2-rank and 4-rank runs alike. Every wait in the parent has a deadline and every collective in the
workers has a timeout; the first error a worker reports (preferring the rank that failed by itself over ranks that
then lost their peer) is raised in the parent as :class:`WorkerError` with that rank's traceback.

Two kinds of job: :meth:`MultiprocExecutor.collective_rpc` runs any module-level function on the first ``k`` ranks
(tensor parallelism and disaggregated prefill in chapter 9 use it), and :meth:`ContextParallelExecutor.prefill` is
chapter 7's context-parallel prefill.

vLLM counterpart: ``MultiprocExecutor`` (``vllm/v1/executor/multiproc_executor.py``): worker processes per rank,
a message queue for work (``collective_rpc`` sends a method name and its arguments to every worker), and a monitor
that shuts everything down when a worker dies.
"""
from __future__ import annotations

import dataclasses
import importlib
import io
import math
import numbers
import os
import queue
import shutil
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any
from pathlib import Path

import torch

from minillm.config import LlamaConfig
from minillm.distributed.comm import CollectiveError
from minillm.distributed.context_parallel import STRATEGIES, RankPrefillOutput
from minillm.distributed.splits import ContextSplit, make_split
from minillm.sampling_params import is_int


class WorkerError(RuntimeError):
    """A worker rank failed; the message carries its rank and traceback."""


class ContextParallelError(WorkerError):
    """A worker rank of a context-parallel prefill failed (chapter 7's name for :class:`WorkerError`)."""


@dataclass
class WorkerContext:
    """What a function run by :meth:`MultiprocExecutor.collective_rpc` gets on its rank.

    Attributes:
        rank: this process's rank in the job (``0 ... world_size - 1``).
        world_size: ranks in the job.
        group: the ``torch.distributed`` process group of the job's ranks (gloo).
        models: name -> the models the executor was given, loaded in this process (full weights, memory-mapped).
        timeout_s: the job's timeout: every collective the function makes should wait at most this long.
    """

    rank: int
    world_size: int
    group: Any
    models: dict[str, torch.nn.Module]
    timeout_s: float


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


# ---------------------------------------------------------------------------------------------------------------
# worker side
# ---------------------------------------------------------------------------------------------------------------

def _load_model(path: str) -> torch.nn.Module:
    from minillm.loaders.gguf_loader import _load_state
    from minillm.model.llama import LlamaForCausalLM

    saved = torch.load(path, mmap=True, weights_only=True)
    config = LlamaConfig(**saved["config"])
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model.to_empty(device="cpu")
    _load_state(model, dict(saved["state"]), torch.float32)
    return model.eval()


def _to_bytes(obj) -> bytes:
    # By value: a tensor shared through a queue would need the sender alive until the receiver maps it.
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _from_bytes(data: bytes):
    return torch.load(io.BytesIO(data), weights_only=True)


# ---------------------------------------------------------------------------------------------------------------
# argument checks, in the parent, before anything reaches a worker
# ---------------------------------------------------------------------------------------------------------------

def _check_timeout(name: str, value: object) -> float:
    """``value`` as a float if it is a finite number of seconds > 0, else ValueError."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a finite number of seconds > 0, got {value!r}")
    return float(value)


def _check_input_ids(input_ids: object, vocab_size: int) -> list[int]:
    """``input_ids`` (a 1-D integer tensor or a list/tuple of ints) as a list of ints in ``[0, vocab_size)``.

    Checked here so that a bad prompt is a ValueError in the caller, not a traceback from a worker and a closed
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


def _worker_main(rank: int, world_size: int, init_file: str, model_files: dict[str, str], jobs, results,
                 start_timeout_s: float) -> None:
    """Body of one worker process: join the group, load models, serve jobs until ``None``."""
    import torch.distributed as dist

    from minillm.distributed.context_parallel import context_parallel_forward

    try:
        # Several ranks share few cores: one thread each keeps them from fighting and makes per-rank CPU time
        # meaningful.
        torch.set_num_threads(1)
        # Keep gloo on the loopback interface (a laptop's hostname may resolve to an unreachable address).
        if sys.platform.startswith("linux"):
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        elif sys.platform == "darwin":
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo0")
        # Joining waits for the slowest rank to start; each job's collectives get the job's own, shorter timeout.
        timeout = timedelta(seconds=start_timeout_s)
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size,
                                timeout=timeout)
        # One group per size k: ranks 0..k-1. new_group is collective, so every rank creates every group.
        groups = {k: dist.new_group(list(range(k)), timeout=timeout)
                  for k in range(1, world_size)}
        groups[world_size] = dist.group.WORLD
        models = {name: _load_model(path) for name, path in model_files.items()}
        results.put(("ready", rank, None))
        while True:
            job = jobs.get()
            if job is None:
                break
            if job["kind"] == "rpc":
                module, _, name = job["fn"].partition(":")
                fn = getattr(importlib.import_module(module), name)
                ctx = WorkerContext(rank, job["world_size"], groups[job["world_size"]], models, job["timeout_s"])
                out = fn(ctx, **_from_bytes(job["kwargs"]))
                results.put(("result", rank, _to_bytes(out)))
                continue
            split = make_split(job["num_tokens"], job["world_size"], job["split"])
            fail = job["fail_at_layer"] if job["fail_rank"] == rank else None
            out = context_parallel_forward(models[job["model"]], torch.tensor(job["input_ids"]), split,
                                           groups[job["world_size"]], job["strategy"], job["timeout_s"], fail,
                                           job["fail_mode"])
            results.put(("result", rank, _to_bytes(dataclasses.asdict(out))))
    except BaseException as e:  # report everything, including KeyboardInterrupt, then exit
        results.put(("error", rank, (isinstance(e, CollectiveError), traceback.format_exc())))
    finally:
        try:
            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:
            pass


# ---------------------------------------------------------------------------------------------------------------
# parent side
# ---------------------------------------------------------------------------------------------------------------

def _function_name(fn: Callable[..., Any] | str) -> str:
    """``"module:name"`` of a module-level function (what a worker imports), checked here in the parent."""
    if isinstance(fn, str):
        name = fn
    else:
        module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
        if not module or "." in qualname or "<" in qualname or module == "__main__":
            raise ValueError(f"collective_rpc needs a module-level function of an importable module (workers import "
                             f"it by name), got {fn!r}")
        name = f"{module}:{qualname}"
    module, sep, attr = name.partition(":")
    if not sep or not module or not attr:
        raise ValueError(f"a function name must look like 'package.module:function', got {name!r}")
    try:
        ok = callable(getattr(importlib.import_module(module), attr))
    except (ImportError, AttributeError):
        ok = False
    if not ok:
        raise ValueError(f"cannot import the function {name!r}")
    return name


class MultiprocExecutor:
    """``world_size`` worker processes in one gloo group that run jobs together. Use as a context manager.

    Args:
        models: name -> :class:`~minillm.model.llama.LlamaForCausalLM`; weights are saved once to a temporary file
            and memory-mapped by every worker.
        world_size: number of worker processes (the largest context-parallel group a job may use).
        timeout_s: default timeout of every collective of a job; the parent gives a job ``timeout_s`` plus a margin.
        start_timeout_s: how long the workers may take to start (import torch, join the group, load weights).

    Example::

        with MultiprocExecutor({"smollm": model}, world_size=3) as ex:
            outs = ex.collective_rpc(my_module.my_function, world_size=3, kwargs={"n": 4})  # one result per rank
    """

    error_cls: type[WorkerError] = WorkerError

    def __init__(self, models: dict[str, torch.nn.Module], world_size: int, timeout_s: float = 60.0,
                 start_timeout_s: float = 180.0) -> None:
        if not is_int(world_size) or world_size < 1:
            raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
        if not models:
            raise ValueError("give at least one model")
        self.world_size = world_size
        self.timeout_s = _check_timeout("timeout_s", timeout_s)
        start_timeout_s = _check_timeout("start_timeout_s", start_timeout_s)
        self.broken = False
        self._tmp = Path(tempfile.mkdtemp(prefix="minillm_cp_"))
        self._configs = {name: m.config for name, m in models.items()}
        files = {}
        for name, m in models.items():
            files[name] = str(self._tmp / f"{name}.pt")
            torch.save({"config": dataclasses.asdict(m.config), "state": m.state_dict()}, files[name])
        ctx = torch.multiprocessing.get_context("spawn")
        self._results = ctx.Queue()
        self._jobs = [ctx.Queue() for _ in range(world_size)]
        self._procs = [ctx.Process(target=_worker_main, daemon=True, name=f"minillm-cp-rank{r}",
                                   args=(r, world_size, str(self._tmp / "store"), files, self._jobs[r],
                                         self._results, start_timeout_s))
                       for r in range(world_size)]
        for p in self._procs:
            p.start()
        try:
            self._collect("ready", world_size, start_timeout_s)
        except BaseException:
            self.close()
            raise

    @property
    def configs(self) -> dict[str, LlamaConfig]:
        """Model name -> its :class:`~minillm.config.LlamaConfig` (what the workers loaded)."""
        return dict(self._configs)

    @property
    def alive_ranks(self) -> list[int]:
        """Ranks whose worker process is still running (empty after :meth:`close`)."""
        return [r for r, p in enumerate(self._procs) if p.is_alive()]

    def __enter__(self) -> "MultiprocExecutor":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def collective_rpc(self, fn: Callable[..., Any] | str, world_size: int | None = None,
                       kwargs: dict[str, Any] | None = None, timeout_s: float | None = None) -> list[Any]:
        """Run ``fn(ctx, **kwargs)`` on ranks ``0 ... world_size-1`` at once; return their results, by rank.

        Args:
            fn: a module-level function (or ``"module:function"``), imported by name in each worker. It gets a
                :class:`WorkerContext` (its rank, the job's group, the models, the timeout) and ``kwargs``.
            world_size: ranks to use, ``1 ... self.world_size`` (default all).
            kwargs: keyword arguments, the same for every rank: plain data (numbers, strings, lists, dicts, tensors),
                since they travel by value.
            timeout_s: the job's timeout (default: the executor's); the parent waits that long plus a margin.

        Returns:
            One result per rank: what ``fn`` returned there (plain data, as for ``kwargs``).

        Raises:
            ValueError: a bad argument, checked here before anything is sent (the executor stays usable).
            WorkerError: a rank failed (its traceback is in the message); the executor is then closed.
        """
        if self.broken:
            raise self.error_cls("this executor was closed after an error; start a new one")
        world_size = self._check_world_size(world_size)
        timeout_s = self.timeout_s if timeout_s is None else _check_timeout("timeout_s", timeout_s)
        job = {"kind": "rpc", "fn": _function_name(fn), "kwargs": _to_bytes(dict(kwargs or {})),
               "world_size": world_size, "timeout_s": timeout_s}
        outs = self._run(job, world_size, timeout_s)
        return [_from_bytes(outs[r]) for r in range(world_size)]

    def _check_world_size(self, world_size: Any) -> int:
        world_size = self.world_size if world_size is None else world_size
        if not is_int(world_size) or not 1 <= world_size <= self.world_size:
            raise ValueError(f"world_size must be an int in [1, {self.world_size}], got {world_size!r}")
        return int(world_size)

    def _run(self, job: dict[str, Any], world_size: int, timeout_s: float) -> dict[int, Any]:
        """Send ``job`` to ranks ``0 ... world_size-1`` and collect one result from each."""
        try:
            for r in range(world_size):
                self._jobs[r].put(job)
            return self._collect("result", world_size, timeout_s + 30.0)
        except BaseException:
            # Interrupted (or failed) half-way: the workers may still be in the job; nothing can be reused.
            self.close(graceful=False)
            raise

    def _collect(self, kind: str, count: int, deadline_s: float) -> dict[int, object]:
        """Wait for ``count`` messages of ``kind``; on any error or dead worker, shut down and raise."""
        got: dict[int, object] = {}
        end = time.monotonic() + deadline_s
        while len(got) < count:
            try:
                msg_kind, rank, payload = self._results.get(timeout=0.2)
            except queue.Empty:
                dead = [(r, p.exitcode) for r, p in enumerate(self._procs) if p.exitcode is not None]
                if dead:
                    self._fail(None, f"worker rank {dead[0][0]} exited with code {dead[0][1]} without reporting an "
                                     f"error")
                if time.monotonic() > end:
                    self._fail(None, f"no {kind!r} from ranks {sorted(set(range(count)) - set(got))} within "
                                     f"{deadline_s:.0f} s")
                continue
            if msg_kind == "error":
                self._fail((rank, payload), "")
            got[rank] = payload
        return got

    def _fail(self, first_error: tuple[int, tuple[bool, str]] | None, message: str) -> None:
        errors = [first_error] if first_error else []
        # Wait briefly for the other reports: the rank that failed by itself may report after ranks that only
        # lost their peer, and its error is the one worth showing.
        grace_end = time.monotonic() + 3.0
        while time.monotonic() < grace_end and not any(not comm for _, (comm, _) in errors):
            try:
                kind, rank, payload = self._results.get(timeout=0.1)
            except queue.Empty:
                continue
            if kind == "error":
                errors.append((rank, payload))
        reported = {r for r, _ in errors}
        silent = [(r, p.exitcode) for r, p in enumerate(self._procs)
                  if p.exitcode not in (None, 0) and r not in reported]
        if silent and not message:
            message = f"worker rank {silent[0][0]} exited with code {silent[0][1]} without reporting an error"
        self.close(graceful=False)
        root = next((e for e in errors if not e[1][0]), None)  # a rank that failed by itself
        if root is None and not message and errors:
            root = errors[0]  # only communication errors: show the first
        if root is not None:
            rank, (_, tb) = root
            others = sorted({r for r, _ in errors} - {rank})
            also = f" (ranks {others} then failed too)" if others else ""
            raise self.error_cls(f"rank {rank} failed{also}:\n{tb}")
        if errors:  # a worker died or the deadline passed; the others only saw their peer vanish
            message += f" (ranks {sorted(r for r, _ in errors)} then reported communication errors)"
        raise self.error_cls(message)

    def close(self, graceful: bool = True) -> None:
        """Stop the workers (asking them to leave the group, then by force) and delete the temporary weights.

        ``graceful=False`` (after an error): terminate at once; ranks stuck waiting on a dead peer need not wait out
        their timeout.
        """
        self.broken = True
        for q, p in zip(self._jobs, self._procs):
            if graceful and p.is_alive():
                try:
                    q.put(None)
                except Exception:
                    pass
        end = time.monotonic() + (3.0 if graceful else 0.0)
        for p in self._procs:
            p.join(timeout=max(0.0, end - time.monotonic()))
        for p in self._procs:
            if p.is_alive():
                p.terminate()
                p.join(timeout=5.0)
            if p.is_alive():
                p.kill()
                p.join(timeout=5.0)
        shutil.rmtree(self._tmp, ignore_errors=True)


class ContextParallelExecutor(MultiprocExecutor):
    """``world_size`` worker processes that prefill prompts together (chapter 7). Use as a context manager.

    Takes :class:`MultiprocExecutor`'s arguments.

    Example::

        with ContextParallelExecutor({"smollm": model}, world_size=4) as cp:
            result = cp.prefill("smollm", input_ids, strategy="ring", split="zigzag")
            next_token = int(result.logits.argmax())
    """

    error_cls = ContextParallelError

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
        if self.broken:
            raise ContextParallelError("this executor was closed after an error; start a new one")
        # Every check happens here, in the parent: a bad argument that reached the workers would fail there, come
        # back as a worker traceback and close the executor for good.
        world_size = self._check_world_size(world_size)
        if model not in self._configs:
            raise ValueError(f"unknown model {model!r}; have {sorted(self._configs)}")
        config = self._configs[model]
        if strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
        timeout_s = self.timeout_s if timeout_s is None else _check_timeout("timeout_s", timeout_s)
        if fail_rank is not None and (not is_int(fail_rank) or not 0 <= fail_rank < world_size):
            raise ValueError(f"fail_rank must be None or an int in [0, {world_size}), got {fail_rank!r}")
        if not is_int(fail_at_layer) or not 0 <= fail_at_layer < config.num_hidden_layers:
            raise ValueError(f"fail_at_layer must be an int in [0, {config.num_hidden_layers}), got "
                             f"{fail_at_layer!r}")
        if fail_mode not in ("raise", "hang"):
            raise ValueError(f"fail_mode must be 'raise' or 'hang', got {fail_mode!r}")
        ids = _check_input_ids(input_ids, config.vocab_size)
        the_split = make_split(len(ids), world_size, split)  # the split kind, and enough tokens for its pieces
        job = {"kind": "prefill", "model": model, "input_ids": ids, "num_tokens": len(ids), "world_size": int(world_size),
               "strategy": strategy, "split": split, "timeout_s": timeout_s,
               "fail_rank": None if fail_rank is None else int(fail_rank), "fail_at_layer": int(fail_at_layer),
               "fail_mode": fail_mode}
        t0 = time.perf_counter()
        outs = self._run(job, world_size, timeout_s)
        wall = time.perf_counter() - t0
        ranks = [RankPrefillOutput(**_from_bytes(outs[r])) for r in range(world_size)]
        return ContextParallelResult(the_split, strategy, ranks, wall)
