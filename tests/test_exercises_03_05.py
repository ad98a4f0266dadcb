"""Exercises 3.1-5.4: every check cell catches the usual wrong answers and says why, and accepts the solution.

Each test runs a solution notebook up to one check cell with a deliberately wrong answer swapped in
(``tests/exercise_helpers.run_check``) and asserts that the check fails with an ``AssertionError`` whose message
names the mistake. The wrong answers are the solution's own code with one thing changed (the usual slip), so they
stay in step with the solutions. A last group checks the course-wide exercise format of these three notebooks (a
``### Exercise N.M ★`` heading, a folded hint, the exercise, its check) and the names and signatures chapter 8 loads
from a learner's notebook.
"""
from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

import nbformat
import pytest
import torch

from minillm.exercises.build import BEGIN
from minillm.outputs import PLACEHOLDER_TOKEN_ID
from minillm.request import RequestStatus
from tests.exercise_helpers import caught, exercise_source, mutated, run_check

ROOT = Path(__file__).resolve().parent.parent
NB03, NB04, NB05 = "03_triton_prefill_kernel.ipynb", "04_scheduler.ipynb", "05_sampler.ipynb"


# -- 03 ----------------------------------------------------------------------------------------------------------------
TRITON_HEADER = "import math\nimport torch\nimport triton\nimport triton.language as tl\n"


def _step(m, l, acc, s, v, *, rescale_acc=True, rescale_l=True, safe=True, invert=False, p_from_old=False):
    m_new = torch.maximum(m, s.max(dim=1).values)
    ref = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new) if safe else m_new
    alpha = torch.exp(m - ref) if not invert else torch.exp(ref - m)
    p = torch.exp(s - (torch.where(torch.isinf(m), torch.zeros_like(m), m) if p_from_old else ref)[:, None])
    return m_new, (l * alpha if rescale_l else l) + p.sum(dim=1), (acc * alpha[:, None] if rescale_acc else acc) + p @ v


@pytest.mark.parametrize("wrong, why", [
    (dict(rescale_acc=False), "forgot to rescale the accumulator by alpha = exp(m_old - m_new)"),
    (dict(rescale_l=False), "forgot to rescale the running sum l"),
    (dict(safe=False), "your result holds NaN"),
    (dict(invert=True), "alpha is inverted"),
    (dict(p_from_old=True), "P must be measured from the new max"),
], ids=["acc_not_rescaled", "l_not_rescaled", "nan_on_masked_rows", "alpha_inverted", "p_from_old_max"])
def test_3_1_online_softmax_mistakes(wrong, why):
    assert why in caught(NB03, "3.1", my_online_softmax_step=lambda m, l, acc, s, v: _step(m, l, acc, s, v, **wrong))


def test_3_1_returning_zero_as_the_max_of_a_masked_row_is_named():
    def zero_max(m, l, acc, s, v):
        m_new, l_new, acc_new = _step(m, l, acc, s, v)
        return torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new), l_new, acc_new

    assert "you returned 0 as the new max" in caught(NB03, "3.1", my_online_softmax_step=zero_max)


@pytest.mark.slow
@pytest.mark.parametrize("edits, why", [
    ([("acc = acc * alpha[:, None] +", "acc = acc +")], "the tiles do not combine"),
    ([("        m_i = m_new\n", "")], "the tiles do not combine"),
    ([("mask=j_ok[None, :], other=0.0)", ")"), ("mask=j_ok[:, None], other=0.0)", ")")],
     "loads K or V rows past the end of K"),
    ([(" * scale\n", "\n")], "your scores are not scaled"),
    ([("(j[None, :] <= q_abs[:, None]) & j_ok[None, :]", "j_ok[None, :]")], "lets each query see keys after it"),
    ([("(j[None, :] <= q_abs[:, None])", "(j[None, :] < q_abs[:, None])")], "a query must see its own key"),
    ([("head * stride_k_head +", "")], "never reads head(s) [1] of K"),
], ids=["acc_not_rescaled", "m_not_carried", "unmasked_loads", "no_scale", "no_causal_mask", "strict_causal_mask",
        "no_head_offset"])
def test_3_2_kernel_loop_mistakes(tmp_path, edits, why):
    kernel = mutated(NB03, "3.2", "my_contiguous_kernel", *edits, header=TRITON_HEADER, tmp_path=tmp_path)
    assert why in caught(NB03, "3.2", my_contiguous_kernel=kernel)


@pytest.mark.slow
def test_3_2_extra_reads_that_the_masks_hide_pass_with_a_note(tmp_path, capsys):
    """Masking the tile with j < num_k instead of j < kv_end reads keys the first program never needs: the result is
    right (the causal mask hides them), so the check passes, but says so."""
    kernel = mutated(NB03, "3.2", "my_contiguous_kernel", ("j_ok = j < kv_end", "j_ok = j < num_k"),
                     header=TRITON_HEADER, tmp_path=tmp_path)
    assert run_check(NB03, "3.2", my_contiguous_kernel=kernel) is None
    assert "wasted memory traffic" in capsys.readouterr().out


