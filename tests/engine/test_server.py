"""The OpenAI-compatible server on the real model, called with the real ``openai`` client.

One server per module: ``python -m minillm.entrypoints.openai.api_server`` on a free loopback port, SmolLM2 with
``max_model_len=512`` and ``--dtype float32`` (the server's default is ``auto``, bf16 on some CPUs; the answers
checked here are fp32's). Every generation is greedy and short. Checked: models, completions, chat ("Paris"),
streaming (deltas joined == the non-streamed text), 16 concurrent streaming clients (each equal to its own
non-streamed answer, and batched together), ``max_completion_tokens`` vs ``max_tokens`` vs the room left (as in vLLM
v0.33.0: a limit above ``max_model_len`` is a 400, one above the room left is lowered to it), usage counts, clients
that hang up (request aborted, every KV block back, seen on ``GET /debug/kv_cache``), the 400 cases with OpenAI's
error body, and that values which used to fail only inside an engine step (a huge seed, top_k or top_logprobs) are
refused or handled without stopping the engine loop.
Last, hostile clients (issue 15): a 10 MB body is refused with a 413 while /health keeps answering, and a soak test
mixes good, bad, dropped, cancelled and reset requests for MINILLM_SOAK_SECONDS (15) and then finds nothing left in
the engine (more in ``test_serving_safely.py``).
"""
import asyncio
import contextlib
import json
import os
import shlex
import socket
import struct
import subprocess
import sys
import time
from dataclasses import dataclass

import httpx
import openai
import pytest

pytestmark = pytest.mark.slow

MAX_MODEL_LEN = 512
QUESTION = "What is the capital of France?"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    url: str  # http://127.0.0.1:PORT
    model: str  # the served model's name
    http: httpx.Client  # one client for the module (creating one per call costs CPU: an SSL context each)


