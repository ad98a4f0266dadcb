"""Compare a learner's function with the reference on many cases, and say exactly which case differs."""
from __future__ import annotations

import copy
from collections.abc import Callable, Iterable
from typing import Any

import torch


def _describe(x: Any) -> str:
    if isinstance(x, torch.Tensor):
        return f"tensor{tuple(x.shape)} {x.dtype}"
    if isinstance(x, (list, tuple)) and len(x) > 8:
        return f"{type(x).__name__} of {len(x)}"
    return repr(x)


def private_copy(x: Any) -> Any:
    """A deep copy of ``x`` that shares the ``torch.nn.Module`` objects in it (a model's layers are not inputs to
    copy, and copying them per case would cost their weights' memory). The learner's answer gets one such copy and
    the reference another, so neither sees what the other wrote into its inputs, and what the answer returned is
    taken before the reference runs."""
    memo: dict[int, Any] = {}
    stack = [x]
    while stack:   # find the modules inside lists, tuples and dicts (the shapes cases come in)
        item = stack.pop()
        if isinstance(item, torch.nn.Module):
            memo[id(item)] = item
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
        elif isinstance(item, dict):
            stack.extend(item.values())
    return copy.deepcopy(x, memo)


def _compare(got: Any, want: Any, atol: float, rtol: float) -> str | None:
    """``None`` if equal, else a sentence saying what differs."""
    if isinstance(want, torch.Tensor):
        if not isinstance(got, torch.Tensor):
            return f"expected a tensor, got {type(got).__name__}"
        if got.shape != want.shape:
            return f"shape {tuple(got.shape)} != expected {tuple(want.shape)}"
        if want.dtype == torch.bool or not want.is_floating_point():
            if not torch.equal(got.to(want.dtype), want):
                bad = (got.to(want.dtype) != want).nonzero()[:3].tolist()
                return f"values differ at indices {bad}"
            return None
        if not torch.allclose(got.float(), want.float(), atol=atol, rtol=rtol, equal_nan=True):
            # NaN where the reference is finite must count as the largest difference, not vanish from max(); an
            # infinite difference stays inf (nan_to_num would otherwise turn it into the largest finite float).
            diff = torch.nan_to_num((got.float() - want.float()).abs(), nan=float("inf"), posinf=float("inf"))
            # Equal entries (the same infinity on both sides included: inf - inf is NaN) and NaN on both sides agree.
            same = (got.float() == want.float()) | (torch.isnan(got.float()) & torch.isnan(want.float()))
            diff = diff.masked_fill(same, 0.0)
            idx = tuple(torch.nonzero(diff == diff.max())[0].tolist()) if diff.numel() else ()
            return f"max abs difference {diff.max().item():.3g} at index {idx} (tolerance atol={atol}, rtol={rtol})"
        return None
    if isinstance(want, (tuple, list)) and want and isinstance(want[0], torch.Tensor):
        if not isinstance(got, (tuple, list)) or len(got) != len(want):
            return f"expected {len(want)} outputs, got {_describe(got)}"
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            msg = _compare(g, w, atol, rtol)
            if msg:
                return f"output {i}: {msg}"
        return None
    return None if got == want else f"got {got!r}, expected {want!r}"


def check_cases(learner: Callable[..., Any], reference: Callable[..., Any], cases: Iterable[dict[str, Any]],
                atol: float = 1e-5, rtol: float = 1e-5, name: str = "your function",
                exercise: str | None = None) -> int:
    """Call ``learner(**case)``, then ``reference(**case)``, for every case; raise ``AssertionError`` at the first
    difference, naming the case. Returns the number of cases checked (and prints it).

    With ``exercise`` ("2.1"), the learner runs under :func:`~minillm.course.exercises.tripwire.guard`: an answer
    that calls the package's own implementation of that exercise's part fails with
    :class:`~minillm.course.exercises.tripwire.DelegationError`. The reference always runs unguarded.
    """
    if exercise is not None:
        from minillm.course.exercises.tripwire import guard

        learner = guard(exercise, learner)
    n = 0
    for case in cases:
        msg = _check_case(learner, reference, case, atol, rtol)
        if msg:
            args = ", ".join(f"{k}={_describe(v)}" for k, v in case.items())
            raise AssertionError(f"{name} differs from the reference for ({args}): {msg}")
        n += 1
    if n == 0:
        raise AssertionError("no cases were checked")
    print(f"All {n} cases agree with the reference.")
    return n


def _check_case(learner: Callable[..., Any], reference: Callable[..., Any], case: dict[str, Any], atol: float,
                rtol: float) -> str | None:
    """One case, in the order that keeps the reference out of the answer's reach: the answer on a copy of the case,
    its result copied, then the reference on a fresh copy. A function of its own, so that no reference result of an
    earlier case is a local of the frame the next answer is called from."""
    got = private_copy(learner(**private_copy(case)))
    want = reference(**private_copy(case))
    return _compare(got, want, atol, rtol)


def watch_forward(module: Any, fn: Callable[[tuple[Any, ...]], Any]) -> Any:
    """``fn(args)`` with the positional inputs of each forward call of ``module`` (a layer of the notebook's model)
    while the learner's code runs; returns a handle whose ``remove()`` stops it. In a learner's kernel a forward
    hook; when graded, the hook is put on the answer's process's copy of the module, and ``fn`` runs here with the
    inputs that come back with each call's reply."""
    from minillm.course.exercises import grading

    if grading.ACTIVE:
        return grading.watch_forward(module, fn)
    return module.register_forward_hook(lambda _module, args, _out: fn(args))
