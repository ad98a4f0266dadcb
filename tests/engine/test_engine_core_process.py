"""The engine core in its own process: same tokens as in-process, and every way it can go wrong handled.

Tokens: the tiny model's workload (chunked prefill, prefix hits, stop ids, seeded sampling, staggered arrivals)
through ``SyncMPClient`` with async scheduling on and off, and through ``AsyncMPClient`` (``AsyncLLM``), equals the
in-process synchronous engine's. SmolLM2's oracle tests through the process are in
``tests/engine/test_engine_vs_transformers.py``.

Faults: the core killed mid-generate gives ``EngineDeadError`` within 5 s; no core process outlives ``del``,
``shutdown()``, the interpreter's exit or a SIGKILL of its parent (checked with ``psutil``); a bad request is
refused in the caller's process and never reaches the core; Ctrl-C in ``generate`` leaves a usable engine; the core
finishes its steps while nobody reads its outputs.
"""
from __future__ import annotations

import _thread
import asyncio
import gc
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from minillm.engine import EngineDeadError
from minillm.engine.arg_utils import EngineArgs
from minillm.engine.async_llm import AsyncLLM
from minillm.engine.llm_engine import LLMEngine
from minillm.sampling_params import SamplingParams
from tests.engine_helpers import single_thread, tiny_model  # noqa: F401
from tests.engine.test_engine_core import run, workload

pytestmark = [pytest.mark.usefixtures("single_thread"), pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]
ARGS = dict(long_prefill_token_threshold=5, max_num_batched_tokens=24, block_size=4, num_gpu_blocks=300,
            max_num_seqs=5)


def wait_gone(pid: int, timeout: float = 10.0) -> bool:
    """``True`` once no live process has ``pid`` (a zombie counts as gone: it runs nothing)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.05)
    return False


def mp_engine(async_scheduling: bool | None = True, **args) -> LLMEngine:
    return LLMEngine(tiny_model(), None, EngineArgs(async_scheduling=async_scheduling, **(args or ARGS)),
                     multiprocess_mode=True)


@pytest.fixture(scope="module")
def reference() -> dict[str, list[int]]:
    return run(LLMEngine(tiny_model(), None, EngineArgs(**ARGS)), workload(seed=7, seeded_sampling=True))


@pytest.mark.parametrize("async_scheduling", [True, None], ids=["async", "sync (the CPU default)"])
def test_sync_mp_client_gives_the_in_process_tokens(reference, async_scheduling):
    engine = mp_engine(async_scheduling)
    try:
        assert engine.async_scheduling is bool(async_scheduling)
        assert engine.engine_core.ready["async_scheduling"] is engine.async_scheduling
        pid = engine.engine_core.proc.pid
        assert pid != os.getpid() and psutil.Process(pid).is_running()
        assert run(engine, workload(seed=7, seeded_sampling=True)) == reference
        assert engine.get_num_free_blocks() == engine.num_gpu_blocks - 1
        assert engine.stats.num_requests == len(reference) and engine.stats.num_cached_prompt_tokens > 0
        with pytest.raises(AttributeError, match="lives in the engine-core process"):
            engine.scheduler  # noqa: B018
    finally:
        engine.shutdown()
    assert wait_gone(pid)


def test_async_llm_over_the_async_mp_client_gives_the_in_process_tokens(reference):
    llm = AsyncLLM(tiny_model(), None, EngineArgs(async_scheduling=True, **ARGS), multiprocess_mode=True)
    requests = workload(seed=7, seeded_sampling=True)

    async def one(arrival, rid, prompt, params, priority):
        await asyncio.sleep(0.01 * arrival)  # staggered: later requests join running steps
        final = None
        async for out in llm.generate(rid, prompt, params, priority):
            final = out
        return rid, final.outputs[0].token_ids

    async def main():
        return dict(await asyncio.gather(*(one(*r) for r in requests)))

    try:
        assert asyncio.run(main()) == reference
        assert llm.stats.num_finished == len(requests) and llm.stats.num_unfinished_requests == 0
    finally:
        llm.shutdown()
    assert wait_gone(llm.engine_core.proc.pid)


def test_a_killed_core_gives_engine_dead_error_within_5_seconds():
    engine = mp_engine(max_num_batched_tokens=64, num_gpu_blocks=200, block_size=4)
    pid = engine.engine_core.proc.pid
    killed_at: list[float] = []

    def kill_soon():
        time.sleep(0.5)
        killed_at.append(time.monotonic())
        os.kill(pid, signal.SIGKILL)

    threading.Thread(target=kill_soon, daemon=True).start()
    long = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
    try:
        with pytest.raises(EngineDeadError, match=rf"pid {pid}\) died unexpectedly \(exit code -9\)"):
            while True:  # one request after another, so the kill lands in a generate
                engine.add_request(f"r{time.monotonic_ns()}", list(range(1, 40)), long)
                while engine.has_requests():
                    engine.step()
        assert time.monotonic() - killed_at[0] < 5.0
        with pytest.raises(EngineDeadError):  # and every later call
            engine.add_request("again", [1, 2, 3], long)
    finally:
        engine.shutdown()
    assert wait_gone(pid)


def test_no_core_process_outlives_del_or_shutdown():
    engine = mp_engine()
    pid = engine.engine_core.proc.pid
    del engine
    gc.collect()
    assert wait_gone(pid), "deleting the engine must stop its core process"
    engine = mp_engine()
    pid = engine.engine_core.proc.pid
    engine.shutdown()
    engine.shutdown()  # idempotent
    assert wait_gone(pid)
    with pytest.raises(EngineDeadError, match="shut down"):
        engine.add_request("late", [1, 2], SamplingParams())


SCRIPT = """
import os, signal, sys, time
sys.path.insert(0, {root!r})
from minillm.engine.arg_utils import EngineArgs
from minillm.engine.llm_engine import LLMEngine
from tests.engine_helpers import tiny_model

