"""The checks of solutions/09_disaggregation_and_tp.ipynb catch the typical wrong answers, and say why.

Each test runs the solution notebook up to one check cell with a deliberately wrong function or class in place of
the learner's (tests/exercise_helpers.run_check) and asserts that the check fails with an AssertionError that names
the mistake. The notebook's ``minillm.load_model()`` is served from the session's model (conftest's ``smollm``).
A run up to the check of 9.1 takes a few seconds; up to 9.2 it also runs four engines on SmolLM2 (about 10 s).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import minillm
from minillm.distributed.kv_transfer import SharedStorageConnector
from tests.course.exercise_helpers import run_check

SOLUTION = "09_disaggregation_and_tp.ipynb"


@pytest.fixture
def shared_model(monkeypatch, smollm):
    """The notebook's set-up cell gets the already loaded SmolLM2 instead of loading it again."""
    monkeypatch.setattr(minillm, "load_model", lambda *args, **kwargs: smollm)


pytestmark = pytest.mark.usefixtures("shared_model")


def _assert_caught(e: BaseException | None, *phrases: str) -> None:
    assert isinstance(e, AssertionError), f"the check should fail with an AssertionError, got {e!r}"
    for phrase in phrases:
        assert phrase in str(e), f"{phrase!r} is not in the check's message: {e}"


# ---------------------------------------------------------------------------------------------------------------------
# Exercise 9.1: the column/row-parallel split of one MLP and its all-reduce


def _features(mlp, tp_rank, tp_size):
    intermediate = mlp.gate_proj.weight.shape[0]
    if intermediate % tp_size:
        raise ValueError("not divisible")
    per = intermediate // tp_size
    return tp_rank * per, (tp_rank + 1) * per


def down_by_rows(mlp, tp_rank, tp_size):
    """down_proj split by its output features (rows of the [H, I] weight) instead of its input columns."""
    s, e = _features(mlp, tp_rank, tp_size)
    hidden = mlp.down_proj.weight.shape[0]
    hs, he = tp_rank * hidden // tp_size, (tp_rank + 1) * hidden // tp_size
    return mlp.gate_proj.weight[s:e], mlp.up_proj.weight[s:e], mlp.down_proj.weight[hs:he]


def gate_up_by_columns(mlp, tp_rank, tp_size):
    """gate_proj and up_proj split by their input features (columns), like a row-parallel layer."""
    s, e = _features(mlp, tp_rank, tp_size)
    hidden = mlp.gate_proj.weight.shape[1]
    hs, he = tp_rank * hidden // tp_size, (tp_rank + 1) * hidden // tp_size
    return mlp.gate_proj.weight[:, hs:he], mlp.up_proj.weight[:, hs:he], mlp.down_proj.weight[:, s:e]


def stacked_split(mlp, tp_rank, tp_size):
    """The stacked [gate; up] weight cut into tp_size pieces, each piece halved into 'gate' and 'up'."""
    s, e = _features(mlp, tp_rank, tp_size)
    stacked = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])
    piece = stacked.chunk(tp_size)[tp_rank]
    gate_w, up_w = piece.chunk(2)
    return gate_w, up_w, mlp.down_proj.weight[:, s:e]


def floor_split(mlp, tp_rank, tp_size):
    """I // tp_size features per rank, no check: with tp_size = 5 the last feature is on no rank."""
    per = mlp.gate_proj.weight.shape[0] // tp_size
    s, e = tp_rank * per, (tp_rank + 1) * per
    return mlp.gate_proj.weight[s:e], mlp.up_proj.weight[s:e], mlp.down_proj.weight[:, s:e]


def chunk_split(mlp, tp_rank, tp_size):
    """torch.chunk: uneven shards when tp_size does not divide I."""
    return (mlp.gate_proj.weight.chunk(tp_size)[tp_rank], mlp.up_proj.weight.chunk(tp_size)[tp_rank],
            mlp.down_proj.weight.chunk(tp_size, dim=1)[tp_rank])


def reversed_ranks(mlp, tp_rank, tp_size):
    """Consistent shards, but rank r holds the features of rank R-1-r."""
    _features(mlp, tp_rank, tp_size)  # ValueError when tp_size does not divide I
    return floor_split(mlp, tp_size - 1 - tp_rank, tp_size)


