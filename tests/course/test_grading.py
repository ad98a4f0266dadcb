"""Grading out of the answer's reach (minillm/course/exercises/grading.py, remote.py, answer_process.py).

The answer runs in a process of its own; a call from the check carries its arguments there and brings back the
result and the arguments' new state, with every object's identity kept. These tests start real answer processes
(each closed at the end, with a timeout on every wait) and check: the state comes back into the check's own objects;
the tripwire runs there, by code; errors keep their type and message; an answer that never returns is stopped; a
reply that asks the grading side to run anything is refused.
"""
from __future__ import annotations

import io
import os
import pickle

import pytest
import torch

from minillm.course.exercises import grading, remote
from minillm.course.exercises.tripwire import DelegationError, guard

SETUP = """
import torch
from minillm.core.block_pool import BlockPool
from minillm.core.sched.scheduler import Scheduler
from minillm.attention.paged import compute_slot_mapping as csm
"""


@pytest.fixture()
def answer():
    """``run(source)`` runs the setup and an answer in a fresh answer process and returns the check's namespace
    with the answer's names bound as proxies; every process is closed afterwards."""
    clients = []

    def run(source: str, timeout_s: float = 60.0) -> dict:
        ns: dict = {"__name__": "__main__"}
        exec(SETUP, ns)  # noqa: S102 - the teacher's cells, in the grading process too
        client = grading.AnswerClient(ns, timeout_s=120.0)
        clients.append(client)
        client.request(("run", "<setup>", SETUP))
        client.bind(client.request(("answer", "<answer>", source)), ns)
        client.timeout_s = timeout_s
        client.sock.settimeout(timeout_s)
        ns["_client"] = client
        return ns

    yield run
    for client in clients:
        client.close()
        assert client.proc.poll() is not None, "an answer process was left running"


def test_state_comes_back_into_the_checks_own_objects(answer):
    ns = answer('''
def my_allocate_slots(pool, req_blocks, num_computed_tokens, num_new_tokens, block_size):
    need = -(-(num_computed_tokens + num_new_tokens) // block_size) - len(req_blocks)
    if need <= 0:
        return []
    if pool.get_num_free_blocks() < need:
        return None
    new = pool.get_new_blocks(need)
    req_blocks.extend(new)
    return new


def fill(cache, view, table, seen, counts):
    view += 1.0          # a view of the cache: the cache changes too
    table["r1"] = [7]
    seen.add(3)
    counts.append(len(seen))
    return cache.sum().item()
''')
    pool = ns["BlockPool"](10, enable_caching=False)
    req_blocks = pool.get_new_blocks(2)
    got = guard("2.2", ns["my_allocate_slots"])(pool, req_blocks, 6, 5, 4)
    assert len(got) == 1 and req_blocks[-1] is got[0] and req_blocks[0] is pool.blocks[req_blocks[0].block_id]
    assert pool.get_num_free_blocks() == 10 - 1 - 3  # block 0 is the null block
    cache = torch.zeros(2, 3)
    table, seen, counts = {}, set(), []
    total = ns["fill"](cache, cache[1], table, seen, counts)
    assert total == 3.0 and cache[1].tolist() == [1.0, 1.0, 1.0] and cache[0].tolist() == [0.0, 0.0, 0.0]
    assert table == {"r1": [7]} and seen == {3} and counts == [1]


def test_the_tripwire_runs_in_the_answers_process_by_code(answer):
    ns = answer('''
import functools


def by_alias(block_ids, start, end, block_size):
    return csm(block_ids, start, end, block_size)


def by_default(block_ids, start, end, block_size, _f=csm):
    return _f(block_ids, start, end, block_size)


_held = [functools.partial(csm)]


def caught(block_ids, start, end, block_size):
    try:
        return _held[0](block_ids, start, end, block_size)
    except AssertionError:
        return torch.zeros(end - start, dtype=torch.long)


class Admission(Scheduler):
    def _schedule_waiting(self, step):
        return super()._schedule_waiting(step)
''')
    for name in ("by_alias", "by_default", "caught"):
        with pytest.raises(DelegationError, match=r"Exercise 2\.1 asks you to write this yourself"):
            guard("2.1", ns[name])([1, 2], 0, 3, 4)
    stand_in = ns["Admission"]
    assert issubclass(stand_in, ns["Scheduler"]) and "_schedule_waiting" in vars(stand_in)
    with pytest.raises(DelegationError, match=r"Scheduler\._schedule_waiting"):
        guard("4.2", stand_in)._schedule_waiting(object.__new__(guard("4.2", stand_in)), None)


