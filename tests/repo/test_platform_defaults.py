"""What vLLM v0.33.0 does by default depends on the platform: the course says which, and minillm does the same.

``VllmConfig.__post_init__`` resolves async scheduling (on, unless something is incompatible) and then calls the
platform hook, which has the last word: ``CpuPlatform.check_and_update_config`` turns async scheduling off and moves
the single worker into a process of its own. Three things are tied together here, each to the source lines that
``scripts/vllm_index.py`` found in the unpacked release and recorded in the committed index (``"quotes"``):

1. the lines are there, in the order the statements need (the hook after the resolution);
2. minillm resolves the same defaults (``EngineArgs``, ``LLMEngine``, ``multiprocessing_enabled``);
3. the course's prose never calls async scheduling "the default" without saying for which platform, and the
   places that state a default cite the function that sets it.

A failure names the sentence (file and cell or line) or the quote.
"""
from __future__ import annotations

import re

import pytest

from minillm.engine.arg_utils import EngineArgs
from tests.repo.test_vllm_references import INDEX_FILE, _script, course_prose, sentences

CPU_HOOK = "vllm/platforms/cpu.py:CpuPlatform.check_and_update_config"
POST_INIT = "vllm/config/vllm.py:VllmConfig.__post_init__"


@pytest.fixture(scope="module")
def quotes() -> dict[str, dict]:
    import json

    return json.loads(INDEX_FILE.read_text(encoding="utf-8"))["quotes"]


def test_the_index_holds_every_quote_the_script_asks_for(quotes):
    """The index was made by the script as it is now: same keys, same lines (re-run the script after changing
    ``QUOTES``; it checks them against the release)."""
    script_quotes = _script().QUOTES
    assert set(quotes) == set(script_quotes)
    for key, (path, function, lines) in script_quotes.items():
        assert quotes[key]["lines"] == list(lines), key
        assert quotes[key]["where"] == (f"{path}:{function}" if function else path), key
        assert isinstance(quotes[key]["line"], int) and quotes[key]["line"] > 0, key


def test_the_platform_hook_has_the_last_word(quotes):
    """``__post_init__`` sets async scheduling first and calls the platform hook after: the CPU's ``False`` wins."""
    assert quotes["gpu_async_scheduling_on"]["where"] == quotes["platform_hook_last"]["where"] == POST_INIT
    assert quotes["gpu_async_scheduling_on"]["line"] < quotes["async_scheduling_set_true"]["line"] \
        < quotes["platform_hook_last"]["line"]
    assert quotes["cpu_async_scheduling_off"]["where"] == quotes["cpu_worker_process"]["where"] == CPU_HOOK
    assert quotes["cpu_async_scheduling_off"]["lines"][-1] == "scheduler_config.async_scheduling = False"


