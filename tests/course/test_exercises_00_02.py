"""Exercises 0.1-2.5: every check cell catches the usual wrong answers and says why, and accepts the solution (for
chapter 02, nbval's run of ``solutions/02_paged_kv_cache.ipynb`` in ``make test`` is that proof).

Each test runs a solution notebook up to one check cell with a deliberately wrong answer swapped in
(``tests/exercise_helpers.run_check``) and asserts that the check fails with an ``AssertionError`` whose message
names the mistake, not only where the values differ. An answer that calls the package's own implementation of the
part fails every check with "asks you to write this yourself" (``minillm/course/exercises/tripwire.py``). Chapter 2's open
challenge (sliding-window freeing) is checked the same way. A last group checks the course-wide exercise format of
these three notebooks (a ``### Exercise N.M ★`` heading, two folded hints, the exercise, its check; the challenge's
heading, hints, cell and check) and the names and signatures chapter 8 loads from a learner's notebook.
"""
from __future__ import annotations

import ast
import math
import re
from pathlib import Path

import nbformat
import pytest
import torch

from minillm.attention.reference import causal_mask, reference_attention
from minillm.core import hash_block_tokens
from minillm.course.exercises.build import BEGIN
from tests.course.exercise_helpers import (CHALLENGE_HEADING, EXERCISE_HEADING, HINT_FORMAT, _plain_python, mutated,
                                           run_challenge, run_check)

ROOT = Path(__file__).resolve().parents[2]
NB00, NB01, NB02 = "00_warmup.ipynb", "01_attention_and_chunks.ipynb", "02_paged_kv_cache.ipynb"


@pytest.fixture(scope="module")
def model_loaded_once(smollm):
    """Notebooks 00 and 01 call ``minillm.load_model()``; every run_check would load the model again (~10 s).
    Hand them the session's model instead (they only read it)."""
    import minillm

    real = minillm.load_model
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(minillm, "load_model", lambda *a, **k: smollm if not a and not k else real(*a, **k))
        yield smollm


def caught(solution: str, exercise: str, **wrong) -> str:
    """The message of the AssertionError the check of ``exercise`` raises on ``wrong``; fails if it raises nothing
    or something else. ``exercise`` "C2" is chapter 2's challenge."""
    e = run_challenge(solution, exercise, **wrong) if exercise.startswith("C") else run_check(solution, exercise,
                                                                                               **wrong)
    assert isinstance(e, AssertionError), f"check {exercise} did not fail with an AssertionError on {wrong}: {e!r}"
    return str(e)


DELEGATED = "asks you to write this yourself"


# -- 00 ----------------------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_00_checks_accept_the_solutions(model_loaded_once):
    assert run_check(NB00, "0.1") is None
    assert run_check(NB00, "0.2") is None


@pytest.mark.slow
@pytest.mark.parametrize("wrong, why", [
    (lambda config, dtype_bytes: config.num_hidden_layers * config.num_key_value_heads * config.head_dim * dtype_bytes,
     "hence the factor 2"),
    (lambda config, dtype_bytes: 2 * config.num_hidden_layers * config.num_attention_heads * config.head_dim
     * dtype_bytes, "counts num_attention_heads"),
    (lambda config, dtype_bytes: 2 * config.num_key_value_heads * config.head_dim * dtype_bytes,
     "leaves out num_hidden_layers"),
], ids=["no_factor_2", "query_heads", "one_layer"])
def test_00_1_kv_bytes_mistakes(model_loaded_once, wrong, why):
    assert why in caught(NB00, "0.1", kv_bytes_per_token=wrong)


def _greedy(model, prompt_ids, max_new_tokens, eos_token_id, *, eos_before_append=False, position_of_out=False,
            with_prompt=False):
    """Greedy decoding with one of the usual mistakes switched on."""
    cache = model.new_kv_cache()
    ids, positions, out = torch.tensor(prompt_ids), torch.arange(len(prompt_ids)), []
    with torch.inference_mode():
        while len(out) < max_new_tokens:
            token = int(model.compute_logits(model(ids, positions, attn=cache)[-1:])[0].argmax())
            if eos_before_append and token == eos_token_id:
                break
            out.append(token)
            if token == eos_token_id:
                break
            ids = torch.tensor([token])
            positions = torch.tensor([len(out) if position_of_out else cache.num_tokens])
    return list(prompt_ids) + out if with_prompt else out


@pytest.mark.slow
@pytest.mark.parametrize("mistake, why", [
    ("eos_before_append", "stops at EOS without returning it"),
    ("position_of_out", "Feed each new token alone, at position cache.num_tokens"),
    ("with_prompt", "returns the prompt too"),
], ids=["eos_not_returned", "position_len_out", "returns_prompt"])
def test_00_2_greedy_mistakes(model_loaded_once, mistake, why):
    model = model_loaded_once[0]

    def wrong(prompt_ids, max_new_tokens, eos_token_id):
        return _greedy(model, prompt_ids, max_new_tokens, eos_token_id, **{mistake: True})

    assert why in caught(NB00, "0.2", greedy_decode=wrong)


