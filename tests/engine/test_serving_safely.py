"""The server against careless and hostile clients, and its shutdown (issue 15).

In-process servers (:class:`BackgroundServer`) on the fake engine of ``test_async_llm`` check what happens before a
request reaches the engine: a body too large (413, decided before it is read, while ``/health`` keeps answering),
a body that is not JSON (415, what stops a cross-origin "simple" POST from a web page), the API key (401), a
``Host`` that is not loopback (400, DNS rebinding), tokenization off the event loop, a capped log line, and that
stopping the server ends the requests in flight. Subprocesses of ``python -m minillm serve`` on a tiny random
checkpoint check SIGTERM/SIGINT with requests in flight (exit 0 within 5 s) and the arguments checked before the
model loads. The soak test against the real model is in ``test_server.py`` (it reuses that module's server).
"""
from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from minillm.entrypoints.openai.api_server import BackgroundServer
from minillm.platforms.cpu import preferred_cpu_dtype
from tests.net_helpers import free_port
from tests.engine.test_async_llm import FakeTokenizer, expected_text, fake_async_llm


class SlowTokenizer(FakeTokenizer):
    """Stands in for a tokenizer facing a huge prompt: every call takes ``delay`` seconds (sleeping, so only an
    event loop blocked by the call, not the CPU, can make a concurrent request wait)."""

    def __init__(self, delay: float) -> None:
        super().__init__()
        self.delay = delay

    def encode(self, text: str) -> list[int]:
        time.sleep(self.delay)
        return [7] * min(len(text), 8)

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=True):
        time.sleep(self.delay)
        return [7] * 8


def fake_server(step_delay: float = 0.002, tokenizer=None, **app_args) -> BackgroundServer:
    llm, _ = fake_async_llm(tokenizer=tokenizer, step_delay=step_delay)
    return BackgroundServer(llm, served_model_name="fake", owns_engine=True, **app_args)


class HealthProbe:
    """Polls ``GET /health`` in a thread while something else happens; records the slowest answer."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.latencies: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(timeout=30) as http:
            while not self._stop.is_set():
                t = time.perf_counter()
                assert http.get(self.url + "/health").status_code == 200
                self.latencies.append(time.perf_counter() - t)
                time.sleep(0.05)

    def __enter__(self) -> "HealthProbe":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(30)


def test_a_10mb_body_gets_a_413_at_once_and_health_keeps_answering():
    with fake_server() as server, HealthProbe(server.url) as probe:
        time.sleep(0.2)
        big = b'{"prompt": "' + b"hello " * (10 * 1024 * 1024 // 6) + b'"}'
        t = time.perf_counter()
        r = httpx.post(server.url + "/v1/completions", content=big, headers={"content-type": "application/json"},
                       timeout=30)
        took = time.perf_counter() - t
        assert r.status_code == 413, r.text
        error = r.json()["error"]
        assert error["code"] == "request_too_large" and "1048576" in error["message"], error
        # A chunked body (no Content-Length) is cut off as soon as it passes the limit.
        chunks = (b"x" * 65536 for _ in range(40))
        r = httpx.post(server.url + "/v1/completions", content=chunks,
                       headers={"content-type": "application/json"}, timeout=30)
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
        time.sleep(0.2)
        assert server.app.state.engine_client.stats.num_requests_total == 0
    print(f"\n10 MB body: 413 after {took * 1000:.0f} ms; /health max {max(probe.latencies) * 1000:.0f} ms "
          f"over {len(probe.latencies)} probes")
    assert took < 5 and max(probe.latencies) < 1.0


def test_the_body_limit_is_configurable():
    with fake_server(max_request_body_bytes=100) as server:
        ok = httpx.post(server.url + "/v1/completions", json={"prompt": [5], "max_tokens": 1})
        assert ok.status_code == 200, ok.text
        r = httpx.post(server.url + "/v1/completions", json={"prompt": [5] * 100, "max_tokens": 1})
        assert r.status_code == 413 and "at most 100 bytes" in r.json()["error"]["message"]


@pytest.mark.parametrize("route,body", [
    ("completions", {"prompt": "x" * 1000, "max_tokens": 2}),
    ("chat/completions", {"messages": [{"role": "user", "content": "x" * 1000}], "max_tokens": 2}),
])
def test_tokenizing_a_long_prompt_does_not_freeze_other_clients(route, body):
    """Tokenization and the chat template run in a worker thread: while one prompt takes 2 s to tokenize,
    /health answers and another client's stream keeps flowing."""
    with fake_server(step_delay=0.01, tokenizer=SlowTokenizer(2.0)) as server, HealthProbe(server.url) as probe:
        result = {}

        def slow_request():
            result["r"] = httpx.post(f"{server.url}/v1/{route}", json=body, timeout=60)

        worker = threading.Thread(target=slow_request)
        worker.start()
        gaps, last = [], None
        with httpx.stream("POST", server.url + "/v1/completions", timeout=60,
                          json={"prompt": [1, 2], "max_tokens": 250, "stream": True}) as stream:
            for line in stream.iter_lines():
                now = time.perf_counter()
                if line.startswith("data: {"):
                    if last is not None:
                        gaps.append(now - last)
                    last = now
        worker.join(60)
    assert result["r"].status_code == 200, result["r"].text
    print(f"\nwhile tokenizing for 2 s: /health max {max(probe.latencies) * 1000:.0f} ms, longest gap between "
          f"stream chunks {max(gaps) * 1000:.0f} ms")
    assert max(probe.latencies) < 1.0 and max(gaps) < 1.0


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data",
                                          None])
