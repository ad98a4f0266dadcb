"""Exercises 0.1-2.5: every check cell catches the usual wrong answers and says why, and accepts the solution.

Each test runs a solution notebook up to one check cell with a deliberately wrong answer swapped in
(``tests/exercise_helpers.run_check``) and asserts that the check fails with an ``AssertionError`` whose message
names the mistake, not only where the values differ. A last group checks the course-wide exercise format of these
three notebooks (a ``### Exercise N.M ★`` heading, a folded hint, the exercise, its check) and the names and
signatures chapter 8 loads from a learner's notebook.
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
from minillm.exercises.build import BEGIN
from tests.exercise_helpers import run_check

ROOT = Path(__file__).resolve().parent.parent
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
    or something else."""
    e = run_check(solution, exercise, **wrong)
    assert isinstance(e, AssertionError), f"check {exercise} did not fail with an AssertionError on {wrong}: {e!r}"
    return str(e)


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
    (lambda query_len, ctx_len: ~causal_mask(query_len, ctx_len), "is inverted"),
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
def test_02_checks_accept_the_solutions():
    for exercise in ("2.1", "2.2", "2.3", "2.4", "2.5"):
        assert run_check(NB02, exercise) is None, exercise


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
HEADING = re.compile(r"^### Exercise (\d+\.\d+) (★{1,3}) \S")
HINT = re.compile(r"^<details><summary>Hint</summary>\n.*\S.*\n</details>$", re.S)


@pytest.mark.parametrize("name", EXERCISES, ids=lambda n: n[:2])
def test_every_exercise_has_a_difficulty_heading_and_a_hint(name):
    cells = nbformat.read(ROOT / "solutions" / name, as_version=4).cells
    found = []
    for i, cell in enumerate(cells):
        if cell.cell_type != "code" or BEGIN not in cell.source:
            continue
        number = re.match(r"# Exercise (\d+\.\d+):", cell.source).group(1)
        hint, heading = cells[i - 1], cells[i - 2]
        assert hint.cell_type == "markdown" and HINT.match(hint.source.strip()), (
            f"{name}: exercise {number} must be preceded by a hint cell that is one <details><summary>Hint</summary> "
            f"block, got {hint.source[:80]!r}")
        m = HEADING.match(heading.source) if heading.cell_type == "markdown" else None
        assert m and m.group(1) == number, (
            f"{name}: the hint of exercise {number} must follow a '### Exercise {number} ★ title' cell, got "
            f"{heading.source[:60]!r}")
        assert cells[i + 1].source.startswith(f"# Check Exercise {number}")
        found.append((number, m.group(2)))
    assert [n for n, _ in found] == EXERCISES[name]
    intro = cells[0].source
    assert cells[0].cell_type == "markdown" and re.search(r"Run time: about [\d.]+ (s|min) on a 2-core CPU", intro)
    for number, stars in found:
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
    assert "a byte count is an int" in caught(NB00, "0.1", kv_bytes_per_token=lambda config, dtype_bytes: float(
        config.kv_cache_bytes_per_token(dtype_bytes)))


@pytest.mark.slow
def test_00_2_recomputing_without_a_cache_and_tensor_tokens_are_caught(model_loaded_once):
    """Found by a learner's walkthrough: both gave the right token values, so comparing values alone passed them."""
    import minillm

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
        return [torch.tensor(t) for t in minillm.generate(model, prompt_ids, max_new_tokens, eos_token_id=eos_token_id)]

    assert "with a KV cache the prompt goes in once" in caught(NB00, "0.2", greedy_decode=no_cache)
    assert "return a list of Python ints" in caught(NB00, "0.2", greedy_decode=tensors)