# -- 01 ----------------------------------------------------------------------------------------------------------------
def test_01_1_2_3_checks_accept_the_solutions():
    for exercise in ("1.1", "1.2", "1.3"):
        assert run_check(NB01, exercise) is None, exercise


@pytest.mark.parametrize("wrong, why", [
    (lambda query_len, ctx_len: torch.arange(ctx_len + query_len)[None] < ctx_len + torch.arange(query_len)[:, None],
     "uses < where it must be <="),
    (lambda query_len, ctx_len: torch.ones(query_len, ctx_len + query_len, dtype=torch.bool).tril(),
     "does not shift the query positions by ctx_len"),
    (lambda query_len, ctx_len: torch.ones(query_len, query_len, dtype=torch.bool).tril(), "is square"),
    (mutated(NB01, "1.1", "rectangular_causal_mask", ("return key_pos <= query_pos", "return key_pos > query_pos"),
             header="import torch\n"), "is inverted"),
], ids=["strict", "not_shifted", "square", "inverted"])
def test_01_1_mask_mistakes(wrong, why):
    assert why in caught(NB01, "1.1", rectangular_causal_mask=wrong)


def _chunk_attention(q, k, v, ctx_len, *, expand="repeat_interleave", scale=True, mask="rectangular"):
    n, num_heads, head_dim = q.shape
    group = num_heads // k.shape[1]
    k, v = ((x.repeat(1, group, 1) if expand == "repeat" else x.repeat_interleave(group, dim=1)) for x in (k, v))
    scores = torch.einsum("qhd,khd->hqk", q, k) / (math.sqrt(head_dim) if scale else 1.0)
    allowed = causal_mask(n, ctx_len) if mask == "rectangular" else torch.ones(n, n, dtype=torch.bool).tril()
    return torch.einsum("hqk,khd->qhd", torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1), v)


@pytest.mark.parametrize("mistake, why", [
    (dict(expand="repeat"), "`repeat_interleave` gives"),
    (dict(scale=False), "does not scale the scores by 1/sqrt(head_dim)"),
    (dict(mask="square"), "build it with rectangular_causal_mask(n, ctx_len)"),
], ids=["repeat_not_interleave", "no_scale", "square_mask"])
def test_01_2_attention_mistakes(mistake, why):
    assert why in caught(NB01, "1.2", chunk_attention=lambda q, k, v, ctx_len: _chunk_attention(q, k, v, ctx_len,
                                                                                                **mistake))


def _merge_naive(out_a, lse_a, out_b, lse_b):
    lse = torch.log(torch.exp(lse_a) + torch.exp(lse_b))      # overflows at lse ~ 89
    return (torch.exp(lse_a - lse)[..., None] * out_a + torch.exp(lse_b - lse)[..., None] * out_b), lse


def _merge_no_empty_guard(out_a, lse_a, out_b, lse_b):
    lse = torch.logaddexp(lse_a, lse_b)                       # -inf - (-inf) = NaN when both are empty
    return (torch.exp(lse_a - lse)[..., None] * out_a + torch.exp(lse_b - lse)[..., None] * out_b), lse


@pytest.mark.parametrize("wrong, why", [
    (_merge_naive, "exp(1000) overflows fp32"),
    (_merge_no_empty_guard, "both key sets are empty"),
    (lambda out_a, lse_a, out_b, lse_b: ((out_a + out_b) / 2, torch.logaddexp(lse_a, lse_b)), "on ordinary scores"),
], ids=["overflow", "nan_when_both_empty", "plain_average"])
def test_01_3_merge_mistakes(wrong, why):
    assert why in caught(NB01, "1.3", merge_states=wrong)


def _chunked_layer(layer, positions, hidden, chunk_sizes, *, prefix=True, restart_positions=False):
    attn = layer.self_attn
    keys, values, outputs, start = [], [], [], 0
    with torch.inference_mode():
        for n in chunk_sizes:
            x = hidden[start:start + n]
            pos = torch.arange(n) if restart_positions else positions[start:start + n]
            q, k, v = attn.qkv(pos, layer.input_layernorm(x))
            if not prefix:
                keys, values = [], []
            keys.append(k)
            values.append(v)
            o = reference_attention(q, torch.cat(keys), torch.cat(values), ctx_len=sum(len(t) for t in keys) - n)
            h = x + attn.o_proj(o.reshape(n, -1))
            outputs.append(h + layer.mlp(layer.post_attention_layernorm(h)))
            start += n
    return torch.cat(outputs)


@pytest.mark.slow
def test_01_4_check_accepts_the_solution(model_loaded_once):
    assert run_check(NB01, "1.4") is None