@pytest.mark.slow
@pytest.mark.parametrize("edits, why", [
    ([("block_ids_ptr + j // BLOCK_SIZE", "block_ids_ptr + j % BLOCK_SIZE")],
     "you used j % BLOCK_SIZE as the block index"),
    ([("blk = tl.load(block_ids_ptr + j // BLOCK_SIZE, mask=j_ok, other=0).to(tl.int64)",
       "blk = (j // BLOCK_SIZE).to(tl.int64)")], "look it up in the block table"),
    ([("blk * stride_blk + (j % BLOCK_SIZE) * stride_slot", "blk * stride_slot + (j % BLOCK_SIZE) * stride_blk")],
     "the strides are swapped"),
    ([("(j % BLOCK_SIZE) * stride_slot", "j * stride_slot")], "the row inside the block is j % BLOCK_SIZE"),
    ([(".to(tl.int64)", "")], "your offsets wrap around"),
    ([(", mask=j_ok, other=0)", ")")], "reads block-table entries past its last block"),
], ids=["j_mod_block_size_as_block", "no_block_table", "swapped_strides", "row_is_j", "int32_overflow",
        "unmasked_block_table_load"])
def test_3_3_block_table_lookup_mistakes(tmp_path, edits, why):
    lookup = mutated(NB03, "3.3", "my_kv_row_offsets", *edits, header=TRITON_HEADER, tmp_path=tmp_path)
    assert why in caught(NB03, "3.3", my_kv_row_offsets=lookup)


@pytest.mark.slow
def test_03_checks_accept_the_solutions_and_draw_both_kernels(monkeypatch):
    import matplotlib.pyplot as plt

    assert run_check(NB03, "3.1") is None and run_check(NB03, "3.2") is None
    titles = []
    monkeypatch.setattr(plt, "show", lambda: titles.append([ax.get_title() for ax in plt.gcf().axes]))
    assert run_check(NB03, "3.3") is None   # runs the checks of 3.1 and 3.2 again on the way
    # 3.2's picture (K, V, output) and 3.3's (block table, K cache, output), each the reference then yours
    assert len(titles) == 2 and [len(t) for t in titles] == [6, 6]
    assert all(t[0].startswith("reference kernel") and t[1].endswith("same as the reference") for t in titles)


# -- 05 ----------------------------------------------------------------------------------------------------------------
def test_05_checks_accept_the_solutions():
    for exercise in ("5.1", "5.2", "5.3", "5.4"):
        assert run_check(NB05, exercise) is None


TOPK = "from minillm.request import Request, RequestStatus\nimport torch\n"


@pytest.mark.parametrize("edits, why", [
    ([("            drop = more_likely >= pr\n", "            drop = sorted_p.cumsum(0) > pr\n")],
     "top-p keeps the token that crosses p"),
    ([("            row[row < kth] = float(\"-inf\")", "            row[row <= kth] = float(\"-inf\")")],
     "top-k keeps k tokens, not k - 1"),
    ([("        if 0 < kr < vocab:\n            kth = row.sort(descending=True).values[kr - 1]\n"
       "            row[row < kth] = float(\"-inf\")\n",
       "        if kr < vocab:\n            dropped = torch.ones_like(row, dtype=torch.bool)\n"
       "            dropped[row.topk(kr).indices] = False\n            row[dropped] = float(\"-inf\")\n")],
     "k = 0 means no top-k"),
    ([("            probs = row.softmax(-1)", "            probs = logits[r].softmax(-1)")],
     "top-p applies to what top-k kept, renormalised"),
    ([("    return out\n", "    return out.log_softmax(-1)\n")], "the kept logits must be returned unchanged"),
    ([("    out = logits.clone()", "    out = logits")], "top_k_top_p_mask changed its input"),
], ids=["drops_crossing_token", "k_minus_1", "k_zero_masks_all", "top_p_not_renormalised",
        "log_probs_returned", "in_place"])
def test_5_1_top_k_top_p_mistakes(edits, why):
    assert why in caught(NB05, "5.1", top_k_top_p_mask=mutated(NB05, "5.1", "top_k_top_p_mask", *edits, header=TOPK))


ASSEMBLE = "import torch\nfrom minillm.outputs import PLACEHOLDER_TOKEN_ID\n"