def test_a_body_that_is_not_declared_json_gets_a_415(content_type):
    """What a browser can send cross-origin without a CORS preflight: text/plain, a form. Refused before parsing."""
    with fake_server() as server:
        headers = {"content-type": content_type} if content_type else {}
        body = json.dumps({"prompt": [5, 6], "max_tokens": 2})
        r = httpx.post(server.url + "/v1/completions", content=body, headers=headers)
        assert r.status_code == 415, r.text
        assert r.json()["error"]["code"] == "unsupported_media_type"
        assert server.app.state.engine_client.stats.num_requests_total == 0
        ok = httpx.post(server.url + "/v1/completions", content=body,
                        headers={"content-type": "application/json; charset=utf-8"})
        assert ok.status_code == 200, ok.text


def test_the_api_key_is_required_on_v1_when_set(monkeypatch):
    import openai

    with fake_server(api_key="s3cret") as server:
        body = {"prompt": [5, 6], "max_tokens": 2}
        for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": "s3cret"},
                        {"authorization": "Basic s3cret"}):
            r = httpx.post(server.url + "/v1/completions", json=body, headers=headers)
            assert r.status_code == 401, (headers, r.text)
            assert r.json()["error"]["code"] == "invalid_api_key" and r.headers["www-authenticate"] == "Bearer"
        assert httpx.get(server.url + "/v1/models").status_code == 401
        ok = httpx.post(server.url + "/v1/completions", json=body, headers={"authorization": "Bearer s3cret"})
        assert ok.status_code == 200 and ok.json()["choices"][0]["text"] == expected_text(ok.json()["id"], 2)
        assert httpx.get(server.url + "/health").status_code == 200  # probes need no key, as in vLLM
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="s3cret", max_retries=0)
        assert client.completions.create(model="fake", prompt=[5], max_tokens=1).usage.completion_tokens == 1
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=server.url + "/v1", api_key="nope", max_retries=0).models.list()
    monkeypatch.setenv("MINILLM_API_KEY", "from-env")
    with fake_server() as server:
        assert httpx.get(server.url + "/v1/models").status_code == 401
        assert httpx.get(server.url + "/v1/models", headers={"authorization": "Bearer from-env"}).status_code == 200
    monkeypatch.delenv("MINILLM_API_KEY")
    with fake_server() as server:  # no key anywhere: open, as before
        assert httpx.get(server.url + "/v1/models").status_code == 200


def test_a_foreign_host_header_is_refused_on_loopback():
    """DNS rebinding: a page on evil.example whose name now resolves to 127.0.0.1 sends Host: evil.example."""
    with fake_server() as server:
        port = server.port
        for host in ("evil.example", f"evil.example:{port}", "192.168.1.10"):
            r = httpx.get(server.url + "/v1/models", headers={"host": host})
            assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_host", (host, r.text)
        for host in (f"127.0.0.1:{port}", f"localhost:{port}", "localhost", f"[::1]:{port}"):
            assert httpx.get(server.url + "/v1/models", headers={"host": host}).status_code == 200, host
    with fake_server(allowed_hosts=None) as server:  # what a server listening on other interfaces does
        assert httpx.get(server.url + "/v1/models", headers={"host": "box.lan"}).status_code == 200
    with fake_server(allowed_hosts=["box.lan"]) as server:
        assert httpx.get(server.url + "/v1/models", headers={"host": "box.lan:8000"}).status_code == 200


