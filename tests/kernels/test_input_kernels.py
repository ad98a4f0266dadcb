"""Model Runner V2's input-preparation kernels (``kernels/input_batch.py``, ``kernels/block_table.py``).

Two kinds of test for each of the seven functions:

- Worked examples: the PyTorch reference (what the engine runs on a CPU) against numbers worked out by hand in the
  test, so a wrong reference cannot pass by agreeing with a wrong kernel. They cover the edge cases by name: empty
  queries, decodes, the last prefill chunk, a prompt tail scheduled with drafts, chunked-prefill rows, rows skipped
  by a negative ``idx_mapping`` entry, the null block and ``pad_id`` padding.
- Property tests (hypothesis): the Triton kernel (``use_triton=True``, in Triton's interpreter without a GPU)
  against the reference on random batches: random ``max_num_reqs``, a random subset of the slots in random batch
  order, rows mid-prefill, finishing their prefill, decoding with 0..k drafts, prompt tails with drafts, empty
  queries where the function allows them, negative ``idx_mapping`` entries where it allows them. Both start from the
  same random (not zero) state and output buffers, and *whole* tensors are compared afterwards, so a write to a slot
  outside the batch or past the batch's rows fails too.

Tolerances: none. Everything is integer indexing and copying, so results must be equal exactly.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels import block_table as bt
from kernels import input_batch as ib

MAX_MODEL_LEN = 40
EXAMPLES = settings(max_examples=25, deadline=None)
# Where the kernels run: "cpu" (Triton's interpreter) here; "cuda" on a GPU, where make gpu-report runs this file.
DEVICE = os.environ.get("MINILLM_KERNEL_TEST_DEVICE", "cpu")


def _run_kernel(fn, *args, **kwargs):
    """``fn(*args, **kwargs, use_triton=True)`` on :data:`DEVICE`: the tensor arguments are copied there and, after
    the call, back into the CPU tensors given (the kernels write in place); a returned tensor comes back to the CPU
    (as the very tensor given, when it is one of them). On the CPU nothing is copied."""
    moved: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def there(x):
        if not isinstance(x, torch.Tensor):
            return x
        if id(x) not in moved:
            moved[id(x)] = (x, x.to(DEVICE))
        return moved[id(x)][1]

    result = fn(*map(there, args), **{k: there(v) for k, v in kwargs.items()}, use_triton=True)
    for cpu, dev in moved.values():
        if dev is not cpu:
            cpu.copy_(dev.cpu())

    def back(r):
        if isinstance(r, tuple):
            return tuple(back(x) for x in r)
        if isinstance(r, torch.Tensor):
            same = [cpu for cpu, dev in moved.values() if dev.data_ptr() == r.data_ptr() and dev.shape == r.shape]
            return same[0] if same else r.cpu()
        return r
    return back(result)


def _i32(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


def _i64(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


# ----------------------------------------------------------------------------------------------------------------
# Random batches
# ----------------------------------------------------------------------------------------------------------------
@dataclass
class World:
    """A step's batch over per-slot state. Slots outside ``idx_mapping`` hold random state of their own."""

    max_num_reqs: int
    num_spec: int
    idx_mapping: torch.Tensor      # [num_reqs] int64
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32
    cu_num_logits: torch.Tensor    # [num_reqs + 1] int32
    prefill_len: torch.Tensor      # [max_num_reqs] int32
    num_computed: torch.Tensor     # [max_num_reqs] int32
    seq_lens: torch.Tensor         # [num_reqs] int32, num_computed + query_len
    gen: torch.Generator           # for bulk random content (token ids, garbage in buffers)

    @property
    def num_reqs(self) -> int:
        return self.idx_mapping.shape[0]

    @property
    def num_tokens(self) -> int:
        return int(self.query_start_loc[-1])

    @property
    def num_logits(self) -> int:
        return int(self.cu_num_logits[-1])

    def rand(self, low: int, high: int, *shape: int, dtype: torch.dtype = torch.int32) -> torch.Tensor:
        return torch.randint(low, high, shape, generator=self.gen, dtype=dtype)


