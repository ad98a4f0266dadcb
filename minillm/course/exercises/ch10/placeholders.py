"""Exercise 10.2's check: the learner's placeholder accounting, run as the scheduler of async scheduling.

Three :class:`~minillm.engine.core.EngineCore` run each workload of :func:`scenarios` on the tiny model: a synchronous
one (the tokens every engine must give), one with async scheduling and the package's ``AsyncScheduler`` (the
reference), and one with async scheduling and the learner's ``Scheduler`` subclass. The two async cores take their
turns (``step_with_batch_queue``) in lockstep, the learner's first in each turn, and the synchronous core runs once
they are done; a recorder on each scheduler notes every ``schedule()`` and every ``update_from_output()`` with each
request's ``num_computed_tokens``, ``num_output_placeholders``, token count and status right after it. The
learner's events must equal the reference's one by one, and its tokens the synchronous engine's exactly. When a
placeholder count differs, the message says what the step did to that request (a prefill chunk that samples nothing,
the last chunk of a prompt, a decode, a token that came back, a stop with a step still in flight) and so which rule
was missed.

The scenarios cover a prompt prefilled in chunks of 5 (four chunks that sample nothing), a request whose only token is
sampled by its prefill (``max_tokens=1``: no step may follow it), ``max_tokens`` reached while a step is in flight, a
stop token (one step more was already planned: its output is dropped), a late arrival, and a KV cache small enough
that a request is preempted while a step is in flight for it. Prefix caching is off: the package's
``AsyncScheduler`` also registers the blocks that new tokens filled in the prefix cache, which is not what the
exercise is about.
"""
from __future__ import annotations

from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from minillm.core.sched.output import ModelRunnerOutput, SchedulerOutput
from minillm.core.sched.scheduler import Scheduler
from minillm.course.exercises.ch10.tiny import tiny_llama
from minillm.engine import EngineCoreOutput
from minillm.engine.arg_utils import EngineArgs
from minillm.engine.core import EngineCore
from minillm.engine.parts import EngineParts
from minillm.model.llama import LlamaForCausalLM
from minillm.request import Request, RequestStatus
from minillm.sampling_params import SamplingParams

MAX_TURNS = 600  # a scenario takes under 100 turns; more means the engine stopped making progress


@dataclass(frozen=True)
class View:
    """One request right after a ``schedule()`` or an ``update_from_output()``."""

    status: str
    num_computed_tokens: int
    num_output_placeholders: int
    num_tokens: int
    num_prompt_tokens: int

    @classmethod
    def of(cls, request: Request) -> View:
        return cls(request.status.name, request.num_computed_tokens, request.num_output_placeholders,
                   request.num_tokens, request.num_prompt_tokens)


@dataclass
class Event:
    """A ``schedule()`` (``kind="schedule"``, ``plan``: the step's ``num_scheduled_tokens``) or an
    ``update_from_output()`` (``kind="update"``, ``tokens``: each request's new tokens, ``finished``: each finished
    request's reason) of step ``step`` (schedules are numbered from 0), with every request's :class:`View` after it."""

    kind: str
    step: int
    views: dict[str, View]
    plan: dict[str, int] | None = None
    tokens: dict[str, list[int]] | None = None
    finished: dict[str, str] | None = None

    def describe(self) -> str:
        if self.kind == "schedule":
            return f"the schedule() of step {self.step}, which planned {self.plan}"
        return f"the update_from_output() of step {self.step}'s output, which gave {self.tokens}"


