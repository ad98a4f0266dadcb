"""AsyncLLM: one event loop serving many consumers, over a fake engine core that follows EngineCore's contract and
is stepped by AsyncInprocClient's engine thread; and over the tiny model in both modes.

What is checked: outputs reach the right consumer in order and their deltas add up to the final text; requests
added while others run join the running batch (continuous batching); only the engine thread ever calls the core;
ValueErrors reach the caller; a consumer that stops listening (break, cancel, cancel while waiting to be accepted)
has its request aborted and its blocks freed; an engine failure reaches every waiter and later callers; shutdown
ends the streams; AsyncLLM is LLMEngine's sibling (it holds no LLMEngine) and gives LLMEngine's tokens in-process and
with the core in its own process; ``build_app`` serves an ``LLMEngine``'s core and leaves the engine usable.
"""
import asyncio
import gc
import os
import threading
import time

import pytest

from minillm.config import LlamaConfig
from minillm.engine import (EngineCoreOutput, EngineCoreOutputs, EngineCoreReady, EngineCoreRequest, EngineStats,
                            SchedulerStats)
from minillm.engine.arg_utils import EngineArgs
from minillm.engine.async_llm import AsyncLLM, EngineDeadError
from minillm.engine.core_client import AsyncInprocClient, InprocClient
from minillm.request import RequestStatus
from minillm.sampling_params import SamplingParams

BLOCK_SIZE = 4
VOCAB = 1000  # prompts use ids below it; the fake core's words get ids above it
MAX_MODEL_LEN = 4096


class FakeKVCacheManager:
    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.held: dict[str, int] = {}

    @property
    def num_free_blocks(self) -> int:
        return self.num_blocks - 1 - sum(self.held.values())  # block 0 is the null block, never free

    @property
    def usage(self) -> float:
        return sum(self.held.values()) / (self.num_blocks - 1)


class FakeTokenizer:
    """Decodes the fake core's token ids into its words."""

    eos_token_id = None

    def __init__(self, vocab: dict[int, str] | None = None) -> None:
        self.vocab = vocab if vocab is not None else {}

    def decode(self, ids, skip_special_tokens=True) -> str:
        return "".join(self.vocab.get(i, "") for i in ids)


