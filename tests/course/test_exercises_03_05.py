"""Exercises 3.1-5.4: every check cell catches the usual wrong answers and says why, and accepts the solution.

Each test runs a solution notebook up to one check cell with a deliberately wrong answer swapped in
(``tests/exercise_helpers.run_check``) and asserts that the check fails with an ``AssertionError`` whose message
names the mistake. The wrong answers are the solution's own code with one thing changed (the usual slip), so they
stay in step with the solutions. An answer that calls the package's own implementation of its part fails with
"asks you to write this yourself" (``minillm/course/exercises/tripwire.py``). Challenges 3 (sliding-window attention in
the paged kernel) and 5 (``allowed_token_ids`` and ``logit_bias``) accept their solutions and name the usual slips.
A last group checks the course-wide exercise format of chapters 03-05 (a ``### Exercise N.M ★`` heading, a hint in
two folded steps, the exercise, its check; one open challenge after the last exercise) and the names and signatures
chapter 8 loads from a learner's notebook.
"""
from __future__ import annotations

import ast
import inspect
import os
import re
from pathlib import Path

import nbformat
import pytest
import torch

from minillm.course.exercises.build import BEGIN
from tests.course.exercise_helpers import (CHALLENGE_HEADING, EXERCISE_HEADING, HINT_FORMAT, caught, exercise_source,
                                           mutated, run_challenge, run_check, run_check_with_answer)

ROOT = Path(__file__).resolve().parents[2]
NB03, NB04, NB05 = "03_triton_prefill_kernel.ipynb", "04_scheduler.ipynb", "05_sampler.ipynb"
DELEGATES = "asks you to write this yourself"


def challenge_message(solution: str, number: int, **wrong) -> str:
    e = run_challenge(solution, number, **wrong)
    assert isinstance(e, AssertionError), f"challenge {number}'s check did not fail with an AssertionError: {e!r}"
    return str(e)


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

    assert run_check(NB03, "3.1") is None
    titles = []
    monkeypatch.setattr(plt, "show", lambda: titles.append([ax.get_title() for ax in plt.gcf().axes]))
    assert run_check(NB03, "3.2") is None and run_check(NB03, "3.3") is None
    # 3.2's picture (K, V, output) and 3.3's (block table, K cache, output), each the reference then yours
    assert len(titles) == 2 and [len(t) for t in titles] == [6, 6]
    assert all(t[0].startswith("reference kernel") and t[1].endswith("same as the reference") for t in titles)


def test_3_1_delegating_and_mistyped_answers_are_named():
    from kernels import attention_stages

    delegate = lambda m, l, acc, s, v: attention_stages.online_softmax_step(m, l, acc, s, v)  # noqa: E731
    assert DELEGATES in caught(NB03, "3.1", my_online_softmax_step=delegate)
    as_list = lambda m, l, acc, s, v: list(_step(m, l, acc, s, v))  # noqa: E731
    assert "return the tuple (m', l', acc') of three tensors" in caught(NB03, "3.1", my_online_softmax_step=as_list)
    as_double = lambda m, l, acc, s, v: tuple(x.double() for x in _step(m, l, acc, s, v))  # noqa: E731
    assert "are float32, like the state you were given" in caught(NB03, "3.1", my_online_softmax_step=as_double)


@pytest.mark.slow
def test_3_2_a_kernel_or_launcher_of_the_package_fails(tmp_path):
    """The guard of my_attention_contiguous rebinds, in the notebook, the names that hold a package kernel: the
    answer ``my_contiguous_kernel = _contiguous_kernel`` fails (checked under TRITON_INTERPRET=1, as on the CPU)."""
    from kernels import attention_stages

    assert os.environ.get("TRITON_INTERPRET") == "1" or torch.cuda.is_available()
    assert DELEGATES in caught(NB03, "3.2", my_contiguous_kernel=attention_stages._contiguous_kernel)
    assert DELEGATES in caught(NB03, "3.2", my_attention_contiguous=lambda q, k, v, block_m=16, tile_size=16:
                               attention_stages.attention_contiguous(q, k, v, block_m, tile_size))
    source = exercise_source(NB03, "3.2")
    answer = (source.split("@triton.jit")[0]   # the exercise's first lines, then the alias the issue names
              + "from kernels.attention_stages import _contiguous_kernel\n\nmy_contiguous_kernel = _contiguous_kernel\n"
              + "\n\ndef my_attention_contiguous" + source.split("def my_attention_contiguous")[1])
    assert DELEGATES in str(run_check_with_answer(NB03, "3.2", answer))