@pytest.fixture(scope="module")
def server():
    """A server running in a subprocess for this module."""
    port = _free_port()
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    # make test-tp runs this module against `--tensor-parallel-size 3` (MINILLM_TEST_SERVER_ARGS).
    cmd = [sys.executable, "-m", "minillm.entrypoints.openai.api_server", "--port", str(port),
           "--max-model-len", str(MAX_MODEL_LEN), "--dtype", "float32", "--uvicorn-log-level", "warning",
           *shlex.split(os.environ.get("MINILLM_TEST_SERVER_ARGS", ""))]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    http = httpx.Client(base_url=base, timeout=120)
    try:
        deadline = time.monotonic() + 300
        while True:
            if proc.poll() is not None:
                pytest.fail(f"the server exited with {proc.returncode}:\n{proc.stdout.read()[-3000:]}")
            try:
                if http.get("/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the server did not come up within 300 s"
            time.sleep(0.25)
        yield Server(base, http.get("/v1/models").json()["data"][0]["id"], http)
    finally:
        http.close()
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def kv_stats(server) -> dict:
    return server.http.get("/debug/kv_cache").json()


def wait_idle(server, timeout: float = 60.0) -> dict:
    """Poll until the engine holds no request; return the stats then."""
    deadline = time.monotonic() + timeout
    while True:
        stats = kv_stats(server)
        if stats["num_unfinished_requests"] == 0:
            return stats
        assert time.monotonic() < deadline, f"the engine still holds requests: {stats}"
        time.sleep(0.05)


def test_models_lists_the_served_model(server):
    body = server.http.get("/v1/models").json()
    assert body["object"] == "list" and len(body["data"]) == 1
    card = body["data"][0]
    assert card["id"] == server.model and card["object"] == "model" and card["max_model_len"] == MAX_MODEL_LEN


def test_chat_answers_paris(server, client):
    r = client.chat.completions.create(model=server.model, messages=[{"role": "user", "content": QUESTION}],
                                       temperature=0, max_completion_tokens=16)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-") and r.model == server.model
    choice = r.choices[0]
    assert choice.message.role == "assistant" and "Paris" in choice.message.content, choice.message.content
    assert choice.finish_reason in ("stop", "length")
    u = r.usage
    assert u.prompt_tokens > 10 and 1 <= u.completion_tokens <= 16  # the chat template adds a system prompt
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens


def test_completion_text_and_usage(server, client):
    r = client.completions.create(model=server.model, prompt="The capital of France is", temperature=0, max_tokens=4)
    assert r.object == "text_completion" and r.id.startswith("cmpl-")
    assert r.choices[0].text.startswith(" Paris"), r.choices[0].text
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 4 and r.usage.total_tokens == r.usage.prompt_tokens + 4
    # A prompt given as token ids is counted exactly.
    ids = [504, 3575, 282, 4649, 314]
    r = client.completions.create(model=server.model, prompt=ids, temperature=0, max_tokens=2)
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 2


def test_stop_string_and_seed(server, client):
    r = client.completions.create(model=server.model, prompt="The capital of France is", temperature=0,
                                  max_tokens=8, stop=["."])
    assert r.choices[0].finish_reason == "stop" and "." not in r.choices[0].text
    kw = dict(model=server.model, prompt="Once upon a time", temperature=1.0, top_p=0.9, max_tokens=6, seed=1234)
    assert client.completions.create(**kw).choices[0].text == client.completions.create(**kw).choices[0].text


def _stream_text(stream) -> tuple[str, str | None, list]:
    text, finish, chunks = "", None, []
    for chunk in stream:
        chunks.append(chunk)
        for choice in chunk.choices:
            text += (choice.delta.content or "") if hasattr(choice, "delta") else choice.text
            finish = choice.finish_reason or finish
    return text, finish, chunks


def test_streaming_equals_the_non_streamed_answer(server, client):
    kw = dict(model=server.model, messages=[{"role": "user", "content": QUESTION}], temperature=0,
              max_completion_tokens=8)
    full = client.chat.completions.create(**kw)
    text, finish, chunks = _stream_text(client.chat.completions.create(
        **kw, stream=True, stream_options={"include_usage": True}))
    assert text == full.choices[0].message.content and finish == full.choices[0].finish_reason
    assert chunks[0].object == "chat.completion.chunk" and chunks[0].choices[0].delta.role == "assistant"
    assert len({c.id for c in chunks}) == 1
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == full.usage.model_dump()

    kw = dict(model=server.model, prompt="The three primary colours are", temperature=0, max_tokens=6)
    full = client.completions.create(**kw)
    text, finish, _ = _stream_text(client.completions.create(**kw, stream=True))
    assert text == full.choices[0].text and finish == full.choices[0].finish_reason == "length"


def test_the_stream_ends_with_done(server):
    body = {"prompt": "Hello", "max_tokens": 3, "temperature": 0, "stream": True}
    with server.http.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    last = json.loads(events[-2][len("data: "):])
    assert last["object"] == "text_completion" and last["choices"][0]["finish_reason"] == "length"


COUNTRIES = ["France", "Germany", "Italy", "Spain", "Japan", "Canada", "Egypt", "Brazil",
             "Kenya", "Norway", "Peru", "India", "Greece", "Chile", "Poland", "Vietnam"]


def test_16_concurrent_streaming_clients(server):
    """Each of 16 simultaneous streams equals its own non-streamed greedy answer, and they ran batched."""
    aclient = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)
    max_tokens = 6

    def kw(country):
        return dict(model=server.model, prompt=f"The capital of {country} is", temperature=0, max_tokens=max_tokens)

    async def full(country):
        return (await aclient.completions.create(**kw(country))).choices[0].text

    async def streamed(country):
        text = ""
        async for chunk in await aclient.completions.create(**kw(country), stream=True):
            text += "".join(c.text for c in chunk.choices)
        return text

    async def main():
        expected = await asyncio.gather(*(full(c) for c in COUNTRIES))
        before = kv_stats(server)
        got = await asyncio.gather(*(streamed(c) for c in COUNTRIES))
        await aclient.close()
        return expected, got, before

    expected, got, before = asyncio.run(main())
    assert got == expected
    after = wait_idle(server)
    assert after["num_finished"] - before["num_finished"] == len(COUNTRIES)
    # Batched: far fewer engine steps than one per token per request.
    assert after["num_steps"] - before["num_steps"] < len(COUNTRIES) * max_tokens / 2
    assert after["num_free_blocks"] == after["num_blocks"] - 1


