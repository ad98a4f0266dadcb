"""Views of the scheduler: one step explained row by row, pictures of a whole run, and a stepper to drive by hand.

- :func:`trace_step`: run ``schedule()`` once and explain, for every running and waiting request, what it got and
  why (as deterministic text rows).
- :func:`plot_schedule` / :func:`plot_queues`: per step, scheduled tokens by request (prefill chunks hatched,
  decodes solid) against the budget line; queue lengths and KV blocks in use.
- :class:`SchedulerStepper`: a scheduler + fake runner a learner steps through (step, add a request, change the
  budget). Its actions are plain methods, so a notebook can drive it headless; :meth:`SchedulerStepper.ui` adds
  ipywidgets buttons around them.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from minillm.config import SchedulerConfig
from minillm.core.sched.output import SchedulerOutput
from minillm.core.sched.scheduler import Scheduler
from minillm.course.fake_runner import FakeModelRunner, SimulationResult, StepRecord
from minillm.course.widgets.figure_view import COLORS as _COLORS
from minillm.course.widgets.figure_view import FigureView, render_png
from minillm.request import Request
from minillm.sampling_params import SamplingParams

_STEPPER_FIGSIZE = (10, 5.2)


@dataclass
class TraceRow:
    """One request's line in a traced step.

    Attributes:
        queue: where it was when the step began (``"running"`` or ``"waiting"``).
        request_id: the request.
        need: ``num_tokens - num_computed_tokens`` when the step began.
        budget_left: the token budget left when its turn came.
        granted: tokens scheduled for it in this step (0: none).
        why: the rule that decided it.
    """

    queue: str
    request_id: str
    need: int
    budget_left: int
    granted: int
    why: str


def _granted_why(sched: Scheduler, r: Request, need: int, granted: int, hit: int = 0) -> str:
    threshold = sched.scheduler_config.long_prefill_token_threshold
    if granted == 1 and need == 1 and r.num_output_tokens > 0:
        return "decode: 1 token"
    what = "prompt" if r.num_output_tokens == 0 else "prompt + outputs (recompute)"
    hit_note = f" after a {hit}-token prefix-cache hit" if hit else ""
    if granted == need - hit:
        return f"all of its {what}{hit_note}"
    if granted == threshold:
        return f"chunk capped by long_prefill_token_threshold={threshold}{hit_note}"
    return f"chunk: only {granted} tokens of budget left{hit_note}"


def trace_step(sched: Scheduler) -> tuple[SchedulerOutput, list[TraceRow]]:
    """Call ``sched.schedule()`` once and explain it.

    Returns:
        The :class:`SchedulerOutput` and one :class:`TraceRow` per request that was running or waiting when the
        step began, running ones first (the order ``schedule()`` visits them).
    """
    cfg = sched.scheduler_config
    before = [("running", r, r.num_tokens - r.num_computed_tokens) for r in sched.running]
    before += [("waiting", r, r.num_tokens - r.num_computed_tokens) for r in sched.waiting]
    so = sched.schedule()
    hits = {n.req_id: n.num_computed_tokens for n in so.scheduled_new_reqs}
    cached = so.scheduled_cached_reqs
    hits.update({rid: cached.num_computed_tokens[i] for i, rid in enumerate(cached.req_ids)
                 if rid in cached.resumed_req_ids})
    left = cfg.max_num_batched_tokens
    rows: list[TraceRow] = []
    blocked = False
    for queue, r, need in before:
        rid = r.request_id
        granted = so.num_scheduled_tokens.get(rid, 0)
        if granted:
            why = _granted_why(sched, r, need, granted, hits.get(rid, 0))
            if queue == "waiting":
                why = ("admitted (resumed): " if rid in cached.resumed_req_ids else "admitted: ") + why
        elif rid in so.preempted_req_ids and queue == "running":
            why = "preempted by recompute: the KV cache was full"
        elif queue == "running":
            why = "budget exhausted" if left == 0 else "not reached: the loop stopped at a self-preemption"
        elif so.preempted_req_ids:
            why = "not admitted: a request was preempted in this step"
        elif blocked:
            why = "waits behind a request that could not be admitted"
        elif left == 0:
            why = "not admitted: budget exhausted"
        elif len(sched.running) >= cfg.max_num_seqs:
            why = f"not admitted: all max_num_seqs={cfg.max_num_seqs} seats taken"
        elif not cfg.enable_chunked_prefill and need > left:
            why = f"not admitted: needs {need} > {left} left and chunked prefill is off"
            blocked = True
        else:
            why = "not admitted: the KV cache cannot hold it"
            blocked = True
        rows.append(TraceRow(queue, rid, need, left, granted, why))
        left -= granted
    return so, rows


def format_trace(rows: Sequence[TraceRow]) -> str:
    """The rows as a fixed-width text table."""
    lines = [f"{'queue':8s} {'request':8s} {'needs':>5s} {'budget left':>11s} {'gets':>4s}  why",
             "-" * 100]
    lines += [f"{r.queue:8s} {r.request_id:8s} {r.need:5d} {r.budget_left:11d} {r.granted:4d}  {r.why}" for r in rows]
    return "\n".join(lines)


def _color_map(ids: Sequence[str]) -> dict[str, str]:
    return {rid: _COLORS[i % len(_COLORS)] for i, rid in enumerate(ids)}


def plot_schedule(steps: Sequence[StepRecord], ax=None, title: str | None = None, legend: bool = True):
    """Stacked bars: per step, the tokens each request got (hatched = prefill or recompute chunk, solid = decode),
    with the token budget as a dashed line. Returns the axes."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    if ax is None:
        _, ax = plt.subplots(figsize=(10, 3.2))
    ids = list(dict.fromkeys(rid for s in steps for rid in s.output.num_scheduled_tokens))
    color = _color_map(ids)
    for s in steps:
        bottom = 0
        for rid, n in s.output.num_scheduled_tokens.items():
            prefill = s.kinds.get(rid) == "prefill"
            ax.bar(s.step, n, bottom=bottom, color=color[rid], edgecolor="black", linewidth=0.4,
                   hatch="///" if prefill else None, alpha=0.75 if prefill else 1.0)
            bottom += n
    ax.step([s.step - 0.5 for s in steps] + [steps[-1].step + 0.5],
            [s.token_budget for s in steps] + [steps[-1].token_budget], where="post", color="black", ls="--", lw=1)
    ax.set_xlabel("step")
    ax.set_ylabel("tokens scheduled")
    ax.set_title(title or "tokens per step by request (hatched: prefill chunk, solid: decode; dashed: budget)")
    if legend:
        handles = [Patch(facecolor=color[r], label=r) for r in ids]
        ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)
    return ax


