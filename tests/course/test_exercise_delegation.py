"""No check passes an answer that delegates to the package (issue 24), and the tripwire that makes it so.

- For every exercise of ``solutions/``, the answer in ``tests/course/delegating_answers.py`` (it calls the package's own
  implementation of the part: by name, through a module, through ``super()``, or by being the package's object)
  fails its check cell with "asks you to write this yourself".
- The tripwire itself (``minillm/course/exercises/tripwire.py``): every target resolves; every name it replaces is put
  back when the learner's call returns or raises; the reference is never tripped outside the learner's call; a class
  that inherits the method its exercise asks for is refused.
"""
from __future__ import annotations

import re
from pathlib import Path

import nbformat
import pytest
import torch

from minillm.course.exercises.tripwire import BUILDS, DelegationError, _resolve, building, guard, targets_of
from tests.course.delegating_answers import DELEGATING, NOTEBOOK, answer_cell
from tests.course.exercise_helpers import run_check_with_answer

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _model_loaded_once(request):
    """The notebooks' set-up cells call ``minillm.load_model()``: hand them the session's SmolLM2 (they only read
    it) instead of loading it again for every check run. Only the tests that run a model-loading notebook ask."""
    callspec = getattr(request.node, "callspec", None)
    if callspec is None or callspec.params.get("number") not in SLOW:
        yield
        return
    import minillm

    smollm, real = request.getfixturevalue("smollm"), minillm.load_model
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(minillm, "load_model", lambda *a, **k: smollm if not a and not k else real(*a, **k))
        yield


_TITLE = re.compile(r"^# (Exercise (\d+\.\d+)|Challenge (\d+)):")


def _numbers_in_solutions() -> tuple[set[str], set[str]]:
    exercises, challenges = set(), set()
    for path in sorted((ROOT / "solutions").glob("*.ipynb")):
        for cell in nbformat.read(path, as_version=4).cells:
            m = _TITLE.match(cell.source) if cell.cell_type == "code" else None
            if m and m.group(2):
                exercises.add(m.group(2))
            elif m:
                challenges.add(m.group(3))
    return exercises, challenges


def test_every_exercise_has_tripwire_targets_and_a_delegating_answer():
    exercises, challenges = _numbers_in_solutions()
    assert set(BUILDS) == exercises, f"BUILDS must list exactly the exercises of solutions/: {sorted(exercises)}"
    assert set(DELEGATING) == exercises
    for number in challenges:  # a challenge's module lists its targets, the reference first
        targets = targets_of(f"C{number}")
        assert targets and targets[0].startswith(f"minillm.course.exercises.challenges.ch{int(number):02d}:"), targets


@pytest.mark.parametrize("target", sorted({t for ts in BUILDS.values() for t in ts}))
def test_every_target_resolves(target):
    owner, name, obj = _resolve(target)
    assert callable(obj) or hasattr(obj, "__get__"), f"{target} is not a function, method or kernel: {obj!r}"


SLOW = {"0.2", "1.4", "6.1", "6.2", "8.1", "9.1", "9.2", "3.2", "3.3"}  # they load the model or run a kernel


@pytest.mark.parametrize("number", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n
                                    for n in sorted(DELEGATING, key=lambda n: tuple(map(int, n.split("."))))])
def test_a_delegating_answer_fails_its_check(number):
    error = run_check_with_answer(NOTEBOOK[number.split(".")[0]], number, answer_cell(number))
    assert error is not None, f"the check of exercise {number} passed an answer that calls the package"
    assert f"Exercise {number} asks you to write this yourself" in str(error), (
        f"the check of exercise {number} failed for another reason than the delegation: "
        f"{type(error).__name__}: {str(error)[:600]}")


# -- the tripwire's mechanics -------------------------------------------------------------------------------------------
def test_nothing_is_replaced_and_the_code_is_refused_by_any_name():
    """The tripwire refuses the code, not a name: the module's name and an alias still hold the package's own
    function (nothing to put back, no original to hand out), yet calling it through the alias raises."""
    import minillm.attention.paged as paged
    from minillm.attention.paged import compute_slot_mapping

    original = paged.compute_slot_mapping
    ns = {"__name__": "__main__", "alias": compute_slot_mapping}

    def learner(block_ids, start, end, block_size):
        assert ns["alias"] is original and paged.compute_slot_mapping is original  # nothing replaced
        return ns["alias"](block_ids, start, end, block_size)

    with pytest.raises(DelegationError, match=r"Exercise 2\.1 asks you to write this yourself.*compute_slot_mapping"):
        with building("2.1", ns):
            learner([1], 0, 1, 4)
    assert compute_slot_mapping([1], 0, 2, 4).tolist() == [4, 5]  # the reference works again, outside
    assert not hasattr(guard("2.1", learner), "__wrapped__")  # the guard hands nothing back