def _partials(x, shards, silu=True):
    act = F.silu if silu else (lambda t: t)
    return [(act(x @ g.T) * (x @ u.T)) @ d.T for g, u, d in shards]


def mean_reduce(x, shards):
    return torch.stack(_partials(x, shards)).mean(0)


def no_reduce(x, shards):
    return _partials(x, shards)[0]


def silu_after_sum(x, shards):
    return F.silu(sum(_partials(x, shards, silu=False)))


def gathered(x, shards):
    return torch.cat(_partials(x, shards), dim=-1)


def silu_on_both(x, shards):
    return sum((F.silu(x @ g.T) * F.silu(x @ u.T)) @ d.T for g, u, d in shards)


def down_not_transposed(x, shards):
    return sum((F.silu(x @ g.T) * (x @ u.T)) @ d for g, u, d in shards)


def test_9_1_solution_passes():
    assert run_check(SOLUTION, "9.1") is None


def test_9_1_down_split_by_rows_is_named():
    _assert_caught(run_check(SOLUTION, "9.1", my_tp_mlp_shards=down_by_rows), "down_proj is row-parallel",
                   "*input* features, the columns of nn.Linear.weight")


def test_9_1_gate_up_split_by_columns_is_named():
    _assert_caught(run_check(SOLUTION, "9.1", my_tp_mlp_shards=gate_up_by_columns), "column-parallel",
                   "silu(a + b) != silu(a) + silu(b)")


def test_9_1_gate_and_up_of_different_ranges_are_named():
    _assert_caught(run_check(SOLUTION, "9.1", my_tp_mlp_shards=stacked_split), "rows 1024..1535 of gate_proj",
                   "rows 0..511 of up_proj", "*same* features 512..1023")


@pytest.mark.parametrize("wrong, phrase", [(floor_split, "1535 of 1536: 1 features are on no rank"),
                                           (chunk_split, "[308, 308, 308, 308, 304] features: shards of different "
                                                         "shapes")])
def test_9_1_uneven_split_is_named(wrong, phrase):
    _assert_caught(run_check(SOLUTION, "9.1", my_tp_mlp_shards=wrong), "5 does not divide I = 1536", phrase,
                   "Raise ValueError")


def down_transposed(mlp, tp_rank, tp_size):
    """The right down_proj features, cut from the transposed weight: [I/R, H] instead of [H, I/R]."""
    s, e = _features(mlp, tp_rank, tp_size)
    return mlp.gate_proj.weight[s:e], mlp.up_proj.weight[s:e], mlp.down_proj.weight.T[s:e]


def test_9_1_transposed_shard_is_named():
    _assert_caught(run_check(SOLUTION, "9.1", my_tp_mlp_shards=down_transposed), "down_w holds the right weights, "
                   "transposed", "Keep nn.Linear's layout")


def test_9_1_rank_order_is_named():
    _assert_caught(run_check(SOLUTION, "9.1", my_tp_mlp_shards=reversed_ranks), "rank r of R holds",
                   "= 1152..1535")


@pytest.mark.parametrize("wrong, phrase", [(mean_reduce, "averages the ranks' partial outputs"),
                                           (no_reduce, "returns rank 0's partial output alone"),
                                           (silu_after_sum, "applies silu after the sum"),
                                           (gathered, "an all-gather"),
                                           (silu_on_both, "applies silu to the up projection too"),
                                           (down_not_transposed, "each is applied as x @ w.T")])
def test_9_1_forward_mistakes_are_named(wrong, phrase):
    _assert_caught(run_check(SOLUTION, "9.1", my_tp_mlp_forward=wrong), phrase)


# ---------------------------------------------------------------------------------------------------------------------
# Exercise 9.2: get_num_new_matched_tokens


def connector(count):
    """A SharedStorageConnector subclass whose count is count(available, num_tokens, num_prompt, num_computed)."""

    class WrongConnector(SharedStorageConnector):
        def get_num_new_matched_tokens(self, request, num_computed_tokens):
            if not self._config.is_kv_consumer:
                return 0, False
            available = self._num_available_tokens(request)
            return count(available, request.num_tokens, request.num_prompt_tokens, num_computed_tokens), False

    return WrongConnector


