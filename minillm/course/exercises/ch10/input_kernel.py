"""Exercise 10.4's check: the learner's Triton kernel for each token's position and each row's sequence length.

The learner writes ``my_pos_seq_lens_kernel(positions_ptr, seq_lens_ptr, idx_mapping_ptr, query_start_loc_ptr,
num_computed_tokens_ptr, BLOCK: tl.constexpr)``, one program per batch row, as Model Runner V2's
``prepare_pos_seq_lens`` (:func:`kernels.input_batch.prepare_pos_seq_lens`). The check launches it itself, in
Triton's interpreter:

1. on chapter 10's picture (rows in the scheduler's order over slots ``[5, 3, 1, 2]``, a row with an empty query,
   queries longer than ``BLOCK``), traced (:func:`kernels.trace.trace_memory`): each program may store only into its
   own row's positions and its own ``seq_lens`` entry, and must store all of them;
2. on random batches (up to 8 rows over 8 slots, queries of 0 to 40 tokens, ``BLOCK`` of 4, 8 or 16, buffers longer
   than the batch), against :func:`kernels.input_batch.prepare_pos_seq_lens_ref`, computed after the kernel ran.

At the first difference it names the row and, for the usual mistakes, the rule that was missed (the row's number
used as its slot, a query longer than ``BLOCK`` cut short, positions that start from 0, a sequence length without
the cached tokens). vLLM counterpart: none (a check); the part is ``vllm/v1/worker/gpu/input_batch.py:
_prepare_pos_seq_lens_kernel``.
"""
from __future__ import annotations

import inspect
import os
import re
from typing import Any

import numpy as np
import torch

from kernels.testing import unwrap_kernel_errors
from kernels.trace import MemoryTrace, interpreted, trace_memory

# Chapter 10's picture: rows in the scheduler's order point at slots 5, 3, 1, 2 (batch row 0 is slot 5's request).
# Every row's number is a slot whose count differs from its own slot's, so reading by row shows.
PICTURE_SLOTS, PICTURE_QUERY_LENS, PICTURE_BLOCK = [5, 3, 1, 2], [1, 11, 0, 6], 4
PICTURE_NUM_COMPUTED = [2, 9, 4, 6, 0, 17, 0, 0]


def _case(idx_mapping: list[int], query_lens: list[int], num_computed: list[int], extra: int = 5) -> dict[str, Any]:
    """One batch: its inputs, and output buffers longer than the batch, filled with -1 (a store past it shows)."""
    qsl = np.zeros(len(query_lens) + 1, dtype=np.int32)
    np.cumsum(query_lens, out=qsl[1:])
    return dict(idx_mapping=torch.tensor(idx_mapping, dtype=torch.int64),
                query_start_loc=torch.from_numpy(qsl),
                num_computed_tokens=torch.tensor(num_computed, dtype=torch.int32),
                positions=torch.full((int(qsl[-1]) + extra,), -1, dtype=torch.int64),
                seq_lens=torch.full((len(query_lens) + extra,), -1, dtype=torch.int32))


def _random_cases(seed: int = 104, n: int = 24) -> list[tuple[dict[str, Any], int]]:
    rng = np.random.default_rng(seed)
    cases = []
    for _ in range(n):
        max_num_reqs = 8
        num_reqs = int(rng.integers(1, max_num_reqs + 1))
        slots = rng.permutation(max_num_reqs)[:num_reqs].tolist()
        query_lens = [int(q) for q in rng.choice([0, 1, 1, 2, 3, 5, 9, 17, 40, 130], size=num_reqs)]
        num_computed = rng.integers(0, 60, size=max_num_reqs).tolist()
        cases.append((_case(slots, query_lens, num_computed), int(rng.choice([4, 8, 16]))))
    return cases


