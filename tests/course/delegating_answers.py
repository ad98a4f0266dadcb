"""For every exercise, an answer that delegates to the package's own implementation of the part it asks for.

Each is the body a learner could hand in without building anything: it calls what the package already has (a
function under the name the notebook imported, a module attribute, ``super()``, or the package's object itself).
The check cells, the capstone and nbgrader must all fail these (``minillm/course/exercises/tripwire.py``): the tests that
use them are ``tests/course/test_exercise_delegation.py``, ``tests/course/test_capstone.py`` and ``tests/course/test_nbgrader.py``.

``answer_cell(number)`` gives the whole cell: the solution cell's comment lines (its ``# Exercise N.M:`` title and
the contract lines) followed by the delegating body, so the capstone's loader and nbgrader find it as they find a
learner's answer.

``CHALLENGE_DELEGATING`` holds the same for the open challenges kept here (``"C10"``: ``answer_cell("C10")`` gives its
``# Challenge 10:`` cell), used by their chapters' test files; the earlier challenges' delegating answers are written
in their chapters' test files.
"""
from __future__ import annotations

from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parents[2]

NOTEBOOK = {"0": "00_warmup.ipynb", "1": "01_attention_and_chunks.ipynb", "2": "02_paged_kv_cache.ipynb",
            "3": "03_triton_prefill_kernel.ipynb", "4": "04_scheduler.ipynb", "5": "05_sampler.ipynb",
            "6": "06_engine.ipynb", "7": "07_context_parallel.ipynb", "8": "08_capstone.ipynb",
            "9": "09_disaggregation_and_tp.ipynb", "10": "10_engine_core.ipynb"}

