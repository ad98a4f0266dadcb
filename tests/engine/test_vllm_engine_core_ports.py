"""vLLM's ``tests/v1/engine/test_engine_core.py``, ported to minillm's :class:`EngineCore` on the tiny random model.

* ``test_engine_core``: the request life cycle, and v0.33.0's idle step. Finished (or aborted) requests count in
  ``Scheduler.has_requests`` (``has_finished_requests``: their ids are not sent yet), so after the last one
  ``EngineCore.step`` plans once more: a plan of 0 tokens that carries the finished ids to the runner, counts as no
  model step and returns no output. minillm's runner has already dropped them then (the engine core tells it at once
  when no step is in flight, so a loop that stops on ``has_requests()`` leaves nothing behind); the idle step empties
  ``scheduler.finished_req_ids``.
* ``test_engine_core_invalid_request_id_type``: a request id that is not a string is a ``TypeError`` with v0.33.0's
  message, in the core and through the in-process client, and leaves nothing behind.
"""
from __future__ import annotations

import time
import uuid

import pytest

from minillm.engine import EngineCoreRequest
from minillm.engine.arg_utils import EngineArgs
from minillm.engine.core import EngineCore
from minillm.engine.llm_engine import LLMEngine
from minillm.request import Request
from minillm.sampling_params import SamplingParams
from tests.engine_helpers import single_thread, tiny_model  # noqa: F401 (fixture)
from tests.engine.reject_recompute_connector import RejectRecomputeConnector

pytestmark = pytest.mark.usefixtures("single_thread")

PROMPT_TOKENS = [(13 * j + 5) % 211 for j in range(12)]  # vLLM's test prompt has 12 tokens too
ARGS = dict(block_size=4, num_gpu_blocks=64, max_model_len=64, max_num_batched_tokens=64)


FRESH = object()


def make_request(request_id: object = FRESH, max_tokens: int = 6) -> EngineCoreRequest:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return EngineCoreRequest(str(uuid.uuid4()) if request_id is FRESH else request_id, PROMPT_TOKENS, params, None,
                             time.time())


def assert_no_request_state(core: EngineCore) -> None:
    assert not core.model_runner.requests and not core.model_runner.req_states.req_id_to_index
    assert core.get_num_free_blocks() == core.num_gpu_blocks - 1


def step_while_work(core: EngineCore, limit: int = 200) -> list[int]:
    """``core.step()`` while ``core.has_requests()`` (at most ``limit`` times); the tokens that came back."""
    tokens = []
    for _ in range(limit):
        if not core.has_requests():
            return tokens
        outputs, _ = core.step()
        tokens += [t for o in outputs.outputs for t in o.new_token_ids]
    raise AssertionError(f"still work after {limit} steps")


