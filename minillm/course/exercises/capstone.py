"""Chapter 8's capstone: the learner's parts run as the engine on SmolLM2, checked part by part and token by token.

:func:`check_capstone` builds an :class:`~minillm.engine.llm_engine.LLMEngine` whose
:class:`~minillm.engine.parts.EngineParts` are the learner's (from
:func:`~minillm.course.exercises.parts.load_learner_parts`), runs a small workload chosen to need every part — prompts
longer than the token budget (chunked prefill), prompts that share a prefix (prefix-cache hits), a KV cache too small
for all of them (preemption), a sampled request with top-k/top-p, a stop token — and then requires

1. every call of every learner part to agree with the package's part on the same inputs (:class:`PartChecker`:
   the reference runs beside it, on copies of the same state). The first disagreement stops the run and is reported
   as a :class:`PartMismatch` naming the step, the part, its exercise and the field that differs. So a wrong part is
   caught even when it does not change the tokens (a scheduler that admits waiting requests before running ones
   still produces the right greedy text);
2. the greedy requests' tokens to equal transformers' own ``generate`` on the same GGUF file.
"""
from __future__ import annotations

import copy
import dataclasses
import functools
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from minillm.course.exercises.check import _compare, private_copy
from minillm.course.exercises.parts import PART_SOURCES, LearnerParts
from minillm.course.exercises.tripwire import DelegationError, guard
from minillm.engine.parts import PART_NAMES, EngineParts

if TYPE_CHECKING:
    from minillm.core.sched.scheduler import Scheduler

_SOURCE = {s.part: s for s in PART_SOURCES}


class PartMismatch(AssertionError):
    """A learner's part gave another result than the reference part on the same inputs (or raised).

    Attributes:
        part, step, field, detail: what differs, where. ``why``: the likely slip, when it is a known one ("").
    """

    def __init__(self, part: str, step: int, field: str, detail: str, why: str = "", label: str = "your") -> None:
        self.part, self.step, self.field, self.detail, self.why = part, step, field, detail, why
        src = _SOURCE[part]
        super().__init__(f"step {step}: {label} {part} ({src.what}; Exercise {', '.join(src.exercises)} in "
                         f"{src.notebook}) differs from the reference on the same inputs: {field}: {detail}"
                         + (f"\nLikely cause: {why}" if why else ""))


def _likely_slip(part: str, field: str, got: Any, want: Any) -> str:
    """A known mistake that explains a difference, in a sentence (as the chapters' own checks say), or ""."""
    if part == "free" and "free queue" in field and isinstance(got, list) and isinstance(want, list):
        if sorted(got) == sorted(want) and got != want:
            return ("the same blocks are free but in another order. Free a request's blocks tail first (last block "
                    "first), unhashed ones to the front of the queue and hashed ones to the back (exercise 2.5).")
    if part == "scheduler_cls" and "waiting queue" in field and sorted(got) == sorted(want):
        return ("the same requests wait, in another order. A preempted request goes back to the FRONT of the "
                "waiting queue (prepend_request), so it runs again before newcomers (exercise 4.3).")
    if part == "prepare_inputs" and field == "positions":
        return ("positions are absolute: the j-th scheduled token of a request sits at num_computed_tokens + j, not "
                "at j (exercise 6.1).")
    if part == "allocate_slots" and "returned block ids" in field and got is not None and want is not None:
        if len(got) > len(want):
            return ("more blocks than needed: count the blocks for num_computed_tokens + num_new_tokens tokens and "
                    "subtract the blocks the request already holds (exercise 2.2).")
    return ""


def _ids(blocks: Sequence[Any] | None) -> list[int] | None:
    return None if blocks is None else [b.block_id for b in blocks]


def _queue(pool: Any) -> list[int]:
    return [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]


def _guarded(learner: EngineParts, reference: EngineParts, package_parts: Iterable[str] | None) -> EngineParts:
    """``learner`` with each of its own parts under :func:`~minillm.course.exercises.tripwire.guard` for the part's
    exercises: while a learner's part runs, the package's implementation of that part raises. A part named in
    ``package_parts`` (the capstone's ``use_reference_for``) runs as it is; with ``package_parts=None``, so does
    every part that is the reference's own object (an :class:`EngineParts` given directly). A learner's scheduler
    that inherits one of the methods its exercises ask for fails here, before the engine is built."""
    changes: dict[str, Any] = {}
    for name in PART_NAMES:
        mine, ref = getattr(learner, name), getattr(reference, name)
        if mine is None or (name in package_parts if package_parts is not None else mine is ref):
            continue
        changes[name] = guard(_SOURCE[name].exercises, mine)
    return dataclasses.replace(learner, **changes)