class Recorder:
    """Notes each ``schedule()`` and ``update_from_output()`` of one core's scheduler as an :class:`Event`.

    Args:
        core: the engine core; its scheduler's two methods are wrapped on the instance.
        requests: request id -> :class:`Request`, every request added to this core (finished ones stay).
    """

    def __init__(self, core: EngineCore, requests: dict[str, Request]) -> None:
        self.events: list[Event] = []
        self.requests = requests
        # id(scheduler_output) -> its step number. An id is unique only among live objects, and a plan lives until its
        # output has been taken, so the number is right when update_from_output looks it up.
        self._step_of: dict[int, int] = {}
        self._num_steps = 0
        scheduler = core.scheduler
        schedule, update = scheduler.schedule, scheduler.update_from_output

        def recorded_schedule() -> SchedulerOutput:
            so = schedule()
            self._step_of[id(so)] = step = self._num_steps
            self._num_steps += 1
            self.events.append(Event("schedule", step, self.views(), plan=dict(so.num_scheduled_tokens)))
            return so

        def recorded_update(scheduler_output: SchedulerOutput,
                            model_runner_output: ModelRunnerOutput) -> list[EngineCoreOutput]:
            outputs = update(scheduler_output, model_runner_output)
            self.events.append(Event("update", self._step_of[id(scheduler_output)], self.views(),
                                     tokens={o.request_id: list(o.new_token_ids) for o in outputs},
                                     finished={o.request_id: o.finish_reason for o in outputs if o.finish_reason}))
            return outputs

        # Instance attributes that wrap the methods, on this scheduler only (mypy's method-assign is about classes).
        scheduler.schedule = recorded_schedule  # type: ignore[method-assign]
        scheduler.update_from_output = recorded_update  # type: ignore[method-assign]

    def views(self) -> dict[str, View]:
        return {rid: View.of(r) for rid, r in self.requests.items()}


@dataclass
class Scenario:
    """One workload: engine arguments and ``(arrival turn, id, prompt, params)`` requests."""

    name: str
    engine_args: dict[str, Any]
    requests: list[tuple[int, str, list[int], SamplingParams]]


def _greedy(max_tokens: int, **kwargs: Any) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kwargs)


_CHUNKS: dict[str, Any] = dict(block_size=4, num_gpu_blocks=200, max_num_batched_tokens=16,
                               long_prefill_token_threshold=5, max_num_seqs=4, max_model_len=64,
                               enable_prefix_caching=False)
_TIGHT: dict[str, Any] = dict(block_size=4, num_gpu_blocks=12, max_num_batched_tokens=64, max_model_len=40,
                              enable_prefix_caching=False)
_STOPPING_PROMPT = [(3 + 11 * j) % 211 for j in range(9)]


def stop_token(model: LlamaForCausalLM, pool: ThreadPoolExecutor) -> int:
    """A token the greedy continuation of :data:`_STOPPING_PROMPT` reaches as its third (or a later) new one, and
    not before: as a stop token it ends that request early, with a step already planned under async scheduling."""
    core = EngineCore(model, EngineArgs(**_CHUNKS), model_thread=pool)
    tokens = _run_sync(core, [(0, "probe", _STOPPING_PROMPT, _greedy(8))])["probe"]
    for i in range(2, len(tokens)):
        if tokens[i] not in tokens[:i]:
            return tokens[i]
    raise RuntimeError(f"the tiny model's greedy tokens {tokens} repeat: no stop token ends the request early")


def scenarios(model: LlamaForCausalLM, pool: ThreadPoolExecutor) -> list[Scenario]:
    """The check's workloads (the stop token depends on the model, so it is found first)."""
    stop = stop_token(model, pool)
    return [
        Scenario("chunked prefill, max_tokens and a stop token", _CHUNKS, [
            (0, "long", [(5 + 7 * j) % 211 for j in range(23)], _greedy(6)),
            (0, "one", [40, 41, 42, 43], _greedy(1)),
            (0, "stops", _STOPPING_PROMPT, _greedy(12, stop_token_ids=[stop])),
            (3, "late", [(90 + 3 * j) % 211 for j in range(7)], _greedy(5))]),
        Scenario("a preemption with a step in flight", _TIGHT, [
            (0, "a", list(range(15)), _greedy(16)), (0, "b", list(range(100, 115)), _greedy(16))]),
    ]


def _run_sync(core: EngineCore, requests: list[tuple[int, str, list[int], SamplingParams]]) -> dict[str, list[int]]:
    """The tokens each request gets from a synchronous core, requests added at their arrival turn."""
    tokens: dict[str, list[int]] = {rid: [] for _, rid, _, _ in requests}
    pending = sorted(requests, key=lambda r: r[0])
    turn = 0
    while pending or core.has_requests():
        while pending and pending[0][0] <= turn:
            _, rid, prompt, params = pending.pop(0)
            core.add_request(Request(rid, prompt, params))
        outputs, _ = core.step()
        for out in outputs.outputs if outputs is not None else ():
            tokens[out.request_id] += out.new_token_ids
        turn += 1
        if turn > MAX_TURNS:
            raise RuntimeError("the synchronous engine made no progress")
    return tokens


