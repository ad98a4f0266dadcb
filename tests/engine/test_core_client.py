"""The engine core's clients are one interface: the same handshake, the same utility results, one path per job.

``InprocClient`` (the core in this process) and ``SyncMPClient`` (the core in its own process, its answers crossing
as msgpack) must give the same types: the handshake is an ``EngineCoreReady`` whose ``model_config`` is a
``LlamaConfig``, ``call_utility("get_stats")`` a ``SchedulerStats`` (not the map it travels as), ``take_timeline`` a
list of tuples. ``LLMEngine`` reads every fact from its client, in either mode, and keeps no second path of its own.
"""
from __future__ import annotations

import typing

import msgspec
import pytest

from minillm.config import LlamaConfig
from minillm.engine import EngineCoreReady, EngineStats, SchedulerStats
from minillm.engine.arg_utils import EngineArgs
from minillm.engine.core_client import InprocClient, SyncMPClient, utility_result_type
from minillm.engine.llm_engine import LLMEngine
from minillm.executor.abstract import Executor
from minillm.sampling_params import SamplingParams
from minillm.serial_utils import MsgpackDecoder, MsgpackEncoder
from tests.engine_helpers import single_thread, tiny_model  # noqa: F401 (fixture)

pytestmark = pytest.mark.usefixtures("single_thread")
ARGS = dict(block_size=4, num_gpu_blocks=48, max_model_len=64, device="cpu")


@pytest.fixture(scope="module")
def engines():
    """The same model and arguments, the core in this process and in its own."""
    model = tiny_model()
    inproc = LLMEngine(model, None, EngineArgs(**ARGS))
    mp = LLMEngine(model, None, EngineArgs(**ARGS), multiprocess_mode=True)
    yield {"in-process": inproc, "engine-core process": mp}
    mp.shutdown()
    inproc.shutdown()


def _serve(engine: LLMEngine) -> list[int]:
    engine.add_request("r", list(range(1, 10)), SamplingParams.greedy(max_tokens=5))
    tokens: list[int] = []
    while engine.has_requests():
        tokens = next((o.outputs[0].token_ids for o in engine.step() if o.finished), tokens)
    return tokens


def test_the_handshake_is_the_same_typed_message_in_both_modes(engines):
    inproc, mp = engines["in-process"].engine_core, engines["engine-core process"].engine_core
    assert isinstance(inproc, InprocClient) and isinstance(mp, SyncMPClient)
    keys = set(typing.get_type_hints(EngineCoreReady))
    for client in (inproc, mp):
        assert set(client.ready) == keys
        assert isinstance(client.ready["model_config"], LlamaConfig)
    assert mp.ready["pid"] == mp.proc.pid != inproc.ready["pid"]
    assert {k: v for k, v in mp.ready.items() if k != "pid"} == {k: v for k, v in inproc.ready.items() if k != "pid"}
    for engine in engines.values():  # the front end's facts come from it, in either mode
        assert engine.num_gpu_blocks == engine.engine_core.ready["num_gpu_blocks"] == 48
        assert engine.model_config == engine.engine_core.ready["model_config"]


def test_a_handshake_that_lacks_a_field_is_refused_when_decoded():
    ready = dict(pid=1, num_gpu_blocks=8, max_model_len=64, block_size=4, async_scheduling=False,
                 attention_backend="torch", dtype="float32", model_config=LlamaConfig())
    wire = MsgpackEncoder().encode(ready)
    assert MsgpackDecoder(EngineCoreReady).decode(wire)["model_config"] == LlamaConfig()
    del ready["num_gpu_blocks"]
    with pytest.raises(msgspec.ValidationError, match="num_gpu_blocks"):
        MsgpackDecoder(EngineCoreReady).decode(MsgpackEncoder().encode(ready))


def test_utility_results_have_the_same_type_in_both_modes(engines):
    assert utility_result_type("get_stats") is SchedulerStats
    results = {}
    for mode, engine in engines.items():
        tokens = _serve(engine)
        client = engine.engine_core
        client.call_utility("start_timeline")
        _serve(engine)
        timeline = client.call_utility("take_timeline")
        stats = client.call_utility("get_stats")
        assert type(stats) is SchedulerStats and type(stats.engine) is EngineStats, mode
        assert type(client.get_stats()) is SchedulerStats
        assert isinstance(timeline, list) and timeline and all(type(e) is tuple for e in timeline), mode
        assert {what for what, _, _ in timeline} == {"schedule", "execute", "update"}, mode
        assert type(client.call_utility("get_num_free_blocks")) is int
        results[mode] = (tokens, stats.num_free_blocks, stats.engine.num_requests, stats.engine.num_steps)
    assert results["in-process"] == results["engine-core process"]


def test_llm_engine_has_one_path_per_job(engines):
    """Every mode-dependent answer comes from the client; the engine keeps no core of its own beside it."""
    inproc, mp = engines["in-process"], engines["engine-core process"]
    assert not hasattr(inproc, "_core") and not hasattr(mp, "_core")
    assert inproc.engine_core.local_engine_core() is inproc.engine_core.engine_core
    assert mp.engine_core.local_engine_core() is None
    assert inproc.stats is inproc.engine_core.engine_core.stats  # the live counters in-process
    with pytest.raises(AttributeError, match="lives in the engine-core process"):
        mp.scheduler  # noqa: B018
    for engine in (inproc, mp):
        assert not engine.has_requests() and not engine.engine_core.has_requests()


def test_the_executor_declares_its_timeline():
    assert "timeline" in typing.get_type_hints(Executor) and Executor.timeline is None