@pytest.mark.slow
def test_3_2_a_tile_that_does_not_move_is_named(tmp_path):
    """Found by a learner: forgetting ``start +`` was told to rescale l_i and acc, while the access picture showed
    only rows 0-15 read. The check now names the tile that never moves."""
    kernel = mutated(NB03, "3.2", "my_contiguous_kernel",
                     ("j = start + tl.arange(0, TILE_SIZE)", "j = tl.arange(0, TILE_SIZE)"),
                     header=TRITON_HEADER, tmp_path=tmp_path)
    why = caught(NB03, "3.2", my_contiguous_kernel=kernel)
    assert "every iteration loads the first tile again" in why and "j = start + tl.arange(0, TILE_SIZE)" in why
    assert "Rescale l_i and acc" not in why


@pytest.mark.slow
def test_3_3_a_lookup_of_the_package_fails(tmp_path):
    from kernels import attention_stages

    assert DELEGATES in caught(NB03, "3.3", my_kv_row_offsets=attention_stages.kv_row_offsets)
    # a helper of one's own that calls the package's lookup inside the kernel
    inner = mutated(NB03, "3.3", "my_kv_row_offsets",
                    ("    blk = tl.load(block_ids_ptr + j // BLOCK_SIZE, mask=j_ok, other=0).to(tl.int64)\n"
                     "    return blk * stride_blk + (j % BLOCK_SIZE) * stride_slot\n",
                     "    return _st.kv_row_offsets(block_ids_ptr, j, j_ok, BLOCK_SIZE, stride_blk, stride_slot)\n"),
                    header=TRITON_HEADER + "import kernels.attention_stages as _st\n", tmp_path=tmp_path)
    assert DELEGATES in caught(NB03, "3.3", my_kv_row_offsets=inner)


def test_03_the_given_paged_kernel_does_not_print_3_2s_loop():
    """The exercise notebook builds my_paged_kernel from the package's kernel and prints only the lines that
    differ; 3.2's loop (the online-softmax update) is not on the page."""
    for folder in ("solutions", "exercises"):
        cells = nbformat.read(ROOT / folder / NB03, as_version=4).cells
        given = next(c for c in cells if c.get("id") == "20dd5cdc").source
        assert "tl.exp" not in given and "alpha" not in given and "tl.dot" not in given
        assert "exec(compile(given_paged_source" in given
    shown = [line for c in nbformat.read(ROOT / "solutions" / NB03, as_version=4).cells
             if c.get("id") == "20dd5cdc" for o in c.outputs for line in o.get("text", "").splitlines()]
    assert shown and not any("tl.exp" in line or "alpha" in line for line in shown)


# -- challenge 3 --------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_challenge_3_accepts_the_solution_and_fails_a_delegating_answer():
    from minillm.course.exercises.challenges import ch03

    assert run_challenge(NB03, 3) is None
    delegate = (lambda q, key_cache, value_cache, block_ids, seq_len, window, block_m=16, tile_size=16:
                ch03.paged_window_attention(q, key_cache, value_cache, block_ids, seq_len, window))
    assert "Challenge 3 asks you to write this yourself" in challenge_message(
        NB03, 3, my_paged_window_attention=delegate)