def step_until_no_outputs(core: EngineCore) -> int:
    """vLLM's ``while (outs := engine_core.step()[0].get(0)) and outs.outputs: pass``; the number of steps."""
    n = 0
    while (outs := core.step()[0]) is not None and outs.outputs:
        n += 1
        assert n < 100, "no progress"
    return n + 1


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_engine_core(async_scheduling):
    """Port of vLLM's ``tests/v1/engine/test_engine_core.py::test_engine_core`` (``step()`` called by hand, as
    there; with async scheduling too, whose ``step`` is the synchronous one), with the idle step's bookkeeping
    checked after each last request: no finished id left to send, no runner state, no model step counted."""
    core = EngineCore(tiny_model(), EngineArgs(**ARGS), async_scheduling=async_scheduling)
    sched = core.scheduler

    # Test basic request lifecycle.
    core.add_request(make_request())
    assert (len(sched.waiting), len(sched.running)) == (1, 0)
    core.step()
    assert (len(sched.waiting), len(sched.running)) == (0, 1)
    core.add_request(make_request())
    assert (len(sched.waiting), len(sched.running)) == (1, 1)
    core.step()
    assert (len(sched.waiting), len(sched.running)) == (0, 2)
    core.add_request(make_request())
    core.add_request(make_request())
    assert (len(sched.waiting), len(sched.running)) == (2, 2)
    core.step()
    assert (len(sched.waiting), len(sched.running)) == (0, 4)

    # Loop through until they are all done: the last step() is the idle one.
    steps_before = core.stats.num_steps
    n = step_until_no_outputs(core)
    assert (len(sched.waiting), len(sched.running)) == (0, 0)
    assert core.stats.num_steps == steps_before + n - 1, "the idle step is no model step"
    assert not sched.finished_req_ids and not sched.has_requests() and not core.has_requests()
    assert_no_request_state(core)
    assert core.step() == (None, False), "then nothing is left to do"

    # Test abort cycle. Basic abort.
    req = make_request()
    core.add_request(req)
    assert (len(sched.waiting), len(sched.running)) == (1, 0)
    assert sched.has_unfinished_requests() and not sched.has_finished_requests()
    core.step()
    assert (len(sched.waiting), len(sched.running)) == (0, 1)
    assert sched.has_unfinished_requests() and not sched.has_finished_requests()
    core.abort_requests([req.request_id])
    assert (len(sched.waiting), len(sched.running)) == (0, 0)
    assert not sched.has_unfinished_requests() and sched.has_finished_requests()
    assert not core.has_requests(), "nothing to step for: the runner dropped it already"
    assert_no_request_state(core)
    steps_before = core.stats.num_steps
    outputs, model_executed = core.step()
    assert not sched.has_unfinished_requests() and not sched.has_finished_requests()
    assert outputs is not None and outputs.outputs == [] and not model_executed
    assert core.stats.num_steps == steps_before and core.last_scheduler_output.finished_req_ids == {req.request_id}
    assert core.last_scheduler_output.total_num_scheduled_tokens == 0

    # Add, step, abort 1 of the 3.
    req0, req1, req2 = make_request(), make_request(), make_request()
    core.add_request(req0)
    core.add_request(req1)
    assert (len(sched.waiting), len(sched.running)) == (2, 0)
    core.step()
    assert (len(sched.waiting), len(sched.running)) == (0, 2)
    core.add_request(req2)
    assert (len(sched.waiting), len(sched.running)) == (1, 2)
    core.step()
    assert (len(sched.waiting), len(sched.running)) == (0, 3)
    # Abort just one.
    core.abort_requests([req1.request_id])
    assert (len(sched.waiting), len(sched.running)) == (0, 2)
    core.step()
    assert (len(sched.waiting), len(sched.running)) == (0, 2)
    # Abort the other requests at the same time.
    core.abort_requests([req2.request_id, req0.request_id])
    assert (len(sched.waiting), len(sched.running)) == (0, 0)
    assert_no_request_state(core)

    # Sending duplicate requests with same request_id.
    req0, req1 = make_request("test"), make_request("test")
    core.add_request(req0)
    step_until_no_outputs(core)
    core.add_request(req1)
    step_until_no_outputs(core)
    assert (len(sched.waiting), len(sched.running)) == (0, 0)
    assert not sched.finished_req_ids and not sched.requests
    assert_no_request_state(core)


def test_the_idle_step_after_an_abort_with_a_step_in_flight():
    """Async scheduling, a request aborted while the batch queue holds a step for it: the runner cannot drop it
    then (that step still runs). Turns go on until nothing is in flight; the update of the last step tells the
    runner, and a ``step_with_batch_queue`` turn after that is the idle step that sends the id."""
    core = EngineCore(tiny_model(), EngineArgs(**ARGS), async_scheduling=True)
    req = make_request(max_tokens=20)
    core.add_request(req)
    for _ in range(20):
        if core.batch_queue and core.scheduler.requests[req.request_id].num_output_tokens:
            break
        core.step_with_batch_queue()
    core.abort_requests([req.request_id])
    assert core.batch_queue and core.model_runner.requests, "the step in flight still reads its state"
    for _ in range(5):
        if not core.has_requests():
            break
        outputs, _ = core.step_with_batch_queue()
        assert outputs is None or outputs.outputs == [], "no output for an aborted request"
    assert_no_request_state(core)
    assert core.scheduler.finished_req_ids == {req.request_id}
    outputs, model_executed = core.step_with_batch_queue()
    assert outputs.outputs == [] and not model_executed and not core.scheduler.has_requests()