def _guarded(fn):
    return lambda a, t, p, c: None if a is None else fn(a, t, p, c)


WRONG_COUNTS = {
    "forgot the last token": (_guarded(lambda a, t, p, c: max(min(a, t) - c, 0)),
                              "the last one too", "would schedule no token"),
    "no local hit subtracted": (_guarded(lambda a, t, p, c: min(a, t - 1)),
                                "instead of from the local hit", "Subtract num_computed_tokens"),
    "negative": (_guarded(lambda a, t, p, c: min(a, t - 1) - c), "it is negative", "un-compute cached tokens"),
    "None becomes 0": (lambda a, t, p, c: max(min(a or 0, t - 1) - c, 0), "'not known yet' into 'nothing to load'",
                       "recomputing everything"),
    "prompt length instead of num_tokens": (_guarded(lambda a, t, p, c: max(min(a, p - 1) - c, 0)),
                                            "Use request.num_tokens, not num_prompt_tokens"),
    "the last available token held back": (_guarded(lambda a, t, p, c: max(a - 1 - c, 0)),
                                           "it holds back the last *prompt* token", "or available - 1"),
    "available ignored": (_guarded(lambda a, t, p, c: max(t - 1 - c, 0) if a else 0),
                          "ignores how much is available"),
    # Issue 24: this one got only "returned (11, False), expected (0, False)" at the probe of a prompt never saved.
    "available ignored, even when nothing was saved": (
        _guarded(lambda a, t, p, c: max(t - 1 - c, 0)), "never saved (0 available), 8 cached locally",
        "returned (11, False), expected (0, False): it ignores how much is available: only 0 prompt tokens",
        "never saved this prompt"),
}


@pytest.mark.slow
def test_9_2_solution_passes():
    assert run_check(SOLUTION, "9.2") is None


@pytest.mark.parametrize("mistake", sorted(WRONG_COUNTS))
def test_9_2_wrong_counts_are_named(mistake):
    count, *phrases = WRONG_COUNTS[mistake]
    _assert_caught(run_check(SOLUTION, "9.2", MyConnector=connector(count)), *phrases)


def test_9_2_async_load_is_named():
    class AsyncConnector(SharedStorageConnector):
        def get_num_new_matched_tokens(self, request, num_computed_tokens):
            available = self._num_available_tokens(request)
            if available is None:
                return None, True
            return max(min(available, request.num_tokens - 1) - num_computed_tokens, 0), True

    _assert_caught(run_check(SOLUTION, "9.2", MyConnector=AsyncConnector), "load_async=True", "synchronously")


def test_9_2_a_crash_on_none_is_explained():
    crash = connector(lambda a, t, p, c: max(min(a, t - 1) - c, 0))
    _assert_caught(run_check(SOLUTION, "9.2", MyConnector=crash), "available=None raised TypeError",
                   "Pass None through before any arithmetic")


def test_9_2_delegating_with_super_fails():
    class Delegating(SharedStorageConnector):
        def get_num_new_matched_tokens(self, request, num_computed_tokens):
            return super().get_num_new_matched_tokens(request, num_computed_tokens)

    _assert_caught(run_check(SOLUTION, "9.2", MyConnector=Delegating), "Exercise 9.2 asks you to write this yourself",
                   "PromptKVConnector.get_num_new_matched_tokens")


def test_9_2_a_class_that_inherits_the_method_fails():
    class Inherits(SharedStorageConnector):
        pass

    _assert_caught(run_check(SOLUTION, "9.2", MyConnector=Inherits), "asks you to write this yourself",
                   "a method your class inherits")


def test_9_2_delegating_through_the_base_class_fails():
    from minillm.distributed.kv_transfer.prompt_connector import PromptKVConnector

    class Delegating(SharedStorageConnector):
        def get_num_new_matched_tokens(self, request, num_computed_tokens):
            return PromptKVConnector.get_num_new_matched_tokens(self, request, num_computed_tokens)

    _assert_caught(run_check(SOLUTION, "9.2", MyConnector=Delegating), "asks you to write this yourself")