def test_max_completion_tokens_wins_over_max_tokens(server, client):
    messages = [{"role": "user", "content": "Count from one to one hundred in words."}]
    base = dict(model=server.model, messages=messages, temperature=0, extra_body={"ignore_eos": True})
    both = client.chat.completions.create(**base, max_tokens=1, max_completion_tokens=3)
    assert both.usage.completion_tokens == 3 and both.choices[0].finish_reason == "length"
    only_old = client.chat.completions.create(**base, max_tokens=2)
    assert only_old.usage.completion_tokens == 2
    # The legacy Completions API has only max_tokens, 16 by default; max_completion_tokens is refused there.
    r = client.completions.create(model=server.model, prompt="One, two, three,", temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 16
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=server.model, prompt="One", extra_body={"max_completion_tokens": 3})
    assert "max_completion_tokens" in e.value.message


def test_without_a_limit_a_chat_answer_may_fill_the_context(server, client):
    """Neither limit given: the answer may use what the prompt leaves of max_model_len (and no more)."""
    def ask(words, **extra):
        return client.chat.completions.create(model=server.model, temperature=0, extra_body={"ignore_eos": True},
                                              messages=[{"role": "user", "content": "hello " * words}], **extra)

    probe = ask(400, max_completion_tokens=1).usage.prompt_tokens
    words = 400 + (MAX_MODEL_LEN - 3) - probe  # aim for 3 tokens of room ("hello" is one token after a space)
    r = ask(words)
    room = MAX_MODEL_LEN - r.usage.prompt_tokens
    assert 1 <= room <= 8, room
    assert r.usage.completion_tokens == room and r.choices[0].finish_reason == "length"
    assert r.usage.total_tokens == MAX_MODEL_LEN


LIMITS = [("chat/completions", "max_completion_tokens"), ("chat/completions", "max_tokens"),
          ("completions", "max_tokens")]


def _body(route: str, name: str, value: int, text: str) -> dict:
    body = {"temperature": 0, name: value}
    if route == "completions":
        return dict(body, prompt=text)
    return dict(body, messages=[{"role": "user", "content": text}])


@pytest.mark.parametrize("route,name", LIMITS, ids=[f"{r}-{n}" for r, n in LIMITS])
def test_a_limit_larger_than_max_model_len_is_a_400(server, route, name):
    """vLLM v0.33.0 (TokenizeParams.__post_init__): a limit above max_model_len can never be served, whatever the
    prompt: a 400 with the JSON error body naming the field and both numbers; the engine never sees it."""
    before = kv_stats(server)["num_requests_total"]
    for over in (MAX_MODEL_LEN + 1, 5000):
        r = server.http.post(f"/v1/{route}", json=_body(route, name, over, QUESTION))
        assert r.status_code == 400, r.text
        assert r.headers["content-type"] == "application/json"
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert error["type"] == "invalid_request_error" and error["code"] == "context_length_exceeded", error
        assert error["param"] == name, error
        assert error["message"] == (f"{name}={over} cannot be greater than max_model_len={MAX_MODEL_LEN}. "
                                    f"Please request fewer output tokens."), error
    assert kv_stats(server)["num_requests_total"] == before  # refused before reaching the engine