@pytest.mark.slow
@pytest.mark.parametrize("edits, why", [
    ([(" & (q_abs[:, None] - j[None, :] < window)", "")], "your kernel ignores the window"),
    ([("(q_abs[:, None] - j[None, :] < window)", "(q_abs[:, None] - j[None, :] <= window)")],
     "yours sees one more"),
    ([("range((first_key // TILE_SIZE) * TILE_SIZE, kv_end, TILE_SIZE)", "range(0, kv_end, TILE_SIZE)")],
     "tiles wholly before their first row's window"),
    ([("ref = tl.where(m_new == float(\"-inf\"), 0.0, m_new)     # a row that has seen nothing yet", "ref = m_new")],
     "your output holds NaN"),
], ids=["window_ignored", "window_plus_one", "no_tile_pruning", "nan_on_a_fully_masked_tile"])
def test_challenge_3_mistakes(tmp_path, edits, why):
    wrong = mutated(NB03, "C3", "my_paged_window_attention", *edits, header=TRITON_HEADER, tmp_path=tmp_path)
    assert why in challenge_message(NB03, 3, my_paged_window_attention=wrong)


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
    # found by a learner: probabilities were told "top-k with k = 3 keeps 3 of the 4 tokens"
    ([("    return out\n", "    return out.softmax(-1)\n")], "you returned probabilities"),
    ([("    return out\n", "    return torch.where(torch.isinf(out), torch.zeros_like(out), out)\n")],
     "you masked with 0, not -inf"),
    ([("    return out\n", "    return out.tolist()\n")], "returns a torch.Tensor (the masked logits), yours returned a list"),
    ([("    return out\n", "    return out.double()\n")], "keeps the dtype of logits (torch.float32); yours is torch.float64"),
    # found by a learner: ties at the k-th largest logit were never probed, so keeping exactly k tokens passed
    ([("            kth = row.sort(descending=True).values[kr - 1]\n            row[row < kth] = float(\"-inf\")\n",
       "            dropped = torch.ones_like(row, dtype=torch.bool)\n"
       "            dropped[row.topk(kr).indices] = False\n            row[dropped] = float(\"-inf\")\n")],
     "tokens 1, 2 and 3 tie at the 2nd largest logit"),
], ids=["drops_crossing_token", "k_minus_1", "k_zero_masks_all", "top_p_not_renormalised",
        "log_probs_returned", "in_place", "probabilities", "zero_mask", "a_list", "float64", "ties_dropped"])
def test_5_1_top_k_top_p_mistakes(edits, why):
    assert why in caught(NB05, "5.1", top_k_top_p_mask=mutated(NB05, "5.1", "top_k_top_p_mask", *edits, header=TOPK))


def test_5_1_probabilities_are_not_blamed_on_top_k():
    probs = mutated(NB05, "5.1", "top_k_top_p_mask", ("    return out\n", "    return out.softmax(-1)\n"), header=TOPK)
    assert "top-k with k = 3 keeps 3 of the 4 tokens" not in caught(NB05, "5.1", top_k_top_p_mask=probs)


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


def test_5_2_the_probe_does_not_agree_when_it_differs(capsys):
    """Found by a learner: the probe printed "The probe agrees with the reference." for an answer that was none of
    the known mistakes, and the failure came only later, from the random cases, without a cause."""
    shifted = mutated(NB05, "5.2", "assemble_output",
                      ("        out[i, j] = recovered[i][j] if j < len(drafts) else bonus[i]\n",
                       "        out[i, j] = recovered[i][j] if j < len(drafts) else drafts[-1] if drafts else bonus[i]\n"),
                      header=ASSEMBLE)
    why = caught(NB05, "5.2", assemble_output=shifted)
    assert "Read each row as" in why
    assert "The probe agrees with the reference." not in capsys.readouterr().out


