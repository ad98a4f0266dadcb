"""SmolLM2 served on 3 tensor-parallel ranks (``make test-tp``; about 3 minutes with the OpenAI server tests).

Kept out of ``make test``: the tiny model's tensor-parallel tests there (``tests/engine/test_tensor_parallel_engine.py``)
cover the same code in seconds. Here: ``LLM(tensor_parallel_size=3, async_scheduling=True)`` (its engine-core process starts three
ranks) gives the greedy tokens of one process on the shared test prompts, chat-templated ones
included, with chunked prefill and prefix-cache hits; ``python -m minillm serve --tensor-parallel-size 3`` stops
cleanly on SIGTERM with a request in flight, and leaves no process behind. ``make test-tp`` also runs
``tests/engine/test_server.py`` against ``--tensor-parallel-size 3`` (``MINILLM_TEST_SERVER_ARGS``).
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import psutil
import pytest

from minillm.sampling_params import SamplingParams
from tests.engine_helpers import single_thread  # noqa: F401
from tests.net_helpers import free_port
from tests.engine.test_engine_core_process import wait_gone
from tests.engine.test_serving_safely import _wait_up

pytestmark = [pytest.mark.usefixtures("single_thread"), pytest.mark.slow]


def test_smollm2_at_tp3_gives_the_tokens_of_one_process():
    import minillm
    from minillm import LLM
    from tests.engine.prompts import CHAT_PROMPTS, PLAIN_PROMPTS

    params = SamplingParams(temperature=0.0, max_tokens=16)
    one = LLM(max_model_len=512)
    try:
        prompts = PLAIN_PROMPTS + [minillm.chat_prompt_ids(one.get_tokenizer(), q) for q in CHAT_PROMPTS]
        want = [o.outputs[0].token_ids for o in one.generate(prompts, params, use_tqdm=False)]
        paris = one.get_tokenizer().decode(want[len(PLAIN_PROMPTS)])
    finally:
        one.shutdown()
    assert "Paris" in paris
    llm = LLM(max_model_len=512, tensor_parallel_size=3, max_num_batched_tokens=32,  # chunked prefill
              async_scheduling=True)
    try:
        core = psutil.Process(llm.llm_engine.engine_core.proc.pid)
        ranks = [p for p in core.children() if "multiprocessing" in " ".join(p.cmdline())]
        assert len(ranks) == 3, [p.cmdline() for p in core.children()]
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        again = [o.outputs[0].token_ids for o in llm.generate(prompts[-2:], params, use_tqdm=False)]
    finally:
        llm.shutdown()
    assert got == want
    assert again == want[-2:]  # prefix-cache hits (the chat template's system prompt) on every rank's cache
    assert all(wait_gone(p.pid) for p in ranks)

def test_serve_with_3_ranks_stops_cleanly_on_sigterm():
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    proc = subprocess.Popen([sys.executable, "-m", "minillm", "serve", "--port", str(port), "--max-model-len", "512",
                             "--dtype", "float32", "--tensor-parallel-size", "3", "--uvicorn-log-level", "warning"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    family: list[psutil.Process] = []
    try:
        _wait_up(proc, url)
        family = psutil.Process(proc.pid).children(recursive=True)
        ranks = [p for p in family if any("multiprocessing" in part for part in p.cmdline())]
        assert len(ranks) >= 4, [p.cmdline() for p in family]  # the engine core and its 3 ranks
        answer = httpx.post(url + "/v1/completions", timeout=120,
                            json={"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0})
        assert answer.status_code == 200 and answer.json()["choices"][0]["text"]
        got: dict = {}

        def in_flight():
            try:
                got["r"] = httpx.post(url + "/v1/completions", timeout=60,
                                      json={"prompt": [1, 2, 3], "max_tokens": 2000, "ignore_eos": True})
            except httpx.TransportError as e:
                got["r"] = e

        worker = threading.Thread(target=in_flight)
        worker.start()
        time.sleep(1.0)
        t = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(30)
        took = time.monotonic() - t
        worker.join(30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert code == 0 and took < 10, (code, took, proc.stdout.read()[-3000:])
    assert all(wait_gone(p.pid) for p in family), "a rank or the engine core outlived serve"