class FakeEngineCore:
    """What ``InprocClient`` calls on an ``EngineCore``. Generates the words ``"<request_id>:<k> "``, one token per
    step, holding ceil(tokens / 4) blocks per request; each word's token id is new, and ``vocab`` maps it back."""

    def __init__(self, num_blocks: int = 257, step_delay: float = 0.002, add_delay: float = 0.0,
                 fail_at_step: int | None = None) -> None:
        self.kv_cache_manager = FakeKVCacheManager(num_blocks)
        self.step_delay, self.add_delay, self.fail_at_step = step_delay, add_delay, fail_at_step
        self.vocab: dict[int, str] = {}
        self.stats = EngineStats()
        self.requests: dict[str, dict] = {}
        self.callers: set[int] = set()
        self.log: list[tuple[str, str]] = []
        self.batch_sizes: list[int] = []

    def _touch(self) -> None:
        self.callers.add(threading.get_ident())

    def _hold(self, rid: str) -> None:
        r = self.requests[rid]
        self.kv_cache_manager.held[rid] = -(-(r["prompt_len"] + len(r["tokens"])) // BLOCK_SIZE)

    def ready_message(self) -> EngineCoreReady:
        return EngineCoreReady(pid=os.getpid(), num_gpu_blocks=self.kv_cache_manager.num_blocks,
                               max_model_len=MAX_MODEL_LEN, block_size=BLOCK_SIZE, async_scheduling=False,
                               attention_backend="fake", dtype="float32",
                               model_config=LlamaConfig(vocab_size=VOCAB, max_position_embeddings=MAX_MODEL_LEN))

    def add_request(self, request: EngineCoreRequest) -> None:
        self._touch()
        time.sleep(self.add_delay)
        rid = request.request_id
        if rid in self.requests:
            raise ValueError(f"request id {rid!r} is already in use by an unfinished request")
        self.stats.num_requests += 1
        self.requests[rid] = {"prompt_len": len(request.prompt_token_ids), "params": request.sampling_params,
                              "tokens": []}
        self._hold(rid)
        self.log.append(("add", rid))

    def abort_requests(self, request_ids, status=RequestStatus.FINISHED_ABORTED) -> None:
        self._touch()
        for rid in request_ids:
            self.log.append(("abort", rid))
            if self.requests.pop(rid, None) is not None:
                del self.kv_cache_manager.held[rid]

    def has_requests(self) -> bool:
        self._touch()
        return bool(self.requests)

    def step_fn(self) -> tuple[EngineCoreOutputs, bool]:
        self._touch()
        if self.fail_at_step is not None and len(self.batch_sizes) == self.fail_at_step:
            raise RuntimeError("boom: the fake model crashed")
        time.sleep(self.step_delay)
        self.batch_sizes.append(len(self.requests))
        self.stats.num_steps += 1
        outputs = []
        for rid, r in list(self.requests.items()):
            token = VOCAB + len(self.vocab)
            self.vocab[token] = f"{rid}:{len(r['tokens'])} "
            r["tokens"].append(token)
            finished = len(r["tokens"]) >= r["params"].max_tokens
            outputs.append(EngineCoreOutput(rid, [token], finish_reason="length" if finished else None))
            if finished:
                del self.requests[rid]
                del self.kv_cache_manager.held[rid]
            else:
                self._hold(rid)
        return EngineCoreOutputs(outputs=outputs, scheduler_stats=self.make_stats()), True

    def make_stats(self) -> SchedulerStats:
        kv = self.kv_cache_manager
        return SchedulerStats(num_running_reqs=len(self.requests), num_blocks=kv.num_blocks,
                              num_free_blocks=kv.num_free_blocks, kv_cache_usage=kv.usage, engine=self.stats)

    def get_stats(self) -> SchedulerStats:
        return self.make_stats()

    def shutdown(self) -> None:
        pass


def fake_async_llm(core: FakeEngineCore | None = None, tokenizer: FakeTokenizer | None = None,
                   **core_args) -> tuple[AsyncLLM, FakeEngineCore]:
    """An AsyncLLM whose engine thread steps a fake core."""
    core = core if core is not None else FakeEngineCore(**core_args)
    tokenizer = tokenizer if tokenizer is not None else FakeTokenizer()
    tokenizer.vocab = core.vocab
    llm = AsyncLLM.from_engine_core(AsyncInprocClient(InprocClient(core)), tokenizer,
                                    EngineArgs(block_size=BLOCK_SIZE, device="cpu"))
    return llm, core


def expected_text(rid: str, n: int) -> str:
    return "".join(f"{rid}:{k} " for k in range(n))


async def wait_for(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out waiting for the engine thread"
        await asyncio.sleep(0.005)


@pytest.fixture
def make_llm():
    made = []

    def make(**kwargs) -> tuple[AsyncLLM, FakeEngineCore]:
        llm, engine = fake_async_llm(**kwargs)
        made.append(llm)
        return llm, engine

    yield make
    for llm in made:
        llm.shutdown()


def test_deltas_add_up_to_the_final_text(make_llm):
    llm, engine = make_llm()

    async def main():
        return [out async for out in llm.generate("r", [1, 2, 3], SamplingParams(max_tokens=5))]

    outs = asyncio.run(main())
    assert len(outs) == 5 and outs[-1].finished and not any(o.finished for o in outs[:-1])
    assert "".join(o.outputs[0].delta_text for o in outs) == outs[-1].outputs[0].text == expected_text("r", 5)
    assert outs[-1].outputs[0].finish_reason == "length"
    assert llm.stats.num_finished == 1 and llm.stats.num_aborted == 0


def test_concurrent_requests_share_steps_and_get_their_own_outputs(make_llm):
    llm, engine = make_llm()

    async def one(i: int) -> str:
        await asyncio.sleep(0.003 * i)  # staggered arrivals: later requests join a running batch
        text = ""
        async for out in llm.generate(f"q{i}", [1] * (i + 1), SamplingParams(max_tokens=10 + i)):
            text += out.outputs[0].delta_text
        return text

    async def main():
        return await asyncio.gather(*(one(i) for i in range(20)))

    texts = asyncio.run(main())
    assert texts == [expected_text(f"q{i}", 10 + i) for i in range(20)]
    assert max(engine.batch_sizes) > 1  # continuous batching: several requests in one step
    # Only the engine thread ever touched the core (it is not thread-safe).
    assert engine.callers == {llm.engine_core.engine_thread.ident}
    assert engine.kv_cache_manager.num_free_blocks == engine.kv_cache_manager.num_blocks - 1


def test_engine_value_errors_reach_the_caller(make_llm):
    llm, engine = make_llm()

    async def main():
        with pytest.raises(ValueError, match="the prompt is empty"):
            await llm.add_request("empty", [], SamplingParams())
        collector = await llm.add_request("dup", [1], SamplingParams(max_tokens=200))
        with pytest.raises(ValueError, match="already in use"):
            await llm.add_request("dup", [1], SamplingParams())
        llm.abort("dup")
        outs = []  # outputs of the steps before the abort, then the stream just ends
        while (out := await collector.get()) is not None:
            outs.append(out)
        assert len(outs) < 200 and not any(o.finished for o in outs)
        # The engine keeps serving after refusing requests.
        return [o async for o in llm.generate("ok", [1], SamplingParams(max_tokens=2))]

    outs = asyncio.run(main())
    assert outs[-1].outputs[0].text == expected_text("ok", 2)


@pytest.mark.parametrize("how", ["break", "cancel"])
def test_a_consumer_that_leaves_aborts_its_request_and_frees_its_blocks(make_llm, how):
    llm, engine = make_llm(step_delay=0.005)
    kv = engine.kv_cache_manager

    async def consume(seen: asyncio.Event):
        async for out in llm.generate("long", [1] * 9, SamplingParams(max_tokens=100_000)):
            if len(out.outputs[0].token_ids) == 3:
                seen.set()
                if how == "break":
                    break

    async def main():
        seen = asyncio.Event()
        task = asyncio.create_task(consume(seen))
        await seen.wait()
        assert kv.num_free_blocks < kv.num_blocks - 1  # the request holds blocks while it runs
        if how == "cancel":
            task.cancel()
        with pytest.raises(asyncio.CancelledError) if how == "cancel" else _nothing():
            await task
        await wait_for(lambda: llm.stats.num_aborted == 1 and llm.stats.num_unfinished_requests == 0)

    asyncio.run(main())
    assert ("abort", "long") in engine.log
    assert kv.num_free_blocks == kv.num_blocks - 1
    assert llm.stats.num_free_blocks == kv.num_blocks - 1 and llm.stats.kv_cache_usage == 0.0


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_cancelled_while_waiting_to_be_accepted_still_aborts(make_llm):
    # add_request blocks the engine thread for 0.3 s: the caller is cancelled before the engine accepts.
    llm, engine = make_llm(add_delay=0.3)

    async def main():
        task = asyncio.create_task(llm.add_request("slow", [1, 2], SamplingParams(max_tokens=100_000)))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await wait_for(lambda: ("abort", "slow") in engine.log and llm.stats.num_unfinished_requests == 0)

    asyncio.run(main())
    assert engine.log.index(("add", "slow")) < engine.log.index(("abort", "slow"))
    assert engine.kv_cache_manager.num_free_blocks == engine.kv_cache_manager.num_blocks - 1


def test_an_engine_failure_reaches_every_waiter_and_later_callers(make_llm):
    llm, engine = make_llm(fail_at_step=3)

    async def one(i: int):
        return [o async for o in llm.generate(f"f{i}", [1], SamplingParams(max_tokens=50))]

    async def main():
        results = await asyncio.gather(*(one(i) for i in range(4)), return_exceptions=True)
        assert all(isinstance(r, EngineDeadError) and "boom" in str(r) for r in results), results
        with pytest.raises(EngineDeadError):
            await llm.add_request("after", [1], SamplingParams())

    asyncio.run(main())
    assert llm.errored and not llm.is_running


def test_shutdown_ends_open_streams(make_llm):
    llm, engine = make_llm(step_delay=0.005)

    async def main():
        outs = []
        async for out in llm.generate("s", [1], SamplingParams(max_tokens=100_000)):
            outs.append(out)
            if len(outs) == 2:
                threading.Thread(target=llm.shutdown).start()
        return outs

    outs = asyncio.run(main())
    assert 2 <= len(outs) < 100_000 and not outs[-1].finished
    assert not llm.is_running

    async def after():
        await llm.add_request("late", [1], SamplingParams())

    with pytest.raises(EngineDeadError):
        asyncio.run(after())


def test_a_stream_dropped_before_it_starts_aborts_its_request(make_llm):
    """A client that hangs up after its request was queued but before its stream began: the server's stream
    generator never runs, so only its finalizer can abort the request (serving_engine.abort_when_dropped)."""
    from minillm.entrypoints.openai.protocol import CompletionRequest
    from minillm.entrypoints.openai.serving_completion import OpenAIServingCompletion

    llm, engine = make_llm(step_delay=0.005)
    serving = OpenAIServingCompletion(llm, "fake-model")

    async def main():
        request = CompletionRequest.model_validate({"prompt": [1, 2, 3], "max_tokens": 4000, "stream": True})
        stream = await serving.create_completion(request)
        await wait_for(lambda: llm.stats.num_unfinished_requests == 1)
        del stream
        gc.collect()
        await wait_for(lambda: llm.stats.num_aborted == 1 and llm.stats.num_unfinished_requests == 0)

    asyncio.run(main())
    assert engine.kv_cache_manager.num_free_blocks == engine.kv_cache_manager.num_blocks - 1


def test_background_server_serves_a_fake_engine_and_stops_its_loop():
    """BackgroundServer (for notebooks): port 0 picks a free port; stopping it stops the engine thread (the app owns
    this AsyncLLM), which alone called the core."""
    import httpx

    from minillm.entrypoints.openai.api_server import BackgroundServer

    llm, engine = fake_async_llm(step_delay=0.0)
    with BackgroundServer(llm, served_model_name="fake-model", owns_engine=True) as server:
        assert server.port != 0
        r = httpx.post(server.url + "/v1/completions", json={"prompt": [5, 6], "max_tokens": 3}, timeout=30)
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["model"] == "fake-model" and body["usage"] == {"prompt_tokens": 2, "completion_tokens": 3,
                                                                   "total_tokens": 5}
        rid = body["id"]
        assert body["choices"][0]["text"] == expected_text(rid, 3)
        assert httpx.get(server.url + "/health").status_code == 200
    assert not llm.is_running and not llm.engine_core.engine_thread.is_alive()
    assert engine.callers == {llm.engine_core.engine_thread.ident}


def test_an_engine_failure_mid_stream_is_reported_in_the_stream_then_503():
    import json

    import httpx

    from minillm.entrypoints.openai.api_server import BackgroundServer

    llm, _ = fake_async_llm(step_delay=0.0, fail_at_step=2)
    with BackgroundServer(llm, served_model_name="fake", owns_engine=True) as server:
        body = {"prompt": [5, 6], "max_tokens": 10, "stream": True}
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=30) as r:
            assert r.status_code == 200  # the failure comes after the headers were sent
            events = [line[len("data: "):] for line in r.iter_lines() if line]
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert error["type"] == "internal_error" and "boom" in error["message"]
        r = httpx.post(server.url + "/v1/completions", json={"prompt": [5], "max_tokens": 2}, timeout=30)
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"
        assert httpx.get(server.url + "/health").status_code == 503


# -- the tiny model --------------------------------------------------------------------------------------------------
TINY_ARGS = dict(block_size=4, num_gpu_blocks=64, max_model_len=64, device="cpu")


@pytest.fixture(scope="module")
def tiny_reference():
    """LLMEngine's greedy tokens on the tiny model, the oracle for AsyncLLM in both modes."""
    from minillm.engine.llm_engine import LLMEngine
    from tests.engine_helpers import tiny_model

    model = tiny_model()
    engine = LLMEngine(model, None, EngineArgs(**TINY_ARGS))
    for i in range(3):
        engine.add_request(f"r{i}", list(range(1, 6 + 3 * i)), SamplingParams.greedy(max_tokens=6))
    tokens = {}
    while engine.has_requests():
        tokens.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
    return model, tokens


@pytest.mark.parametrize("multiprocess_mode", [False, True], ids=["in-process", "engine-core process"])
def test_async_llm_is_llm_engines_sibling_and_gives_its_tokens(tiny_reference, multiprocess_mode):
    """AsyncLLM holds its own front end and client, never an LLMEngine, in both modes, and streams what LLMEngine
    computes; its stats are the core's (a utility call, SchedulerStats in both modes)."""
    from minillm.engine.core_client import AsyncMPClient
    from minillm.engine.input_processor import InputProcessor
    from minillm.engine.llm_engine import LLMEngine
    from minillm.engine.output_processor import OutputProcessor

    model, reference = tiny_reference
    llm = AsyncLLM(model, None, EngineArgs(**TINY_ARGS), multiprocess_mode=multiprocess_mode)
    try:
        assert not any(isinstance(v, LLMEngine) for v in vars(llm).values())
        assert not hasattr(llm, "engine")
        assert isinstance(llm.input_processor, InputProcessor) and isinstance(llm.output_processor, OutputProcessor)
        assert isinstance(llm.engine_core, AsyncMPClient if multiprocess_mode else AsyncInprocClient)
        assert llm.engine_core.ready["num_gpu_blocks"] == 64 and llm.max_model_len == 64

        async def one(i: int) -> tuple[str, list[int]]:
            await asyncio.sleep(0.01 * i)  # staggered: later requests join running steps
            async for out in llm.generate(f"r{i}", list(range(1, 6 + 3 * i)), SamplingParams.greedy(max_tokens=6)):
                final = out
            return final.request_id, final.outputs[0].token_ids

        async def main():
            got = dict(await asyncio.gather(*(one(i) for i in range(3))))
            return got, await llm.get_stats(), await llm.engine_core.call_utility_async("get_stats")

        tokens, stats, sched = asyncio.run(main())
        assert tokens == reference
        assert isinstance(sched, SchedulerStats) and sched.engine.num_requests == 3
        assert stats.num_finished == 3 and stats.num_unfinished_requests == 0 and stats.num_free_blocks == 63
    finally:
        llm.shutdown()
    assert not llm.is_running


@pytest.mark.parametrize("multiprocess_mode", [False, True], ids=["in-process", "engine-core process"])
def test_build_app_serves_an_llm_engines_core_and_leaves_the_engine_usable(tiny_reference, multiprocess_mode):
    """``BackgroundServer(engine)``: an AsyncLLM of its own in front of the engine's core (an InprocClient, or the
    SyncMPClient of an engine whose core has its own process), driven by an engine thread until the server stops;
    then the engine steps as before."""
    import httpx

    from minillm.engine.llm_engine import LLMEngine
    from minillm.entrypoints.openai.api_server import BackgroundServer

    model, reference = tiny_reference
    engine = LLMEngine(model, None, EngineArgs(**TINY_ARGS), multiprocess_mode=multiprocess_mode)
    try:
        with BackgroundServer(engine, served_model_name="tiny") as server:
            llm = server.app.state.engine_client
            assert llm.engine_core.client is engine.engine_core and llm.output_processor is not engine.output_processor
            r = httpx.post(server.url + "/v1/completions", timeout=60,
                           json={"prompt": list(range(1, 6)), "max_tokens": 6, "temperature": 0})
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] == 6
        assert not llm.is_running and not llm.engine_core.engine_thread.is_alive()
        engine.add_request("r0", list(range(1, 6)), SamplingParams.greedy(max_tokens=6))
        outs = []
        while engine.has_requests():
            outs += engine.step()
        assert outs[-1].outputs[0].token_ids == reference["r0"]
        assert engine.get_num_free_blocks() == 63
    finally:
        engine.shutdown()