# -- why a count differs ------------------------------------------------------------------------------------------
def _explain_schedule(rid: str, k: int, n: int | None, before: View, ref: View, mine: View) -> str:
    """Why the learner's count after step ``k``'s ``schedule()`` differs for ``rid`` (``n``: its scheduled tokens)."""
    if n is None:
        return (f"it is not scheduled in step {k}, yet your count went from {before.num_output_placeholders} to "
                f"{mine.num_output_placeholders}: count only the requests of scheduler_output.num_scheduled_tokens")
    start, end = before.num_computed_tokens, before.num_computed_tokens + n
    ref_inc = ref.num_output_placeholders - before.num_output_placeholders
    mine_inc = mine.num_output_placeholders - before.num_output_placeholders
    known, outputs = before.num_tokens, before.num_tokens - before.num_prompt_tokens
    what = (f"its {known}-token prompt" if not outputs else
            f"its {known} tokens (prompt and {outputs} outputs, recomputed after a preemption)")
    if ref_inc == 1 and mine_inc == 0:
        if outputs and start >= known - 1:  # a decode: its input is its last token, or one still in flight
            return (f"step {k} decodes it (position {start}; it has {known} known tokens and "
                    f"{before.num_output_placeholders} in flight): it samples a token, so count one placeholder")
        return (f"step {k} computes positions {start}..{end - 1}, the end of {what}, so it samples the next token: "
                f"the last chunk of a prefill counts one placeholder, as a decode does")
    if ref_inc == 0 and mine_inc > 0:
        return (f"step {k} computes positions {start}..{end - 1} of {what} and stops short of its end: such a chunk "
                f"samples nothing (the runner discards that row's token), so it gets no placeholder. Count one only "
                f"when num_computed_tokens, once advanced, reaches num_tokens + num_output_placeholders")
    return (f"each step samples one token per request here (there are no draft tokens under async scheduling): "
            f"a step that samples adds 1 placeholder; yours added {mine_inc}, the reference {ref_inc}")


def _explain_update(rid: str, k: int, tokens: list[int], reason: str | None, before: View, ref: View,
                    mine: View) -> str:
    """Why the learner's count after the update from step ``k``'s output differs for ``rid``."""
    got, mine_ph, ref_ph = len(tokens), mine.num_output_placeholders, ref.num_output_placeholders
    if reason is not None and mine_ph < ref_ph:
        return (f"it finished ({reason}) on the token step {k} sampled, with {ref_ph} more step(s) already planned "
                f"for it. Their outputs are dropped when they come back (the scheduler no longer knows the request), "
                f"so their placeholders are never taken back: take back one per token that did come back "
                f"({tokens}), also when the request stops")
    if mine_ph - ref_ph == got and got:
        return (f"the token(s) step {k} sampled for it came back ({tokens}): take back as many placeholders "
                f"(num_output_placeholders -= the number of tokens the base class kept)")
    return (f"the update took back {before.num_output_placeholders - mine_ph} placeholder(s) for the {got} token(s) "
            f"that came back ({tokens}); take back exactly one per token returned")


def _compare(ref: Event, mine: Event, before: dict[str, View], where: str) -> str | None:
    """What differs between the reference's event and the learner's (``before``: the views after the previous
    event, equal in both), or ``None``."""
    if (ref.kind, ref.step) != (mine.kind, mine.step):
        return f"{where}: the reference's engine made {ref.describe()}, yours {mine.describe()}"
    if ref.kind == "schedule" and ref.plan != mine.plan:
        return f"{where}: in step {ref.step} your scheduler planned {mine.plan}, the reference {ref.plan}"
    if ref.kind == "update" and ref.tokens != mine.tokens:
        return f"{where}: the update from step {ref.step}'s output gave {mine.tokens}, the reference's {ref.tokens}"
    for rid, want in ref.views.items():
        got = mine.views.get(rid)
        if got is None or got == want:
            continue
        old = before.get(rid, want)
        head = f"{where}, after {ref.describe()}: request {rid!r}"
        if got.num_computed_tokens != want.num_computed_tokens:
            why = (": call super()._update_after_schedule(scheduler_output) first; the base class advances "
                   "num_computed_tokens by the scheduled tokens (and keeps the step's request ids)"
                   if ref.kind == "schedule" and got.num_computed_tokens == old.num_computed_tokens else "")
            return (f"{head} has num_computed_tokens {got.num_computed_tokens}, the reference "
                    f"{want.num_computed_tokens}{why}")
        if got.num_output_placeholders != want.num_output_placeholders:
            why = (_explain_schedule(rid, ref.step, (ref.plan or {}).get(rid), old, want, got) if ref.kind == "schedule"
                   else _explain_update(rid, ref.step, (ref.tokens or {}).get(rid, []),
                                        (ref.finished or {}).get(rid), old, want, got))
            return (f"{head} has {got.num_output_placeholders} output placeholder(s), the reference "
                    f"{want.num_output_placeholders}: {why}")
        return f"{head} is {got}, the reference's {want}"
    return None