def test_a_method_is_tripped_for_super_calls_and_restored():
    from minillm.core.sched.scheduler import Scheduler

    original = Scheduler.__dict__["_schedule_waiting"]

    class Delegating(Scheduler):
        def _schedule_waiting(self, step):
            return super()._schedule_waiting(step)

    guarded = guard("4.2", Delegating)
    with pytest.raises(DelegationError, match=r"Scheduler\._schedule_waiting"):
        guarded._schedule_waiting(object.__new__(guarded), None)
    assert Scheduler.__dict__["_schedule_waiting"] is original


def test_a_method_kept_under_another_name_is_tripped_and_put_back():
    """``f = AsyncScheduler._update_after_schedule`` holds the plain function: replacing the class attribute alone
    misses it, in the notebook's names and in a closure."""
    from minillm.core.sched.async_scheduler import AsyncScheduler

    original = AsyncScheduler.__dict__["_update_after_schedule"]
    ns = {"__name__": "__main__", "f": AsyncScheduler._update_after_schedule}
    exec("def by_name(sched, so):\n    return f(sched, so)\n", ns)  # noqa: S102

    def make():
        captured = AsyncScheduler._update_after_schedule

        def in_closure(sched, so):
            return captured(sched, so)
        return in_closure

    for answer in (ns["by_name"], make()):
        with pytest.raises(DelegationError, match=r"Exercise 10\.2 .*AsyncScheduler\._update_after_schedule"):
            guard("10.2", answer)(None, None)
    assert ns["f"] is original and AsyncScheduler.__dict__["_update_after_schedule"] is original
    assert make().__closure__[0].cell_contents is original


def test_a_class_that_inherits_the_method_is_refused_at_once():
    from minillm.core.sched.scheduler import Scheduler

    class Lazy(Scheduler):
        pass

    with pytest.raises(DelegationError, match=r"Exercise 4\.1 .*_schedule_running.*inherits"):
        guard("4.1", Lazy)


def test_the_package_object_itself_is_refused_and_own_code_passes():
    from minillm.attention.reference import causal_mask

    with pytest.raises(DelegationError, match=r"Exercise 1\.1"):
        guard("1.1", causal_mask)(2, 1)

    def mine(query_len, ctx_len):
        return torch.arange(ctx_len + query_len)[None, :] <= ctx_len + torch.arange(query_len)[:, None]

    assert torch.equal(guard("1.1", mine)(2, 1), causal_mask(2, 1))


def test_other_parts_stay_usable_under_an_exercises_guard():
    """2.3 may call hash_block_tokens (one block) but not hash_request_tokens (the chain it asks for)."""
    from minillm.core.kv_cache_utils import hash_block_tokens, hash_request_tokens

    def chain(token_ids, block_size):
        hashes, parent = [], None
        for i in range(len(token_ids) // block_size):
            parent = hash_block_tokens(parent, token_ids[i * block_size:(i + 1) * block_size])
            hashes.append(parent)
        return hashes

    assert guard("2.3", chain)(list(range(8)), 4) == hash_request_tokens(list(range(8)), 4)


def test_a_kernel_launch_through_the_packages_kernel_is_tripped():
    from kernels import attention_stages

    kernel = attention_stages._contiguous_kernel
    ns = {"__name__": "__main__", "my_kernel": kernel}
    with building("3.2", ns):
        with pytest.raises(DelegationError, match=r"_contiguous_kernel"):
            ns["my_kernel"][(1, 1)]()
    assert ns["my_kernel"] is kernel and attention_stages._contiguous_kernel is kernel


def test_unknown_exercises_are_named():
    with pytest.raises(ValueError, match=r"no exercise '7\.9'"):
        targets_of("7.9")


def test_a_package_function_captured_in_a_closure_is_tripped_and_put_back():
    from minillm.attention.paged import compute_slot_mapping

    def make():
        captured = compute_slot_mapping

        def my_slot_mapping(block_ids, start, end, block_size):
            return captured(block_ids, start, end, block_size)
        return my_slot_mapping

    learner = make()
    with pytest.raises(DelegationError, match=r"Exercise 2\.1"):
        guard("2.1", learner)([1], 0, 1, 4)
    assert learner.__closure__[0].cell_contents is compute_slot_mapping


def test_a_decorated_answer_is_guarded_in_its_own_namespace():
    """@torch.inference_mode() wraps the learner's function in torch's: the names it reads are still the notebook's."""
    ns = {"__name__": "__main__"}
    exec("import torch\nfrom minillm.attention.paged import compute_slot_mapping\n"  # noqa: S102
         "@torch.inference_mode()\ndef my_slot_mapping(b, s, e, bs):\n    return compute_slot_mapping(b, s, e, bs)\n", ns)
    with pytest.raises(DelegationError, match=r"Exercise 2\.1"):
        guard("2.1", ns["my_slot_mapping"])([1], 0, 1, 4)