def test_errors_keep_their_type_and_message(answer):
    ns = answer('''
def bad(x):
    raise ValueError(f"x is {x}")


def odd(x):
    class Oops(Exception):
        pass
    raise Oops("custom")
''')
    with pytest.raises(ValueError, match="x is 3"):
        ns["bad"](3)
    with pytest.raises(grading.AnswerError, match="custom") as info:
        ns["odd"](1)
    assert type(info.value).__name__ == "Oops"


def test_an_answer_that_never_returns_is_stopped(answer):
    ns = answer('''
def forever():
    while True:
        pass
''', timeout_s=3.0)
    with pytest.raises(remote.WireError, match="more than 3 s"):
        ns["forever"]()
    ns["_client"].proc.wait(timeout=10)


def test_a_reply_cannot_run_code_in_the_grading_process(tmp_path):
    marker = tmp_path / "ran"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    class Patch:
        def __reduce__(self):
            return (exec, ("import minillm.course.exercises.tripwire as t; t.guard = print",))

    for payload in (Evil(), Patch()):
        data = pickle.dumps(("ok", payload, [], ""))
        with pytest.raises(remote.WireError):
            remote.SafeUnpickler(data, lambda pid: None, set()).load()
    assert not marker.exists()
    # what a check needs reads back fine: tensors by value, containers, the engine's own classes
    from minillm.core.block_pool import KVCacheBlock

    class ReplyPickler(pickle.Pickler):
        def reducer_override(self, obj):
            return remote.tensor_reduce(obj) if isinstance(obj, torch.Tensor) else NotImplemented

    t = torch.arange(6, dtype=torch.bfloat16).reshape(2, 3)
    buf = io.BytesIO()
    ReplyPickler(buf).dump((t, [1, {2: 3}], KVCacheBlock(4)))
    data = buf.getvalue()
    back, plain, block = remote.SafeUnpickler(data, lambda pid: None, set()).load()
    assert torch.equal(back, t) and plain == [1, {2: 3}] and block.block_id == 4


def test_a_refused_answer_says_why_wherever_it_is_used():
    error = AssertionError("Exercise 2.1, line 1: refused")
    refused = grading.RefusedAnswer(error)
    with pytest.raises(AssertionError, match="line 1: refused"):
        guard("2.1", refused)
    with pytest.raises(AssertionError, match="line 1: refused"):
        refused(1, 2)


def test_in_a_learners_kernel_the_answer_is_linted_as_grading_lints_it(monkeypatch):
    """In JupyterLab the guard finds the answer in the kernel's input history (its ``# Exercise N.M:`` cell and the
    cells after it, up to a check) and refuses it with the lint's message, as grading does; an honest answer run
    again after a refused one passes."""
    import types

    import IPython

    from minillm.course.exercises.lint import AnswerRefused

    history: list[str] = ["", "import torch\nimport inspect"]
    shell = types.SimpleNamespace(history_manager=types.SimpleNamespace(input_hist_raw=history))
    monkeypatch.setattr(IPython, "get_ipython", lambda: shell)

    def learner(x):
        return x

    history += ["# Exercise 2.1: slots\ndef learner(x):\n    return x",
                "helper = inspect.getsource(learner)",   # a cell of the answer region, after the title cell
                "# Check Exercise 2.1\n..."]
    with pytest.raises(AnswerRefused, match=r"Exercise 2\.1, line \d+: .*inspect"):
        guard("2.1", learner)
    history += ["# Exercise 2.1: slots\ndef learner(x):\n    return x", "# Check Exercise 2.1\n..."]
    assert guard("2.1", learner)(3) == 3
    assert guard("2.2", learner)(4) == 4  # no 2.2 answer in the history: nothing to lint