def test_5_2_a_list_is_named_as_a_type_mistake():
    as_list = mutated(NB05, "5.2", "assemble_output", ("    return out\n", "    return out.tolist()\n"), header=ASSEMBLE)
    assert "sampled_token_ids is a torch.Tensor" in caught(NB05, "5.2", assemble_output=as_list)


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
    eos_rule = ("    if not params.ignore_eos and last == request.eos_token_id:\n"
                "        request.status = RequestStatus.FINISHED_STOPPED\n"
                "        return True\n")
    stop_rule = ("    if last in params.stop_token_ids:\n"
                 "        request.status = RequestStatus.FINISHED_STOPPED\n"
                 "        request.stop_reason = last\n"
                 "        return True\n")
    stop_ids_first = mutated(NB05, "5.3", "my_check_stop", (eos_rule + stop_rule, stop_rule + eos_rule), header=STOP)
    assert "EOS is tested before stop_token_ids" in caught(NB05, "5.3", my_check_stop=stop_ids_first)


def test_5_3_a_result_that_is_not_a_bool_or_a_status_is_named():
    returns_none = mutated(NB05, "5.3", "my_check_stop", ("    return False\n    ### END", "    return None\n    ### END"),
                           header=STOP)
    assert "my_check_stop returns a bool" in caught(NB05, "5.3", my_check_stop=returns_none)
    status_string = mutated(NB05, "5.3", "my_check_stop",
                            ("        request.status = RequestStatus.FINISHED_STOPPED\n        return True\n"
                             "    if last in",
                             "        request.status = 'FINISHED_STOPPED'\n        return True\n    if last in"),
                            header=STOP)
    assert "request.status is a RequestStatus" in caught(NB05, "5.3", my_check_stop=status_string)


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
        hits = [(output_text.find(s, max(start - len(s) + 1, 0)), s) for s in stop]
        hits = [(i, s) for i, s in hits if i != -1]
        if not hits:
            return None
        i, s = min(hits, key=lambda h: h[0])
        return s, (i + len(s) if include_in_output else i)

    assert "text[-0:] is the whole text" in caught(NB05, "5.4", find_stop_string=minus_zero)


def test_5_4_a_list_is_not_the_tuple():
    as_list = mutated(NB05, "5.4", "find_stop_string",
                      ("    return s, (i + len(s) if include_in_output else i)\n",
                       "    return [s, (i + len(s) if include_in_output else i)]\n"))
    assert "return a tuple (stop_string, truncate_to) or None" in caught(NB05, "5.4", find_stop_string=as_list)


def test_05_delegating_answers_fail():
    from minillm.core.sched import utils
    from minillm.engine import detokenizer
    from minillm.sample import rejection_sampler
    from minillm.sample.ops import topk_topp

    assert DELEGATES in caught(NB05, "5.1", top_k_top_p_mask=lambda logits, k, p:
                               topk_topp.apply_top_k_top_p(logits.clone(), k, p))
    def assemble(draft_token_ids, accepted, recovered, bonus):
        flat = lambda xs, dtype: torch.tensor([t for x in xs for t in x], dtype=dtype)  # noqa: E731
        return rejection_sampler.assemble_spec_output(flat(draft_token_ids, torch.long), flat(accepted, torch.bool),
                                                      flat(recovered, torch.long), torch.tensor(bonus),
                                                      [len(x) for x in draft_token_ids])

    assert DELEGATES in caught(NB05, "5.2", assemble_output=assemble)
    assert DELEGATES in caught(NB05, "5.3", my_check_stop=lambda request, max_model_len:
                               utils.check_stop(request, max_model_len))
    assert DELEGATES in caught(NB05, "5.4", find_stop_string=lambda output_text, new_char_count, stop, include_in_output:
                               detokenizer.check_stop_strings(output_text, new_char_count, stop, include_in_output))