def test_9_1_delegating_shards_fail():
    from minillm.model.parallel_layers import MergedColumnParallelLinear, RowParallelLinear

    def delegating(mlp, tp_rank, tp_size):
        merged = MergedColumnParallelLinear([mlp.gate_proj, mlp.up_proj], tp_rank, tp_size)
        gate_w, up_w = torch.split(merged.weight, merged.output_sizes_per_partition)
        return gate_w, up_w, RowParallelLinear(mlp.down_proj, tp_rank, tp_size).weight

    _assert_caught(run_check(SOLUTION, "9.1", my_tp_mlp_shards=delegating), "Exercise 9.1 asks you to write this "
                   "yourself", "MergedColumnParallelLinear.__init__")


def test_9_1_delegating_forward_fails():
    from minillm.model.parallel_layers import RowParallelLinear

    def delegating(x, shards):
        total = 0
        for gate_w, up_w, down_w in shards:
            h = F.silu(x @ gate_w.T) * (x @ up_w.T)
            total = total + RowParallelLinear(down_w, 0, 1).partial(h)   # the package's row-parallel layer
        return total

    _assert_caught(run_check(SOLUTION, "9.1", my_tp_mlp_forward=delegating), "asks you to write this yourself",
                   "RowParallelLinear.__init__")


# ---------------------------------------------------------------------------------------------------------------------
# Challenge 9: a connector that transfers only the blocks the decode engine lacks


def _challenge_cell(*edits: tuple[str, str]) -> str:
    """The solution's Challenge 9 cell with each ``(old, new)`` edit applied once: a learner's wrong answer."""
    import nbformat

    from tests.course.exercise_helpers import ROOT

    nb = nbformat.read(ROOT / "solutions" / SOLUTION, as_version=4)
    source = next(c.source for c in nb.cells if c.cell_type == "code" and c.source.startswith("# Challenge 9:"))
    for old, new in edits:
        assert source.count(old) == 1, f"edit {old!r} does not apply once"
        source = source.replace(old, new)
    return source


def _challenge(*edits: tuple[str, str]) -> BaseException | None:
    from tests.course.exercise_helpers import run_check_with_answer

    return run_check_with_answer(SOLUTION, "9", _challenge_cell(*edits), setup_only=True)


@pytest.mark.slow
def test_challenge_9_solution_passes():
    assert _challenge() is None


def test_challenge_9_delegating_answer_fails():
    e = _challenge(("class MyDeltaConnector(SharedStorageConnector):",
                    "from minillm.course.exercises.challenges import ch09\n\n\nclass MyDeltaConnector(SharedStorageConnector):"),
                   ("        ### BEGIN SOLUTION\n        final = self._dir(save.key)",
                    "        return ch09.DeltaStorageConnector._store(self, save, kv)\n        ### BEGIN SOLUTION\n"
                    "        final = self._dir(save.key)"))
    _assert_caught(e, "Challenge 9 asks you to write this yourself", "DeltaStorageConnector._store")


def test_challenge_9_an_inherited_method_fails():
    source = _challenge_cell()
    start = source.index("    def _fetch(")
    end = source.index("    def get_num_new_matched_tokens(")
    from tests.course.exercise_helpers import run_check_with_answer

    e = run_check_with_answer(SOLUTION, "9", source[:start] + source[end:], setup_only=True)
    _assert_caught(e, "inherits _fetch from SharedStorageConnector")


def test_challenge_9_saving_the_whole_prompt_is_named():
    e = _challenge(("        start = min(hit, end)", "        start = 0"))
    _assert_caught(e, "saved positions 0 ...", "the decode engine holds positions 0 ... 23 already")


def test_challenge_9_saving_the_last_token_is_named():
    e = _challenge(("        end = save.end - 1 ", "        end = save.end "))
    _assert_caught(e, "computes the last prompt token, position 23, itself")


def test_challenge_9_fetch_without_the_offset_is_named():
    e = _challenge(("        return torch.cat([before, kv], dim=2)", "        return kv"))
    _assert_caught(e, "_fetch after the _store of a prompt of 37 tokens whose first 24", "start_load_kv needs",
                   ">= 36")


def test_challenge_9_a_count_over_a_gap_is_named():
    e = _challenge(("        if meta is None or num_computed_tokens < int(meta.get(\"start\", 0)):",
                    "        if meta is None:"))
    _assert_caught(e, "the local hit ends before the saved range begins", "neither in this engine's cache nor saved")