# -- running ------------------------------------------------------------------------------------------------------
def _cores(model: LlamaForCausalLM, args: EngineArgs, learner_cls: type,
           pool: ThreadPoolExecutor) -> tuple[EngineCore, EngineCore, EngineCore]:
    """(synchronous, reference async, learner's async) cores; every step of all three runs on ``pool``'s thread,
    one at a time (one OpenMP team, and the steps of each core in order)."""
    # No core.shutdown() here: it would shut the shared pool down, which its owner does once every core is done.
    sync = EngineCore(model, args, model_thread=pool)
    ref = EngineCore(model, args, async_scheduling=True, model_thread=pool)
    try:
        mine = EngineCore(model, args, EngineParts(scheduler_cls=learner_cls), async_scheduling=True,
                          model_thread=pool)
    except ValueError as e:
        raise AssertionError(f"EngineCore refused your class: {e}") from e
    return sync, ref, mine


def _learner_turn(core: EngineCore, where: str) -> Any:
    try:
        return core.step_with_batch_queue()
    except (NotImplementedError, AssertionError):  # a stub, a call of the package's own accounting, a failed assert
        raise
    except Exception as e:  # a crash is a wrong answer: say where
        raise AssertionError(f"{where}: your scheduler raised {type(e).__name__}: {e}") from e


def run_lockstep(scenario: Scenario, learner_cls: type, model: LlamaForCausalLM,
                 pool: ThreadPoolExecutor) -> dict[str, int]:
    """One scenario: the learner's async core beside the reference's, event by event, then the tokens against the
    synchronous core's. Raises ``AssertionError`` at the first difference. Returns what the reference went
    through (steps, placeholders counted, chunks that sampled nothing, ...)."""
    args = EngineArgs(**scenario.engine_args)
    sync, ref, mine = _cores(model, args, learner_cls, pool)
    ref_requests: dict[str, Request] = {}
    mine_requests: dict[str, Request] = {}
    ref_rec, mine_rec = Recorder(ref, ref_requests), Recorder(mine, mine_requests)
    got: dict[str, list[int]] = {rid: [] for _, rid, _, _ in scenario.requests}
    pending = sorted(scenario.requests, key=lambda r: r[0])
    before: dict[str, View] = {}
    compared, turn = 0, 0
    counts = {"steps": 0, "placeholders": 0, "chunks that sample nothing": 0, "last step in flight": 0,
              "stops with a step in flight": 0, "preemptions with a step in flight": 0}
    while pending or ref.has_requests() or mine.has_requests():
        where = f"In scenario {scenario.name!r}, turn {turn}"
        while pending and pending[0][0] <= turn:
            _, rid, prompt, params = pending.pop(0)
            for core, table in ((ref, ref_requests), (mine, mine_requests)):
                table[rid] = Request(rid, prompt, params)
                core.add_request(table[rid])
            before[rid] = View.of(ref_requests[rid])
        # The learner's turn first: the reference's events of this turn do not exist while its code runs.
        if mine.has_requests():
            outputs, _ = _learner_turn(mine, where)
            for out in outputs.outputs if outputs is not None else ():
                got[out.request_id] += out.new_token_ids
        if ref.has_requests():
            ref.step_with_batch_queue()
        for i in range(compared, max(len(ref_rec.events), len(mine_rec.events))):
            if i >= len(mine_rec.events):
                raise AssertionError(f"{where}: the reference's engine made {ref_rec.events[i].describe()}, "
                                     f"yours nothing (its scheduler has no request left to run)")
            if i >= len(ref_rec.events):
                raise AssertionError(f"{where}: your engine made {mine_rec.events[i].describe()}, the "
                                     f"reference's nothing (it has no request left to run)")
            problem = _compare(ref_rec.events[i], mine_rec.events[i], before, where)
            if problem:
                raise AssertionError(problem + ".")
            _count(counts, ref_rec.events[i], before, ref_requests)
            before = {**before, **ref_rec.events[i].views}
        compared = max(len(ref_rec.events), len(mine_rec.events))
        turn += 1
        if turn > MAX_TURNS:
            raise AssertionError(f"In scenario {scenario.name!r}: no progress after {MAX_TURNS} turns")
    want = _run_sync(sync, scenario.requests)  # the tokens every engine must give, once the learner's are in
    for _, rid, _, _ in scenario.requests:
        if got[rid] != want[rid]:
            raise AssertionError(f"In scenario {scenario.name!r}, your engine generated {got[rid]} for {rid!r}, the "
                                 f"synchronous engine {want[rid]}: async scheduling must not change a token")
    return counts