def test_lesson_05_folds_the_answers_of_5_2_and_5_3():
    """Lesson 05 shows assemble_spec_output and check_stop with their bodies left out, traces what they do, and
    keeps the full listings folded after a line inviting the learner to solve the exercise first; the folded
    listings are the package's current source."""
    from minillm.core.sched.utils import check_stop
    from minillm.sample.rejection_sampler import assemble_spec_output

    cells = nbformat.read(ROOT / "notebooks" / NB05, as_version=4).cells
    code = "\n".join(c.source for c in cells if c.cell_type == "code")
    assert not re.search(r"^show_source\((assemble_spec_output|check_stop)\)\s*$", code, re.M)  # a listing shown
    shown = "\n".join(str(o.get("data", o.get("text", ""))) for c in cells if c.cell_type == "code" for o in c.outputs)
    for fn, exercise in ((assemble_spec_output, "5.2"), (check_stop, "5.3")):
        body = inspect.getsource(fn).rstrip("\n")
        folded = [c.source for c in cells if c.cell_type == "markdown"
                  and f"<summary>Solution of exercise {exercise} (solve it first)</summary>" in c.source]
        assert len(folded) == 1 and f"Solve exercise {exercise} before you unfold" in folded[0]
        assert folded[0].index("<details>") > folded[0].index(f"Solve exercise {exercise}")
        assert "```python\n" + body + "\n```" in folded[0], f"the folded listing of {fn.__name__} is out of date"
        last_line = body.splitlines()[-2].strip()    # a body line an unfolded listing would show
        assert last_line not in shown.replace("&quot;", '"'), f"{fn.__name__}'s body is printed in an output"
        # Found by a learner: an open code cell quoted the answer's key lines to keep the folded walkthrough honest.
        after_docstring = body.split('"""')[2]
        quoted = [line.strip() for line in after_docstring.splitlines()
                  if len(line.strip()) >= 12 and line.strip() not in ("return False", "return True")
                  and line.strip() in code]
        assert not quoted, f"an open code cell of the lesson quotes {fn.__name__}'s body: {quoted}"


def _check_cell(exercise: str) -> str:
    cells = nbformat.read(ROOT / "solutions" / NB05, as_version=4).cells
    return next(c.source for c in cells if c.source.startswith(f"# Check Exercise {exercise}"))


def test_lesson_05_does_not_answer_the_5_2_probe():
    """Found by a learner: the lesson ran assemble_spec_output on exactly the 5.2 check's probe and printed the
    answer the check expects."""
    from minillm.sample.rejection_sampler import assemble_spec_output

    tree = ast.parse(_check_cell("5.2"))
    probe = next(node.value for node in ast.walk(tree) if isinstance(node, ast.Assign)
                 and any(isinstance(t, ast.Name) and t.id == "probe_args" for t in node.targets))
    args = eval(compile(ast.Expression(probe), "probe", "eval"), {"dict": dict})  # noqa: S307 - our own notebook
    flat = lambda xs, dtype: torch.tensor([v for x in xs for v in x], dtype=dtype)  # noqa: E731
    want = assemble_spec_output(flat(args["draft_token_ids"], torch.long), flat(args["accepted"], torch.bool),
                                flat(args["recovered"], torch.long), torch.tensor(args["bonus"]),
                                [len(d) for d in args["draft_token_ids"]]).tolist()
    lesson = nbformat.read(ROOT / "notebooks" / NB05, as_version=4).cells
    text = "\n".join(c.source + "".join(str(o.get("data", o.get("text", ""))) for o in c.get("outputs", []))
                     for c in lesson)
    squeezed = re.sub(r"\s+", "", text)
    for row in want:
        assert re.sub(r"\s+", "", str(row)) not in squeezed, f"lesson 05 shows the 5.2 probe's row {row}"
    drafts = [v for d in args["draft_token_ids"] for v in d]
    assert re.sub(r"\s+", "", str(drafts)) not in squeezed, "lesson 05 runs the 5.2 probe's drafts"


def _rule_1(text: str) -> str:
    return re.search(r"^1\. (.*?)^2\. ", text, re.S | re.M).group(1)


