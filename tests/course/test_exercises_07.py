"""The checks of solutions/07_context_parallel.ipynb catch the typical wrong answers, and say why.

Each test runs the solution notebook up to one check cell with a deliberately wrong function in place of the
learner's (tests/exercise_helpers.run_check) and asserts that the check fails with an AssertionError that names the
mistake. The notebook holds no model, so one run takes a few seconds.
"""
from __future__ import annotations

import math
from functools import partial

import pytest
import torch

from minillm.attention.reference import merge_attn_states  # a global, as a notebook's import makes it
from minillm.distributed.splits import make_split
from tests.course.exercise_helpers import run_challenge, run_check

SOLUTION = "07_context_parallel.ipynb"


def _assert_caught(e: BaseException | None, *phrases: str) -> None:
    assert isinstance(e, AssertionError), f"the check should fail with an AssertionError, got {e!r}"
    for phrase in phrases:
        assert phrase in str(e), f"{phrase!r} is not in the check's message: {e}"


# ---------------------------------------------------------------------------------------------------------------------
# Exercise 7.1: the zigzag split and its restore order


def _pieces(num_tokens: int, num_pieces: int, size: int | None = None) -> list[torch.Tensor]:
    """``num_pieces`` contiguous pieces: as make_split cuts them, or of ``size`` tokens each (clipped to the prompt)."""
    if size is None:
        base, extra = divmod(num_tokens, num_pieces)
        sizes = [base + (i < extra) for i in range(num_pieces)]
    else:
        sizes = [size] * num_pieces
    out, start = [], 0
    for s in sizes:
        out.append(torch.arange(min(start, num_tokens), min(start + s, num_tokens)))
        start += s
    return out


def naive_split(num_tokens, world_size):
    """Rank r takes pieces r and R + r: the last rank gets the latest piece of each half."""
    p = _pieces(num_tokens, 2 * world_size)
    return [torch.cat([p[r], p[world_size + r]]) for r in range(world_size)]