class PartChecker:
    """Wraps a learner's :class:`EngineParts` so that every call also runs the reference part on the same inputs.

    The learner's part runs first, on the engine's own inputs, and what it returned and left behind is taken; only
    then the reference part runs, on a copy of the inputs made before the learner's part ran (stateful parts --
    block allocation, freeing, the scheduler, the stop check -- get deep copies of their state), so both start from
    the same inputs and no reference result exists while the learner's code runs. Results and the state afterwards
    are compared.

    Attributes:
        step: the engine step being run (the scheduler's ``schedule()`` calls, from 1).
        calls: how many times each part was called and checked.
        trace: per step, ``(num_scheduled_tokens, preempted_req_ids, num_computed_tokens before the step)``.
    """

    def __init__(self, learner: EngineParts, reference: EngineParts | None = None, atol: float = 1e-4,
                 rtol: float = 1e-4, label: str = "your", guarded: bool = True,
                 package_parts: Iterable[str] | None = None) -> None:
        self.reference = reference if reference is not None else EngineParts()
        self.learner = _guarded(learner, self.reference, package_parts) if guarded else learner
        self._unguarded, self._guarded = learner, guarded
        self.label = label
        self.added: list[tuple[str, list[int]]] = []  # (request id, prompt token ids), in the order they were added
        self.atol, self.rtol = atol, rtol
        self.step = 0
        self.calls = dict.fromkeys(PART_NAMES, 0)
        self.trace: list[tuple[dict[str, int], set[str], dict[str, int]]] = []

    # -- helpers ----------------------------------------------------------------------------------------------------
    def _run(self, part: str, fn: Callable[..., Any], *args: Any) -> Any:
        self.calls[part] += 1
        try:
            return fn(*args)
        except PartMismatch:
            raise
        except DelegationError as e:
            raise PartMismatch(part, self.step, "it called the package's own part", str(e), label=self.label) from e
        except NotImplementedError as e:
            raise PartMismatch(part, self.step, "not solved", str(e), label=self.label) from e
        except Exception as e:  # noqa: BLE001 - the learner's code failed: name it, keep the original as cause
            raise PartMismatch(part, self.step, "raised", f"{type(e).__name__}: {e}", label=self.label) from e

    def _same(self, part: str, field: str, got: Any, want: Any) -> None:
        if isinstance(want, np.ndarray):
            want = torch.from_numpy(want)
            got = torch.as_tensor(np.asarray(got)) if not isinstance(got, torch.Tensor) else got
        msg = _compare(got, want, self.atol, self.rtol) if isinstance(want, torch.Tensor) else (
            None if got == want else f"yours {got!r}, reference {want!r}")
        if msg:
            raise PartMismatch(part, self.step, field, msg, _likely_slip(part, field, got, want), self.label)

    def answer_side(self, method: str) -> tuple[Any, tuple[str, ...]] | None:
        """When graded, what a checked part becomes where the learner's scheduler runs (the answer's process, where
        it calls the learner's block allocation through the KV cache manager): the learner's own part, run under
        the tripwire of its exercises, or the reference's. ``None`` for a method that is not a part."""
        name = method.lstrip("_")
        if name not in PART_NAMES or name == "scheduler_cls":
            return None
        mine = getattr(self._unguarded, name)
        if mine is None or mine is getattr(self.reference, name):
            return getattr(self.reference, name), ()
        return mine, tuple(_SOURCE[name].exercises) if self._guarded else ()

    # -- the parts --------------------------------------------------------------------------------------------------
    def parts(self) -> EngineParts:
        """The checked :class:`EngineParts` to give the engine."""
        return EngineParts(
            attention=self._attention, allocate_slots=self._allocate_slots, block_hashes=self._block_hashes,
            num_cached_tokens=self._num_cached_tokens, free=self._free, scheduler_cls=self._scheduler_cls(),
            top_k_top_p=self._top_k_top_p, check_stop=self._check_stop, prepare_inputs=self._prepare_inputs)

    def _attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx_len: int) -> torch.Tensor:
        from minillm.attention.reference import reference_attention

        ref_q, ref_k, ref_v = private_copy((q, k, v))
        got = self._run("attention", self.learner.attention or reference_attention, q, k, v, ctx_len)
        taken = private_copy(got)
        want = (self.reference.attention or reference_attention)(ref_q, ref_k, ref_v, ctx_len)
        self._same("attention", f"out for a chunk of {q.shape[0]} tokens after {ctx_len} cached ones", taken, want)
        return got

    def _allocate_slots(self, pool: Any, req_blocks: list, num_computed: int, num_new: int, block_size: int):
        ref_pool, ref_blocks = copy.deepcopy((pool, req_blocks))
        what = f"(request with {len(req_blocks)} blocks, {num_computed} computed + {num_new} new)"
        got = self._run("allocate_slots", self.learner.allocate_slots, pool, req_blocks, num_computed, num_new,
                        block_size)
        got_ids, blocks_after, queue_after = _ids(got), _ids(req_blocks), _queue(pool)
        want = self.reference.allocate_slots(ref_pool, ref_blocks, num_computed, num_new, block_size)
        self._same("allocate_slots", f"returned block ids {what}", got_ids, _ids(want))
        self._same("allocate_slots", f"the request's block ids afterwards {what}", blocks_after, _ids(ref_blocks))
        self._same("allocate_slots", "the free queue afterwards", queue_after, _queue(ref_pool))
        return got

    def _block_hashes(self, token_ids: Sequence[int], block_size: int) -> list:
        ref_token_ids = list(token_ids)
        got = list(self._run("block_hashes", self.learner.block_hashes, token_ids, block_size))
        want = self.reference.block_hashes(ref_token_ids, block_size)
        if list(got) != list(want):
            first = next((i for i, (g, w) in enumerate(zip(got, want, strict=False)) if g != w),
                         min(len(got), len(want)))
            raise PartMismatch("block_hashes", self.step, f"hashes of {len(token_ids)} tokens",
                               f"{len(got)} hashes vs the reference's {len(want)}; first difference at block {first}",
                               "each block's hash must chain its parent's hash (exercise 2.3)" if first else "",
                               self.label)
        return got

    def _num_cached_tokens(self, block_hashes: Sequence[Any], num_tokens: int, block_size: int, cached: Any) -> int:
        ref_hashes, ref_cached = list(block_hashes), copy.copy(cached)  # the reference only looks the hashes up
        got = self._run("num_cached_tokens", self.learner.num_cached_tokens, block_hashes, num_tokens, block_size,
                        cached)
        want = self.reference.num_cached_tokens(ref_hashes, num_tokens, block_size, ref_cached)
        self._same("num_cached_tokens", f"cached tokens of a {num_tokens}-token request", got, want)
        return got

    def _free(self, pool: Any, req_blocks: Sequence[Any]) -> None:
        ref_pool, ref_blocks = copy.deepcopy((pool, list(req_blocks)))
        self._run("free", self.learner.free, pool, req_blocks)
        queue_after, ref_cnts_after = _queue(pool), [b.ref_cnt for b in pool.blocks]
        self.reference.free(ref_pool, ref_blocks)
        self._same("free", f"the free queue after freeing blocks {_ids(req_blocks)}", queue_after, _queue(ref_pool))
        self._same("free", "ref_cnt of every block", ref_cnts_after, [b.ref_cnt for b in ref_pool.blocks])

    def _top_k_top_p(self, logits: torch.Tensor, k: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        ref_logits, ref_k, ref_p = private_copy((logits, k, p))
        got = self._run("top_k_top_p", self.learner.top_k_top_p, logits, k, p)
        taken = private_copy(got)
        want = self.reference.top_k_top_p(ref_logits, ref_k, ref_p)
        self._same("top_k_top_p", f"masked logits (k={ref_k.tolist()}, p={[round(x, 3) for x in ref_p.tolist()]})",
                   taken, want)
        return got

    def _check_stop(self, request: Any, max_model_len: int) -> bool:
        ref_request = copy.deepcopy(request)
        got = self._run("check_stop", self.learner.check_stop, request, max_model_len)
        finished, status, stop_reason = bool(got), request.status.name, copy.copy(request.stop_reason)
        want = self.reference.check_stop(ref_request, max_model_len)
        what = f"request {request.request_id!r} after output token {request.output_token_ids[-1]}"
        self._same("check_stop", f"finished? for {what}", finished, bool(want))
        self._same("check_stop", f"status of {what}", status, ref_request.status.name)
        self._same("check_stop", f"stop_reason of {what}", stop_reason, ref_request.stop_reason)
        return got

    def _prepare_inputs(self, so: Any, requests: dict, block_size: int, device: Any):
        ref_so, ref_requests = copy.deepcopy((so, requests))
        returned = self._run("prepare_inputs", self.learner.prepare_inputs, so, requests, block_size, device)
        got = private_copy(returned)
        want = self.reference.prepare_inputs(ref_so, ref_requests, block_size, device)
        self._same("prepare_inputs", "req_ids", list(got.req_ids), list(want.req_ids))
        for field in ("input_ids", "positions", "query_start_loc", "seq_lens", "block_table", "slot_mapping",
                      "logits_indices"):
            self._same("prepare_inputs", field, torch.as_tensor(getattr(got, field)).to(torch.int64),
                       getattr(want, field).to(torch.int64))
        self._same("prepare_inputs", "discard_request_mask", np.asarray(got.discard_request_mask, dtype=bool).tolist(),
                   want.discard_request_mask.tolist())
        return returned

    def _scheduler_cls(self) -> type:
        checker, learner_cls, reference_cls = self, self.learner.scheduler_cls, self.reference.scheduler_cls

        class CheckedScheduler(learner_cls):  # type: ignore[valid-type, misc]
            """The learner's scheduler; each ``schedule()`` also runs the reference scheduler on a copy of it, made
            before and run after the learner's."""

            def add_request(self, request):  # noqa: ANN001, ANN202
                checker.added.append((request.request_id, list(request.prompt_token_ids)))
                return super().add_request(request)

            def schedule(self):  # noqa: ANN202
                checker.step += 1
                before = {r.request_id: r.num_computed_tokens for r in self.running}
                ref: Scheduler = copy.deepcopy(self)
                ref.__class__ = reference_cls
                ref.check_stop_fn = checker.reference.check_stop
                for name, fn in checker.reference.kv_cache_fns().items():
                    setattr(ref.kv_cache_manager, name, fn)
                checker.calls["scheduler_cls"] += 1
                try:
                    got = super().schedule()
                except PartMismatch:
                    raise
                except DelegationError as e:
                    raise PartMismatch("scheduler_cls", checker.step, "it called the package's own part", str(e),
                                       label=checker.label) from e
                except Exception as e:  # noqa: BLE001
                    raise PartMismatch("scheduler_cls", checker.step, "raised", f"{type(e).__name__}: {e}",
                                       label=checker.label) from e
                want = ref.schedule()  # the reference, on the copy made before the learner's schedule() ran
                checker._compare_schedules(got, want, self, ref)
                checker.trace.append((dict(got.num_scheduled_tokens), set(got.preempted_req_ids), before))
                return got

        CheckedScheduler.__name__ = f"Checked{learner_cls.__name__}"
        return CheckedScheduler

    def _compare_schedules(self, got: Any, want: Any, sched: Any, ref: Any) -> None:
        same = functools.partial(self._same, "scheduler_cls")
        same("num_scheduled_tokens (request: tokens, in batch order)", list(got.num_scheduled_tokens.items()),
             list(want.num_scheduled_tokens.items()))
        same("scheduled_new_reqs (request, computed tokens, blocks)",
             [(r.req_id, r.num_computed_tokens, r.block_ids) for r in got.scheduled_new_reqs],
             [(r.req_id, r.num_computed_tokens, r.block_ids) for r in want.scheduled_new_reqs])
        gc, wc = got.scheduled_cached_reqs, want.scheduled_cached_reqs
        same("scheduled_cached_reqs.req_ids", gc.req_ids, wc.req_ids)
        same("scheduled_cached_reqs.resumed_req_ids", sorted(gc.resumed_req_ids), sorted(wc.resumed_req_ids))
        same("scheduled_cached_reqs.new_block_ids", gc.new_block_ids, wc.new_block_ids)
        same("scheduled_cached_reqs.num_computed_tokens", gc.num_computed_tokens, wc.num_computed_tokens)
        same("preempted_req_ids", sorted(got.preempted_req_ids), sorted(want.preempted_req_ids))
        same("the running queue after the step", [r.request_id for r in sched.running],
             [r.request_id for r in ref.running])
        same("the waiting queue after the step", [r.request_id for r in sched.waiting],
             [r.request_id for r in ref.waiting])
        same("status of every request", {k: r.status.name for k, r in sched.requests.items()},
             {k: r.status.name for k, r in ref.requests.items()})


# -- the workload -------------------------------------------------------------------------------------------------
# Three chat questions (their chat template starts with the same system prompt, about 30 tokens: later ones hit the
# prefix cache) and one plain prompt that samples with top-k/top-p. Each chat prompt (37-40 tokens) is longer than
# the 16-token budget, so it is prefilled in chunks; the KV cache (15 usable blocks of 4 = 60 tokens) cannot hold
# them all with their outputs, so the scheduler must preempt. The questions were chosen for clear greedy margins
# (transformers' top-2 logit gap at least 0.08 at every output position; cross-CPU rounding is ~1e-4).
CAPSTONE_QUESTIONS = (
    "What is the capital of France?",
    "What colour is the sky on a clear day?",
    "Name a fruit that is yellow.",
)
SAMPLED_PROMPT = "The three primary colours are"
CAPSTONE_ARGS: dict[str, Any] = dict(block_size=4, num_gpu_blocks=16, max_num_batched_tokens=16, max_num_seqs=4,
                                     max_model_len=56, enable_prefix_caching=True, enable_chunked_prefill=True)
MAX_TOKENS = 10


def capstone_requests(tokenizer: Any) -> tuple[list[list[int]], list[Any]]:
    """The capstone's prompts (token ids) and their :class:`SamplingParams`: the chat questions greedy, then the
    plain prompt sampled with top-k and top-p from a fixed seed, stopping at the first newline."""
    from minillm.sampling_params import SamplingParams

    prompts = [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                                              add_generation_prompt=True))
               for q in CAPSTONE_QUESTIONS]
    prompts.append(tokenizer.encode(SAMPLED_PROMPT))
    newline = tokenizer.encode("\n")[-1]
    params = [SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0) for _ in CAPSTONE_QUESTIONS]
    params.append(SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, top_k=20, top_p=0.9, seed=8,
                                 stop_token_ids=[newline]))
    return prompts, params


