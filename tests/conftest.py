"""Shared test set-up: Triton's interpreter without a GPU, offline Hugging Face, seeds, one model per session."""
import os
import random

# Must happen before anything defines a @triton.jit function: Triton picks its driver then ("0 active drivers" after).
try:
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
except ImportError:  # pragma: no cover
    pass
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

# CI's 2 cores are slow and shared by 2 xdist workers: no per-example deadline, and a fixed seed so a failure
# reproduces (hypothesis prints the failing example either way).
settings.register_profile("minillm", deadline=None, derandomize=True,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.load_profile("minillm")


@pytest.fixture(autouse=True)
def _seed_everything():
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    yield


@pytest.fixture(scope="session")
def smollm():
    """``(model, tokenizer)``: SmolLM2-135M-Instruct loaded once per test process (fp32, CPU)."""
    import minillm

    return minillm.load_model()


@pytest.fixture(scope="session")
def model(smollm):
    return smollm[0]


@pytest.fixture(scope="session")
def tokenizer(smollm):
    return smollm[1]


@pytest.fixture(scope="session")
def hf_oracle():
    """transformers' own GGUF loading of the same file, fp32: the independent reference for logits."""
    from transformers import AutoModelForCausalLM

    import minillm

    path = minillm.default_model_path()
    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Keep each phase's report on the test item (``item.rep_call``), so a fixture's teardown can tell whether the
    test failed (tests/lab/test_browser.py saves a screenshot then)."""
    outcome = yield
    rep = outcome.get_result()
    setattr(item, f"rep_{rep.when}", rep)



def _live_children() -> list:
    import psutil

    out = []
    for p in psutil.Process().children(recursive=True):
        try:
            # Python's own helper that outlives every spawn, and exits with us: not a process of ours.
            helper = "multiprocessing.resource_tracker" in " ".join(p.cmdline())
            if p.status() != psutil.STATUS_ZOMBIE and not helper:
                out.append(p)
        except psutil.NoSuchProcess:
            pass
    return out


@pytest.fixture(scope="session", autouse=True)
def _no_process_left_behind():
    """When the run ends, no process of ours is left: every test that starts one (an engine core, ranks, a
    server, a kernel) stops it. Checked in each xdist worker (a failure here is an error of the last test)."""
    import time

    yield
    deadline = time.monotonic() + 20  # a core or a rank told to stop may take a moment to exit
    while (left := _live_children()) and time.monotonic() < deadline:
        time.sleep(0.2)
    described = []
    for p in left:
        try:
            described.append(f"pid {p.pid}: {' '.join(p.cmdline())[:160]}")
        except Exception:  # noqa: BLE001 - it exited while we looked
            pass
    assert not described, "processes left running after the tests:\n" + "\n".join(described)