DELEGATING: dict[str, str] = {
    "0.1": '''
def kv_bytes_per_token(config, dtype_bytes):
    return config.kv_cache_bytes_per_token(dtype_bytes)
''',
    "0.2": '''
from minillm.generate import generate_tokens


@torch.inference_mode()
def greedy_decode(prompt_ids, max_new_tokens, eos_token_id):
    return [int(t) for t in generate_tokens(model, prompt_ids, max_new_tokens, eos_token_id=eos_token_id)]
''',
    "1.1": '''
from minillm.attention.reference import causal_mask


def rectangular_causal_mask(query_len, ctx_len):
    return causal_mask(query_len, ctx_len)
''',
    "1.2": '''
from minillm.attention import reference as _ref


def chunk_attention(q, k, v, ctx_len):
    return _ref.reference_attention(q, k, v, ctx_len)
''',
    "1.3": '''
from minillm.attention.reference import merge_attn_states as merge_states
''',
    "1.4": '''
from minillm.attention.contiguous import ContiguousKVCache


@torch.inference_mode()
def chunked_layer_forward(layer, positions, hidden, chunk_sizes):
    attn = layer.self_attn
    cache = ContiguousKVCache(attn.layer_idx + 1, attn.num_kv_heads, attn.head_dim, capacity=hidden.shape[0])
    out, start = [], 0
    for n in chunk_sizes:
        out.append(layer(positions[start:start + n], hidden[start:start + n], cache))
        start += n
    return torch.cat(out)
''',
    "2.1": '''
from minillm.attention.paged import compute_slot_mapping


def my_slot_mapping(block_ids, start, end, block_size):
    return compute_slot_mapping(block_ids, start, end, block_size)
''',
    "2.2": '''
from minillm.core.kv_cache_manager import allocate_new_blocks as my_allocate_slots
''',
    "2.3": '''
import minillm.core.kv_cache_utils as _utils


def my_block_hashes(token_ids, block_size):
    return _utils.hash_request_tokens(token_ids, block_size)
''',
    "2.4": '''
from minillm.core.kv_cache_manager import num_cached_prefix_tokens


def my_num_cached_tokens(block_hashes, num_tokens, block_size, cached_hashes):
    return num_cached_prefix_tokens(block_hashes, num_tokens, block_size, cached_hashes)
''',
    "2.5": '''
def my_free(pool, req_blocks):
    pool.free_blocks(reversed(req_blocks))
''',
    "3.1": '''
from kernels.attention_stages import online_softmax_step as my_online_softmax_step
''',
    "3.2": '''
from kernels.attention_stages import _contiguous_kernel as my_contiguous_kernel


def my_attention_contiguous(q, k, v, block_m=16, tile_size=16):
    out = torch.empty_like(q)
    grid = (triton.cdiv(q.shape[0], block_m), q.shape[1])
    my_contiguous_kernel[grid](out, q, k, v, 1.0 / math.sqrt(q.shape[2]), q.shape[0], k.shape[0],
                               q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                               out.stride(0), out.stride(1), HEAD_DIM=q.shape[2], BLOCK_M=block_m,
                               TILE_SIZE=tile_size)
    return out
''',
    "3.3": '''
from kernels.attention_stages import kv_row_offsets as my_kv_row_offsets
''',
    "4.1": '''
class RunningLoopScheduler(Scheduler):
    def _schedule_running(self, step):
        return super()._schedule_running(step)
''',
    "4.2": '''
class AdmissionScheduler(Scheduler):
    def _schedule_waiting(self, step):
        return super()._schedule_waiting(step)
''',
    "4.3": '''
class FCFSPreemptionScheduler(Scheduler):
    def _preempt_request(self, request):
        return Scheduler._preempt_request(self, request)

    def _allocate_or_preempt(self, request, num_new_tokens, step):
        return super()._allocate_or_preempt(request, num_new_tokens, step)
''',
    "5.1": '''
from minillm.sample.ops.topk_topp import apply_top_k_top_p


def top_k_top_p_mask(logits, k, p):
    return apply_top_k_top_p(logits.clone(), k, p)
''',
    "5.2": '''
from minillm.sample.rejection_sampler import assemble_spec_output


def assemble_output(draft_token_ids, accepted, recovered, bonus):
    width = max((len(d) for d in draft_token_ids), default=0)
    pad = lambda rows, fill: torch.tensor([list(r) + [fill] * (width - len(r)) for r in rows], dtype=torch.int64)
    drafts = pad(draft_token_ids, 0).reshape(len(draft_token_ids), width)
    acc = pad([[bool(a) for a in r] for r in accepted], 0).bool().reshape(len(draft_token_ids), width)
    rec = pad(recovered, 0).reshape(len(draft_token_ids), width)
    return assemble_spec_output(drafts, acc, rec, torch.tensor(bonus), [len(d) for d in draft_token_ids])
''',
    "5.3": '''
from minillm.core.sched.utils import check_stop as my_check_stop
''',
    "5.4": '''
from minillm.engine.detokenizer import check_stop_strings


def find_stop_string(output_text, new_char_count, stop, include_in_output):
    return check_stop_strings(output_text, new_char_count, stop, include_in_output)
''',
    "6.1": '''
from minillm.worker.model_runner import prepare_inputs


def my_prepare_inputs(scheduler_output, requests, block_size, device="cpu"):
    return prepare_inputs(scheduler_output, requests, block_size, device)
''',
    "6.2": '''
def my_step(engine):
    return engine.step()
''',
    "7.1": '''
from minillm.distributed.splits import make_split


def zigzag_positions(num_tokens, world_size):
    split = make_split(num_tokens, world_size, "zigzag")
    return [split.positions(r) for r in range(world_size)]


def restore_order(num_tokens, world_size):
    return torch.argsort(torch.cat(zigzag_positions(num_tokens, world_size)))
''',
    "7.2": '''
from minillm.attention.reference import merge_attn_states


def ring_attention_step(q, q_pos, k, v, k_pos, out, lse):
    group = q.shape[1] // k.shape[1]
    kf, vf = k.float().repeat_interleave(group, dim=1), v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->qhk", q.float(), kf) / math.sqrt(q.shape[2])
    scores = scores.masked_fill(~(k_pos[None, :] <= q_pos[:, None])[:, None, :], float("-inf"))
    lse_b = torch.logsumexp(scores, dim=-1)
    safe = torch.where(torch.isinf(lse_b), torch.zeros_like(lse_b), lse_b)
    out_b = torch.einsum("qhk,khd->qhd", torch.exp(scores - safe[..., None]), vf)
    return merge_attn_states(out, lse, out_b, lse_b)
''',
    "8.1": '''
from minillm.course.exercises.capstone import run_requests


def run_engine(engine, prompts, params):
    return run_requests(engine, prompts, params)
''',
    "9.1": '''
from minillm.model.parallel_layers import MergedColumnParallelLinear, RowParallelLinear


def my_tp_mlp_shards(mlp, tp_rank, tp_size):
    gate_up = MergedColumnParallelLinear([mlp.gate_proj, mlp.up_proj], tp_rank, tp_size)
    gate_w, up_w = gate_up.weight.chunk(2, dim=0)
    down = RowParallelLinear(mlp.down_proj, tp_rank, tp_size, None)
    return gate_w, up_w, down.weight


def my_tp_mlp_forward(x, shards):
    partials = []
    for gate_w, up_w, down_w in shards:
        partials.append((F.silu(x @ gate_w.T) * (x @ up_w.T)) @ down_w.T)
    return simulate_all_reduce(partials)
''',
    "9.2": '''
class MyConnector(SharedStorageConnector):
    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        return super().get_num_new_matched_tokens(request, num_computed_tokens)
''',
    "10.1": '''
from minillm.worker.model_runner import ModelRunner


class _Holder:
    _add = ModelRunner._add


def update_states(req_states, block_tables, requests_info, scheduler_output):
    runner = _Holder()
    runner.req_states, runner.block_tables, runner.requests_info = req_states, block_tables, requests_info
    runner.device = req_states.device
    ModelRunner.finish_requests(runner, scheduler_output)
    ModelRunner.add_requests(runner, scheduler_output)
    ModelRunner.update_requests(runner, scheduler_output)
    return [req_states.req_id_to_index[r] for r in scheduler_output.num_scheduled_tokens]
''',
    "10.2": '''
from minillm.core.sched.async_scheduler import AsyncScheduler


class PlaceholderScheduler(AsyncScheduler):
    def _update_after_schedule(self, scheduler_output):
        super()._update_after_schedule(scheduler_output)

    def _update_request_with_output(self, request, new_token_ids):
        return super()._update_request_with_output(request, new_token_ids)
''',
    "10.3": '''
from minillm.engine.arg_utils import EngineArgs
from minillm.model.parallel_layers import num_kv_heads_per_rank


def kv_heads_of_rank(num_kv_heads, tp_size, rank):
    per_rank = num_kv_heads_per_rank(num_kv_heads, tp_size)
    first = rank // max(1, tp_size // num_kv_heads) * per_rank
    return list(range(first, first + per_rank))


def num_blocks_per_rank(config, block_size, dtype_bytes, tp_size, budget_bytes):
    dtype = {4: torch.float32, 2: torch.bfloat16}[dtype_bytes]
    args = EngineArgs(kv_cache_memory_bytes=budget_bytes, block_size=block_size, tensor_parallel_size=tp_size,
                      dtype=dtype, device="cpu")
    return args.resolved_num_gpu_blocks(config, config.max_position_embeddings, dtype)
''',
    "10.4": '''
from kernels.input_batch import _prepare_pos_seq_lens_kernel

my_pos_seq_lens_kernel = _prepare_pos_seq_lens_kernel
''',
}