@functools.lru_cache(maxsize=1)
def _hf_model() -> Any:
    from transformers.utils import logging as hf_logging

    from minillm.course.benchmarks.throughput import load_hf_model

    was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # no loading bars in the notebook's output (they hold timings)
    try:
        return load_hf_model()
    finally:
        if was_on:
            hf_logging.enable_progress_bar()


def transformers_greedy(prompt_ids: Sequence[int], max_tokens: int) -> list[int]:
    """transformers' greedy ``generate`` on the same GGUF file: the independent reference (the EOS token, if it
    comes, is the last one)."""
    hf = _hf_model()
    with torch.inference_mode():
        out = hf.generate(torch.tensor([list(prompt_ids)]), max_new_tokens=max_tokens, do_sample=False,
                          pad_token_id=hf.config.eos_token_id)
    return out[0, len(prompt_ids):].tolist()


@dataclasses.dataclass
class CapstoneResult:
    """What the capstone run did.

    Attributes:
        tokens: per request, the output token ids your engine produced.
        expected: per greedy request, transformers' tokens (``None`` for the sampled request).
        checker: the :class:`PartChecker` (calls per part, the per-step trace).
        num_preemptions / num_cached_prompt_tokens / num_chunked_prompts: evidence the workload needed each part.
        request_ids: the id ``run_engine`` gave each prompt, in prompt order (to read ``checker.trace``).
        package_parts: the parts that were the package's own (``use_reference_for``), not the learner's.
    """

    tokens: list[list[int]]
    expected: list[list[int] | None]
    checker: PartChecker
    num_preemptions: int
    num_cached_prompt_tokens: int
    num_chunked_prompts: int
    request_ids: list[str] = dataclasses.field(default_factory=list)
    package_parts: frozenset[str] = frozenset()

    @property
    def labels(self) -> list[str]:
        """A short label per prompt: the questions, then the sampled prompt."""
        return [*CAPSTONE_QUESTIONS, f"{SAMPLED_PROMPT!r} (sampled)"]

    def summary(self) -> str:
        calls = ", ".join(f"{k} {v}" + (" (package)" if k in self.package_parts else "")
                          for k, v in self.checker.calls.items())
        return (f"{self.checker.step} steps; {self.num_chunked_prompts} prompts prefilled in chunks, "
                f"{self.num_cached_prompt_tokens} prompt tokens from the prefix cache, {self.num_preemptions} "
                f"preemption(s).\nChecked calls per part: {calls}.")


