"""Disaggregated prefill: one engine prefills, another decodes, and a KV connector carries the prompt's K/V across.

The prefill engine runs each request with ``max_tokens=1`` and hands its K/V off; the decode engine gets the same
request id and prompt, counts the transferred tokens as computed and computes only the last prompt token. Greedy
outputs equal one engine's. :func:`run_requests` drives one engine until its requests *and* its transfers are done;
:func:`prefill_then_decode` runs the pair in one process (files are the hand-off); :func:`disaggregated_worker`
runs it in two (rank 0 prefills and sends, rank 1 receives and decodes).

vLLM counterpart: a router in front of a prefill instance (``kv_role="kv_producer"``) and a decode instance
(``"kv_consumer"``) does the same with two servers (vLLM's ``disaggregated_serving`` examples).
"""
from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from minillm.distributed.kv_transfer.torch_distributed_connector import TorchDistributedConnector
from minillm.engine.arg_utils import EngineArgs
from minillm.engine.llm_engine import LLMEngine
from minillm.sampling_params import SamplingParams


def run_requests(engine: LLMEngine, requests: Sequence[tuple[str, Sequence[int] | str, SamplingParams]],
                 trace: list[dict[str, Any]] | None = None, idle_sleep_s: float = 0.001,
                 timeout_s: float = 600.0) -> dict[str, list[int]]:
    """Add ``requests`` (``(request_id, prompt, params)``) and step until nothing is left, transfers included.

    Args:
        trace: if a list, one record per step is appended: ``{"step", "num_scheduled_tokens": {rid: n} (of the
            latest step that ran),
            "num_computed_tokens": {rid: n} (after the step, for the requests still in the scheduler), "waiting",
            "running", "pending_sends", "free_blocks"}``.
        idle_sleep_s: pause after a step that computed nothing (waiting for K/V to arrive or a send to finish).
        timeout_s: give up (RuntimeError) after this long.

    Returns:
        request id -> its output token ids.
    """
    for rid, prompt, params in requests:
        engine.add_request(rid, prompt, params)
    outputs: dict[str, list[int]] = {}
    end = time.monotonic() + timeout_s
    step = 0
    while engine.has_requests():
        if time.monotonic() > end:
            raise RuntimeError(f"requests still unfinished after {timeout_s} s: "
                               f"{sorted(engine.scheduler.requests)}")
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = list(out.outputs[0].token_ids)
        sched = engine.scheduler
        if trace is not None:
            so = engine.last_scheduler_output
            trace.append({"step": step,
                          "num_scheduled_tokens": dict(so.num_scheduled_tokens) if so is not None else {},
                          "num_computed_tokens": {rid: r.num_computed_tokens for rid, r in sched.requests.items()},
                          "waiting": len(sched.waiting), "running": len(sched.running),
                          "pending_sends": sorted(sched.pending_kv_sends), "free_blocks": engine.get_num_free_blocks()})
        if not sched.running and sched.has_requests():
            time.sleep(idle_sleep_s)
        step += 1
    return outputs


def prefill_then_decode(prefill_engine: LLMEngine, decode_engine: LLMEngine,
                        prompts: Sequence[Sequence[int] | str], params: SamplingParams,
                        request_ids: Sequence[str] | None = None) -> dict[str, list[int]]:
    """Prefill every prompt on ``prefill_engine`` (``max_tokens=1``), then decode them on ``decode_engine``.

    Both engines need a connector that keeps the K/V after the prefill engine is done with it (the shared-storage
    connector does). Returns request id -> the decode engine's output tokens (the prefill engine's one token is the
    same as the decode engine's first, and is not returned).
    """
    ids = list(request_ids) if request_ids is not None else [f"req-{i}" for i in range(len(prompts))]
    run_requests(prefill_engine, [(rid, p, params.clone(max_tokens=1, min_tokens=0))
                                  for rid, p in zip(ids, prompts, strict=False)])
    return run_requests(decode_engine, [(rid, p, params) for rid, p in zip(ids, prompts, strict=False)])


def disaggregated_worker(ctx: Any, model: str, prompts: list[list[int]], max_tokens: int,
                         engine_kwargs: dict[str, Any] | None = None, connector: str = "TorchDistributedConnector",
                         connector_module_path: str | None = None, producer_extra: dict[str, Any] | None = None,
                         transfer_timeout_s: float | None = None) -> dict[str, Any]:
    """One rank of a prefill/decode pair over ``torch.distributed`` (run it with ``run_job(...,
    world_size=2)``): rank 0 prefills and sends, rank 1 receives and decodes, at the same time.

    Args:
        ctx: the :class:`~minillm.distributed.jobs.WorkerContext`.
        model: the name of the model the executor was given.
        prompts: token ids; request ``i`` is ``"req-{i}"`` on both ranks.
        max_tokens: greedy tokens to generate per request.
        engine_kwargs: :class:`~minillm.engine.arg_utils.EngineArgs` fields for both engines (block size, budget...).
        connector / connector_module_path: the connector class (and its module, for a connector outside minillm,
            e.g. a test's faulty one) both ranks use.
        producer_extra: extra ``kv_connector_extra_config`` for rank 0 only.
        transfer_timeout_s: how long the decode engine waits for a request's K/V before prefilling it itself, and the
            prefill engine for a send to complete (default: the job's timeout).

    Returns:
        per rank: ``{"role", "outputs" (rank 1: request id -> tokens), "stats" (the engine's counters),
        "connector_stats", "bytes_sent"/"bytes_received", "free_blocks", "num_blocks", "trace" (see
        :func:`run_requests`), "wall_s"}``.
    """
    if ctx.world_size != 2:
        raise ValueError(f"a prefill/decode pair runs on 2 ranks, got world_size={ctx.world_size}")
    producer = ctx.rank == 0
    extra = {"peer_rank": 1 - ctx.rank, "group": ctx.group,
             "timeout_s": ctx.timeout_s if transfer_timeout_s is None else transfer_timeout_s}
    if producer:
        extra.update(producer_extra or {})
    kv_config = {"kv_connector": connector, "kv_role": "kv_producer" if producer else "kv_consumer",
                 "kv_connector_extra_config": extra, "kv_connector_module_path": connector_module_path}
    engine = LLMEngine(ctx.models[model], None, EngineArgs(**(engine_kwargs or {}), kv_transfer_config=kv_config))
    params = SamplingParams(max_tokens=1 if producer else max_tokens, temperature=0.0, ignore_eos=False)
    trace: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    outputs = run_requests(engine, [(f"req-{i}", p, params) for i, p in enumerate(prompts)], trace,
                           timeout_s=ctx.timeout_s)
    engine.shutdown()
    worker = engine.kv_connector_worker
    if not isinstance(worker, TorchDistributedConnector):  # the counters below are that connector's
        raise TypeError(f"the prefill/decode pair reads a TorchDistributedConnector's byte counters; the connector "
                        f"{connector!r} is a {type(worker).__name__}")
    stats = engine.stats
    return {"role": "prefill" if producer else "decode", "outputs": outputs if not producer else {},
            "stats": {k: getattr(stats, k) for k in stats.__struct_fields__},
            "connector_stats": dict(worker.stats), "bytes_sent": worker.bytes_sent,
            "bytes_received": worker.bytes_received, "free_blocks": engine.get_num_free_blocks(),
            "num_blocks": engine.num_gpu_blocks, "trace": trace, "wall_s": time.perf_counter() - t0}
