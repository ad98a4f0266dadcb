"""AsyncLLM: one engine thread serving many asyncio consumers (a fake engine that follows LLMEngine's contract).

What is checked: outputs reach the right consumer in order and their deltas add up to the final text; requests
added while others run join the running batch (continuous batching); only the engine thread ever calls the engine;
the engine's ValueErrors reach the caller; a consumer that stops listening (break, cancel, cancel while waiting to
be accepted) has its request aborted and its blocks freed; an engine failure reaches every waiter and later callers;
shutdown ends the streams.
"""
import asyncio
import gc
import threading
import time

import pytest

from minillm.engine.async_llm import AsyncLLM, EngineDeadError
from minillm.engine.outputs import CompletionOutput, RequestOutput
from minillm.sampling_params import SamplingParams

BLOCK_SIZE = 4


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


class FakeEngine:
    """Generates the words ``"<request_id>:<k> "``, one per step, holding ceil(tokens / 4) blocks per request."""

    def __init__(self, num_blocks: int = 257, step_delay: float = 0.002, add_delay: float = 0.0,
                 fail_at_step: int | None = None) -> None:
        self.kv_cache_manager = FakeKVCacheManager(num_blocks)
        self.tokenizer = None
        self.max_model_len = 4096
        self.step_delay, self.add_delay, self.fail_at_step = step_delay, add_delay, fail_at_step
        self.requests: dict[str, dict] = {}
        self.callers: set[int] = set()
        self.log: list[tuple[str, str]] = []
        self.batch_sizes: list[int] = []

    def _touch(self) -> None:
        self.callers.add(threading.get_ident())

    def _hold(self, rid: str) -> None:
        r = self.requests[rid]
        self.kv_cache_manager.held[rid] = -(-(r["prompt_len"] + len(r["tokens"])) // BLOCK_SIZE)

    def add_request(self, request_id, prompt, params, priority=0):
        self._touch()
        time.sleep(self.add_delay)
        if not prompt:
            raise ValueError("the prompt is empty; give at least one token")
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use by an unfinished request")
        self.requests[request_id] = {"prompt_len": len(prompt), "params": params, "tokens": [], "text": ""}
        self._hold(request_id)
        self.log.append(("add", request_id))

    def abort_request(self, request_ids):
        self._touch()
        for rid in request_ids:
            self.log.append(("abort", rid))
            if self.requests.pop(rid, None) is not None:
                del self.kv_cache_manager.held[rid]

    def has_unfinished_requests(self):
        self._touch()
        return bool(self.requests)

    def get_num_unfinished_requests(self):
        self._touch()
        return len(self.requests)

    def step(self):
        self._touch()
        if self.fail_at_step is not None and len(self.batch_sizes) == self.fail_at_step:
            raise RuntimeError("boom: the fake model crashed")
        time.sleep(self.step_delay)
        self.batch_sizes.append(len(self.requests))
        outputs = []
        for rid, r in list(self.requests.items()):
            word = f"{rid}:{len(r['tokens'])} "
            r["tokens"].append(len(r["tokens"]))
            r["text"] += word
            finished = len(r["tokens"]) >= r["params"].max_tokens
            outputs.append(RequestOutput(rid, None, [1] * r["prompt_len"], [CompletionOutput(
                0, r["text"], list(r["tokens"]), "length" if finished else None, None, word, [r["tokens"][-1]])],
                finished))
            if finished:
                del self.requests[rid]
                del self.kv_cache_manager.held[rid]
            else:
                self._hold(rid)
        return outputs


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

    def make(**kwargs) -> tuple[AsyncLLM, FakeEngine]:
        engine = FakeEngine(**kwargs)
        llm = AsyncLLM(engine)
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
    # Only the engine thread ever touched the engine (it is not thread-safe).
    assert engine.callers == {llm._thread.ident}
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
    """BackgroundServer (for notebooks): port 0 picks a free port; stopping it stops the engine loop thread,
    after which the engine may be used directly again."""
    import httpx

    from minillm.entrypoints.openai.api_server import BackgroundServer

    engine = FakeEngine(step_delay=0.0)
    with BackgroundServer(engine, served_model_name="fake-model") as server:
        assert server.port != 0
        llm = server.app.state.engine_client
        r = httpx.post(server.url + "/v1/completions", json={"prompt": [5, 6], "max_tokens": 3}, timeout=30)
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["model"] == "fake-model" and body["usage"] == {"prompt_tokens": 2, "completion_tokens": 3,
                                                                   "total_tokens": 5}
        rid = body["id"]
        assert body["choices"][0]["text"] == expected_text(rid, 3)
        assert httpx.get(server.url + "/health").status_code == 200
    assert not llm.is_running and engine.callers == {llm._thread.ident}
    engine.add_request("direct", [1], SamplingParams(max_tokens=1))
    assert engine.step()[0].finished


def test_an_engine_failure_mid_stream_is_reported_in_the_stream_then_503():
    import json

    import httpx

    from minillm.entrypoints.openai.api_server import BackgroundServer

    with BackgroundServer(FakeEngine(step_delay=0.0, fail_at_step=2), served_model_name="fake") as server:
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