# Open challenge -> an answer that hands the work to the challenge's reference (minillm/course/exercises/challenges/).
CHALLENGE_DELEGATING: dict[str, str] = {
    "C10": '''
from minillm.course.exercises.challenges.ch10 import request_regions, swap_plan


def reorder_batch_to_split_decodes_and_prefills(input_batch, scheduler_output, decode_threshold=1):
    swaps = swap_plan(request_regions(input_batch, scheduler_output, decode_threshold))
    for i, j in swaps:
        input_batch.swap_states(i, j)
    return bool(swaps)
''',
}


def solution_cell(number: str) -> str:
    """The source of exercise ``number``'s cell in its solution notebook ("2.1"; "C10" for chapter 10's challenge)."""
    chapter = number[1:] if number.startswith("C") else number.split(".")[0]
    title = f"# Challenge {chapter}:" if number.startswith("C") else f"# Exercise {number}:"
    nb = nbformat.read(ROOT / "solutions" / NOTEBOOK[chapter], as_version=4)
    return next(c.source for c in nb.cells if c.cell_type == "code" and c.source.startswith(title))


def answer_cell(number: str) -> str:
    """A whole answer cell for exercise ``number`` (or challenge ``"C10"``) that delegates: the solution cell's
    leading comment lines, then the delegating body."""
    lines = solution_cell(number).splitlines()
    head = []
    for line in lines:
        if not line.startswith("#"):
            break
        head.append(line)
    body = CHALLENGE_DELEGATING[number] if number.startswith("C") else DELEGATING[number]
    return "\n".join(head) + "\n" + body.strip("\n") + "\n"