def test_the_min_tokens_rule_reads_the_same_in_lesson_05_and_exercise_5_3():
    """Found by a learner: the lesson said "never stop on EOS or stop ids" during min_tokens and left out that
    max_model_len still ends the request; exercise 5.3 said it does (it does, in minillm and in vLLM v0.33.0)."""
    lesson = next(c.source for c in nbformat.read(ROOT / "notebooks" / NB05, as_version=4).cells
                  if c.source.startswith("### The stop check, after every token"))
    for folder in ("solutions", "exercises"):
        statement = next(c.source for c in nbformat.read(ROOT / folder / NB05, as_version=4).cells
                         if c.source.startswith("### Exercise 5.3 "))
        english = statement.split("**练习 5.3")[0]
        assert _rule_1(lesson) == _rule_1(english)
        chinese = statement.split("**练习 5.3")[1]
        assert "max_model_len" in _rule_1(chinese) and "FINISHED_LENGTH_CAPPED" in _rule_1(chinese)
    assert "max_model_len" in _rule_1(lesson) and "FINISHED_LENGTH_CAPPED" in _rule_1(lesson)


# -- challenge 5 --------------------------------------------------------------------------------------------------
def test_challenge_5_statement_does_not_point_at_the_reference():
    """Found by a learner: the statement named the file that holds the answer; only the check imports it."""
    for folder in ("solutions", "exercises"):
        cells = nbformat.read(ROOT / folder / NB05, as_version=4).cells
        statement = next(c.source for c in cells if c.source.startswith("### Challenge 5 "))
        assert "ch05" not in statement and "exercises/challenges" not in statement
        assert not re.search(r"^\s*\d+\. ", statement, re.M), "the ★★★ statement lists numbered steps"
    check = next(c.source for c in nbformat.read(ROOT / "solutions" / NB05, as_version=4).cells
                 if c.source.startswith("# Check Challenge 5"))
    assert "from minillm.course.exercises.challenges.ch05 import" in check


def test_challenge_5_accepts_the_solution_and_fails_a_delegating_answer():
    from minillm.course.exercises.challenges import ch05

    assert run_challenge(NB05, 5) is None
    assert "Challenge 5 asks you to write this yourself" in challenge_message(
        NB05, 5, my_apply_allowed_and_bias=lambda logits, a, b: ch05.apply_allowed_and_bias(logits, a, b))


@pytest.mark.parametrize("edits, why", [
    ([("min(100.0, max(-100.0, b))", "b")], "clamp every bias to [-100, 100]"),
    ([("            disallowed[list(allowed)] = False\n", "            disallowed[:] = False\n"
                                                           "            disallowed[list(allowed)] = True\n")],
     "you masked exactly those"),
    ([('            out[r, disallowed] = float("-inf")', '            out[r, disallowed] = -1e9')],
     "very negative but finite logit"),
    ([("        if any(not 0 <= t < vocab for t in ids):\n", "        if any(t >= vocab for t in ids):\n")],
     "Token -1 is legal as a PyTorch index"),
    ([("            out[r, torch.tensor(list(bias))] += values", "            out[:, torch.tensor(list(bias))] += values")],
     "must come back unchanged"),
    ([("    out = logits.clone()\n", "    out = logits\n")], "changed its input"),
], ids=["no_clamp", "allowed_masked", "finite_mask", "negative_id", "bias_on_every_row", "in_place"])
def test_challenge_5_mistakes(edits, why):
    wrong = mutated(NB05, "C5", "my_apply_allowed_and_bias", *edits, header="import torch\n")
    assert why in challenge_message(NB05, 5, my_apply_allowed_and_bias=wrong)


# -- the course-wide format --------------------------------------------------------------------------------------------
_HEADING, _HINT, _CHALLENGE = EXERCISE_HEADING, HINT_FORMAT, CHALLENGE_HEADING
_CONTRACT = ("# Keep this first line (chapter 8 and the grader find your answer by it); helpers: here or in new cells "
             "before the check.")