@pytest.mark.parametrize("route,name", LIMITS, ids=[f"{r}-{n}" for r, n in LIMITS])
def test_a_limit_that_fits_max_model_len_but_not_the_room_is_lowered(server, route, name):
    """vLLM v0.33.0 (get_max_tokens): a limit that fits max_model_len but not the room the prompt leaves is lowered
    to that room, silently: a 200 whose answer stops at the end of the context with finish_reason "length".
    (Older vLLM releases, and minillm before, refused it with a 400.)"""
    def ask(words: int, limit: int) -> dict:
        body = dict(_body(route, name, limit, "hello " * words), ignore_eos=True)
        r = server.http.post(f"/v1/{route}", json=body)
        assert r.status_code == 200, r.text
        return r.json()

    probe = ask(400, 1)["usage"]["prompt_tokens"]
    words = 400 + (MAX_MODEL_LEN - 4) - probe  # aim for 4 tokens of room ("hello" is one token after a space)
    for limit in (100, MAX_MODEL_LEN):  # both fit max_model_len; both are more than the room
        answer = ask(words, limit)
        usage, choice = answer["usage"], answer["choices"][0]
        room = MAX_MODEL_LEN - usage["prompt_tokens"]
        assert 1 <= room <= 8 and room < limit, (room, usage)
        assert usage["completion_tokens"] == room and choice["finish_reason"] == "length", answer
        assert usage["total_tokens"] == MAX_MODEL_LEN


def test_a_huge_top_k_is_served_like_no_top_k(server, client):
    """vLLM accepts any top_k >= 1; one beyond the vocabulary (even beyond int64) keeps every token."""
    kw = dict(model=server.model, prompt="Once upon a time", temperature=1.0, max_tokens=6, seed=77)
    plain = client.completions.create(**kw).choices[0].text
    huge = client.completions.create(**kw, extra_body={"top_k": 2**70}).choices[0].text
    assert huge == plain
    assert server.http.get("/health").status_code == 200


def test_a_streaming_client_that_hangs_up_is_aborted_and_its_blocks_freed(server):
    body = {"model": server.model, "prompt": "Count to one thousand: one, two,", "max_tokens": 400, "temperature": 0,
            "ignore_eos": True, "stream": True}
    # The engine thread keeps generating whether or not the client reads, and a slow reader gets several tokens per
    # chunk. On a starved CPU the 400 tokens can all be done before the client has read 3 chunks; that attempt
    # tests nothing, so it is retried (and must have finished normally).
    for _attempt in range(3):
        before = wait_idle(server)
        with server.http.stream("POST", "/v1/completions", json=body) as r:
            chunks = 0
            for line in r.iter_lines():
                chunks += line.startswith("data: {")
                if chunks == 3:
                    break
            # Leaving the loop closed the connection (httpx closes the stream with its line iterator).
            held = kv_stats(server)
            if held["num_unfinished_requests"] == 1:
                assert held["num_free_blocks"] < held["num_blocks"] - 1
                break
            if held["num_aborted"] == before["num_aborted"] + 1:
                break  # already aborted: the front end drops a request as soon as its stream is closed
            assert held["num_finished"] == before["num_finished"] + 1, (held, before)  # it ran to its end, not lost
    else:
        pytest.fail("the request finished before the client hung up, 3 times in a row")
    # Leaving the block closed the connection.
    deadline = time.monotonic() + 60
    while (s := kv_stats(server))["num_aborted"] == before["num_aborted"]:
        assert time.monotonic() < deadline, s
        time.sleep(0.05)
    after = wait_idle(server)
    assert after["num_aborted"] == before["num_aborted"] + 1 and after["num_finished"] == before["num_finished"]
    assert after["num_free_blocks"] == after["num_blocks"] - 1 and after["kv_cache_usage"] == 0.0