def cheat_cell(number: str, body: str) -> str:
    """A whole answer cell for exercise ``number`` holding ``body`` (one of :data:`CHEATS`), after the solution
    cell's leading comment lines (its title: how the grader finds the answer)."""
    head = []
    for line in solution_cell(number).splitlines():
        if not line.startswith("#"):
            break
        head.append(line)
    return "\n".join(head) + "\n" + body.strip("\n") + "\n"


# --- cheats: what a clever student tried, per chapter graded in `make test` ------------------------------------------
# Each entry is (what it tries, the answer cells by exercise). A cheat in one answer cell can aim at every check of
# the notebook (the input transformer, a patched checker), so each student's notebook must score 0 in every cell.
# tests/course/test_nbgrader.py autogrades them with nbgrader (chapters 06 and 10 in `make test`); tests/course/test_grading.py runs
# the same tricks against the checks directly.
TRANSFORMER = '''
get_ipython().input_transformers_cleanup.append(
    lambda lines: ["pass\\n"] if lines and lines[0].startswith("# Check") else lines)
'''

CHEATS: dict[str, dict[str, dict[str, str]]] = {
    "06_engine": {
        "cheat_transformer_and_patches": {
            # one line rewrites every check cell before it runs; then the checker and the guard are patched
            "6.1": TRANSFORMER + '''
def my_prepare_inputs(scheduler_output, requests, block_size, device="cpu"):
    raise NotImplementedError
''',
            "6.2": '''
from minillm.course.exercises import tripwire
tripwire.building = lambda *a, **k: __import__("contextlib").nullcontext()
guard = lambda numbers, learner: learner


def my_step(engine):
    return engine.step()
''',
            "C6": '''
import minillm.course.exercises.challenges.ch06 as _ch06


def my_parallel_sample(engine, request_id, prompt_ids, params, n):
    return _ch06.parallel_sample(engine, request_id, prompt_ids, params, n)
''',
        },
        "cheat_captures": {
            # the answer the check computed just before (6.1's `want`); the package's step taken before the check
            "6.1": '''
def my_prepare_inputs(scheduler_output, requests, block_size, device="cpu"):
    return want
''',
            "6.2": '''
def my_step(engine, _step=LLMEngine.step):
    return _step(engine)
''',
            "C6": '''
import functools
import inspect

_impls = [functools.partial(LLMEngine.step)]


def my_parallel_sample(engine, request_id, prompt_ids, params, n):
    engine.add_request(request_id, prompt_ids, params)
    outs = []
    while engine.has_unfinished_requests():
        outs += _impls[0](engine)
    return inspect.unwrap(outs)
''',
        },
    },
    "10_engine_core": {
        "cheat_transformer_and_patches": {
            "10.1": TRANSFORMER + '''
import minillm.course.exercises.ch10 as _ch10
_ch10.check_update_states = lambda *a, **k: {"preempted": 1, "resumed from their slot": 1,
                                             "rows out of slot order": 1}


def update_states(req_states, block_tables, requests_info, scheduler_output):
    raise NotImplementedError
''',
            "10.2": '''
from minillm.core.sched.async_scheduler import AsyncScheduler


class PlaceholderScheduler(Scheduler):
    _update_after_schedule = AsyncScheduler._update_after_schedule          # a class attribute alias
    _update_request_with_output = AsyncScheduler._update_request_with_output
''',
            "C10": CHALLENGE_DELEGATING["C10"],
            "10.3": '''
import functools
import types

from minillm.model.parallel_layers import num_kv_heads_per_rank

_per_rank = functools.partial(num_kv_heads_per_rank)
_copy = types.FunctionType(num_kv_heads_per_rank.__code__, num_kv_heads_per_rank.__globals__)


def kv_heads_of_rank(num_kv_heads, tp_size, rank):
    per_rank = _copy(num_kv_heads, tp_size)
    first = rank // max(1, tp_size // num_kv_heads) * per_rank
    return list(range(first, first + per_rank))


def num_blocks_per_rank(config, block_size, dtype_bytes, tp_size, budget_bytes):
    return budget_bytes // (block_size * dtype_bytes * 2 * config.num_hidden_layers * config.head_dim
                            * _per_rank(config.num_key_value_heads, tp_size))
''',
            "10.4": '''
import minillm.course.exercises.ch10 as _ch10
_ch10.check_pos_seq_lens_kernel = lambda *a, **k: {"empty rows": 1, "rows longer than BLOCK": 1}


@triton.jit
def my_pos_seq_lens_kernel(positions_ptr, seq_lens_ptr, idx_mapping_ptr, query_start_loc_ptr,
                           num_computed_tokens_ptr, BLOCK: tl.constexpr):
    pass
''',
        },
        "cheat_captures": {
            "10.1": '''
from minillm.worker import model_runner


def update_states(req_states, block_tables, requests_info, scheduler_output,
                  _refs=(model_runner.ModelRunner.finish_requests, model_runner.ModelRunner.add_requests,
                         model_runner.ModelRunner.update_requests)):
    holder = type("Holder", (), {"_add": model_runner.ModelRunner._add})()
    holder.req_states, holder.block_tables, holder.requests_info = req_states, block_tables, requests_info
    holder.device = req_states.device
    for ref in _refs:
        ref(holder, scheduler_output)
    return [req_states.req_id_to_index[r] for r in scheduler_output.num_scheduled_tokens]
''',
            "10.2": '''
import gc
import sys


class PlaceholderScheduler(Scheduler):
    def _update_after_schedule(self, scheduler_output):
        caller = sys._getframe(1)
        while caller is not None and "ref" not in caller.f_locals:
            caller = caller.f_back
        gc.collect()
        super()._update_after_schedule(scheduler_output)

    def _update_request_with_output(self, request, new_token_ids):
        return super()._update_request_with_output(request, new_token_ids)
''',
            "10.3": '''
import importlib
import inspect

import minillm.model.parallel_layers as _pl

_again = importlib.reload(_pl)
_src = {}
exec(inspect.getsource(_pl.num_kv_heads_per_rank), _src)


def kv_heads_of_rank(num_kv_heads, tp_size, rank):
    per_rank = _again.num_kv_heads_per_rank(num_kv_heads, tp_size)
    first = rank // max(1, tp_size // num_kv_heads) * per_rank
    return list(range(first, first + per_rank))


def num_blocks_per_rank(config, block_size, dtype_bytes, tp_size, budget_bytes):
    return budget_bytes // (block_size * dtype_bytes * 2 * config.num_hidden_layers * config.head_dim
                            * _src["num_kv_heads_per_rank"](config.num_key_value_heads, tp_size))
''',
            "10.4": '''
from kernels import input_batch as _ib

_inner = _ib._prepare_pos_seq_lens_kernel


@triton.jit
def my_pos_seq_lens_kernel(positions_ptr, seq_lens_ptr, idx_mapping_ptr, query_start_loc_ptr,
                           num_computed_tokens_ptr, BLOCK: tl.constexpr):
    _inner(positions_ptr, seq_lens_ptr, idx_mapping_ptr, query_start_loc_ptr, num_computed_tokens_ptr, BLOCK)
''',
        },
    },
}