@pytest.mark.parametrize("edits, why", [
    ([("PLACEHOLDER_TOKEN_ID, dtype=torch.int32)", "0, dtype=torch.int32)")], "pad with PLACEHOLDER_TOKEN_ID (-1)"),
    ([("        out[i, j] = recovered[i][j] if j < len(drafts) else bonus[i]\n",
       "        if j < len(drafts):\n            out[i, j] = recovered[i][j]\n        else:\n"
       "            out[i, -1] = bonus[i]\n")], "the bonus token goes right after the accepted drafts"),
    ([("        out[i, j] = recovered[i][j] if j < len(drafts) else bonus[i]\n", "        out[i, j] = bonus[i]\n")],
     "at the first rejected draft, emit recovered"),
    ([("max((len(d) for d in draft_token_ids), default=0) + 1", "max((len(d) for d in draft_token_ids), default=0)"),
      ("        out[i, j] = recovered[i][j] if j < len(drafts) else bonus[i]\n",
       "        if j < width:\n            out[i, j] = recovered[i][j] if j < len(drafts) else bonus[i]\n")],
     "max_num_drafts + 1 columns"),
    ([("dtype=torch.int32)", "dtype=torch.int64)")], "sampled_token_ids is int32"),
], ids=["zero_padding", "bonus_at_the_end", "bonus_instead_of_recovered", "no_extra_column", "int64"])
def test_5_2_assemble_output_mistakes(edits, why):
    assert why in caught(NB05, "5.2", assemble_output=mutated(NB05, "5.2", "assemble_output", *edits,
                                                              header=ASSEMBLE))


STOP = "from minillm.request import Request, RequestStatus\n"
_MIN_TOKENS = ("    if request.num_output_tokens < params.min_tokens:\n"
               "        if request.num_tokens >= max_model_len:\n"
               "            request.status = RequestStatus.FINISHED_LENGTH_CAPPED\n"
               "            return True\n"
               "        return False\n")
_EOS = ("    if not params.ignore_eos and last == request.eos_token_id:\n"
        "        request.status = RequestStatus.FINISHED_STOPPED\n"
        "        return True\n")


@pytest.mark.parametrize("edits, why", [
    ([(_MIN_TOKENS + _EOS, _EOS + _MIN_TOKENS)], "test min_tokens first, before EOS"),
    ([("    if not params.ignore_eos and last == request.eos_token_id:",
       "    if last == request.eos_token_id:")], "with ignore_eos the request goes on past EOS"),
    ([("        request.stop_reason = last\n", "")], "stop_reason = that id"),
    ([("request.num_output_tokens >= params.max_tokens", "request.num_output_tokens > params.max_tokens")],
     "num_output_tokens >= max_tokens"),
    ([("(params.max_tokens is not None and request.num_output_tokens >= params.max_tokens)",
       "request.num_output_tokens >= params.max_tokens")], "max_tokens may be None"),
    ([("or request.num_tokens >= max_model_len:", "or request.num_output_tokens >= max_model_len:")],
     "max_model_len counts all tokens"),
    ([("        if request.num_tokens >= max_model_len:\n            request.status = "
       "RequestStatus.FINISHED_LENGTH_CAPPED\n            return True\n        return False\n",
       "        return False\n")], "max_model_len ends a request even during min_tokens"),
], ids=["eos_before_min_tokens", "ignore_eos_ignored", "no_stop_reason", "max_tokens_off_by_one",
        "max_tokens_none", "output_length_vs_max_model_len", "min_tokens_beats_max_model_len"])
def test_5_3_check_stop_mistakes(edits, why):
    assert why in caught(NB05, "5.3", my_check_stop=mutated(NB05, "5.3", "my_check_stop", *edits, header=STOP))


def test_5_3_stop_token_before_eos_is_named():
    def stop_ids_first(request, max_model_len):
        params, last = request.sampling_params, request.output_token_ids[-1]
        if request.num_output_tokens >= params.min_tokens and last in params.stop_token_ids:
            request.status, request.stop_reason = RequestStatus.FINISHED_STOPPED, last
            return True
        from minillm.core.sched.utils import check_stop

        return check_stop(request, max_model_len)

    assert "EOS is tested before stop_token_ids" in caught(NB05, "5.3", my_check_stop=stop_ids_first)


_BEGIN = "        begin = max(0, len(output_text) - new_char_count - len(s) + 1)\n"


@pytest.mark.parametrize("edits, why", [
    ([(_BEGIN, "        begin = len(output_text) - new_char_count\n")], "a stop string can span several tokens"),
    ([(_BEGIN, "        begin = 0\n")], "look only for matches that end in the new characters"),
    ([("(best is None or i < best[0])", "best is None")], "the one that starts first wins"),
    ([("(i + len(s) if include_in_output else i)", "(i if include_in_output else i + len(s))")],
     "truncate_to is the start of the match"),
], ids=["new_characters_only", "whole_text", "first_listed", "include_swapped"])
def test_5_4_stop_string_mistakes(edits, why):
    wrong = mutated(NB05, "5.4", "find_stop_string", *edits)
    assert why in caught(NB05, "5.4", find_stop_string=wrong)