def check_capstone(learner: LearnerParts | EngineParts, model: Any, tokenizer: Any,
                   run_engine: Callable[[Any, list[list[int]], list[Any]], list[list[int]]],
                   use_reference_for: Sequence[str] = (), label: str = "your",
                   guarded: bool = True) -> CapstoneResult:
    """Run the learner's parts as the engine on the capstone workload; raise ``AssertionError`` naming the first
    missing part, the first part that disagrees with the reference (step, part, field), or the first token that
    differs from transformers.

    Args:
        learner: :func:`~minillm.course.exercises.parts.load_learner_parts`'s result (or an :class:`EngineParts`).
        model, tokenizer: SmolLM2 as :func:`minillm.load_model` returns it.
        run_engine: exercise 8.1, ``run_engine(engine, prompts, params) -> output token ids per prompt``.
        use_reference_for: parts to take from the package instead of the learner's notebooks.
        label: how reports name the parts under test ("your scheduler_cls ...").
        guarded: run each learner part under :func:`~minillm.course.exercises.tripwire.guard` (the default), so a part
            that calls the package's own implementation of itself fails. ``False`` only for a demonstration built on
            the package's code (chapter 8's wrong scheduler, which inherits the package's running loop).
    """
    from minillm.course.exercises import grading
    from minillm.engine.arg_utils import EngineArgs
    from minillm.engine.llm_engine import LLMEngine

    parts = learner.engine_parts(use_reference_for) if isinstance(learner, LearnerParts) else learner
    package_parts = frozenset(set(PART_NAMES) - set(parts.replaced()))
    if grading.ACTIVE and guarded and run_engine is not run_requests:
        # Graded: run_engine runs in the answer's process and the parts are checked here, so the two are checked
        # apart: run_engine on the package's engine there, then the parts as the engine with the package's loop.
        _check_run_engine(guard("8.1", run_engine), model, tokenizer)
        run_engine = run_requests
    checker = PartChecker(parts, label=label, guarded=guarded,
                          package_parts=set(use_reference_for) if isinstance(learner, LearnerParts) else None)
    engine = LLMEngine(model, tokenizer, EngineArgs(**CAPSTONE_ARGS), parts=checker.parts())
    prompts, params = capstone_requests(tokenizer)
    # The package's own answer (the notebook's demonstration of a wrong part) runs as it is; a learner's is guarded.
    runner = guard("8.1", run_engine) if guarded and run_engine is not run_requests else run_engine
    tokens = runner(engine, [list(p) for p in prompts], params)
    if engine.has_unfinished_requests():
        raise AssertionError(f"run_engine returned while {engine.get_num_unfinished_requests()} request(s) were "
                             f"unfinished (Exercise 8.1): step until engine.has_unfinished_requests() is False")
    if not isinstance(tokens, (list, tuple)) or len(tokens) != len(prompts):
        raise AssertionError(f"run_engine must return one list of token ids per prompt ({len(prompts)}), got "
                             f"{type(tokens).__name__} of length {len(tokens) if hasattr(tokens, '__len__') else '?'}")
    tokens = [list(t) for t in tokens]  # taken before transformers' reference runs

    expected: list[list[int] | None] = []
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        if p.temperature > 0:
            expected.append(None)
            continue
        want = transformers_greedy(prompt, p.max_tokens)
        expected.append(want)
        got = list(tokens[i])
        if got != want:
            first = next((j for j, (a, b) in enumerate(zip(got, want, strict=False)) if a != b),
                         min(len(got), len(want)))
            raise AssertionError(
                f"request {i} ({CAPSTONE_QUESTIONS[i]!r}): your engine's tokens differ from transformers' at output "
                f"position {first} (yours {got}, transformers {want}), although every part agreed with the "
                f"reference on every call. Look at run_engine (Exercise 8.1): does it return each prompt's tokens "
                f"in prompt order, all of them?")

    # A prompt prefilled in chunks runs several steps with more than one token (a decode step has one).
    multi = [rid for sched, _, _ in checker.trace for rid, n in sched.items() if n > 1]
    num_chunked = sum(1 for rid in set(multi) if multi.count(rid) > 1)
    by_prompt = {tuple(ids): rid for rid, ids in checker.added}
    request_ids = [by_prompt.get(tuple(p), "?") for p in prompts]
    result = CapstoneResult([list(t) for t in tokens], expected, checker, engine.stats.num_preemptions,
                            engine.stats.num_cached_prompt_tokens, num_chunked, request_ids, package_parts)
    # The workload must have needed every part, or "it agrees" would prove little.
    assert result.num_preemptions >= 1, "the capstone workload caused no preemption"
    assert result.num_cached_prompt_tokens > 0, "the capstone workload had no prefix-cache hit"
    assert result.num_chunked_prompts >= 2, "the capstone workload prefilled fewer than 2 prompts in chunks"
    # (Graded, the KV cache manager's parts run inside the learner's scheduler, in the answer's process: checked
    # through the scheduler's results there, not counted here.)
    inside = {"allocate_slots", "block_hashes", "num_cached_tokens"} if grading.ACTIVE else set()
    assert all(checker.calls[n] > 0 for n in PART_NAMES if n not in inside), f"a part was never called: {checker.calls}"
    return result