def _launch(kernel: Any, case: dict[str, Any], block: int) -> None:
    """Launch ``kernel`` on ``case``; a crash is a wrong answer (an ``AssertionError`` that names the batch)."""
    num_reqs = case["idx_mapping"].shape[0]
    try:
        unwrap_kernel_errors(kernel[(num_reqs,)])(case["positions"], case["seq_lens"], case["idx_mapping"],
                                                  case["query_start_loc"], case["num_computed_tokens"], BLOCK=block)
    except (NotImplementedError, AssertionError):  # a stub, or a call of the package's own kernel
        raise
    except Exception as e:  # noqa: BLE001
        hint = ""
        if "arange" in str(e):
            hint = (". tl.arange's bounds must be constants the compiler knows (tl.constexpr): use "
                    "tl.arange(0, BLOCK), and a mask for the lanes past the query's end")
        raise AssertionError(f"On the batch {_describe(case, block)}: your kernel raised {type(e).__name__}: "
                             f"{str(e).strip().splitlines()[-1] if str(e).strip() else ''}{hint}") from e


def _want(case: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference's positions and sequence lengths for ``case`` (buffers of the same size, -1 elsewhere)."""
    from kernels.input_batch import prepare_pos_seq_lens_ref

    positions, seq_lens = torch.full_like(case["positions"], -1), torch.full_like(case["seq_lens"], -1)
    prepare_pos_seq_lens_ref(case["idx_mapping"], case["query_start_loc"], case["num_computed_tokens"], positions,
                             seq_lens)
    return positions, seq_lens


def _describe(case: dict[str, Any], block: int) -> str:
    qsl = case["query_start_loc"].tolist()
    lens = [b - a for a, b in zip(qsl, qsl[1:], strict=False)]
    return (f"idx_mapping {case['idx_mapping'].tolist()}, query lengths {lens}, num_computed_tokens "
            f"{case['num_computed_tokens'].tolist()}, BLOCK={block}")


def _row_problem(case: dict[str, Any], block: int, got_pos: list[int], got_len: list[int]) -> str | None:
    """The first row whose positions or sequence length differ from the reference's, and why if it is a usual
    mistake."""
    idx = case["idx_mapping"].tolist()
    qsl = case["query_start_loc"].tolist()
    nc = case["num_computed_tokens"].tolist()
    for b, slot in enumerate(idx):
        start, end = qsl[b], qsl[b + 1]
        q = end - start
        want = list(range(nc[slot], nc[slot] + q))
        got = got_pos[start:end]
        where = f"row {b} (slot {slot}, {nc[slot]} tokens cached, a query of {q})"
        if got != want:
            if b < len(nc) and b != slot and got == list(range(nc[b], nc[b] + q)):
                why = (f": it read num_computed_tokens[{b}], the row's number; row {b}'s request lives in slot "
                       f"idx_mapping[{b}] = {slot}, so load num_computed_tokens at that slot")
            elif q > block and got[:block] == want[:block]:
                why = (f": only its first {block} positions are right. A query can be longer than BLOCK: loop over it "
                       f"in steps of BLOCK, with a mask on the last step")
            elif got == list(range(q)):
                why = (": they start from 0. The query continues the sequence: its tokens come right after the "
                       "num_computed_tokens cached ones, so token j is at num_computed + j")
            else:
                why = ""
            return f"{where}: positions[{start}:{end}] are {got}, expected {want}{why}"
        if got_len[b] != nc[slot] + q:
            why = ""
            if got_len[b] == q:
                why = ": the sequence length counts the cached tokens too (attention reads them all): num_computed + q"
            elif got_len[b] == nc[slot]:
                why = ": the sequence length counts this step's query too: num_computed + query length"
            return f"{where}: seq_lens[{b}] is {got_len[b]}, expected {nc[slot] + q}{why}"
    return None


def _stores_problem(trace: MemoryTrace, case: dict[str, Any], block: int) -> str | None:
    """Each program's stores: only its own row's positions and its own ``seq_lens`` entry, ``BLOCK`` lanes at most."""
    positions, seq_lens = case["positions"], case["seq_lens"]
    qsl = case["query_start_loc"].tolist()
    spans = {"positions": (positions.data_ptr(), positions.numel(), 8),
             "seq_lens": (seq_lens.data_ptr(), seq_lens.numel(), 4)}
    for access in trace.accesses:
        if access.kind != "store":
            continue
        b = access.program_id[0]
        for name, (base, n, size) in spans.items():
            offset = (access.addresses - base) // size
            inside = (access.addresses >= base) & (offset < n)
            hits = sorted(set(offset[inside].tolist()))
            allowed = range(qsl[b], qsl[b + 1]) if name == "positions" else range(b, b + 1)
            stray = [h for h in hits if h not in allowed]
            if stray:
                return (f"program {b} stored into {name}{stray[:6]}, outside its own "
                        + (f"positions[{qsl[b]}:{qsl[b + 1]}]: mask the stores of the last piece with "
                           f"j < query length" if name == "positions" else f"entry seq_lens[{b}]"))
    widest = max((a.addresses.size for a in trace.accesses if a.kind == "store"), default=0)
    if widest > block:
        return (f"one store wrote {widest} values at once, more than BLOCK = {block}: the kernel must work in pieces "
                f"of BLOCK lanes (tl.arange(0, BLOCK)), whatever the query's length")
    outside = trace.outside([positions, seq_lens], "store")
    if outside.size:
        return f"the kernel stored {outside.size} values outside positions and seq_lens"
    return None


def _package_kernel_reached(kernel: Any) -> None:
    """Raise :class:`~minillm.course.exercises.tripwire.DelegationError` if ``kernel``, or a ``@triton.jit`` function
    it calls (by a name of its globals, however deep), is the package's kernel or a copy of its code. The tripwire
    sees a call only where it watches; this reads the kernel's own calls, wherever the kernel was rebuilt."""
    from minillm.course.exercises.answer_kernels import is_kernel
    from minillm.course.exercises.tripwire import DelegationError, _resolve, _same_code, targets_of

    codes = []
    for target in targets_of(["10.4"]):
        obj = _resolve(target)[2]
        fn = getattr(obj, "fn", obj)
        if hasattr(fn, "__code__"):
            codes.append((target, fn.__code__))
    seen: set[int] = set()
    todo = [kernel]
    while todo:
        k = todo.pop()
        fn = getattr(k, "fn", k)
        if id(fn) in seen or not hasattr(fn, "__code__"):
            continue
        seen.add(id(fn))
        for target, code in codes:
            if _same_code(fn.__code__, code):
                raise DelegationError("10.4", target)
        names = set(fn.__code__.co_names)
        for const in fn.__code__.co_consts:  # nested code (a loop body's comprehension, a local function)
            if hasattr(const, "co_names"):
                names |= set(const.co_names)
        todo += [v for n in names if is_kernel(v := fn.__globals__.get(n))]


def _gpu_compile_problem(kernel: Any) -> str | None:
    """Compile ``kernel`` for a CUDA GPU (sm_80, no GPU needed, as ``kernels.compile_check`` does): the interpreter
    runs any Python, the compiler only Triton. ``None`` when it compiles or the toolchain is missing."""
    try:
        from triton.runtime.jit import JITFunction

        from kernels.compile_check import _compile
    except ImportError:
        return None
    # kernels.compile_check's setting: Triton 3.9 warns on every first compile without it.
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    pointers = {"positions_ptr": "*i64", "seq_lens_ptr": "*i32", "idx_mapping_ptr": "*i64",
                "query_start_loc_ptr": "*i32", "num_computed_tokens_ptr": "*i32"}
    try:
        _compile(JITFunction(getattr(kernel, "fn", kernel)), {}, pointers, {"BLOCK": 16}, 80, 4, 1)
    except (FileNotFoundError, PermissionError):  # no ptxas here: the interpreter's verdict stands
        return None
    except Exception as e:  # noqa: BLE001 - any refusal of the compiler is the answer's
        text = str(e)
        if "should be defined in a Python file" in text:  # no source to compile (a kernel built by exec)
            return None
        where = re.search(r"at (\d+):(\d+):", text)
        line = ""
        if where:
            try:
                lines = inspect.getsource(getattr(kernel, "fn", kernel)).splitlines()
                line = f" at line {where.group(1)} of the kernel, counting its @triton.jit line as 1: " \
                       f"`{lines[int(where.group(1)) - 1].strip()}`"
            except (OSError, TypeError, IndexError):
                line = f" at line {where.group(1)} of the kernel"
        last = next((x.strip() for x in reversed(text.splitlines()) if x.strip() and not x.strip().startswith("^")),
                    type(e).__name__)
        return (f"your kernel runs in Triton's interpreter, but Triton's compiler for a GPU refuses it{line} "
                f"({last[:160]}). Inside a kernel only Triton works: no int() or float() of a loaded value, no "
                f"Python lists; a loop over range(start, end, BLOCK) with values the kernel loaded is fine")
    return None


def check_pos_seq_lens_kernel(kernel: Any, verbose: bool = True) -> dict[str, int]:
    """Exercise 10.4's check: ``kernel`` against :func:`kernels.input_batch.prepare_pos_seq_lens_ref`, launched
    here in Triton's interpreter under the tripwire (reaching the package's kernel raises). Returns what it ran
    (cases, rows, tokens, empty rows, rows longer than BLOCK)."""
    from minillm.course.exercises.answer_kernels import is_kernel
    from minillm.course.exercises.tripwire import guard

    if not is_kernel(kernel):
        raise AssertionError(f"my_pos_seq_lens_kernel must be a @triton.jit kernel (the check launches it as "
                             f"kernel[(num_reqs,)](...)), got {type(kernel).__name__}")
    _package_kernel_reached(kernel)
    learner = guard("10.4", interpreted(kernel))
    picture = _case(PICTURE_SLOTS, PICTURE_QUERY_LENS, PICTURE_NUM_COMPUTED)
    with trace_memory() as trace:
        _launch(learner, picture, PICTURE_BLOCK)
    counts = {"cases": 0, "rows": 0, "tokens": 0, "empty rows": 0, "rows longer than BLOCK": 0}
    for case, block in [(picture, PICTURE_BLOCK)] + _random_cases():
        if case is not picture:
            _launch(learner, case, block)
        got_pos, got_len = case["positions"].tolist(), case["seq_lens"].tolist()
        want_pos, want_len = _want(case)  # the reference only now, after the learner's kernel ran
        where = f"On the batch {_describe(case, block)}"
        problem = _row_problem(case, block, got_pos, got_len)
        if problem is None and case is picture:
            problem = _stores_problem(trace, case, block)
        if problem is None and (got_pos != want_pos.tolist() or got_len != want_len.tolist()):
            num_tokens, num_reqs = int(case["query_start_loc"][-1]), case["idx_mapping"].shape[0]
            problem = (f"the buffers past the batch changed: positions[{num_tokens}:] is {got_pos[num_tokens:]} and "
                       f"seq_lens[{num_reqs}:] is {got_len[num_reqs:]}, expected all -1 (write only the batch's "
                       f"entries)")
        if problem:
            raise AssertionError(f"{where}: {problem.rstrip('.')}.")
        lens = np.diff(case["query_start_loc"].numpy())
        counts["cases"] += 1
        counts["rows"] += len(lens)
        counts["tokens"] += int(lens.sum())
        counts["empty rows"] += int((lens == 0).sum())
        counts["rows longer than BLOCK"] += int((lens > block).sum())
    problem = _gpu_compile_problem(kernel)
    if problem:
        raise AssertionError(problem.rstrip(".") + ".")
    if verbose:
        print(f"Your kernel wrote the positions and sequence lengths of {counts['rows']} rows ({counts['tokens']} "
              f"tokens, {counts['empty rows']} empty rows, {counts['rows longer than BLOCK']} longer than BLOCK) in "
              f"{counts['cases']} batches exactly as prepare_pos_seq_lens does, each program storing only its own row.")
    return counts