if __name__ == "__main__":
    engine = LLMEngine(tiny_model(), None, EngineArgs(num_gpu_blocks=64), multiprocess_mode=True)
    print(engine.engine_core.proc.pid, flush=True)
    if sys.argv[1] == "sleep":
        time.sleep(60)   # the test SIGKILLs us here
"""


@pytest.mark.parametrize("how", ["exit", "sigkill"])
def test_no_core_process_outlives_its_parent(tmp_path, how):
    """At the interpreter's exit the finalizer stops the core; when the parent is SIGKILLed (no finalizer runs),
    the core sees the pipe to its parent close and exits by itself."""
    script = tmp_path / "parent.py"
    script.write_text(SCRIPT.format(root=str(ROOT)))
    proc = subprocess.Popen([sys.executable, str(script), "sleep" if how == "sigkill" else "exit"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line.strip().isdigit(), proc.stderr.read() if proc.poll() is not None else line
        core_pid = int(line)
        if how == "sigkill":
            proc.kill()
        proc.wait(timeout=60)
        assert wait_gone(core_pid), f"the core (pid {core_pid}) outlived its parent ({how})"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)


UNGUARDED = """
import dataclasses, sys
sys.path.insert(0, {root!r})
from minillm.engine.arg_utils import EngineArgs
from minillm.engine.llm_engine import LLMEngine
from minillm.model.llama import LlamaForCausalLM
from tests.engine_helpers import TINY

# No `if __name__ == "__main__":`. 40 layers: the pickled model is larger than a pipe's buffer (64 KiB), the case
# in which sending it with the process's start-up data blocked forever once the child had died.
model = LlamaForCausalLM(dataclasses.replace(TINY, num_hidden_layers=40))
LLMEngine(model, None, EngineArgs(num_gpu_blocks=64), multiprocess_mode=True)
"""


def test_a_script_without_a_main_guard_gets_the_reason_not_a_hang(tmp_path):
    """spawn imports the script again in the core's process, which fails there (multiprocessing refuses to start a
    process while bootstrapping); the script's own engine must then say why, not wait forever."""
    script = tmp_path / "unguarded.py"
    script.write_text(UNGUARDED.format(root=str(ROOT)))
    try:
        done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"the script hung: {e}")
    assert done.returncode == 1
    assert 'must do it under `if __name__ == "__main__":`' in done.stderr, done.stderr[-2000:]