@st.composite
def worlds(draw, allow_empty: bool = True) -> World:
    """Rows of four kinds: ``prefill`` (a chunk, possibly the last), ``decode`` (1 + 0..num_spec drafts), ``tail``
    (the rest of the prompt and beyond, with logits for drafts; the first logit may lie inside or past the prompt)
    and ``empty`` (no tokens, no logits). A ``tail`` may end exactly at the prompt's end, with logits for drafts."""
    max_num_reqs = draw(st.integers(1, 6))
    num_spec = draw(st.integers(0, 3))
    order = draw(st.permutations(range(max_num_reqs)))
    num_reqs = draw(st.integers(0, max_num_reqs))
    slots = order[:num_reqs]
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    # Slots outside the batch: state that must survive the call untouched.
    prefill_len = torch.randint(1, 17, (max_num_reqs,), generator=gen, dtype=torch.int32)
    num_computed = torch.randint(0, 27, (max_num_reqs,), generator=gen, dtype=torch.int32)
    kinds = ["prefill", "decode", "tail"] + (["empty"] if allow_empty else [])
    query_lens, row_logits = [], []
    for s in slots:
        kind = draw(st.sampled_from(kinds))
        if kind == "prefill":
            pl = draw(st.integers(2, 16))
            nc = draw(st.integers(0, pl - 1))
            qlen, nlog = draw(st.integers(1, pl - nc)), 1
        elif kind == "decode":
            pl = draw(st.integers(1, 16))
            nc = draw(st.integers(pl, pl + 10))
            nlog = draw(st.integers(1, num_spec + 1))
            qlen = nlog
        elif kind == "tail":
            pl = draw(st.integers(1, 16))
            nc = draw(st.integers(0, pl - 1))
            nlog = draw(st.integers(1, num_spec + 1))
            qlen = max(nlog, pl - nc + draw(st.integers(0, num_spec + 1)))
        else:
            pl, nc, qlen, nlog = draw(st.integers(1, 16)), draw(st.integers(0, 26)), 0, 0
        prefill_len[s], num_computed[s] = pl, nc
        query_lens.append(qlen)
        row_logits.append(nlog)
    idx = _i64(slots)
    qsl = torch.zeros(num_reqs + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(_i32(query_lens), 0)
    cu = torch.zeros(num_reqs + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(_i32(row_logits), 0)
    seq_lens = num_computed[idx] + _i32(query_lens) if num_reqs else _i32([])
    return World(max_num_reqs, num_spec, idx, qsl, cu, prefill_len, num_computed, seq_lens, gen)


def _clones(*tensors):
    return tuple(t.clone() if isinstance(t, torch.Tensor) else t for t in tensors)


def _assert_all_equal(got, want):
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        if g is None:
            assert w is None
            continue
        assert g.dtype == w.dtype and g.shape == w.shape, (i, g.dtype, w.dtype, g.shape, w.shape)
        assert torch.equal(g, w), f"tensor {i}:\nkernel    {g}\nreference {w}"


# ----------------------------------------------------------------------------------------------------------------
# prepare_prefill_inputs
# ----------------------------------------------------------------------------------------------------------------
def test_prepare_prefill_inputs_worked_example():
    all_token_ids = torch.arange(10, 50, dtype=torch.int32).view(4, 10)  # slot s holds 10 + 10 s, 11 + 10 s, ...
    prefill_len = _i32([5, 3, 6, 2])
    num_computed = _i32([2, 3, 0, 1])
    # row 0: slot 2, fresh prefill of 4; row 1: slot 3, empty; row 2: slot 0, chunk of 3 from token 2 (the last
    # chunk: 2 + 3 = 5); row 3: slot 1, decoding (3 >= 3): untouched.
    idx = _i64([2, 3, 0, 1])
    qsl = _i32([0, 4, 4, 7, 8])
    input_ids = torch.full((10,), -1, dtype=torch.int64)
    ib.prepare_prefill_inputs_ref(input_ids, idx, qsl, all_token_ids, prefill_len, num_computed)
    assert input_ids.tolist() == [30, 31, 32, 33, 12, 13, 14, -1, -1, -1]


@EXAMPLES
@given(w=worlds(), ids_dtype=st.sampled_from([torch.int32, torch.int64]))
def test_prepare_prefill_inputs_kernel_matches_reference(w, ids_dtype):
    all_token_ids = w.rand(0, 1000, w.max_num_reqs, MAX_MODEL_LEN)
    input_ids = w.rand(-9, 0, w.num_tokens + 3, dtype=ids_dtype)
    state = (w.idx_mapping, w.query_start_loc, all_token_ids, w.prefill_len, w.num_computed)
    got, want, kernel_state = input_ids.clone(), input_ids.clone(), _clones(*state)
    _run_kernel(ib.prepare_prefill_inputs, got, *kernel_state)
    ib.prepare_prefill_inputs(want, *state, use_triton=False)
    assert torch.equal(got, want)
    _assert_all_equal(kernel_state, state)  # the state is only read
    # Only prefilling rows' tokens change.
    changed = (want != input_ids).nonzero().flatten()
    rows = torch.searchsorted(w.query_start_loc, changed, right=True) - 1
    assert bool((w.num_computed[w.idx_mapping[rows]] < w.prefill_len[w.idx_mapping[rows]]).all())


# ----------------------------------------------------------------------------------------------------------------
# prepare_pos_seq_lens
# ----------------------------------------------------------------------------------------------------------------
def test_prepare_pos_seq_lens_worked_example():
    num_computed = _i32([2, 3, 0, 1])
    idx = _i64([2, 3, 0, 1])
    qsl = _i32([0, 4, 4, 7, 8])  # row 1 (slot 3) is empty: seq_len 1, no positions
    positions = torch.full((10,), -7, dtype=torch.int64)
    seq_lens = torch.full((6,), -5, dtype=torch.int32)
    ib.prepare_pos_seq_lens_ref(idx, qsl, num_computed, positions, seq_lens)
    assert positions.tolist() == [0, 1, 2, 3, 2, 3, 4, 3, -7, -7]
    assert seq_lens.tolist() == [4, 1, 5, 4, -5, -5]


@EXAMPLES
@given(w=worlds())
def test_prepare_pos_seq_lens_kernel_matches_reference(w):
    positions = w.rand(-9, 0, w.num_tokens + 3, dtype=torch.int64)
    seq_lens = w.rand(-9, 0, w.max_num_reqs + 2)
    got = (positions.clone(), seq_lens.clone())
    want = (positions.clone(), seq_lens.clone())
    _run_kernel(ib.prepare_pos_seq_lens, w.idx_mapping, w.query_start_loc, w.num_computed, *got)
    ib.prepare_pos_seq_lens(w.idx_mapping, w.query_start_loc, w.num_computed, *want, use_triton=False)
    _assert_all_equal(got, want)
    assert torch.equal(want[1][:w.num_reqs], w.seq_lens)
    assert torch.equal(want[1][w.num_reqs:], seq_lens[w.num_reqs:])  # no padding of unused rows


# ----------------------------------------------------------------------------------------------------------------
# combine_sampled_and_draft_tokens
# ----------------------------------------------------------------------------------------------------------------
def test_combine_sampled_and_draft_tokens_worked_example():
    prefill_len = _i32([3, 5, 6, 10, 4])
    last_sampled = _i64([[100], [111], [122], [133], [144]])
    draft_tokens = _i64([[201, 202], [211, 212], [221, 222], [231, 232], [241, 242]])
    # row 0: slot 3, a prefill chunk (seq 6 <= 10): logit at its last token 3, no writes.
    # row 1: slot 1, decode with 2 drafts (seq 10, 3 logits): tokens 4, 5, 6 = sampled 111, drafts 211, 212.
    # row 2: slot 0, plain decode (seq 4, 1 logit): token 7 = 100.
    # row 3: slot 2, prompt tail + 1 draft (seq 7 > 6, 2 logits): first logit at seq pos 5 < 6 is a prompt token,
    #        kept; token 10 = draft 221.
    # row 4: slot 4, the last prefill chunk with 2 logits (seq 4 == prompt 4): logits at tokens 12, 13, and no
    #        writes: every input id is a prompt token, the draft 241 included.
    idx = _i64([3, 1, 0, 2, 4])
    qsl = _i32([0, 4, 7, 8, 11, 14])
    seq_lens = _i32([6, 10, 4, 7, 4])
    cu = _i32([0, 1, 4, 5, 7, 9])
    input_ids = torch.arange(1000, 1015, dtype=torch.int32)
    logits_indices = ib.combine_sampled_and_draft_tokens_ref(input_ids, idx, last_sampled, qsl, seq_lens,
                                                             prefill_len, draft_tokens, cu, 9)
    assert logits_indices.dtype == torch.int64
    assert logits_indices.tolist() == [3, 4, 5, 6, 7, 9, 10, 12, 13]
    want = list(range(1000, 1015))
    want[4:8] = [111, 211, 212, 100]
    want[10] = 221
    assert input_ids.tolist() == want


def test_combine_sampled_and_draft_tokens_without_speculation():
    """``num_spec == 0``: draft_tokens is ``[max_num_reqs, 0]``; the kernel must not read it."""
    idx = _i64([1, 0])
    qsl = _i32([0, 1, 2])
    input_ids = torch.zeros(2, dtype=torch.int64)
    for use_triton in (False, True):
        input_ids.zero_()
        out = ib.combine_sampled_and_draft_tokens(input_ids, idx, _i64([[5], [6]]), qsl, _i32([9, 9]),
                                                  _i32([3, 3]), torch.zeros(2, 0, dtype=torch.int64), _i32([0, 1, 2]),
                                                  2, use_triton=use_triton)
        assert out.tolist() == [0, 1] and input_ids.tolist() == [6, 5]


@EXAMPLES
@given(w=worlds(allow_empty=False), ids_dtype=st.sampled_from([torch.int32, torch.int64]))
def test_combine_sampled_and_draft_tokens_kernel_matches_reference(w, ids_dtype):
    input_ids = w.rand(-9, 0, w.num_tokens + 3, dtype=ids_dtype)
    last_sampled = w.rand(0, 1000, w.max_num_reqs, 1, dtype=torch.int64)
    draft_tokens = w.rand(1000, 2000, w.max_num_reqs, w.num_spec, dtype=torch.int64)
    args = (w.idx_mapping, last_sampled, w.query_start_loc, w.seq_lens, w.prefill_len, draft_tokens,
            w.cu_num_logits, w.num_logits)
    got, want, kernel_args = input_ids.clone(), input_ids.clone(), _clones(*args)
    got_idx = _run_kernel(ib.combine_sampled_and_draft_tokens, got, *kernel_args)
    want_idx = ib.combine_sampled_and_draft_tokens(want, *args, use_triton=False)
    _assert_all_equal((got_idx, got), (want_idx, want))
    _assert_all_equal(kernel_args[:-1], args[:-1])  # the state is only read
    assert torch.equal(input_ids[w.num_tokens:], want[w.num_tokens:])


# ----------------------------------------------------------------------------------------------------------------
# get_num_sampled_and_rejected
# ----------------------------------------------------------------------------------------------------------------
def test_get_num_sampled_and_rejected_worked_example():
    # row 0: slot 1, seq 10 past prompt 8, 3 logits, kept 2: 1 rejected.
    # row 1: slot 0, seq 4 < prompt 5: a chunk mid-prefill: 0 and 0.
    # row 2: slot 2, seq 3 == prompt 3: the last chunk, its token is the first output: kept 1, rejected 0.
    num_sampled = _i32([2, 1, 1])
    got_sampled, got_rejected = ib.get_num_sampled_and_rejected_ref(num_sampled, _i32([10, 4, 3]),
                                                                    _i32([0, 3, 4, 5]), _i64([1, 0, 2]),
                                                                    _i32([5, 8, 3]))
    assert got_sampled is num_sampled  # updated in place, as vLLM
    assert got_sampled.tolist() == [2, 0, 1]
    assert got_rejected.tolist() == [1, 0, 0] and got_rejected.dtype == torch.int32


@EXAMPLES
@given(w=worlds(allow_empty=False), data=st.data())
def test_get_num_sampled_and_rejected_kernel_matches_reference(w, data):
    row_logits = (w.cu_num_logits[1:] - w.cu_num_logits[:-1]).tolist()
    num_sampled = _i32([data.draw(st.integers(0, n)) for n in row_logits])
    args = (w.seq_lens, w.cu_num_logits, w.idx_mapping, w.prefill_len)
    got_in, want_in = num_sampled.clone(), num_sampled.clone()
    got = _run_kernel(ib.get_num_sampled_and_rejected, got_in, *args)
    want = ib.get_num_sampled_and_rejected(want_in, *args, use_triton=False)
    _assert_all_equal(got + (got_in,), want + (want_in,))
    assert got[0] is got_in


# ----------------------------------------------------------------------------------------------------------------
# post_update
# ----------------------------------------------------------------------------------------------------------------
def _post_update_state():
    """4 slots; the batch is slot 2 (kept 2 of 3, 1 rejected, query 3), a skipped row, and slot 0 (a chunk of 5
    mid-prefill: kept 0)."""
    return dict(
        idx_mapping=_i64([2, -1, 0]),
        num_computed_tokens=_i32([10, 20, 30, 40]),
        last_sampled_tokens=torch.full((4, 1), 7, dtype=torch.int64),
        output_bin_counts=torch.zeros(4, 6, dtype=torch.int32),
        sampled_tokens=_i64([[4, 4, 5], [1, 2, 3], [0, 3, 3]]),
        num_sampled=_i32([2, 3, 0]),
        num_rejected=_i32([1, 0, 0]),
        query_start_loc=_i32([0, 3, 4, 9]),
        all_token_ids=torch.full((4, 8), 9, dtype=torch.int32),
        total_len=_i32([3, 1, 2, 0]),
        draft_tokens=_i64([[51, 52], [61, 62], [71, 72]]),
        draft_tokens_out=torch.zeros(4, 2, dtype=torch.int64),
    )


def test_post_update_worked_example():
    s = _post_update_state()
    ib.post_update_ref(**s)
    assert s["num_computed_tokens"].tolist() == [15, 20, 32, 40]  # slot 2: + 3 - 1; slot 0: + 5
    assert s["last_sampled_tokens"].flatten().tolist() == [7, 7, 4, 7]
    assert s["total_len"].tolist() == [3, 1, 4, 0]
    want_ids = torch.full((4, 8), 9, dtype=torch.int32)
    want_ids[2, 2:4] = 4
    assert torch.equal(s["all_token_ids"], want_ids)
    want_bins = torch.zeros(4, 6, dtype=torch.int32)
    want_bins[2, 4] = 2  # token 4 kept twice: counted twice
    assert torch.equal(s["output_bin_counts"], want_bins)
    assert s["draft_tokens_out"].tolist() == [[71, 72], [0, 0], [51, 52], [0, 0]]


def test_post_update_without_query_start_loc_bins_or_drafts():
    """``query_start_loc=None`` counts every query as empty: num_computed only loses the rejected drafts."""
    s = _post_update_state()
    s.update(query_start_loc=None, output_bin_counts=None, draft_tokens=None, draft_tokens_out=None)
    ib.post_update_ref(**s)
    assert s["num_computed_tokens"].tolist() == [10, 20, 29, 40]
    assert s["total_len"].tolist() == [3, 1, 4, 0]


@pytest.mark.parametrize("drop", [(), ("query_start_loc", "output_bin_counts", "draft_tokens")])
def test_post_update_kernel_on_the_worked_example(drop):
    """The duplicated token (4 kept twice) checks the kernel's bin counting adds per occurrence."""
    want, got = _post_update_state(), _post_update_state()
    for name in drop:
        want[name] = got[name] = None
        if name == "draft_tokens":
            want["draft_tokens_out"] = got["draft_tokens_out"] = None
    ib.post_update(**want, use_triton=False)
    _run_kernel(ib.post_update, **got)
    _assert_all_equal(list(got.values()), list(want.values()))


@EXAMPLES
@given(w=worlds(), data=st.data(), sampled_dtype=st.sampled_from([torch.int32, torch.int64]),
       with_qsl=st.booleans(), with_bins=st.booleans(), with_drafts=st.booleans())
def test_post_update_kernel_matches_reference(w, data, sampled_dtype, with_qsl, with_bins, with_drafts):
    vocab, k1 = 5, w.num_spec + 1  # a small vocabulary: a row often keeps one token twice
    idx = w.idx_mapping.clone()
    if w.num_reqs:
        idx[_i32(data.draw(st.lists(st.booleans(), min_size=w.num_reqs, max_size=w.num_reqs))).bool()] = -1
    query_lens = (w.query_start_loc[1:] - w.query_start_loc[:-1]).tolist()
    state = dict(
        idx_mapping=idx,
        num_computed_tokens=w.num_computed.clone(),
        last_sampled_tokens=w.rand(0, vocab, w.max_num_reqs, 1, dtype=torch.int64),
        output_bin_counts=w.rand(0, 4, w.max_num_reqs, vocab) if with_bins else None,
        sampled_tokens=w.rand(0, vocab, w.num_reqs, k1, dtype=sampled_dtype),
        num_sampled=_i32([data.draw(st.integers(0, k1)) for _ in range(w.num_reqs)]),
        num_rejected=_i32([data.draw(st.integers(0, q)) for q in query_lens]),
        query_start_loc=w.query_start_loc if with_qsl else None,
        all_token_ids=w.rand(-9, 0, w.max_num_reqs, MAX_MODEL_LEN),
        total_len=w.rand(0, MAX_MODEL_LEN - k1 + 1, w.max_num_reqs),
        draft_tokens=w.rand(100, 200, w.num_reqs, w.num_spec, dtype=torch.int64) if with_drafts else None,
        draft_tokens_out=w.rand(200, 300, w.max_num_reqs, w.num_spec, dtype=torch.int64) if with_drafts else None,
    )
    got = {name: v.clone() if v is not None else None for name, v in state.items()}
    _run_kernel(ib.post_update, **got)
    ib.post_update(**state, use_triton=False)
    _assert_all_equal(list(got.values()), list(state.values()))


def test_post_update_rejects_drafts_without_their_output():
    s = _post_update_state()
    s["draft_tokens_out"] = None
    with pytest.raises(ValueError, match="draft_tokens_out"):
        ib.post_update(**s)


# ----------------------------------------------------------------------------------------------------------------
# gather_block_tables
# ----------------------------------------------------------------------------------------------------------------
def test_gather_block_tables_worked_example():
    block_table = _i32([[7, 3, 99, 99, 99], [1, 2, 3, 4, 5], [99, 99, 99, 99, 99], [8, 99, 99, 99, 99]])
    num_blocks = _i32([2, 5, 0, 1])  # the 99s are stale entries past each slot's blocks
    out = torch.full((5, 5), -3, dtype=torch.int32)
    got = bt.gather_block_tables_ref(_i64([3, 1, 2]), block_table, num_blocks, out)
    assert got.tolist() == [[8, 0, 0, 0, 0], [1, 2, 3, 4, 5], [0, 0, 0, 0, 0]]
    assert got.data_ptr() == out.data_ptr()  # a view of out
    assert out[3:].eq(-3).all()  # rows past the batch untouched


@EXAMPLES
@given(w=worlds(), max_blocks=st.integers(1, 9), extra_rows=st.integers(0, 2))
def test_gather_block_tables_kernel_matches_reference(w, max_blocks, extra_rows):
    block_table = w.rand(1, 100, w.max_num_reqs, max_blocks)
    num_blocks = w.rand(0, max_blocks + 1, w.max_num_reqs)
    out = w.rand(-9, 0, w.num_reqs + extra_rows, max_blocks)
    got_out, want_out, table = out.clone(), out.clone(), block_table.clone()
    got = _run_kernel(bt.gather_block_tables, w.idx_mapping, table, num_blocks, got_out)
    want = bt.gather_block_tables(w.idx_mapping, block_table, num_blocks, want_out, use_triton=False)
    _assert_all_equal((got, got_out, table), (want, want_out, block_table))
    assert torch.equal(want_out[w.num_reqs:], out[w.num_reqs:])


def test_gather_block_tables_rejects_an_out_of_another_width():
    with pytest.raises(ValueError, match="out must be"):
        bt.gather_block_tables(_i64([0]), torch.zeros(2, 4, dtype=torch.int32), _i32([1, 1]),
                               torch.zeros(2, 3, dtype=torch.int32))


# ----------------------------------------------------------------------------------------------------------------
# compute_slot_mappings
# ----------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("pad_id", [-1, -7])
def test_compute_slot_mappings_worked_example(pad_id):
    block_table = _i32([[5, 2, 0], [9, 0, 0], [3, 7, 1]])
    # row 0: slot 2, positions 3, 4, 9 -> blocks 3, 7, 1 -> 3*4+3, 7*4+0, 1*4+1.
    # row 1: a dummy row (-1) with positions far past any table: pad_id, and its row is never read.
    # row 2: slot 0, position 5 -> block 2 -> 2*4+1.
    idx = _i64([2, -1, 0])
    qsl = _i32([0, 3, 5, 6])
    positions = _i64([3, 4, 9, 1000, 2000, 5])
    out = torch.full((9,), 77, dtype=torch.int64)
    got = bt.compute_slot_mappings_ref(idx, qsl, positions, block_table, 4, out, pad_id)
    p = pad_id
    assert got.tolist() == [15, 28, 5, p, p, 9]
    assert out.tolist() == [15, 28, 5, p, p, 9, p, p, p]  # the tail past num_tokens padded too
    out_kernel = torch.full((9,), 77, dtype=torch.int64)
    got_kernel = _run_kernel(bt.compute_slot_mappings, idx, qsl, positions, block_table, 4, out_kernel, pad_id)
    assert got_kernel.tolist() == got.tolist() and torch.equal(out_kernel, out)


def test_compute_slot_mappings_empty_batch_pads_everything():
    out = torch.full((4,), 77, dtype=torch.int64)
    got = bt.compute_slot_mappings_ref(_i64([]), _i32([0]), _i64([]), torch.zeros(2, 2, dtype=torch.int32), 16,
                                       out)
    assert got.numel() == 0 and out.tolist() == [-1, -1, -1, -1]


@EXAMPLES
@given(w=worlds(), data=st.data(), block_size=st.sampled_from([1, 2, 4, 16]), extra=st.integers(0, 3),
       pad_id=st.sampled_from([-1, -2]))
def test_compute_slot_mappings_kernel_matches_reference(w, data, block_size, extra, pad_id):
    max_blocks = -(-MAX_MODEL_LEN // block_size)
    block_table = w.rand(1, 50, w.max_num_reqs, max_blocks)
    positions = torch.zeros(w.num_tokens, dtype=torch.int64)
    ib.prepare_pos_seq_lens_ref(w.idx_mapping, w.query_start_loc, w.num_computed, positions,
                                torch.zeros(w.num_reqs, dtype=torch.int32))
    idx = w.idx_mapping.clone()
    if w.num_reqs:
        dummy = _i32(data.draw(st.lists(st.booleans(), min_size=w.num_reqs, max_size=w.num_reqs))).bool()
        idx[dummy] = -1
        # A dummy row's positions may be anything: make them unreadable as block indices.
        token_rows = torch.repeat_interleave(dummy, (w.query_start_loc[1:] - w.query_start_loc[:-1]).long())
        positions[token_rows] += 10_000
    out = w.rand(100, 200, w.num_tokens + extra, dtype=torch.int64)
    got_out, want_out = out.clone(), out.clone()
    got = _run_kernel(bt.compute_slot_mappings, idx, w.query_start_loc, positions, block_table, block_size, got_out,
                      pad_id)
    want = bt.compute_slot_mappings(idx, w.query_start_loc, positions, block_table, block_size, want_out, pad_id,
                                    use_triton=False)
    _assert_all_equal((got, got_out), (want, want_out))
    assert want_out[w.num_tokens:].eq(pad_id).all()


# ----------------------------------------------------------------------------------------------------------------
# Dispatch
# ----------------------------------------------------------------------------------------------------------------
def test_cpu_tensors_run_the_reference_by_default(monkeypatch):
    """The engine on a CPU calls these every step: by default they must not start Triton's (slow) interpreter."""
    for module in (ib, bt):
        for name in dir(module):
            if name.startswith("_") and name.endswith("_kernel"):
                monkeypatch.setattr(module, name, None)  # launching it would fail: None is not subscriptable
    s = _post_update_state()
    ib.post_update(**s)
    assert s["total_len"].tolist() == [3, 1, 4, 0]
    out = torch.zeros(3, dtype=torch.int64)
    assert bt.compute_slot_mappings(_i64([0]), _i32([0, 2]), _i64([0, 1]), _i32([[4]]), 16, out).tolist() == [64, 65]