def test_a_waiting_client_that_hangs_up_is_aborted_too(server):
    before = wait_idle(server)
    body = {"model": server.model, "messages": [{"role": "user", "content": "Tell me a long story."}],
            "max_completion_tokens": 400, "temperature": 0, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        server.http.post("/v1/chat/completions", json=body, timeout=httpx.Timeout(10, read=1.5))
    deadline = time.monotonic() + 60
    while (s := kv_stats(server))["num_aborted"] == before["num_aborted"]:
        assert time.monotonic() < deadline, s
        time.sleep(0.05)
    after = wait_idle(server)
    assert after["num_finished"] == before["num_finished"]
    assert after["num_free_blocks"] == after["num_blocks"] - 1


BAD_REQUESTS = [
    # (route, raw body, param, code)
    ("completions", '{"prompt": "Hello", "max_tokens": 2,', None, "invalid_json"),
    ("chat/completions", "[1, 2]", None, "invalid_type"),
    ("completions", {"prompt": "Hello", "temperature": "hot"}, "temperature", "invalid_type"),
    ("completions", {"prompt": "Hello", "max_tokens": 1.5}, "max_tokens", "invalid_type"),
    ("chat/completions", {"messages": [{"role": "user", "content": 3}]}, "messages", "invalid_type"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "stream": "yes"}, "stream", "invalid_type"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "stop": [1]}, "stop", "invalid_type"),
    ("completions", {"max_tokens": 2}, "prompt", "missing_required_parameter"),
    ("chat/completions", {"messages": []}, "messages", "invalid_value"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "temperature": -0.5}, "temperature",
     "invalid_value"),
    ("completions", {"prompt": "Hello", "top_p": 1.5}, "top_p", "invalid_value"),
    ("completions", {"prompt": "Hello", "top_p": 0}, "top_p", "invalid_value"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 2}, "n", "invalid_value"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 0},
     "max_completion_tokens", "invalid_value"),
    ("completions", {"prompt": [999999]}, "prompt", "invalid_value"),
    ("completions", {"prompt": ""}, "prompt", "invalid_value"),
    ("completions", {"prompt": "Hello", "logprobs": 2}, "logprobs", "unsupported_parameter"),
    ("completions", {"prompt": "Hello", "logprobs": 21}, "logprobs", "unsupported_parameter"),
    # Values that used to pass the checks and then fail inside an engine step.
    ("completions", {"prompt": "Hello", "seed": 2**64}, "seed", "invalid_value"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "seed": 2**70}, "seed", "invalid_value"),
    ("completions", {"prompt": "Hello", "seed": -(2**63) - 1}, "seed", "invalid_value"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 21},
     "top_logprobs", "invalid_value"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "logprobs": True,
                          "top_logprobs": 10**6}, "top_logprobs", "invalid_value"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": -1}, "top_logprobs",
     "invalid_value"),
    ("completions", {"prompt": "Hello", "stop": 5}, "stop", "invalid_type"),
    ("completions", {"prompt": "Hello", "stop_token_ids": 5}, "stop_token_ids", "invalid_type"),
    ("completions", {"prompt": "Hello", "stop_token_ids": [-1]}, "stop_token_ids", "invalid_value"),
    ("completions", {"prompt": "Hello", "max_tokens": 600}, "max_tokens", "context_length_exceeded"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 600},
     "max_completion_tokens", "context_length_exceeded"),
    ("completions", {"prompt": "hello " * 600}, "prompt", "context_length_exceeded"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hello " * 600}]}, "messages",
     "context_length_exceeded"),
    # A limit above max_model_len is checked first, before the prompt (vLLM builds TokenizeParams before rendering).
    ("completions", {"prompt": "hello " * 600, "max_tokens": 600}, "max_tokens", "context_length_exceeded"),
]


@pytest.mark.parametrize("route,body,param,code", BAD_REQUESTS,
                         ids=[f"{r}-{c}-{p}-{i}" for i, (r, _, p, c) in enumerate(BAD_REQUESTS)])