def _last_in_flight(view: View, max_tokens: int | None) -> bool:
    """``Scheduler._in_flight_step_is_its_last`` on a recorded view: the step in flight samples the last token."""
    return (max_tokens is not None and view.num_computed_tokens + 2 - view.num_output_placeholders
            >= view.num_prompt_tokens + max_tokens)


def _count(counts: dict[str, int], event: Event, before: dict[str, View], requests: dict[str, Request]) -> None:
    for rid, view in event.views.items():
        old = before.get(rid, view)
        if event.kind == "schedule":
            if rid in (event.plan or {}):
                counts["placeholders"] += view.num_output_placeholders - old.num_output_placeholders
                counts["chunks that sample nothing"] += view.num_output_placeholders == old.num_output_placeholders
            elif view.status == RequestStatus.RUNNING.name and old.num_output_placeholders and _last_in_flight(
                    old, requests[rid].max_tokens):
                counts["last step in flight"] += 1
            if view.status == RequestStatus.PREEMPTED.name != old.status and old.num_output_placeholders:
                counts["preemptions with a step in flight"] += 1
        elif (event.finished or {}).get(rid) == "stop" and view.num_output_placeholders:
            counts["stops with a step in flight"] += 1
    counts["steps"] += event.kind == "schedule"


def check_placeholder_scheduler(scheduler_cls: type, model: LlamaForCausalLM | None = None,
                                verbose: bool = True) -> dict[str, int]:
    """Exercise 10.2's check: ``scheduler_cls`` (a :class:`Scheduler` subclass defining ``_update_after_schedule`` and
    ``_update_request_with_output``) as the scheduler of async scheduling, against the package's
    :class:`AsyncScheduler`, under the tripwire (its two methods raise while the learner's run).

    Returns:
        what the scenarios went through, summed; printed when ``verbose``.
    """
    from minillm.course.exercises.tripwire import guard

    if not (isinstance(scheduler_cls, type) and issubclass(scheduler_cls, Scheduler)):
        raise AssertionError(f"exercise 10.2 asks for a subclass of minillm's Scheduler, got {scheduler_cls!r}")
    learner_cls = guard("10.2", scheduler_cls)  # refuses an AsyncScheduler subclass that inherits the two methods
    for name in ("_update_after_schedule", "_update_request_with_output"):
        if getattr(scheduler_cls, name) is getattr(Scheduler, name):
            raise AssertionError(f"{scheduler_cls.__name__} must define {name}: it inherits Scheduler's, which counts "
                                 f"no placeholders")
    model = model if model is not None else tiny_llama()
    total: Counter[str] = Counter()
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="minillm-ch10") as pool:
        for scenario in scenarios(model, pool):
            total.update(run_lockstep(scenario, learner_cls, model, pool))
    if verbose:
        print(f"Your scheduler counts the output placeholders as AsyncScheduler does after every schedule and every "
              f"update of {total['steps']} steps, and the tokens are the synchronous engine's. The steps counted "
              f"{total['placeholders']} placeholders; {total['chunks that sample nothing']} prefill chunks sampled "
              f"nothing; {total['last step in flight']} times a request got no step because the one in flight "
              f"sampled its last token; {total['stops with a step in flight']} request(s) stopped on a token and "
              f"{total['preemptions with a step in flight']} were preempted with a step in flight.")
    return total