@pytest.mark.parametrize("solution", [NB03, NB04, NB05])
def test_every_exercise_has_a_star_heading_a_two_step_hint_and_a_check(solution):
    chapter = int(solution[:2])
    for folder in ("solutions", "exercises"):
        nb = nbformat.read(ROOT / folder / solution, as_version=4)
        assert re.search(r"Run time: about \d+ (s|min) on a 2-core CPU", nb.cells[0].source), (
            f"{folder}/{solution}: the first cell must say how long the notebook runs")
        numbers, challenges, last_check = [], [], None
        for i, cell in enumerate(nb.cells):
            first = cell.source.lstrip().splitlines()[0] if cell.source.strip() else ""
            m = re.match(r"# (Exercise (\d+\.\d+)|Challenge (\d+)):", first)
            if cell.cell_type != "code" or not m:
                continue
            hint, heading = nb.cells[i - 1], nb.cells[i - 2]
            assert hint.cell_type == "markdown" and _HINT.match(hint.source.strip()), (
                f"{folder}/{solution}: {m.group(1)} must follow a hint cell of two <details> blocks ('Hint 1: the "
                f"idea', 'Hint 2: closer to the code'), got {hint.source[:80]!r}")
            assert cell.source.splitlines()[1] == _CONTRACT, f"{folder}/{solution}: {m.group(1)} lacks the contract"
            if m.group(3):
                number = m.group(3)
                h = _CHALLENGE.match(heading.source) if heading.cell_type == "markdown" else None
                assert h and h.group(1) == number and f"**挑战 {number} {h.group(2)}" in heading.source, (
                    f"{folder}/{solution}: challenge {number} needs a '### Challenge {number} ★★★ title (optional, "
                    f"extra credit)' cell with its Chinese statement")
                assert "vllm/" in heading.source, f"{solution}: challenge {number} must cite vLLM's file:function"
                check = nb.cells[i + 1].source
                assert check.startswith(f"# Check Challenge {number}")
                assert f"from minillm.course.exercises.challenges.ch{int(number):02d} import" in check
                assert f'guard("C{number}"' in check
                challenges.append((i, number))
                continue
            number = m.group(2)
            numbers.append(number)
            heading_match = _HEADING.match(heading.source)
            assert heading.cell_type == "markdown" and heading_match and heading_match.group(1) == number, (
                f"{folder}/{solution}: exercise {number} needs a '### Exercise {number} ★ title' cell before its hint")
            assert nb.cells[i + 1].source.startswith(f"# Check Exercise {number}")
            last_check = i + 1
        assert numbers == {NB03: ["3.1", "3.2", "3.3"], NB04: ["4.1", "4.2", "4.3"],
                           NB05: ["5.1", "5.2", "5.3", "5.4"]}[solution]
        assert [n for _, n in challenges] == [str(chapter)], f"{folder}/{solution}: one open challenge, number {chapter}"
        assert challenges[0][0] > last_check, f"{folder}/{solution}: the challenge comes after the last exercise"


def test_the_set_up_cells_import_no_reference():
    """The exercise notebooks' set-up cells stop importing what the exercises ask for: each check imports its
    reference inside its own cell, after the exercise."""
    asked = {NB03: ["online_softmax_step", "_contiguous_kernel", "attention_contiguous", "_paged_one_seq_kernel",
                    "kv_row_offsets"],
             NB05: ["apply_top_k_top_p", "assemble_spec_output", "check_stop", "check_stop_strings"]}
    for solution, names in asked.items():
        cells = nbformat.read(ROOT / "exercises" / solution, as_version=4).cells
        first_exercise = next(i for i, c in enumerate(cells) if c.source.startswith("# Exercise "))
        before = "\n".join(c.source for c in cells[:first_exercise] if c.cell_type == "code")
        for name in names:
            assert not re.search(rf"\b{name}\b", before), f"{solution}'s set-up imports {name}"


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
    from minillm.course.exercises.parts import load_learner_parts

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