def plot_queues(steps: Sequence[StepRecord], num_usable_blocks: int | None = None, ax=None):
    """Running and waiting queue lengths (left axis) and KV blocks in use (right axis) after each step's schedule."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(10, 2.8))
    x = [s.step for s in steps]
    ax.plot(x, [s.num_running for s in steps], label="running", color="#4C72B0", drawstyle="steps-mid")
    ax.plot(x, [s.num_waiting for s in steps], label="waiting", color="#DD8452", drawstyle="steps-mid")
    pre = [s.step for s in steps if s.output.preempted_req_ids]
    if pre:
        ax.scatter(pre, [0] * len(pre), marker="x", color="#C44E52", label="preemption", zorder=3)
    ax.set_xlabel("step")
    ax.set_ylabel("requests")
    ax2 = ax.twinx()
    ax2.fill_between(x, [s.num_used_blocks for s in steps], step="mid", color="#55A868", alpha=0.25,
                     label="KV blocks in use")
    if num_usable_blocks:
        ax2.axhline(num_usable_blocks, color="#55A868", ls=":", lw=1)
    ax2.set_ylabel("KV blocks in use")
    lines = ax.get_legend_handles_labels()
    lines2 = ax2.get_legend_handles_labels()
    ax.legend(lines[0] + lines2[0], lines[1] + lines2[1], loc="upper left", bbox_to_anchor=(1.08, 1.0), fontsize=8,
              frameon=False)
    return ax


class SchedulerStepper:
    """A scheduler with a fake model runner that a learner advances one step at a time.

    Args:
        config: the scheduler configuration to start with.
        num_gpu_blocks / block_size / enable_prefix_caching: the KV cache.
        requests: ``(request_id, prompt_len, max_tokens, priority)`` added before the first step.
    """

    def __init__(self, config: SchedulerConfig, num_gpu_blocks: int = 32, block_size: int = 4,
                 enable_prefix_caching: bool = False,
                 requests: Sequence[tuple[str, int, int, int]] = ()) -> None:
        self.scheduler = Scheduler(config, num_gpu_blocks, block_size, enable_prefix_caching)
        self.runner = FakeModelRunner(num_gpu_blocks, block_size)
        self.result = SimulationResult({}, {})
        self._prefilling: set[str] = set()
        self._next_id = 0
        self.last_rows: list[TraceRow] = []
        for rid, prompt_len, max_tokens, priority in requests:
            self.add_request(prompt_len, max_tokens, priority, rid)

    @property
    def step_index(self) -> int:
        return len(self.result.steps)

    def add_request(self, prompt_len: int = 12, max_tokens: int = 6, priority: int = 0,
                    request_id: str | None = None) -> str:
        """Queue a request with a ``prompt_len``-token prompt (arriving now). Returns a status line."""
        rid = request_id or f"n{self._next_id}"
        self._next_id += 1
        start = 1000 * (self._next_id + 1)  # distinct prompts: no accidental prefix hits
        req = Request(rid, list(range(start, start + prompt_len)),
                      SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                      arrival_time=float(self.step_index) + self._next_id * 1e-6, priority=priority)
        self.scheduler.add_request(req)
        self.result.outputs[rid] = []
        return f"{rid}: {prompt_len}-token prompt, {max_tokens} tokens wanted, priority {priority}"

    def set_budget(self, max_num_batched_tokens: int) -> str:
        """Change the token budget from the next step on (validated like a new :class:`SchedulerConfig`)."""
        config = dataclasses.replace(self.scheduler.scheduler_config, max_num_batched_tokens=max_num_batched_tokens)
        self.scheduler.scheduler_config = config
        self.scheduler.max_num_scheduled_tokens = max_num_batched_tokens
        return f"budget set to {max_num_batched_tokens} tokens per step"

    def step(self) -> str:
        """Schedule one step, run it with the fake runner, apply its output. Returns the step's trace as text."""
        sched = self.scheduler
        so, rows = trace_step(sched)
        self.last_rows = rows
        self._prefilling |= {n.req_id for n in so.scheduled_new_reqs} | so.scheduled_cached_reqs.resumed_req_ids
        kinds = {rid: ("prefill" if rid in self._prefilling else "decode") for rid in so.num_scheduled_tokens}
        self._prefilling -= {rid for rid in so.num_scheduled_tokens
                             if sched.requests[rid].num_computed_tokens == sched.requests[rid].num_tokens}
        kv = sched.kv_cache_manager
        record = StepRecord(self.step_index, so, kinds, len(sched.running), len(sched.waiting),
                            kv.num_blocks - 1 - kv.num_free_blocks, sched.max_num_scheduled_tokens)
        self.result.steps.append(record)
        for out in sched.update_from_output(so, self.runner.execute_model(so)):
            self.result.outputs[out.request_id].extend(out.new_token_ids)
            if out.finish_reason is not None:  # finished
                self.result.finish_reasons[out.request_id] = out.finish_reason
        head = (f"step {record.step}: {so.total_num_scheduled_tokens}/{sched.max_num_scheduled_tokens} tokens, "
                f"running {record.num_running}, waiting {record.num_waiting}, KV blocks in use "
                f"{record.num_used_blocks}/{kv.num_blocks - 1}")
        if so.preempted_req_ids:
            head += f", preempted {sorted(so.preempted_req_ids)}"
        return head + "\n" + format_trace(rows)

    def state_text(self) -> str:
        """Every live request: queue, status, computed / total tokens, outputs so far."""
        sched = self.scheduler
        lines = []
        for queue, reqs in (("running", sched.running), ("waiting", list(sched.waiting))):
            for r in reqs:
                lines.append(f"{queue:8s} {r.request_id:6s} {r.status.name:9s} computed {r.num_computed_tokens:3d}"
                             f" / {r.num_tokens:3d} tokens, {r.num_output_tokens} outputs, priority {r.priority}")
        done = [rid for rid, why in self.result.finish_reasons.items()]
        lines.append(f"finished: {', '.join(done) if done else '-'}")
        return "\n".join(lines)

    def plot(self):
        """The run so far: tokens per step, then queues and KV blocks (a pyplot figure, for a notebook cell)."""
        import matplotlib.pyplot as plt

        fig = plt.figure(figsize=_STEPPER_FIGSIZE)
        self._draw(fig)
        return fig

    def _draw(self, fig) -> None:
        a, b = fig.subplots(2, 1, sharex=True)
        if self.result.steps:
            plot_schedule(self.result.steps, ax=a)
            plot_queues(self.result.steps, self.scheduler.kv_cache_manager.num_blocks - 1, ax=b)
        fig.tight_layout()

    # -- the ipywidgets front-end ----------------------------------------------------------------------------------
    def ui(self):
        """Buttons around :meth:`step`, :meth:`add_request` and :meth:`set_budget` (an ``ipywidgets.VBox``)."""
        import ipywidgets as w

        step_btn = w.Button(description="step")
        prompt = w.BoundedIntText(value=12, min=1, max=self.scheduler.max_model_len - 1, description="prompt len",
                                  layout=w.Layout(width="170px"))
        max_tokens = w.BoundedIntText(value=6, min=1, max=64, description="max tokens",
                                      layout=w.Layout(width="170px"))
        priority = w.BoundedIntText(value=0, min=0, max=9, description="priority", layout=w.Layout(width="150px"))
        add_btn = w.Button(description="add request")
        budget = w.IntSlider(value=self.scheduler.max_num_scheduled_tokens, min=self.scheduler.max_num_running_reqs,
                             max=4 * self.scheduler.max_num_scheduled_tokens, description="budget")
        view = FigureView()

        def render(status: str) -> None:
            view.show(status, render_png(self._draw, _STEPPER_FIGSIZE), self.state_text())

        def act(fn):
            def handler(_):
                try:
                    render(fn())
                except ValueError as e:
                    render(f"refused: {e}")
            return handler

        step_btn.on_click(act(self.step))
        add_btn.on_click(act(lambda: self.add_request(prompt.value, max_tokens.value, priority.value)))
        budget.observe(lambda change: act(lambda: self.set_budget(change["new"]))(None), names="value")
        render("press 'step' to schedule one step")
        return w.VBox([w.HBox([step_btn, budget]), w.HBox([prompt, max_tokens, priority, add_btn]), view.widget])