def test_minillm_resolves_the_same_defaults(quotes, monkeypatch):
    # async scheduling: None is on for a GPU (quote gpu_async_scheduling_on), off on a CPU (cpu_async_scheduling_off)
    assert EngineArgs().resolved_async_scheduling("cuda") is True
    assert EngineArgs().resolved_async_scheduling("cpu") is False
    # An in-process engine follows the same rule: it is a configuration choice, not a property of the process.
    from minillm.engine.llm_engine import LLMEngine
    from tests.engine_helpers import tiny_model

    assert LLMEngine(tiny_model(), None, EngineArgs(num_gpu_blocks=64)).async_scheduling is False
    # One rank: the worker in the engine core's process unless asked (one_rank_uni); vLLM's CPU hook asks for "mp"
    # (cpu_worker_process), which minillm runs when given.
    assert EngineArgs().resolved_distributed_executor_backend() == "uni"
    assert 'distributed_executor_backend = "mp"' in quotes["cpu_worker_process"]["lines"][-1]
    assert EngineArgs(distributed_executor_backend="mp").resolved_distributed_executor_backend() == "mp"
    # The engine core in its own process unless the variable says 0 (engine_core_process: its default is "1").
    from minillm.engine.core_client import multiprocessing_enabled

    assert '"1"' in quotes["engine_core_process"]["lines"][-1]
    monkeypatch.delenv("MINILLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    assert multiprocessing_enabled()


ASYNC_RE = re.compile(r"async(?:hronous)?[ _-]scheduling|AsyncScheduler|step_with_batch_queue|异步调度", re.I)
DEFAULT_RE = re.compile(r"\bdefault|\bby default|默认", re.I)
PLATFORM_RE = re.compile(r"\bGPUs?\b|\bCPUs?\b|CUDA|platform|平台|显卡", re.I)


def unplatformed_default_claims() -> list[str]:
    """Sentences that speak of async scheduling and a default without naming a platform."""
    bad = []
    for file, where, text in course_prose(lambda source: bool(ASYNC_RE.search(source))):
        for _, sentence in sentences(text):
            if ASYNC_RE.search(sentence) and DEFAULT_RE.search(sentence) and not PLATFORM_RE.search(sentence):
                bad.append(f"{file} ({where}): \"{' '.join(sentence.split())[:200]}\"")
    return bad


def test_no_sentence_calls_async_scheduling_the_default_without_its_platform():
    bad = unplatformed_default_claims()
    assert not bad, ("v0.33.0's default depends on the platform (on for a GPU, off on a CPU: "
                     f"{CPU_HOOK}); say which:\n" + "\n".join(bad))


V2_RE = re.compile(r"Model Runner V2|\bMRV2\b")
GPU_ONLY_RE = re.compile(r"\bGPUs?\b|GPU 上")
V2_WHERE_RE = re.compile(r"\bCPUs?\b|Triton|CPU 上")


def gpu_only_runner_claims() -> list[str]:
    """Sentences that call Model Runner V2 the default of a GPU alone: v0.33.0 picks it wherever Triton runs
    (quote v2_runner_needs_triton), a CPU build with triton-cpu included (quote cpu_v2_runner)."""
    bad = []
    for file, where, text in course_prose(lambda source: bool(V2_RE.search(source))):
        for _, sentence in sentences(text):
            if (V2_RE.search(sentence) and DEFAULT_RE.search(sentence) and GPU_ONLY_RE.search(sentence)
                    and not V2_WHERE_RE.search(sentence)):
                bad.append(f"{file} ({where}): \"{' '.join(sentence.split())[:200]}\"")
    return bad


def test_model_runner_v2_is_not_called_the_default_of_a_gpu_alone(quotes):
    assert quotes["v2_runner_needs_triton"]["where"] == "vllm/config/vllm.py:VllmConfig.use_v2_model_runner"
    assert quotes["cpu_v2_runner"]["where"] == "vllm/v1/worker/cpu_worker.py:CPUWorker.init_device"
    bad = gpu_only_runner_claims()
    assert not bad, ("Model Runner V2 is v0.33.0's default wherever Triton runs and the model is supported, a CPU "
                     "with triton-cpu too (vllm/v1/worker/cpu/model_runner.py:CPUModelRunner); say so:\n"
                     + "\n".join(bad))


@pytest.mark.parametrize("sentence, fails", [
    ("In v0.33.0 async scheduling is on by default.", True),
    ("Async scheduling (vLLM v0.33.0's default) plans step N+1 early.", True),
    ("On a GPU async scheduling is on by default; on a CPU the platform hook turns it off.", False),
    ("异步调度是 vLLM 的默认设置。", True),
    ("在 GPU 上，异步调度默认开启。", False),
    ("The default dtype is fp32.", False),
])
def test_the_rule_on_single_sentences(sentence, fails):
    found = [s for _, s in sentences(sentence)
             if ASYNC_RE.search(s) and DEFAULT_RE.search(s) and not PLATFORM_RE.search(s)]
    assert bool(found) is fails


# Where the course states a platform default, it cites the function that sets it (the quotes above).
CITES = {
    "minillm/engine/arg_utils.py": [CPU_HOOK, POST_INIT],
    "notebooks/06_engine.ipynb": [CPU_HOOK, POST_INIT],
    "notebooks/10_engine_core.ipynb": [CPU_HOOK, POST_INIT],
}


@pytest.mark.parametrize("path", sorted(CITES))
def test_the_places_that_state_a_default_cite_where_it_is_set(path):
    from tests.repo.test_vllm_references import REPO

    text = (REPO / path).read_text(encoding="utf-8")
    for cite in CITES[path]:
        # In a notebook's JSON a path may be split by markup: look for the file and the function separately.
        file, function = cite.split(":")
        assert file in text and function in text, f"{path} states a default but does not cite {cite}"