def test_bad_requests_get_a_400_with_an_openai_error_body(server, route, body, param, code):
    before = kv_stats(server)["num_requests_total"]
    content = body if isinstance(body, str) else json.dumps(body)
    r = server.http.post(f"/v1/{route}", content=content, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    assert r.headers["content-type"] == "application/json"
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["param"] == param and error["code"] == code, error
    assert isinstance(error["message"], str) and len(error["message"]) > 10
    assert kv_stats(server)["num_requests_total"] == before  # refused: nothing was queued in the engine


def test_the_engine_loop_still_serves_after_the_bad_requests(server, client):
    """None of the refused requests above may have stopped the one engine loop every request shares."""
    assert server.http.get("/health").status_code == 200
    r = client.completions.create(model=server.model, prompt="The capital of France is", temperature=0, max_tokens=2)
    assert r.choices[0].text.startswith(" Paris")


def test_an_unexpected_error_while_adding_one_request_fails_only_that_request():
    """A bug hit while adding a request (not a ValueError the engine foresaw) is a 500 for that request alone; the
    engine loop keeps serving the others. A fake engine stands in for the model."""
    import httpx

    from minillm.entrypoints.openai.api_server import BackgroundServer
    from tests.engine.test_async_llm import FakeEngineCore, expected_text, fake_async_llm

    class BuggyAddCore(FakeEngineCore):
        def add_request(self, request):
            if request.prompt_token_ids == [13]:
                raise TypeError("unexpected: the fake engine cannot add prompt [13]")
            return super().add_request(request)

    llm, _ = fake_async_llm(BuggyAddCore(step_delay=0.0))
    with BackgroundServer(llm, served_model_name="fake", owns_engine=True) as server:
        bad = httpx.post(server.url + "/v1/completions", json={"prompt": [13], "max_tokens": 2}, timeout=30)
        assert bad.status_code == 500 and bad.json()["error"]["type"] == "internal_error", bad.text
        assert httpx.get(server.url + "/health").status_code == 200
        ok = httpx.post(server.url + "/v1/completions", json={"prompt": [5, 6], "max_tokens": 3}, timeout=30)
        assert ok.status_code == 200, ok.text
        assert ok.json()["choices"][0]["text"] == expected_text(ok.json()["id"], 3)
        assert server.app.state.engine_client.is_running


def test_the_openai_client_sees_the_error_fields(server, client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=server.model, messages=[{"role": "user", "content": "hello " * 600}])
    assert e.value.status_code == 400 and e.value.code == "context_length_exceeded" and e.value.param == "messages"
    assert f"maximum context length is {MAX_MODEL_LEN} tokens" in e.value.message
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-4", prompt="Hello", max_tokens=1)
    assert e.value.code == "model_not_found"


def test_the_serve_subcommand_parses_engine_arguments():
    """``add_serve_subparser`` (what ``python -m minillm serve`` uses): loopback by default, every EngineArgs
    field as an option, unset options left to EngineArgs' defaults but ``--dtype``, which is ``auto``."""
    import argparse

    import torch

    from minillm.engine.arg_utils import EngineArgs
    from minillm.entrypoints.openai.api_server import add_serve_subparser, engine_args_from_cli, run_server

    parser = argparse.ArgumentParser()
    add_serve_subparser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["serve", "--port", "9001", "--max-model-len", "256", "--no-enable-prefix-caching",
                              "--block-size", "8"])
    assert args.command == "serve" and args.func is run_server
    assert args.host == "127.0.0.1" and args.port == 9001
    engine_args = engine_args_from_cli(args)
    assert engine_args == EngineArgs(max_model_len=256, enable_prefix_caching=False, block_size=8, dtype="auto")
    fp32 = engine_args_from_cli(parser.parse_args(["serve", "--dtype", "float32"]))
    assert fp32 == EngineArgs(dtype="float32") and fp32.resolved_dtype() == torch.float32
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--max-model-len", "lots"])