def test_the_log_line_of_unknown_fields_is_capped(caplog):
    with fake_server() as server, caplog.at_level(logging.WARNING):
        body = {"prompt": [5], "max_tokens": 1, **{f"field_{i:06d}": 1 for i in range(30000)}}
        r = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
    lines = [rec.getMessage() for rec in caplog.records if "unknown request fields" in rec.getMessage()]
    assert lines and max(len(line) for line in lines) < 1000, [len(line) for line in lines]
    assert "and 29990 more" in lines[0]


def test_stopping_the_server_ends_requests_in_flight():
    """BackgroundServer.stop() with a stream and a non-streaming request running: both end at once, the stream
    with an error event and [DONE], the other with a 503 error body; stop() returns within seconds."""
    server = fake_server(step_delay=0.01).start()
    got: dict = {}

    def full():
        got["full"] = httpx.post(server.url + "/v1/completions", json={"prompt": [3], "max_tokens": 3000},
                                 timeout=60)

    worker = threading.Thread(target=full)
    worker.start()
    events = []
    with httpx.stream("POST", server.url + "/v1/completions", timeout=60,
                      json={"prompt": [1, 2], "max_tokens": 3000, "stream": True}) as stream:
        for line in stream.iter_lines():
            if line:
                events.append(line)
            if len(events) == 3:
                t = time.perf_counter()
                stopper = threading.Thread(target=server.stop)
                stopper.start()
    stopper.join(30)
    took = time.perf_counter() - t
    worker.join(30)
    assert not stopper.is_alive() and took < 5, took
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[-2][len("data: "):])["error"]["code"] == "request_aborted", events[-2]
    assert got["full"].status_code == 503, got["full"].text[-300:]
    assert got["full"].json()["error"]["type"] == "internal_error"