def _check_run_engine(runner: Callable[..., Any], model: Any, tokenizer: Any) -> None:
    """Exercise 8.1 alone, on the package's engine: ``runner`` must return what :func:`run_requests` returns on an
    engine built alike (when graded, ``runner`` runs in the answer's process, which gets a copy of the engine)."""
    from minillm.engine.arg_utils import EngineArgs
    from minillm.engine.llm_engine import LLMEngine

    prompts, params = capstone_requests(tokenizer)
    engine = LLMEngine(model, tokenizer, EngineArgs(**CAPSTONE_ARGS))
    tokens = runner(engine, [list(p) for p in prompts], params)
    if not isinstance(tokens, (list, tuple)) or len(tokens) != len(prompts):
        raise AssertionError(f"run_engine must return one list of token ids per prompt ({len(prompts)}), got "
                             f"{type(tokens).__name__} of length {len(tokens) if hasattr(tokens, '__len__') else '?'}")
    want = run_requests(LLMEngine(model, tokenizer, EngineArgs(**CAPSTONE_ARGS)), [list(p) for p in prompts], params)
    for i, (got, expected) in enumerate(zip(tokens, want, strict=True)):
        if params[i].temperature == 0 and list(got) != expected:
            raise AssertionError(f"request {i} ({CAPSTONE_QUESTIONS[i]!r}): run_engine (Exercise 8.1) on the "
                                 f"package's own engine returned {list(got)}, the engine's tokens are {expected}: "
                                 f"does it return each prompt's tokens in prompt order, all of them?")


def run_requests(engine: Any, prompts: list[list[int]], params: list[Any]) -> list[list[int]]:
    """The package's answer to exercise 8.1: add each prompt as request ``capstone-i``, step until the engine is
    empty, return each prompt's output token ids in prompt order."""
    for i, (prompt, sp) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(f"capstone-{i}", prompt, sp)
    done: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        done.update((o.request_id, list(o.outputs[0].token_ids)) for o in engine.step() if o.finished)
    return [done[f"capstone-{i}"] for i in range(len(prompts))]


def capstone_tokens(parts: EngineParts, model: Any, tokenizer: Any) -> list[list[int]]:
    """The capstone workload through ``LLMEngine(parts=parts)``, without any check: each request's output tokens.

    For seeing what a part does to the output on its own (a wrong scheduler, for instance, can leave every greedy
    token right, which is why :func:`check_capstone` compares the parts themselves)."""
    from minillm.engine.arg_utils import EngineArgs
    from minillm.engine.llm_engine import LLMEngine

    engine = LLMEngine(model, tokenizer, EngineArgs(**CAPSTONE_ARGS), parts=parts)
    return run_requests(engine, *capstone_requests(tokenizer))