# ------------------------------------------------------------------------------------------- hostile clients
def test_a_10mb_body_gets_a_413_while_health_answers(server):
    """Refused from its Content-Length before a byte of it is read or tokenized (it used to freeze every client for
    48 s); /health answers within 1 s all along."""
    from tests.engine.test_serving_safely import HealthProbe

    big = json.dumps({"model": server.model, "prompt": "The capital of France is " * (10 * 1024 * 1024 // 25),
                      "max_tokens": 1}).encode()
    with HealthProbe(server.url) as probe:
        time.sleep(0.2)
        t = time.perf_counter()
        r = server.http.post("/v1/completions", content=big, headers={"content-type": "application/json"})
        took = time.perf_counter() - t
        time.sleep(0.2)
    print(f"\n10 MB body: {r.status_code} after {took * 1000:.0f} ms; /health max "
          f"{max(probe.latencies) * 1000:.0f} ms over {len(probe.latencies)} probes")
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large", r.text[:500]
    assert max(probe.latencies) < 1.0 and took < 5


SOAK_SECONDS = float(os.environ.get("MINILLM_SOAK_SECONDS", "15"))


def test_soak_random_clients_leave_the_server_clean(server):
    """For SOAK_SECONDS, 8 concurrent clients send a random mix: good requests (streamed or not, completions and
    chat, each checked against its greedy answer), bad ones (400/404/405/413/415), streams dropped after a chunk or
    two, requests cut by a client timeout, connections reset mid-request, bodies never finished. Then the engine
    holds no request and no block, and still answers correctly."""
    import random

    countries = COUNTRIES[:6]
    chat_q = [{"role": "user", "content": QUESTION}]
    http = server.http
    expected = {c: http.post("/v1/completions", json={"prompt": f"The capital of {c} is", "max_tokens": 5,
                                                      "temperature": 0}).json()["choices"][0]["text"]
                for c in countries}
    expected_chat = http.post("/v1/chat/completions", json={"messages": chat_q, "max_tokens": 8, "temperature": 0}
                              ).json()["choices"][0]["message"]["content"]
    before = wait_idle(server)
    port = int(server.url.rsplit(":", 1)[1])
    oversized = json.dumps({"prompt": "x" * (2 * 1024 * 1024)}).encode()
    bad_cases = [  # (method, path, content, content-type, expected status)
        ("POST", "/v1/completions", b'{"prompt": "Hi", "max_tokens": 2,', "application/json", 400),
        ("POST", "/v1/completions", json.dumps({"prompt": "Hi", "temperature": "hot"}).encode(), "application/json",
         400),
        ("POST", "/v1/completions", json.dumps({"prompt": [999999]}).encode(), "application/json", 400),
        ("POST", "/v1/chat/completions", json.dumps({"messages": [], "n": 2}).encode(), "application/json", 400),
        ("POST", "/v1/completions", json.dumps({"prompt": "Hi", "model": "gpt-4"}).encode(), "application/json", 404),
        ("POST", "/v1/completions", json.dumps({"prompt": "Hi"}).encode(), "text/plain", 415),
        ("GET", "/v1/completions", b"", None, 405),
        ("POST", "/v1/nothing", b"{}", "application/json", 404),
        ("POST", "/v1/completions", oversized, "application/json", 413),
    ]
    counts: dict[str, int] = {}
    problems: list[str] = []

    def count(key: str) -> None:
        counts[key] = counts.get(key, 0) + 1

    def long_body(stream: bool) -> dict:
        return {"prompt": "Count to one hundred: one, two,", "max_tokens": 60, "temperature": 0, "ignore_eos": True,
                "stream": stream}

    async def raw(request: bytes, read_bytes: int, rst: bool, pause: float) -> None:
        """Send raw bytes, maybe read a little, then close (with an RST when ``rst``)."""
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(request)
        await writer.drain()
        if read_bytes:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(reader.read(read_bytes), 1)
        await asyncio.sleep(pause)
        if rst:
            writer.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        writer.close()

    async def one(client: httpx.AsyncClient, rng: random.Random) -> None:
        kind = rng.choice(["good", "good_stream", "chat", "bad", "bad", "drop_stream", "client_timeout", "reset",
                           "unfinished_body"])
        if kind in ("good", "good_stream"):
            c = rng.choice(countries)
            body = {"prompt": f"The capital of {c} is", "max_tokens": 5, "temperature": 0}
            if kind == "good":
                r = await client.post("/v1/completions", json=body)
                text = r.json()["choices"][0]["text"] if r.status_code == 200 else r.text
            else:
                text = ""
                async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
                    lines = [line async for line in r.aiter_lines() if line]
                if lines[-1] != "data: [DONE]":
                    problems.append(f"stream without [DONE]: {lines[-2:]}")
                for line in lines[:-1]:
                    text += "".join(ch["text"] for ch in json.loads(line[6:])["choices"])
            if r.status_code != 200 or text != expected[c]:
                problems.append(f"{kind} {c}: {r.status_code} {text!r} != {expected[c]!r}")
        elif kind == "chat":
            r = await client.post("/v1/chat/completions",
                                  json={"messages": chat_q, "max_tokens": 8, "temperature": 0})
            if r.status_code != 200 or r.json()["choices"][0]["message"]["content"] != expected_chat:
                problems.append(f"chat: {r.status_code} {r.text[:200]}")
        elif kind == "bad":
            method, path, content, ctype, status = rng.choice(bad_cases)
            r = await client.request(method, path, content=content, headers={"content-type": ctype} if ctype else {})
            kind = f"bad_{status}"
            if r.status_code != status or "error" not in r.json():
                problems.append(f"bad {path}: {r.status_code} (wanted {status}) {r.text[:200]}")
        elif kind == "drop_stream":
            async with client.stream("POST", "/v1/completions", json=long_body(True)) as r:
                n = 0
                async for line in r.aiter_lines():
                    n += line.startswith("data: {")
                    if n >= rng.randint(1, 3):
                        break  # leaving the block closes the connection mid-stream
        elif kind == "client_timeout":  # the client gives up (its task is cancelled) while the answer is made
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(client.post("/v1/completions", json=long_body(rng.random() < 0.5)),
                                       rng.uniform(0.05, 0.6))
        elif kind == "reset":
            body = json.dumps(long_body(rng.random() < 0.5)).encode()
            head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
                    f"Content-Length: {len(body)}\r\n\r\n").encode()
            await raw(head + body, read_bytes=rng.choice([0, 200]), rst=True, pause=rng.uniform(0, 0.3))
        else:  # unfinished_body: promises 400 bytes, sends 20, goes away
            head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
                    f"Content-Length: 400\r\n\r\n").encode()
            await raw(head + b'{"prompt": "Hello", ', read_bytes=0, rst=rng.random() < 0.5, pause=rng.uniform(0, 0.3))
        count(kind)

    async def worker(i: int, deadline: float) -> None:
        rng = random.Random(i)
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
            while time.monotonic() < deadline:
                try:
                    await one(client, rng)
                except Exception as e:  # noqa: BLE001 - any surprise is a finding, reported with the rest
                    problems.append(f"worker {i}: {type(e).__name__}: {e}")

    async def main() -> None:
        deadline = time.monotonic() + SOAK_SECONDS
        await asyncio.gather(*(worker(i, deadline) for i in range(8)))

    started = time.monotonic()
    asyncio.run(main())
    ran = time.monotonic() - started
    after = wait_idle(server)
    leaked = after["num_blocks"] - 1 - after["num_free_blocks"]
    print(f"\nsoak {SOAK_SECONDS:.0f} s (clients done after {ran:.1f} s): {sum(counts.values())} requests "
          f"{dict(sorted(counts.items()))}; engine: "
          f"{after['num_requests_total'] - before['num_requests_total']} admitted, "
          f"{after['num_finished'] - before['num_finished']} finished, "
          f"{after['num_aborted'] - before['num_aborted']} aborted; unfinished {after['num_unfinished_requests']}, "
          f"blocks leaked {leaked}; problems {len(problems)}")
    assert not problems, problems[:10]
    assert after["num_unfinished_requests"] == 0 and leaked == 0, after
    assert after["num_aborted"] > before["num_aborted"]  # the dropped, timed-out and reset requests were aborted
    assert http.get("/health").status_code == 200
    final = http.post("/v1/completions", json={"prompt": "The capital of France is", "max_tokens": 5,
                                               "temperature": 0}).json()["choices"][0]["text"]
    assert final == expected["France"]