# ------------------------------------------------------------------------------------ the real command line
@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    """A random Llama saved as a Hugging Face directory (config.json + safetensors, written directly: importing
    transformers' model classes would cost seconds), without a tokenizer: prompts are token ids. Slow enough per
    token (4096 positions, 4 layers) that a long request is still running when the test signals the server."""
    import torch
    from safetensors.torch import save_file

    path = tmp_path_factory.mktemp("tiny-llama")
    hidden, inter, layers, heads, kv_heads, vocab = 128, 256, 4, 4, 2, 256
    head_dim = hidden // heads
    config = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": vocab,
              "hidden_size": hidden, "intermediate_size": inter, "num_hidden_layers": layers,
              "num_attention_heads": heads, "num_key_value_heads": kv_heads, "max_position_embeddings": 4096,
              "rms_norm_eps": 1e-6, "tie_word_embeddings": False}
    (path / "config.json").write_text(json.dumps(config))
    g = torch.Generator().manual_seed(0)
    shapes = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,),
              "lm_head.weight": (vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes.update({p + "self_attn.q_proj.weight": (heads * head_dim, hidden),
                       p + "self_attn.k_proj.weight": (kv_heads * head_dim, hidden),
                       p + "self_attn.v_proj.weight": (kv_heads * head_dim, hidden),
                       p + "self_attn.o_proj.weight": (hidden, heads * head_dim),
                       p + "mlp.gate_proj.weight": (inter, hidden), p + "mlp.up_proj.weight": (inter, hidden),
                       p + "mlp.down_proj.weight": (hidden, inter),
                       p + "input_layernorm.weight": (hidden,), p + "post_attention_layernorm.weight": (hidden,)})
    tensors = {name: torch.ones(shape) if len(shape) == 1 else torch.randn(shape, generator=g) * 0.05
               for name, shape in shapes.items()}
    save_file(tensors, str(path / "model.safetensors"))
    return path


def _serve(model, *extra: str) -> subprocess.Popen:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1")
    env.pop("MINILLM_API_KEY", None)
    cmd = [sys.executable, "-m", "minillm", "serve", "--model", str(model), "--uvicorn-log-level", "warning",
           "--num-gpu-blocks", "600", "--block-size", "16", *extra]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _wait_up(proc: subprocess.Popen, url: str) -> None:
    deadline = time.monotonic() + 120
    while True:
        if proc.poll() is not None:
            pytest.fail(f"the server exited with {proc.returncode}:\n{proc.stdout.read()[-3000:]}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "the server did not come up"
        time.sleep(0.1)


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_with_requests_in_flight_exits_0_within_5_s(tiny_checkpoint, sig):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = _serve(tiny_checkpoint, "--port", str(port))
    try:
        _wait_up(proc, url)
        got: dict = {}

        def full():
            try:
                got["full"] = httpx.post(url + "/v1/completions", timeout=60,
                                         json={"prompt": [1, 2, 3], "max_tokens": 4000, "ignore_eos": True})
            except httpx.TransportError as e:  # the connection closed without an answer: counted as a failure
                got["full"] = e

        worker = threading.Thread(target=full)
        worker.start()
        events: list[str] = []

        def stream():  # no tokenizer, so no text: the chunks come only at the end; read them in a thread
            with httpx.stream("POST", url + "/v1/completions", timeout=60,
                              json={"prompt": [4, 5], "max_tokens": 4000, "ignore_eos": True, "stream": True}) as r:
                events.extend(line for line in r.iter_lines() if line)

        reader = threading.Thread(target=stream)
        reader.start()
        deadline = time.monotonic() + 30
        while (stats := httpx.get(url + "/debug/kv_cache").json())["num_unfinished_requests"] < 2 \
                or stats["num_steps"] < 20:
            assert time.monotonic() < deadline, stats
            time.sleep(0.02)
        t = time.perf_counter()
        proc.send_signal(sig)
        code = proc.wait(10)
        took = time.perf_counter() - t
        worker.join(10)
        reader.join(10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    output = proc.stdout.read()
    print(f"\n{signal.Signals(sig).name}: exit {code} after {took:.2f} s")
    assert code == 0 and took < 5, (code, took, output[-3000:])
    assert "Traceback" not in output, output[-3000:]
    # No --dtype: the server ran at auto, what this CPU's flags pick (both picks: tests/engine/test_serving_dtype.py).
    assert f"minillm: dtype {preferred_cpu_dtype()}" in output.splitlines(), output[-3000:]
    assert events[-1] == "data: [DONE]" and '"request_aborted"' in events[-2], events[-2:]
    assert isinstance(got["full"], httpx.Response) and got["full"].status_code == 503, got["full"]


@pytest.mark.parametrize("args,message", [
    (["--port", "70000"], "argument --port: must be in [0, 65535], got 70000"),
    (["--host", "999.1.1.1"], "cannot listen on 999.1.1.1"),
    (["--max-request-body-bytes", "0"], "must be a positive integer, got 0"),
])
def test_bad_serve_arguments_fail_before_the_model_loads(tmp_path, capsys, args, message):
    """Checked before the model is loaded: the model path here does not even exist, so the only error that can
    come out is the argument's own (exit status 2, one line, no traceback, no "serving on")."""
    from minillm.entrypoints.openai.api_server import main

    try:
        code = main(["--model", str(tmp_path / "no-model"), *args])
    except SystemExit as e:  # argparse's own refusal
        code = e.code
    out = capsys.readouterr()
    assert code == 2, out.err[-2000:]
    assert message in out.err and "Traceback" not in out.err and "serving" not in out.out, out.err


@pytest.mark.slow
def test_a_dead_engine_core_gives_503_and_health_says_so(tiny_checkpoint):
    """``serve`` runs the engine core in a process of its own. Killed mid-request: the request in flight gets a
    503 with a JSON body, so does every new one, ``/health`` answers 503, and the server stops cleanly after."""
    import psutil

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = _serve(tiny_checkpoint, "--port", str(port))
    try:
        _wait_up(proc, url)
        cores = [p for p in psutil.Process(proc.pid).children() if "resource_tracker" not in " ".join(p.cmdline())]
        assert len(cores) == 1, cores  # the engine core
        got: dict = {}
        worker = threading.Thread(target=lambda: got.update(r=httpx.post(
            url + "/v1/completions", timeout=60, json={"prompt": [1, 2, 3], "max_tokens": 4000, "ignore_eos": True})))
        worker.start()
        deadline = time.monotonic() + 30
        while httpx.get(url + "/debug/kv_cache").json()["num_steps"] < 5:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        cores[0].kill()
        worker.join(10)
        assert got["r"].status_code == 503 and got["r"].json()["error"]["code"] == "engine_dead", got["r"].text
        assert "died unexpectedly" in got["r"].json()["error"]["message"]
        new = httpx.post(url + "/v1/completions", timeout=10, json={"prompt": [4, 5], "max_tokens": 3})
        assert new.status_code == 503 and new.json()["error"]["code"] == "engine_dead", new.text
        assert httpx.get(url + "/health", timeout=5).status_code == 503
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(15) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