def floor_split(num_tokens, world_size):
    """Pieces of T // 2R tokens: the last T mod 2R tokens are on no rank."""
    n = 2 * world_size
    p = _pieces(num_tokens, n, size=num_tokens // n)
    return [torch.cat([p[r], p[n - 1 - r]]) for r in range(world_size)]


def ceil_split(num_tokens, world_size):
    """vLLM's cut: pieces of ceil(T / 2R) tokens, the last ones shorter or empty."""
    n = 2 * world_size
    p = _pieces(num_tokens, n, size=math.ceil(num_tokens / n))
    return [torch.cat([p[r], p[n - 1 - r]]) for r in range(world_size)]


def zigzag_split(num_tokens, world_size):
    """The right split, written here (an answer that calls make_split would trip the check's wire)."""
    if num_tokens < 2 * world_size:
        raise ValueError("fewer tokens than pieces")
    p = _pieces(num_tokens, 2 * world_size)
    return [torch.cat([p[r], p[2 * world_size - 1 - r]]) for r in range(world_size)]


def late_remainder_split(num_tokens, world_size):
    """The T mod 2R longer pieces last instead of first."""
    if num_tokens < 2 * world_size:
        raise ValueError("fewer tokens than pieces")
    n = 2 * world_size
    base, extra = divmod(num_tokens, n)
    sizes = [base + (i >= n - extra) for i in range(n)]
    bounds = [sum(sizes[:i]) for i in range(n + 1)]
    p = [torch.arange(bounds[i], bounds[i + 1]) for i in range(n)]
    return [torch.cat([p[r], p[n - 1 - r]]) for r in range(world_size)]


def permutation_not_inverse(num_tokens, world_size):
    """Returns which position each row holds instead of which row holds each position."""
    return torch.cat(zigzag_split(num_tokens, world_size))


def test_7_1_solution_passes():
    assert run_check(SOLUTION, "7.1") is None


def test_7_1_the_test_split_is_right():
    """The helper the wrong answers below start from is a right answer: each differs from it in one thing."""
    assert run_check(SOLUTION, "7.1", zigzag_positions=zigzag_split) is None


def test_7_1_delegating_to_make_split_fails():
    def delegating(num_tokens, world_size):
        split = make_split(num_tokens, world_size, "zigzag")
        return [split.positions(r) for r in range(world_size)]

    _assert_caught(run_check(SOLUTION, "7.1", zigzag_positions=delegating), "asks you to write this yourself",
                   "make_split")


def test_7_1_delegating_restore_order_fails():
    def delegating(num_tokens, world_size):
        split = make_split(num_tokens, world_size, "zigzag")
        return torch.argsort(torch.cat([split.positions(r) for r in range(world_size)]))

    _assert_caught(run_check(SOLUTION, "7.1", restore_order=delegating), "asks you to write this yourself",
                   "make_split")


def test_7_1_float_positions_are_named_as_a_dtype_mistake():
    def as_float(num_tokens, world_size):
        return [p.float() for p in zigzag_split(num_tokens, world_size)]

    _assert_caught(run_check(SOLUTION, "7.1", zigzag_positions=as_float), "dtype torch.float32", "int64")


def test_7_1_a_list_restore_order_is_named_as_a_type_mistake():
    def as_list(num_tokens, world_size):
        return torch.argsort(torch.cat(zigzag_split(num_tokens, world_size))).tolist()

    _assert_caught(run_check(SOLUTION, "7.1", restore_order=as_list), "returned list", "int64 tensor")


def test_7_2_a_float64_state_is_named_as_a_dtype_mistake():
    def in_double(q, q_pos, k, v, k_pos, out, lse):
        o, l = _step(q.double(), q_pos, k.double(), v.double(), k_pos, out.double(), lse.double())
        return o, l

    _assert_caught(run_check(SOLUTION, "7.2", ring_attention_step=in_double), "dtype torch.float64", "fp32 in and out")


def test_7_1_remainder_on_the_last_pieces_is_named():
    _assert_caught(run_check(SOLUTION, "7.1", zigzag_positions=late_remainder_split), "longer pieces last",
                   "piece sizes [3, 3, 3, 3, 3, 4]", "the longer pieces come first")


def test_7_1_naive_split_is_named():
    _assert_caught(run_check(SOLUTION, "7.1", zigzag_positions=naive_split), "naive split", "2R-1-r")


def test_7_1_lost_tokens_are_named():
    _assert_caught(run_check(SOLUTION, "7.1", zigzag_positions=floor_split), "positions on no rank: [18]",
                   "one token more")


def test_7_1_vllm_ceil_cut_is_named():
    _assert_caught(run_check(SOLUTION, "7.1", zigzag_positions=ceil_split), "vLLM's cut", "spreads the remainder")


def test_7_1_permutation_instead_of_its_inverse_is_named():
    _assert_caught(run_check(SOLUTION, "7.1", restore_order=permutation_not_inverse), "the inverse",
                   "torch.argsort")


def test_7_1_late_piece_first_is_named():
    def late_first(num_tokens, world_size):
        n = 2 * world_size
        p = _pieces(num_tokens, n)
        return [torch.cat([p[n - 1 - r], p[r]]) for r in range(world_size)]

    _assert_caught(run_check(SOLUTION, "7.1", zigzag_positions=late_first), "in increasing order")


def test_7_1_too_few_tokens_must_raise_value_error():
    def no_check(num_tokens, world_size):
        if num_tokens < 2 * world_size:
            return [torch.arange(num_tokens)] + [torch.empty(0, dtype=torch.long)] * (world_size - 1)
        return zigzag_split(num_tokens, world_size)

    _assert_caught(run_check(SOLUTION, "7.1", zigzag_positions=no_check), "raise ValueError")


# ---------------------------------------------------------------------------------------------------------------------
# Exercise 7.2: one ring step of attention


def _step(q, q_pos, k, v, k_pos, out, lse, *, mask="global", heads="interleave", merge="lse", max_trick=True,
          lse_heads_first=False):
    """A ring step with the chosen mistakes; all defaults give the right answer."""
    n, num_heads, head_dim = q.shape
    group = num_heads // k.shape[1]
    if heads == "interleave":
        kf, vf = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    elif heads == "tile":
        kf, vf = k.repeat(1, group, 1), v.repeat(1, group, 1)
    else:  # "none": pretend num_kv_heads == num_heads
        kf, vf = k, v
    s = torch.einsum("qhd,khd->qhk", q, kf) / math.sqrt(head_dim)
    if mask == "global":
        visible = k_pos[None, :] <= q_pos[:, None]
    else:  # "local": row index against column index
        visible = torch.arange(k.shape[0])[None, :] <= torch.arange(n)[:, None]
    if max_trick:
        s = s.masked_fill(~visible[:, None, :], float("-inf"))
        lse_b = torch.logsumexp(s, -1)
        safe_b = torch.where(torch.isinf(lse_b), torch.zeros_like(lse_b), lse_b)
        out_b = torch.einsum("qhk,khd->qhd", torch.exp(s - safe_b[..., None]), vf)
        new_lse = torch.logaddexp(lse, lse_b)
        safe = torch.where(torch.isinf(new_lse), torch.zeros_like(new_lse), new_lse)
        w_a, w_b = torch.exp(lse - safe)[..., None], torch.exp(lse_b - safe)[..., None]
    else:  # exp of raw scores and raw LSEs, fully masked rows handled by a clamp: right unless exp overflows
        e = torch.exp(s) * visible[:, None, :]
        total = e.sum(-1)
        out_b = torch.einsum("qhk,khd->qhd", e, vf) / total.clamp_min(1e-30)[..., None]
        lse_b = torch.log(total)
        ea, eb = torch.exp(lse), torch.exp(lse_b)
        new_lse = torch.log(ea + eb)
        w_a = (ea / (ea + eb).clamp_min(1e-30))[..., None]
        w_b = (eb / (ea + eb).clamp_min(1e-30))[..., None]
    new_out = (out + out_b) / 2 if merge == "average" else w_a * out + w_b * out_b
    return new_out, (new_lse.T if lse_heads_first else new_lse)


def test_7_2_solution_passes():
    assert run_check(SOLUTION, "7.2") is None


def test_7_2_reference_step_equals_the_right_answer_here():
    """The helper above, with no mistake, is a right answer: the tests below differ from it in one thing only."""
    assert run_check(SOLUTION, "7.2", ring_attention_step=_step) is None


def test_7_2_mask_by_local_index_is_named():
    e = run_check(SOLUTION, "7.2", ring_attention_step=partial(_step, mask="local"))
    _assert_caught(e, "local row indices", "global position")


def _merge(out, lse, o, l):
    """The log-sum-exp merge, written here (the check trips on the package's merge_attn_states)."""
    new_lse = torch.logaddexp(lse, l)
    safe = torch.where(torch.isinf(new_lse), torch.zeros_like(new_lse), new_lse)
    return torch.exp(lse - safe)[..., None] * out + torch.exp(l - safe)[..., None] * o, new_lse


def test_7_2_calling_reference_attention_fails():
    """reference_attention does the block's attention (per query, causal=False, over the keys it sees): it is part
    of what 7.2 asks for, so calling it trips the wire (before, its causal diagonal was the diagnosed slip)."""
    from minillm.attention.reference import reference_attention

    def uses_reference_attention(q, q_pos, k, v, k_pos, out, lse):
        o, l = reference_attention(q, k, v, return_lse=True)  # the causal diagonal of a prefix + chunk
        return _merge(out, lse, o, l)

    e = run_check(SOLUTION, "7.2", ring_attention_step=uses_reference_attention)
    _assert_caught(e, "Exercise 7.2 asks you to write this yourself", "reference_attention")


def test_7_2_delegating_to_merge_attn_states_fails():
    def delegating(q, q_pos, k, v, k_pos, out, lse):
        right_out, right_lse = _step(q, q_pos, k, v, k_pos, torch.zeros_like(out), torch.full_like(lse, -math.inf))
        return merge_attn_states(out, lse, right_out, right_lse)

    _assert_caught(run_check(SOLUTION, "7.2", ring_attention_step=delegating), "Exercise 7.2 asks you to write this "
                   "yourself", "merge_attn_states")


def test_7_2_delegating_to_the_package_ring_step_fails():
    from minillm.distributed.context_parallel import ContextParallelAttention

    def delegating(q, q_pos, k, v, k_pos, out, lse):
        # Whatever stands in for self, the package's step is the call that must fail.
        ContextParallelAttention._attend_block(None, 0, q, torch.stack([k, v]), 0, out, lse)
        return out, lse

    _assert_caught(run_check(SOLUTION, "7.2", ring_attention_step=delegating), "asks you to write this yourself",
                   "_attend_block")


def test_7_2_one_over_head_dim_scale_is_named():
    def scaled_by_d(q, q_pos, k, v, k_pos, out, lse):
        return _step(q * (1 / math.sqrt(q.shape[2])), q_pos, k, v, k_pos, out, lse)  # scores / d

    _assert_caught(run_check(SOLUTION, "7.2", ring_attention_step=scaled_by_d), "divided by head_dim",
                   "1 / sqrt(head_dim)")


def test_7_2_plain_averaging_is_named():
    e = run_check(SOLUTION, "7.2", ring_attention_step=partial(_step, merge="average"))
    _assert_caught(e, "averaged", "logaddexp")


def test_7_2_exp_without_max_overflows_and_is_named():
    e = run_check(SOLUTION, "7.2", ring_attention_step=partial(_step, max_trick=False))
    _assert_caught(e, "scores in the 1000s", "overflows fp32")


def test_7_2_nan_on_a_fully_masked_block_is_named():
    def softmax_step(q, q_pos, k, v, k_pos, out, lse):
        group = q.shape[1] // k.shape[1]
        kf, vf = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        s = torch.einsum("qhd,khd->qhk", q, kf) / math.sqrt(q.shape[2])
        s = s.masked_fill(~(k_pos[None, :] <= q_pos[:, None])[:, None, :], float("-inf"))
        out_b = torch.einsum("qhk,khd->qhd", torch.softmax(s, -1), vf)  # NaN for a row that sees nothing
        lse_b = torch.logsumexp(s, -1)
        new_lse = torch.logaddexp(lse, lse_b)
        return (torch.exp(lse - new_lse)[..., None] * out + torch.exp(lse_b - new_lse)[..., None] * out_b), new_lse

    _assert_caught(run_check(SOLUTION, "7.2", ring_attention_step=softmax_step), "sees none of the block",
                   "unchanged")


def test_7_2_tiled_gqa_heads_are_named():
    e = run_check(SOLUTION, "7.2", ring_attention_step=partial(_step, heads="tile"))
    _assert_caught(e, "tiled", "repeat_interleave")


def test_7_2_missing_gqa_expansion_fails_as_an_assertion():
    e = run_check(SOLUTION, "7.2", ring_attention_step=partial(_step, heads="none"))
    _assert_caught(e, "raised RuntimeError", "query head h uses KV head h // 3")


def test_7_2_lse_heads_first_is_named():
    e = run_check(SOLUTION, "7.2", ring_attention_step=partial(_step, lse_heads_first=True))
    _assert_caught(e, "[num_heads, n]", "tokens first")


@pytest.mark.parametrize("exercise", ["7.1", "7.2"])
def test_stub_fails_with_not_implemented(exercise):
    def stub(*args, **kwargs):
        raise NotImplementedError(f"Exercise {exercise}")

    names = ["zigzag_positions", "restore_order"] if exercise == "7.1" else ["ring_attention_step"]
    e = run_check(SOLUTION, exercise, **{n: stub for n in names})
    assert isinstance(e, NotImplementedError), repr(e)


# ---------------------------------------------------------------------------------------------------------------------
# Challenge 7: the striped split


def _striped(num_tokens, world_size, interleave=1, rank_of=None, clip=True, merge_runs=False):
    """A striped split with the chosen slips (all defaults: the right answer)."""
    from minillm.distributed.splits import ContextSplit, Piece

    if world_size < 1 or interleave < 1 or num_tokens <= (world_size - 1) * interleave:
        raise ValueError("no token for a rank")
    rank_of = rank_of or (lambda k, start: k % world_size)
    pieces = [[] for _ in range(world_size)]
    for k, start in enumerate(range(0, num_tokens, interleave)):
        end = min(start + interleave, num_tokens) if clip else start + interleave
        r = rank_of(k, start)
        if merge_runs and pieces[r] and pieces[r][-1].end == start:
            pieces[r][-1] = Piece(pieces[r][-1].start, end)
        else:
            pieces[r].append(Piece(start, end))
    return ContextSplit(num_tokens, world_size, "striped", tuple(tuple(p) for p in pieces))


def test_challenge_7_solution_passes():
    assert run_challenge(SOLUTION, 7, setup_only=True) is None


def test_challenge_7_the_test_split_is_right():
    assert run_challenge(SOLUTION, 7, setup_only=True, striped_split=_striped) is None


def test_challenge_7_delegating_answer_fails():
    from minillm.course.exercises.challenges import ch07

    _assert_caught(run_challenge(SOLUTION, 7, setup_only=True,
                                 striped_split=lambda t, r, s=1: ch07.striped_split(t, r, s)),
                   "Challenge 7 asks you to write this yourself", "striped_split")


def test_challenge_7_position_modulo_ranks_is_named():
    def by_position(num_tokens, world_size, interleave=1):   # the run's start, not its index, dealt round-robin
        return _striped(num_tokens, world_size, interleave, rank_of=lambda k, start: start % world_size)

    _assert_caught(run_challenge(SOLUTION, 7, setup_only=True, striped_split=by_position), "on rank", "run's index")


def test_challenge_7_unclipped_last_run_is_named():
    _assert_caught(run_challenge(SOLUTION, 7, setup_only=True, striped_split=partial(_striped, clip=False)),
                   "outside 0 .. 6",
                   "The last run stops at the prompt's end")


def test_challenge_7_merged_runs_are_named():
    _assert_caught(run_challenge(SOLUTION, 7, setup_only=True, striped_split=partial(_striped, merge_runs=True)),
                   "one Piece per run of interleave positions")


def test_challenge_7_permutation_instead_of_its_inverse_is_named():
    def held_not_restored(num_tokens, world_size, interleave=1):
        split = _striped(num_tokens, world_size, interleave)
        return torch.cat([split.positions(r) for r in range(world_size)])

    _assert_caught(run_challenge(SOLUTION, 7, setup_only=True, striped_restore_order=held_not_restored),
                   "the position each row holds",
                   "the inverse")


def test_challenge_7_too_strict_value_error_is_named():
    def strict(num_tokens, world_size, interleave=1):
        if num_tokens < world_size * interleave:
            raise ValueError("fewer tokens than runs")
        return _striped(num_tokens, world_size, interleave)

    _assert_caught(run_challenge(SOLUTION, 7, setup_only=True, striped_split=strict),
                   "striped_split(5, 3, 2) raised ValueError",
                   "every rank holds a token")