@pytest.mark.slow
@pytest.mark.parametrize("mistake, why", [
    (dict(prefix=False), "attends each chunk only over itself"),
    (dict(restart_positions=True), "rotated at its own absolute positions"),
], ids=["no_prefix_kv", "positions_restart"])
def test_01_4_chunked_layer_mistakes(model_loaded_once, mistake, why):
    def wrong(layer, positions, hidden, chunk_sizes):
        return _chunked_layer(layer, positions, hidden, chunk_sizes, **mistake)

    assert why in caught(NB01, "1.4", chunked_layer_forward=wrong)


# -- 02 ----------------------------------------------------------------------------------------------------------------


def _slots(block_ids, start, end, block_size, *, index_by_offset=False, no_multiply=False):
    pos, ids = torch.arange(start, end), torch.tensor(block_ids)
    block = ids[pos % block_size] if index_by_offset else ids[pos // block_size]
    return block + pos % block_size if no_multiply else block * block_size + pos % block_size


@pytest.mark.parametrize("mistake, why", [
    (dict(index_by_offset=True), "uses pos % block_size as the block index"),
    (dict(no_multiply=True), "forgets to multiply the block id by block_size"),
], ids=["pos_mod_as_block_index", "no_multiply"])
def test_02_1_slot_mapping_mistakes(mistake, why):
    assert why in caught(NB02, "2.1", my_slot_mapping=lambda block_ids, start, end, block_size: _slots(
        block_ids, start, end, block_size, **mistake))


def _allocate(pool, req_blocks, num_computed_tokens, num_new_tokens, block_size, *, new_alone=False,
              check_free=True):
    cdiv = lambda a, b: -(-a // b)  # noqa: E731
    needed = (cdiv(num_new_tokens, block_size) if new_alone
              else cdiv(num_computed_tokens + num_new_tokens, block_size) - len(req_blocks))
    if check_free and needed > pool.get_num_free_blocks():
        return None
    new_blocks = pool.get_new_blocks(max(needed, 0))
    req_blocks.extend(new_blocks)
    return new_blocks


def _allocate_what_is_free(pool, req_blocks, num_computed_tokens, num_new_tokens, block_size):
    needed = -(-(num_computed_tokens + num_new_tokens) // block_size) - len(req_blocks)
    new_blocks = pool.get_new_blocks(min(max(needed, 0), pool.get_num_free_blocks()))
    req_blocks.extend(new_blocks)
    return new_blocks


@pytest.mark.parametrize("wrong, why", [
    (lambda *a: _allocate(*a, new_alone=True), "for the new tokens alone"),
    (lambda *a: _allocate(*a, check_free=False), "without checking pool.get_num_free_blocks() first"),
    (_allocate_what_is_free, "taking part of what a request needs"),
    (lambda *a: _allocate(*a) or None, "an empty list means 'nothing new needed'"),
], ids=["new_tokens_alone", "no_free_check", "takes_what_is_free", "none_when_fine"])
def test_02_2_allocate_mistakes(wrong, why):
    assert why in caught(NB02, "2.2", my_allocate_slots=wrong)


def _hashes(token_ids, block_size, *, chain=True, partial=False):
    hashes, parent = [], None
    for i in range(-(-len(token_ids) // block_size) if partial else len(token_ids) // block_size):
        h = hash_block_tokens(parent if chain else None, token_ids[i * block_size:(i + 1) * block_size])
        hashes.append(h)
        parent = h
    return hashes


@pytest.mark.parametrize("mistake, why", [
    (dict(chain=False), "hashes each block on its own (parent None)"),
    (dict(partial=True), "also hashes the trailing partial block"),
], ids=["no_chain", "hashes_partial_block"])
def test_02_3_hash_chain_mistakes(mistake, why):
    assert why in caught(NB02, "2.3", my_block_hashes=lambda token_ids, block_size: _hashes(token_ids, block_size,
                                                                                              **mistake))


def _cached_tokens(block_hashes, num_tokens, block_size, cached_hashes, *, stop_at_miss=True, cap=True, tokens=True):
    n = 0
    for h in block_hashes[:(num_tokens - 1) // block_size] if cap else block_hashes:
        if h in cached_hashes:
            n += 1
        elif stop_at_miss:
            break
    return n * block_size if tokens else n


@pytest.mark.parametrize("mistake, why", [
    (dict(stop_at_miss=False), "instead of stopping at the first miss"),
    (dict(cap=False), "returns the whole request as cached"),
    (dict(tokens=False), "returns blocks (1), not tokens"),
], ids=["counts_past_a_miss", "whole_prompt_hit", "blocks_not_tokens"])
def test_02_4_lookup_mistakes(mistake, why):
    def wrong(block_hashes, num_tokens, block_size, cached_hashes):
        return _cached_tokens(block_hashes, num_tokens, block_size, cached_hashes, **mistake)

    assert why in caught(NB02, "2.4", my_num_cached_tokens=wrong)


def test_02_4_lookup_drops_a_block_too_many():
    def wrong(block_hashes, num_tokens, block_size, cached_hashes):
        n = 0
        for h in block_hashes[:max(num_tokens // block_size - 1, 0)]:
            if h not in cached_hashes:
                break
            n += 1
        return n * block_size

    assert "drops the last full block although a 13th token follows it" in caught(NB02, "2.4",
                                                                                   my_num_cached_tokens=wrong)


def _free(pool, req_blocks, *, tail_first=True, where="by_hash", respect_refs=True):
    front, back = [], []
    for block in (reversed(req_blocks) if tail_first else req_blocks):
        block.decr_ref()
        if block.ref_cnt == 0 or not respect_refs:
            to_back = {"by_hash": block.block_hash is not None, "back": True, "front": False}[where]
            (back if to_back else front).append(block)
    pool.free_block_queue.prepend_n(front)
    pool.free_block_queue.append_n(back)


@pytest.mark.parametrize("mistake, why", [
    (dict(tail_first=False), "frees head first"),
    (dict(where="back"), "not at the front: nothing can ever hit a block without a hash"),
    (dict(where="front"), "puts the hashed blocks 2 and 1 at the front"),
    (dict(respect_refs=False), "only blocks whose ref_cnt reaches 0 are free"),
], ids=["head_first", "all_to_back", "all_to_front", "ignores_ref_cnt"])
def test_02_5_free_mistakes(mistake, why):
    assert why in caught(NB02, "2.5", my_free=lambda pool, req_blocks: _free(pool, req_blocks, **mistake))


def test_02_5_free_without_decrementing():
    def wrong(pool, req_blocks):
        pool.free_block_queue.append_n([b for b in reversed(req_blocks) if b.ref_cnt == 1])

    assert "drop exactly one reference per block with block.decr_ref()" in caught(NB02, "2.5", my_free=wrong)


# -- the format and the names chapter 8 loads --------------------------------------------------------------------------
EXERCISES = {NB00: ["0.1", "0.2"], NB01: ["1.1", "1.2", "1.3", "1.4"], NB02: ["2.1", "2.2", "2.3", "2.4", "2.5"]}
HEADING, HINT, CHALLENGE = EXERCISE_HEADING, HINT_FORMAT, CHALLENGE_HEADING


def test_the_hint_format_is_exactly_two_steps():
    two = ("<details><summary>Hint 1: the idea</summary>\n\nThe idea.\n\n**提示 1：** 思路。\n\n</details>\n"
           "<details><summary>Hint 2: closer to the code</summary>\n\nCloser.\n\n**提示 2：** 更近。\n\n</details>")
    assert HINT.match(two)
    one = "<details><summary>Hint</summary>\n\nAll of it.\n\n**提示：** 全部。\n\n</details>"
    assert not HINT.match(one)
    assert not HINT.match(two.replace("**提示 2：** 更近。", ""))              # a step without its Chinese
    assert not HINT.match(two.replace("\n\nCloser.", ""))                      # a step without its English
    assert not HINT.match(two.split("\n<details>")[0])                          # the first step alone


@pytest.mark.parametrize("name", EXERCISES, ids=lambda n: n[:2])
def test_every_exercise_has_a_difficulty_heading_and_a_hint(name):
    cells = nbformat.read(ROOT / "solutions" / name, as_version=4).cells
    found, challenges = [], []
    for i, cell in enumerate(cells):
        if cell.cell_type != "code" or BEGIN not in cell.source:
            continue
        hint, heading = cells[i - 1], cells[i - 2]
        assert hint.cell_type == "markdown" and HINT.match(hint.source.strip()), (
            f"{name}: the cell {cell.source.splitlines()[0]!r} must be preceded by a hint cell of two <details> "
            f"blocks ('Hint 1: the idea', 'Hint 2: closer to the code'), got {hint.source[:80]!r}")
        challenge = re.match(r"# Challenge (\d+): \S", cell.source)
        if challenge:
            number = challenge.group(1)
            m = CHALLENGE.match(heading.source) if heading.cell_type == "markdown" else None
            assert m and m.group(1) == number and f"**挑战 {number} {m.group(2)}" in heading.source, (
                f"{name}: challenge {number} must follow a '### Challenge {number} ★★★ title (optional, extra "
                f"credit)' cell with its Chinese statement, got {heading.source[:60]!r}")
            assert "vllm/" in heading.source, f"{name}: challenge {number} must cite vLLM's file:function"
            check = cells[i + 1].source
            assert check.startswith(f"# Check Challenge {number}")
            assert f"from minillm.course.exercises.challenges.ch{int(number):02d} import" in check
            assert f'guard("C{number}"' in check
            challenges.append((i, number))
            continue
        number = re.match(r"# Exercise (\d+\.\d+):", cell.source).group(1)
        m = HEADING.match(heading.source) if heading.cell_type == "markdown" else None
        assert m and m.group(1) == number, (
            f"{name}: the hint of exercise {number} must follow a '### Exercise {number} ★ title' cell, got "
            f"{heading.source[:60]!r}")
        assert cells[i + 1].source.startswith(f"# Check Exercise {number}")
        found.append((i, number, m.group(2)))
    assert [n for _, n, _ in found] == EXERCISES[name]
    chapter = str(int(name[:2]))
    assert [n for _, n in challenges] == ([chapter] if int(chapter) >= 2 else []), (
        f"{name}: from chapter 02 on a chapter has exactly one open challenge")
    assert all(i > found[-1][0] for i, _ in challenges), f"{name}: the challenge comes after the last exercise"
    intro = cells[0].source
    assert cells[0].cell_type == "markdown" and re.search(r"Run time: about [\d.]+ (s|min) on a 2-core CPU", intro)
    for _, number, stars in found:
        assert f"**{number} {stars}**" in intro, f"{name}: the first cell must list exercise {number} as {stars}"


SIGNATURES = {  # what chapter 8 loads from a learner's notebook, by name
    "rectangular_causal_mask": ["query_len", "ctx_len"],
    "chunk_attention": ["q", "k", "v", "ctx_len"],
    "merge_states": ["out_a", "lse_a", "out_b", "lse_b"],
    "chunked_layer_forward": ["layer", "positions", "hidden", "chunk_sizes"],
    "my_slot_mapping": ["block_ids", "start", "end", "block_size"],
    "my_allocate_slots": ["pool", "req_blocks", "num_computed_tokens", "num_new_tokens", "block_size"],
    "my_block_hashes": ["token_ids", "block_size"],
    "my_num_cached_tokens": ["block_hashes", "num_tokens", "block_size", "cached_hashes"],
    "my_free": ["pool", "req_blocks"],
}


def test_exercise_cells_only_define_the_names_chapter_8_loads():
    """Chapter 8 executes the exercise cells alone, with the notebook's import lines: no top-level work there."""
    defined = {}
    for name in EXERCISES:
        for cell in nbformat.read(ROOT / "solutions" / name, as_version=4).cells:
            if cell.cell_type == "code" and BEGIN in cell.source:
                for node in ast.parse(cell.source).body:
                    assert isinstance(node, (ast.FunctionDef, ast.ClassDef)), (
                        f"{name}: an exercise cell may only define functions and classes, found {ast.dump(node)[:80]}")
                    if isinstance(node, ast.FunctionDef):
                        defined[node.name] = [a.arg for a in node.args.args]
    for fn, args in SIGNATURES.items():
        assert defined.get(fn) == args, f"{fn} must keep the signature ({', '.join(args)}), got {defined.get(fn)}"


@pytest.mark.slow
def test_00_1_a_float_is_not_a_byte_count(model_loaded_once):
    assert "a byte count is an int" in caught(NB00, "0.1", kv_bytes_per_token=mutated(
        NB00, "0.1", "kv_bytes_per_token", ("* dtype_bytes\n", "* dtype_bytes / 1\n"), header="LlamaConfig = object\n"))


@pytest.mark.slow
def test_00_2_recomputing_without_a_cache_and_tensor_tokens_are_caught(model_loaded_once):
    """Found by a learner's walkthrough: both gave the right token values, so comparing values alone passed them."""
    model = model_loaded_once[0]

    def no_cache(prompt_ids, max_new_tokens, eos_token_id):
        ids, out = list(prompt_ids), []
        with torch.inference_mode():
            while len(out) < max_new_tokens:
                token = int(model.compute_logits(model(torch.tensor(ids))[-1:])[0].argmax())
                out.append(token)
                ids.append(token)
                if token == eos_token_id:
                    break
        return out

    def tensors(prompt_ids, max_new_tokens, eos_token_id):
        return [torch.tensor(t) for t in _greedy(model, prompt_ids, max_new_tokens, eos_token_id)]

    assert "with a KV cache the prompt goes in once" in caught(NB00, "0.2", greedy_decode=no_cache)
    assert "return a list of Python ints" in caught(NB00, "0.2", greedy_decode=tensors)


# -- an answer that calls the package's own part fails every check (issue 24) ------------------------------------------
_DELEGATING = {  # exercise -> (the names to swap in, a learner's cell that hands the work to minillm's own part)
    "0.1": ("kv_bytes_per_token", """
def kv_bytes_per_token(config, dtype_bytes):
    return config.kv_cache_bytes_per_token(dtype_bytes)
"""),
    "0.2": ("greedy_decode", """
import minillm
from minillm import generate


def greedy_decode(prompt_ids, max_new_tokens, eos_token_id):
    return generate(minillm.load_model()[0], prompt_ids, max_new_tokens, eos_token_id=eos_token_id)
"""),
    "1.1": ("rectangular_causal_mask", """
from minillm.attention.reference import causal_mask


def rectangular_causal_mask(query_len, ctx_len):
    return causal_mask(query_len, ctx_len)
"""),
    "1.2": ("chunk_attention", """
from minillm.attention.reference import reference_attention


def chunk_attention(q, k, v, ctx_len):
    return reference_attention(q, k, v, ctx_len)
"""),
    "1.3": ("merge_states", "from minillm.attention.reference import merge_attn_states as merge_states"),
    "1.4": ("chunked_layer_forward", """
import torch
from minillm.attention.contiguous import ContiguousKVCache


def chunked_layer_forward(layer, positions, hidden, chunk_sizes):
    a = layer.self_attn
    cache = ContiguousKVCache(a.layer_idx + 1, a.num_kv_heads, a.head_dim, capacity=hidden.shape[0])
    out, start = [], 0
    with torch.inference_mode():
        for n in chunk_sizes:
            out.append(layer(positions[start:start + n], hidden[start:start + n], cache))
            start += n
    return torch.cat(out)
"""),
    "2.1": ("my_slot_mapping", """
from minillm.attention.paged import compute_slot_mapping


def my_slot_mapping(block_ids, start, end, block_size):
    return compute_slot_mapping(block_ids, start, end, block_size)
"""),
    "2.2": ("my_allocate_slots", "from minillm.core.kv_cache_manager import allocate_new_blocks as my_allocate_slots"),
    "2.3": ("my_block_hashes", """
from minillm.core import hash_request_tokens


def my_block_hashes(token_ids, block_size):
    return hash_request_tokens(token_ids, block_size)
"""),
    "2.4": ("my_num_cached_tokens", """
from minillm.core.kv_cache_manager import num_cached_prefix_tokens


def my_num_cached_tokens(block_hashes, num_tokens, block_size, cached_hashes):
    return num_cached_prefix_tokens(block_hashes, num_tokens, block_size, cached_hashes)
"""),
    "2.5": ("my_free", """
def my_free(pool, req_blocks):
    pool.free_blocks(reversed(req_blocks))
"""),
    "C2": ("free_out_of_window", """
from minillm.course.exercises.challenges.ch02 import free_out_of_window as _theirs


def free_out_of_window(pool, req_blocks, num_computed_tokens, sliding_window, block_size):
    _theirs(pool, req_blocks, num_computed_tokens, sliding_window, block_size)
"""),
}


def _delegating(number: str) -> dict:
    """The learner's names for exercise ``number``, from a cell run in a namespace of its own (as a notebook's)."""
    name, source = _DELEGATING[number]
    ns: dict = {}
    exec(compile(source, f"<delegating {number}>", "exec"), ns)  # noqa: S102
    return {name: ns[name]}


@pytest.mark.parametrize("number", ["1.1", "1.2", "1.3", "2.1", "2.2", "2.3", "2.4", "2.5", "C2"])
def test_a_delegating_answer_fails_the_check(number):
    nb = NB01 if number.startswith("1") else NB02
    message = caught(nb, number, **_delegating(number))
    assert DELEGATED in message, message


@pytest.mark.slow
@pytest.mark.parametrize("number", ["0.1", "0.2", "1.4"])
def test_a_delegating_answer_fails_the_check_with_the_model(model_loaded_once, number):
    message = caught(NB00 if number.startswith("0") else NB01, number, **_delegating(number))
    assert DELEGATED in message, message


def test_the_exercise_notebooks_do_not_import_what_they_ask_for():
    for name, forbidden in [(NB01, ("causal_mask", "reference_attention", "merge_attn_states")),
                            (NB02, ("compute_slot_mapping", "hash_request_tokens", "num_cached_prefix_tokens"))]:
        setup = next(c.source for c in nbformat.read(ROOT / "exercises" / name, as_version=4).cells
                     if c.cell_type == "code")
        for fn in forbidden:
            assert fn not in setup, f"exercises/{name}: the set-up cell imports {fn}, which an exercise asks for"


# -- diagnoses named (issue 24) ----------------------------------------------------------------------------------------
def _attention_with(q, k, v, ctx_len, *, softmax_dim=-1, scale_by_d=False):
    n, num_heads, head_dim = q.shape
    group = num_heads // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / (head_dim if scale_by_d else math.sqrt(head_dim))
    scores = scores.masked_fill(~causal_mask(n, ctx_len), float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=softmax_dim), v)


@pytest.mark.parametrize("mistake, why", [
    (dict(softmax_dim=1), "takes the softmax over the queries"),
    (dict(softmax_dim=0), "takes the softmax over the heads"),
    (dict(scale_by_d=True), "scales the scores by 1/head_dim"),
], ids=["softmax_over_queries", "softmax_over_heads", "scale_1_over_d"])
def test_01_2_softmax_dimension_and_scale_are_named(mistake, why):
    assert why in caught(NB01, "1.2", chunk_attention=lambda q, k, v, ctx_len: _attention_with(q, k, v, ctx_len,
                                                                                                **mistake))


def _layer_with_a_bug(layer, positions, hidden, chunk_sizes, *, bug):
    attn = layer.self_attn
    keys, values, outputs, start = [], [], [], 0
    with torch.inference_mode():
        for n in chunk_sizes:
            x = hidden[start:start + n]
            q, k, v = attn.qkv(positions[start:start + n], x if bug == "no_input_norm" else layer.input_layernorm(x))
            keys.append(k)
            values.append(v)
            o = attn.o_proj(reference_attention(q, torch.cat(keys), torch.cat(values), ctx_len=start).reshape(n, -1))
            h = o if bug == "no_residual" else x + o
            outputs.append(h + layer.mlp(layer.post_attention_layernorm(x if bug == "mlp_on_x" else h)))
            start += n
    return torch.cat(outputs)


@pytest.mark.slow
@pytest.mark.parametrize("bug, why", [
    ("no_residual", "leaves out the residual around the attention"),
    ("mlp_on_x", "applies the MLP to the layer's input x"),
    ("no_input_norm", "skips the input norm"),
])
def test_01_4_a_bug_inside_the_layer_is_not_blamed_on_the_positions(model_loaded_once, bug, why):
    """Found by the issue: these fail from row 0, where no chunking can matter, and were told to check the rotary
    positions of the chunk."""
    message = caught(NB01, "1.4", chunked_layer_forward=lambda layer, positions, hidden, chunk_sizes:
                     _layer_with_a_bug(layer, positions, hidden, chunk_sizes, bug=bug))
    assert "the mistake is inside the layer" in message and why in message, message
    assert "rotated" not in message, message


@pytest.mark.slow
def test_01_4_running_the_whole_layer_at_once_is_caught(model_loaded_once):
    """The full prefill with an attention object of the learner's own: right numbers, but no chunking at all."""

    class AllAtOnce:
        def forward(self, layer_idx, q, k, v):
            return reference_attention(q, k, v, ctx_len=0)

    def whole_layer(layer, positions, hidden, chunk_sizes):
        with torch.inference_mode():
            return layer(positions, hidden, AllAtOnce())

    message = caught(NB01, "1.4", chunked_layer_forward=whole_layer)
    assert "runs the layer over all" in message and "at once" in message, message


def test_02_1_a_list_is_named_as_a_list():
    """Found by the issue: a list of the right slots printed two equal lists and 'it differs'."""
    message = caught(NB02, "2.1", my_slot_mapping=lambda block_ids, start, end, block_size: [
        block_ids[p // block_size] * block_size + p % block_size for p in range(start, end)])
    assert "returned a list, not a torch.Tensor" in message and "are right" in message, message


def test_02_4_capping_tokens_instead_of_blocks_is_named():
    """Found by the issue: min(hits * block_size, num_tokens - 1) got only 'it differs'."""
    def wrong(block_hashes, num_tokens, block_size, cached_hashes):
        n = 0
        for h in block_hashes:
            if h not in cached_hashes:
                break
            n += 1
        return min(n * block_size, num_tokens - 1)

    message = caught(NB02, "2.4", my_num_cached_tokens=wrong)
    assert "caps the tokens at num_tokens - 1 = 11 instead of capping the blocks" in message, message


# -- challenge 2: sliding-window freeing ------------------------------------------------------------------------------
def test_challenge_2_check_accepts_the_solution():
    assert run_challenge(NB02, "C2") is None


def _window_free(pool, req_blocks, num_computed_tokens, sliding_window, block_size, *, too_wide=False,
                 remove=False, head_first=False, stop_at_null=True):
    start = max(0, num_computed_tokens - sliding_window + (0 if too_wide else 1))
    num_out = min(start // block_size, len(req_blocks))
    order = range(num_out) if head_first else range(num_out - 1, -1, -1)
    freed = []
    for i in order:
        if req_blocks[i].is_null and stop_at_null:
            if head_first:
                continue
            break
        freed.append(req_blocks[i])
        req_blocks[i] = pool.null_block
    if remove:
        del req_blocks[:num_out]
    pool.free_blocks(freed)


@pytest.mark.parametrize("mistake, why", [
    (dict(too_wide=True), "is the window one token too wide?"),
    (dict(remove=True), "must not remove it from the table: put pool.null_block"),
    (dict(head_first=True), "frees head first"),
    (dict(stop_at_null=False), "a second call met the blocks an earlier call replaced by the null block"),
], ids=["window_off_by_one", "removes_blocks", "head_first", "frees_the_null_block"])
def test_challenge_2_mistakes(mistake, why):
    message = caught(NB02, "C2", free_out_of_window=lambda pool, req_blocks, nct, window, bs: _window_free(
        pool, req_blocks, nct, window, bs, **mistake))
    assert why in message, message


def test_challenge_2_shared_blocks_stay_out_of_the_free_queue():
    def ignores_refs(pool, req_blocks, num_computed_tokens, sliding_window, block_size):
        num_out = min(max(0, num_computed_tokens - sliding_window + 1) // block_size, len(req_blocks))
        freed = []
        for i in range(num_out - 1, -1, -1):
            if req_blocks[i].is_null:
                break
            freed.append(req_blocks[i])
            req_blocks[i] = pool.null_block
        for b in freed:
            b.ref_cnt = 0
        pool.free_block_queue.prepend_n([b for b in freed if b.block_hash is None])
        pool.free_block_queue.append_n([b for b in freed if b.block_hash is not None])

    assert "puts blocks that B still holds into the free queue" in caught(NB02, "C2", free_out_of_window=ignores_refs)


# -- no answer on the page before its exercise (issue 24) --------------------------------------------------------------
ANSWER_OBJECTS = {  # exercise -> the package's implementation of its part (BUILDS' first target)
    "1.1": "minillm.attention.reference:causal_mask", "1.2": "minillm.attention.reference:reference_attention",
    "1.3": "minillm.attention.reference:merge_attn_states", "2.1": "minillm.attention.paged:compute_slot_mapping",
    "2.2": "minillm.core.kv_cache_manager:allocate_new_blocks", "2.3": "minillm.core.kv_cache_utils:hash_request_tokens",
    "2.4": "minillm.core.kv_cache_manager:num_cached_prefix_tokens",
    "2.5": "minillm.core.block_pool:BlockPool.free_blocks",
}
# The same arithmetic written elsewhere in the package: allocate_slots counts the blocks for prefix-cache hits as
# exercise 2.2 does.
ANSWER_PATTERNS = {"2.2": r"cdiv\([^)]*\) - len\(", "2.5": r"prepend_n\(evict_first\)"}


def _answer_lines(number: str) -> list[str]:
    import importlib
    import inspect

    module, qualname = ANSWER_OBJECTS[number].split(":")
    obj = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    body = inspect.getsource(obj).split('"""')[-1]   # the code after the docstring
    return [line.strip() for line in body.splitlines() if len(line.strip()) > 24 and not line.strip().startswith("#")]


@pytest.mark.parametrize("name", ["01_attention_and_chunks.ipynb", "02_paged_kv_cache.ipynb"])
def test_the_lessons_show_no_answer_whole(name):
    """A listing the lesson shows (a cell ending in show_source(X)) holds none of an exercise's answer lines."""
    import inspect

    cells = nbformat.read(ROOT / "notebooks" / name, as_version=4).cells
    ns: dict = {}
    setup = _plain_python(next(c.source for c in cells if c.cell_type == "code" and "import minillm" in c.source))
    imports = [ast.get_source_segment(setup, node) for node in ast.parse(setup).body
               if isinstance(node, (ast.Import, ast.ImportFrom))]
    exec("\n".join(imports), ns)  # noqa: S102
    shown = [m.group(1) for c in cells if c.cell_type == "code"
             for m in [re.fullmatch(r"show_source\(([\w.]+)\)", c.source.strip().splitlines()[-1] if c.source.strip()
                                    else "")] if m]
    assert shown, f"{name}: no listing found; the test reads cells that end in show_source(X)"
    for target in shown:
        source = inspect.getsource(eval(target, ns))  # noqa: S307 - a name from the lesson's own imports
        for number in ANSWER_OBJECTS:
            found = [line for line in _answer_lines(number) if line in source]
            assert not found, f"{name}: show_source({target}) prints exercise {number}'s answer: {found[:2]}"
            pattern = ANSWER_PATTERNS.get(number)
            assert not (pattern and re.search(pattern, source)), (
                f"{name}: show_source({target}) prints exercise {number}'s arithmetic ({pattern}): elide it")


def test_lesson_02_folds_the_block_count_of_allocate_slots_and_keeps_it_current():
    """The hit branch of KVCacheManager.allocate_slots counts blocks as exercise 2.2 does: the lesson leaves those
    lines out of the listing and folds them after the walk-through, as they are in the package."""
    import inspect
    import textwrap

    from minillm.core import KVCacheManager

    cells = {c.get("id"): c for c in nbformat.read(ROOT / "notebooks" / "02_paged_kv_cache.ipynb", as_version=4).cells}
    assert cells["dc5570a2"].source.startswith("elide_source(KVCacheManager.allocate_slots,")
    walk = cells["ab2d6b7b"].source
    folded = walk.split("<details><summary>Solution of exercise 2.2")[1].split("```python\n")[1].split("```")[0]
    lines = inspect.getsource(KVCacheManager.allocate_slots).splitlines()
    first = next(i for i, line in enumerate(lines) if "num_new_blocks = max(0, cdiv(" in line)
    assert textwrap.dedent("\n".join(lines[first:first + 5])) + "\n" == folded
    assert walk.index("Solve exercise 2.2 first") < walk.index("<details>")