def test_5_4_minus_zero_slice_is_named():
    def minus_zero(output_text, new_char_count, stop, include_in_output):
        tail = output_text[-new_char_count:]             # the whole text when new_char_count == 0
        start = len(output_text) - len(tail)
        hits = [(tail.find(s) + start, s) for s in stop if s in tail]
        if not hits:
            from minillm.engine.detokenizer import check_stop_strings

            return check_stop_strings(output_text, new_char_count, stop, include_in_output)
        i, s = min(hits)
        return s, (i + len(s) if include_in_output else i)

    assert "text[-0:] is the whole text" in caught(NB05, "5.4", find_stop_string=minus_zero)


# -- the course-wide format --------------------------------------------------------------------------------------------
_HEADING = re.compile(r"^### Exercise (\d+\.\d+) (★{1,3}) \S")


@pytest.mark.parametrize("solution", [NB03, NB04, NB05])
def test_every_exercise_has_a_star_heading_a_hint_and_a_check(solution):
    for folder in ("solutions", "exercises"):
        nb = nbformat.read(ROOT / folder / solution, as_version=4)
        assert re.search(r"Run time: about \d+ (s|min) on a 2-core CPU", nb.cells[0].source), (
            f"{folder}/{solution}: the first cell must say how long the notebook runs")
        numbers = []
        for i, cell in enumerate(nb.cells):
            first = cell.source.lstrip().splitlines()[0] if cell.source.strip() else ""
            m = re.match(r"# Exercise (\d+\.\d+):", first)
            if cell.cell_type != "code" or not m:
                continue
            number = m.group(1)
            numbers.append(number)
            hint, heading = nb.cells[i - 1], nb.cells[i - 2]
            assert hint.cell_type == "markdown" and re.fullmatch(
                r"<details><summary>Hint</summary>.+</details>", hint.source.strip(), re.S), (
                f"{folder}/{solution}: exercise {number} must follow a folded hint cell")
            heading_match = _HEADING.match(heading.source)
            assert heading.cell_type == "markdown" and heading_match and heading_match.group(1) == number, (
                f"{folder}/{solution}: exercise {number} needs a '### Exercise {number} ★ title' cell before its hint")
            assert nb.cells[i + 1].source.startswith(f"# Check Exercise {number}")
        assert numbers == {NB03: ["3.1", "3.2", "3.3"], NB04: ["4.1", "4.2", "4.3"],
                           NB05: ["5.1", "5.2", "5.3", "5.4"]}[solution]


@pytest.mark.parametrize("solution", [NB03, NB04, NB05])
def test_exercise_cells_only_define(solution):
    """Chapter 8's loader runs exercise cells alone (with the notebook's import lines): no top-level work."""
    nb = nbformat.read(ROOT / "solutions" / solution, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code" and BEGIN in cell.source:
            for node in ast.parse(cell.source).body:
                assert isinstance(node, (ast.FunctionDef, ast.ClassDef, ast.Import, ast.ImportFrom)), (
                    f"{solution}: an exercise cell does top-level work: {ast.unparse(node)[:80]}")


def test_chapter_8_finds_the_parts_of_04_and_05():
    from minillm.core.sched.scheduler import Scheduler
    from minillm.exercises.parts import load_learner_parts

    solved = {s.source.part: s for s in load_learner_parts(ROOT / "solutions").status}
    for part in ("scheduler_cls", "top_k_top_p", "check_stop"):
        assert solved[part].solved, solved[part].message
    learner = solved["scheduler_cls"].value
    assert issubclass(learner, Scheduler)
    for cls_name, methods in (("RunningLoopScheduler", {"_schedule_running"}),
                              ("AdmissionScheduler", {"_schedule_waiting"}),
                              ("FCFSPreemptionScheduler", {"_preempt_request", "_allocate_or_preempt"})):
        cls = next(c for c in learner.__mro__ if c.__name__ == cls_name)
        own = {k for k, v in vars(cls).items() if callable(v) and not k.startswith("__")}
        assert own == methods, f"{cls_name} overrides {own}, expected only {methods}"
    assert list(inspect.signature(solved["top_k_top_p"].value).parameters) == ["logits", "k", "p"]
    assert list(inspect.signature(solved["check_stop"].value).parameters) == ["request", "max_model_len"]
    unsolved = {s.source.part: s for s in load_learner_parts(ROOT / "exercises").status}
    for part in ("scheduler_cls", "top_k_top_p", "check_stop"):
        assert not unsolved[part].solved and "not solved" in unsolved[part].message