def test_the_idle_step_reaches_a_kv_connectors_worker_side():
    """With a KV connector the idle step runs the connector's worker side like any other (it is told the finished
    ids in ``get_finished``), over a plan of 0 tokens (vLLM's runner: ``kv_connector_no_forward``). The connector
    rejects the load it promised, so the request recomputes first."""
    config = {"kv_connector": "RejectRecomputeConnector", "kv_role": "kv_both",
              "kv_connector_module_path": "tests.engine.reject_recompute_connector"}
    core = EngineCore(tiny_model(), EngineArgs(**ARGS, kv_transfer_config=config))
    worker = core.kv_connector_worker
    assert isinstance(worker, RejectRecomputeConnector)
    told: list[set[str]] = []
    get_finished = worker.get_finished
    worker.get_finished = lambda ids: (told.append(set(ids)), get_finished(ids))[1]
    req = make_request(max_tokens=3)
    core.add_request(req)
    step_while_work(core)
    assert worker.stats["rejected_loads"] == 1 and core.scheduler.finished_req_ids == {req.request_id}
    assert req.request_id not in set().union(*told)
    outputs, model_executed = core.step()
    assert outputs.outputs == [] and not model_executed
    assert told[-1] == {req.request_id} and not core.scheduler.finished_req_ids
    assert_no_request_state(core)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_the_idle_step_over_tensor_parallel_ranks():
    """The plan of 0 tokens goes to every rank of a tensor-parallel executor like any other: each rank's runner drops
    the finished ids and returns before the forward pass (no collective, so no rank waits for another), and the
    engine serves the next request."""
    core = EngineCore(tiny_model(), EngineArgs(**ARGS, tensor_parallel_size=2))
    try:
        req = make_request(max_tokens=3)
        core.add_request(req)
        step_while_work(core)
        outputs, model_executed = core.step()
        assert outputs.outputs == [] and not model_executed and not core.scheduler.has_requests()
        core.add_request(make_request("after", max_tokens=3))
        tokens = step_while_work(core)
        assert len(tokens) == 3 and core.get_num_free_blocks() == core.num_gpu_blocks - 1
    finally:
        core.shutdown()


@pytest.mark.parametrize("bad_id, type_name", [(uuid.uuid4(), "UUID"), (12345, "int"), (None, "NoneType")],
                         ids=["UUID", "int", "None"])
def test_engine_core_invalid_request_id_type(bad_id, type_name):
    """Port of vLLM's ``tests/v1/engine/test_engine_core.py::test_engine_core_invalid_request_id_type``: a UUID, an
    int or None as the id is refused with v0.33.0's ``TypeError("request_id must be a string, got <class ...>")``,
    as an ``EngineCoreRequest`` and as a scheduler ``Request``; nothing is queued or counted, and the engine still
    takes a valid request."""
    core = EngineCore(tiny_model(), EngineArgs(**ARGS))
    for request in (make_request(bad_id), Request(bad_id, PROMPT_TOKENS, SamplingParams(max_tokens=2))):
        with pytest.raises(TypeError, match=f"^request_id must be a string, got <class '.*{type_name}'>$"):
            core.add_request(request)
    assert not core.scheduler.requests and core.stats.num_requests == 0
    # Verify engine is still functional after errors.
    core.add_request(make_request())
    assert (len(core.scheduler.waiting), len(core.scheduler.running)) == (1, 0)
    step_until_no_outputs(core)
    assert_no_request_state(core)


def test_a_non_string_id_through_the_in_process_client_leaves_nothing_behind():
    """``LLMEngine.add_request`` refuses a non-string id itself when it builds the request (a ``ValueError``); an
    ``EngineCoreRequest`` built elsewhere reaches the core, whose ``TypeError`` the caller gets, and the output
    processor forgets the request again."""
    engine = LLMEngine(tiny_model(), None, EngineArgs(**ARGS))
    with pytest.raises(ValueError, match="request_id must be a non-empty string, got 12345"):
        engine.add_request(12345, PROMPT_TOKENS, SamplingParams(max_tokens=2))
    with pytest.raises(TypeError, match="request_id must be a string, got <class 'int'>"):
        engine.add_request(12345, make_request(12345))
    assert not engine.output_processor.request_states and not engine.has_requests()
    engine.add_request("ok", make_request("ok", max_tokens=3))
    finished = [o for _ in range(20) for o in engine.step() if o.finished]
    assert [o.request_id for o in finished] == ["ok"] and len(finished[0].outputs[0].token_ids) == 3


@pytest.mark.timeout(120)
def test_a_non_string_id_through_the_engine_core_process_is_refused_before_it_is_sent():
    """The engine core in its own process: an ``EngineCoreRequest`` with an int id must be refused in the caller
    (it cannot cross as an ``EngineCoreRequest``), and the core must still answer afterwards."""
    engine = LLMEngine(tiny_model(), None, EngineArgs(**ARGS), multiprocess_mode=True)
    try:
        with pytest.raises(TypeError, match="request_id must be a string"):
            engine.add_request(12345, make_request(12345))
        assert engine.engine_core.call_utility("ping", timeout=10) == "pong"
    finally:
        engine.shutdown()