def test_arrays_generators_and_watched_calls_travel(answer):
    """numpy arrays go there and their new values come back into the check's own array; a numpy scalar and a
    torch generator come back by value; a check's closure goes as a placeholder and comes back as itself; the
    calls a check watches (``grading.recording``) are recorded there and named by the check's own object."""
    import numpy as np

    from minillm.core.block_pool import BlockPool

    ns = answer('''
import numpy as np
import torch

def bump(a, hook):
    a[1] += 5
    return np.int64(7), torch.Generator().manual_seed(3), hook

def free_two(pool, blocks):
    pool.free_blocks(blocks[:1])
    pool.free_blocks(blocks[1:])
''')
    a = np.arange(4, dtype=np.int32)
    hook = (lambda: 1)
    scalar, gen, back = ns["bump"](a, hook)
    assert a.tolist() == [0, 6, 2, 3] and scalar == 7 and back is hook
    assert torch.equal(torch.rand(3, generator=gen), torch.rand(3, generator=torch.Generator().manual_seed(3)))

    pool, other = BlockPool(8, enable_caching=False), BlockPool(8, enable_caching=False)
    blocks = pool.get_new_blocks(2)
    with grading.recording(BlockPool, ["free_blocks"], only=pool) as calls:
        ns["free_two"](pool, blocks)
    assert [name for name, _ in calls] == ["free_blocks", "free_blocks"]
    assert pool.get_num_free_blocks() == 8 - 1  # the null block is never free
    with grading.recording(BlockPool, ["free_blocks"], only=other) as calls:
        ns["free_two"](pool, pool.get_new_blocks(2))
    assert calls == []  # calls on another object than the one watched


def test_the_answers_kernels_are_rebuilt_here_only_if_they_are_triton(monkeypatch):
    """A ``@triton.jit`` kernel of the answer comes back as its source and is rebuilt in the grading process (a
    check traces and launches it there), with the kernels and constants it uses; a kernel that reaches for more than
    Triton (a tensor's handle, its numpy data, ctypes) is not rebuilt, and using it says why."""
    from minillm.course.exercises.answer_kernels import KernelRefused, kernel_problems

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    setup = ("import os\nos.environ['TRITON_INTERPRET'] = '1'\nimport math\nimport torch\nimport triton\n"
             "import triton.language as tl\n")
    ns: dict = {"__name__": "__main__"}
    exec(setup, ns)  # noqa: S102
    client = grading.AnswerClient(ns, timeout_s=120.0)
    try:
        client.request(("run", "<setup>", setup))
        source = '''# Exercise 3.3: double
SCALE = tl.constexpr(2)

@triton.jit
def helper(x):
    return x * SCALE

@triton.jit
def double_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = i < n
    tl.store(out_ptr + i, helper(tl.load(x_ptr + i, mask=ok, other=0.0)).to(out_ptr.dtype.element_ty), mask=ok)

def launch(x):
    out = torch.empty_like(x)
    double_kernel[(triton.cdiv(x.numel(), 8),)](x, out, x.numel(), BLOCK=8)
    return out

@triton.jit
def escape(x_ptr):
    y = x_ptr.handle.data.ctypes
'''
        client.bind(client.request(("answer", "<Exercise 3.3>", source)), ns)
        assert type(ns["double_kernel"]).__name__ == "InterpretedFunction"   # rebuilt here
        assert isinstance(ns["launch"], grading.RemoteFunction)               # a launcher runs there
        x, out = torch.arange(10.0), torch.empty(10)
        ns["double_kernel"][(2,)](x, out, 10, BLOCK=8)
        assert torch.equal(out, 2 * x) and torch.equal(ns["launch"](x), 2 * x)
        with pytest.raises(KernelRefused, match=r"escape .*`\.handle` is not a method of a Triton tensor"):
            ns["escape"][(1,)](x)
    finally:
        client.close()
    assert kernel_problems("def k(p):\n    import os\n", {})
    assert kernel_problems("def k(p):\n    return getattr(p, 'x')\n", {})     # a builtin a kernel has no use for
    assert kernel_problems("def k(p):\n    return triton.runtime\n", {})     # triton: cdiv, next_power_of_2 only
    assert kernel_problems("def k(p):\n    return p.__class__\n", {})
    assert not kernel_problems("def k(p, N: tl.constexpr):\n    return tl.sum(tl.load(p + tl.arange(0, N)), 0)\n", {})