def test_a_bad_request_is_refused_here_and_never_reaches_the_core():
    engine = mp_engine()
    try:
        for prompt, params, message in [([1, 2, 10**6], None, "token ids must be integers in"),
                                        ([], None, "the prompt is empty"),
                                        ([1, 2], {"temperature": -1.0}, "temperature"),
                                        ("text", None, "this engine has no tokenizer")]:
            with pytest.raises(ValueError, match=message):
                engine.add_request("bad", prompt, params)
        assert engine.engine_core.call_utility("get_stats").engine.num_requests == 0
        engine.add_request("good", [1, 2, 3], SamplingParams(max_tokens=2, ignore_eos=True))
        while engine.has_requests():
            engine.step()
        assert engine.engine_core.get_stats().engine.num_requests == 1
    finally:
        engine.shutdown()


def test_ctrl_c_in_generate_leaves_a_usable_engine():
    """``interrupt_main`` acts only where SIGINT has Python's handler, as in a terminal or a notebook. A pytest
    worker may have inherited SIG_IGN from an earlier test (an IPython kernel app ignores SIGINT): then the Ctrl-C
    never came and the loop below ran until pytest's 15-minute timeout. So the handler is set here, and the loop
    gives up after 60 s."""
    engine = mp_engine(max_num_batched_tokens=64, num_gpu_blocks=200, block_size=4)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        threading.Timer(0.5, _thread.interrupt_main).start()
        long = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
        deadline = time.monotonic() + 60
        with pytest.raises(KeyboardInterrupt):
            for i in range(10_000):
                assert time.monotonic() < deadline, "no KeyboardInterrupt within 60 s of interrupt_main"
                engine.add_request(f"long{i}", list(range(1, 30)), long)
                while engine.has_requests():
                    engine.step()
        signal.signal(signal.SIGINT, previous)
        engine.abort_request([f"long{i}" for i in range(10_000)])  # what LLM.generate does on Ctrl-C
        short = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
        reference = LLMEngine(tiny_model(), None, EngineArgs(num_gpu_blocks=64))
        want = run(reference, [(0, "x", [5, 6, 7], short, 0)])
        assert run(engine, [(0, "x", [5, 6, 7], short, 0)]) == want
        deadline = time.monotonic() + 10
        while engine.engine_core.call_utility("get_num_unfinished_requests") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert engine.engine_core.call_utility("get_num_unfinished_requests") == 0
        assert engine.get_num_free_blocks() == engine.num_gpu_blocks - 1
    finally:
        signal.signal(signal.SIGINT, previous)
        engine.shutdown()


def test_the_core_steps_on_while_nobody_reads_its_outputs(monkeypatch):
    """The client's output thread starts reading only after 3 s: by then the core has run every step (the
    timestamps it put on its outputs are all earlier), so it never waited for the socket to drain."""
    import minillm.engine.core_client as core_client

    real = core_client._process_outputs
    started: list[float] = []

    def late_reader(*args):
        time.sleep(3.0)
        started.append(time.monotonic())
        real(*args)

    monkeypatch.setattr(core_client, "_process_outputs", late_reader)
    engine = mp_engine(max_num_batched_tokens=64, num_gpu_blocks=200, block_size=4)
    try:
        t0 = time.monotonic()
        params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
        for i in range(4):
            engine.add_request(f"r{i}", list(range(1 + i, 20 + i)), params)
        last = 0.0
        finished = 0
        while finished < 4:
            outputs = engine.engine_core.get_output()
            last = max(last, outputs.timestamp)
            finished += sum(o.finished for o in outputs.outputs)
            engine._process_engine_outputs(outputs)
        assert started and last < started[0], "the core waited for the client to read"
        assert last - t0 < 3.0
    finally:
        engine.shutdown()
