"""Model Runner V2's input preparation: the step's ``input_ids``, positions, logits rows, and the update after sampling.

Request state lives in fixed *slots*, tensors ``[max_num_reqs, ...]`` a request keeps from its first step to its
last; a step's batch row ``b`` reads and writes slot ``idx_mapping[b]``, so no state moves when the batch changes.
Every function here has a Triton kernel (``_<name>_kernel``, one program per batch row, as vLLM), a vectorised
PyTorch reference (``<name>_ref``, what the engine runs on a CPU) and a public ``<name>`` that picks the kernel for
CUDA tensors (or ``use_triton=True``: the tests run it in Triton's interpreter) and the reference otherwise.

Throughout: ``query_start_loc`` is ``[num_reqs + 1]`` int32 with ``query_start_loc[0] == 0``; non-negative entries
of ``idx_mapping`` are distinct slots. Values are not checked (a check would sync the GPU every step).

vLLM counterpart: ``vllm/v1/worker/gpu/input_batch.py``, without lookahead tokens, CUDA-graph padding or the
``num_new_sampled_tokens`` switch of ``combine_sampled_and_draft_tokens`` (here always 1 bonus token).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

# Tokens one program copies per loop iteration: a query of any length is walked in chunks of this many.
_BLOCK = 1024


def _pick_triton(use_triton: bool | None, t: torch.Tensor) -> bool:
    """The kernel for CUDA tensors unless told otherwise; on a CPU only when asked (it runs in the interpreter)."""
    return t.is_cuda if use_triton is None else use_triton


def _column(t: torch.Tensor) -> torch.Tensor:
    """``[max_num_reqs]`` view of a per-slot value stored as ``[max_num_reqs]`` or ``[max_num_reqs, 1]``."""
    return t if t.dim() == 1 else t[:, 0]


def _row_offsets(lens: torch.Tensor, total: int) -> torch.Tensor:
    """``[total]`` int64: for rows of ``lens`` items laid end to end, each item's index within its row."""
    starts = torch.cumsum(lens, 0) - lens
    return torch.arange(total, device=lens.device) - torch.repeat_interleave(starts, lens, output_size=total)


# ----------------------------------------------------------------------------------------------------------------
# prepare_prefill_inputs
# ----------------------------------------------------------------------------------------------------------------
@triton.jit
def _prepare_prefill_inputs_kernel(
    input_ids_ptr,            # [num_tokens] int32 or int64, written
    idx_mapping_ptr,          # [num_reqs] int64
    query_start_loc_ptr,      # [num_reqs + 1] int32
    all_token_ids_ptr,        # [max_num_reqs, max_model_len] int32
    all_token_ids_stride,
    prefill_len_ptr,          # [max_num_reqs] int32
    num_computed_tokens_ptr,  # [max_num_reqs] int32
    BLOCK: tl.constexpr,
):
    b = tl.program_id(0)
    slot = tl.load(idx_mapping_ptr + b)
    num_computed = tl.load(num_computed_tokens_ptr + slot)
    # A decoding row's input token is the last sampled one, which combine_sampled_and_draft_tokens writes.
    if num_computed >= tl.load(prefill_len_ptr + slot):
        return
    start = tl.load(query_start_loc_ptr + b)
    query_len = tl.load(query_start_loc_ptr + b + 1) - start
    src = all_token_ids_ptr + slot * all_token_ids_stride + num_computed  # slot is int64: no overflow
    for i in range(0, query_len, BLOCK):
        j = i + tl.arange(0, BLOCK)
        mask = j < query_len
        tokens = tl.load(src + j, mask=mask)
        # all_token_ids is int32; the model's input buffer may be int64.
        tl.store(input_ids_ptr + start + j, tokens.to(input_ids_ptr.dtype.element_ty), mask=mask)


def prepare_prefill_inputs_ref(input_ids: torch.Tensor, idx_mapping: torch.Tensor, query_start_loc: torch.Tensor,
                               all_token_ids: torch.Tensor, prefill_len: torch.Tensor,
                               num_computed_tokens: torch.Tensor) -> None:
    """PyTorch reference of :func:`prepare_prefill_inputs` (same arguments, same result)."""
    num_reqs = idx_mapping.shape[0]
    if num_reqs == 0:
        return
    qsl = query_start_loc[:num_reqs + 1].long()
    num_computed = num_computed_tokens[idx_mapping].long()
    # Only the prefilling rows are copied: selecting them first makes a decode row cost nothing per token.
    rows = (num_computed < prefill_len[idx_mapping]).nonzero().squeeze(1)
    lens = (qsl[rows + 1] - qsl[rows])
    total = int(lens.sum())
    if total == 0:
        return
    j = _row_offsets(lens, total)
    dst = torch.repeat_interleave(qsl[rows], lens, output_size=total) + j
    src_slot = torch.repeat_interleave(idx_mapping[rows], lens, output_size=total)
    src_col = torch.repeat_interleave(num_computed[rows], lens, output_size=total) + j
    input_ids[dst] = all_token_ids[src_slot, src_col].to(input_ids.dtype)


def prepare_prefill_inputs(input_ids: torch.Tensor, idx_mapping: torch.Tensor, query_start_loc: torch.Tensor,
                           all_token_ids: torch.Tensor, prefill_len: torch.Tensor, num_computed_tokens: torch.Tensor,
                           use_triton: bool | None = None) -> None:
    """Copy each prefilling row's prompt chunk into ``input_ids``, in place.

    Row ``b`` (slot ``s = idx_mapping[b]``) is prefilling when ``num_computed_tokens[s] < prefill_len[s]``; its
    ``query_len = query_start_loc[b + 1] - query_start_loc[b]`` input ids are then
    ``all_token_ids[s, num_computed_tokens[s]:][:query_len]``. Other rows' ``input_ids`` are left as they are.

    Args:
        input_ids: ``[>= num_tokens]`` int32 or int64, the step's input ids, written.
        idx_mapping: ``[num_reqs]`` int64, batch row -> slot.
        query_start_loc: ``[num_reqs + 1]`` int32, where each row's tokens start in ``input_ids``.
        all_token_ids: ``[max_num_reqs, max_model_len]`` int32, each slot's prompt and output tokens so far.
        prefill_len: ``[max_num_reqs]`` int32, the tokens fed as a prefill (the prompt, plus the outputs of a
            request resumed after preemption).
        num_computed_tokens: ``[max_num_reqs]`` int32, tokens whose KV is already in the cache.
        use_triton: the kernel (``True``), the reference (``False``), or by device (``None``).

    vLLM counterpart: ``vllm/v1/worker/gpu/input_batch.py:prepare_prefill_inputs`` (which also stores the next
    prompt tokens for lookahead).
    """
    if not _pick_triton(use_triton, input_ids):
        prepare_prefill_inputs_ref(input_ids, idx_mapping, query_start_loc, all_token_ids, prefill_len,
                                   num_computed_tokens)
        return
    num_reqs = idx_mapping.shape[0]
    if num_reqs == 0:
        return
    _prepare_prefill_inputs_kernel[(num_reqs,)](
        input_ids, idx_mapping, query_start_loc, all_token_ids, all_token_ids.stride(0), prefill_len,
        num_computed_tokens, BLOCK=_BLOCK,
    )


# ----------------------------------------------------------------------------------------------------------------
# prepare_pos_seq_lens
# ----------------------------------------------------------------------------------------------------------------
@triton.jit
def _prepare_pos_seq_lens_kernel(
    positions_ptr,            # [num_tokens] int64, written
    seq_lens_ptr,             # [num_reqs] int32, written
    idx_mapping_ptr,          # [num_reqs] int64
    query_start_loc_ptr,      # [num_reqs + 1] int32
    num_computed_tokens_ptr,  # [max_num_reqs] int32
    BLOCK: tl.constexpr,
):
    b = tl.program_id(0)
    slot = tl.load(idx_mapping_ptr + b)
    num_computed = tl.load(num_computed_tokens_ptr + slot)
    start = tl.load(query_start_loc_ptr + b)
    query_len = tl.load(query_start_loc_ptr + b + 1) - start
    # The query continues the sequence: its tokens sit right after the num_computed cached ones.
    tl.store(seq_lens_ptr + b, num_computed + query_len)
    for i in range(0, query_len, BLOCK):
        j = i + tl.arange(0, BLOCK)
        tl.store(positions_ptr + start + j, (num_computed + j).to(tl.int64), mask=j < query_len)


def prepare_pos_seq_lens_ref(idx_mapping: torch.Tensor, query_start_loc: torch.Tensor,
                             num_computed_tokens: torch.Tensor, positions: torch.Tensor,
                             seq_lens: torch.Tensor) -> None:
    """PyTorch reference of :func:`prepare_pos_seq_lens` (same arguments, same result)."""
    num_reqs = idx_mapping.shape[0]
    if num_reqs == 0:
        return
    qsl = query_start_loc[:num_reqs + 1]
    lens = (qsl[1:] - qsl[:-1]).long()
    num_computed = num_computed_tokens[idx_mapping]
    seq_lens[:num_reqs] = num_computed + lens.to(num_computed.dtype)
    total = int(qsl[-1])
    # positions[qsl[b] + j] = nc + j = t + (nc - qsl[b]) for token t = qsl[b] + j: one shift per row.
    shift = torch.repeat_interleave(num_computed.long() - qsl[:-1].long(), lens, output_size=total)
    positions[:total] = torch.arange(total, device=positions.device) + shift


def prepare_pos_seq_lens(idx_mapping: torch.Tensor, query_start_loc: torch.Tensor, num_computed_tokens: torch.Tensor,
                         positions: torch.Tensor, seq_lens: torch.Tensor, use_triton: bool | None = None) -> None:
    """Write each token's position and each row's sequence length, in place.

    Row ``b`` (slot ``s = idx_mapping[b]``, ``nc = num_computed_tokens[s]``): token ``j`` of its query gets position
    ``nc + j``, and ``seq_lens[b] = nc + query_len``, the tokens its attention sees.

    Args:
        idx_mapping: ``[num_reqs]`` int64, batch row -> slot.
        query_start_loc: ``[num_reqs + 1]`` int32.
        num_computed_tokens: ``[max_num_reqs]`` int32, tokens whose KV is already in the cache.
        positions: ``[>= num_tokens]`` int64, written up to ``num_tokens = query_start_loc[num_reqs]``.
        seq_lens: ``[>= num_reqs]`` int32, written up to ``num_reqs``; entries past it are left as they are (vLLM
            zeros them for its full CUDA graphs, which minillm does not capture).
        use_triton: the kernel (``True``), the reference (``False``), or by device (``None``).

    vLLM counterpart: ``vllm/v1/worker/gpu/input_batch.py:prepare_pos_seq_lens``.
    """
    if not _pick_triton(use_triton, positions):
        prepare_pos_seq_lens_ref(idx_mapping, query_start_loc, num_computed_tokens, positions, seq_lens)
        return
    num_reqs = idx_mapping.shape[0]
    if num_reqs == 0:
        return
    _prepare_pos_seq_lens_kernel[(num_reqs,)](
        positions, seq_lens, idx_mapping, query_start_loc, num_computed_tokens, BLOCK=_BLOCK,
    )


# ----------------------------------------------------------------------------------------------------------------
# combine_sampled_and_draft_tokens
# ----------------------------------------------------------------------------------------------------------------
@triton.jit
def _combine_sampled_and_draft_tokens_kernel(
    input_ids_ptr,            # [num_tokens] int32 or int64, written
    idx_mapping_ptr,          # [num_reqs] int64
    last_sampled_tokens_ptr,  # [max_num_reqs, 1] int64
    last_sampled_stride,
    query_start_loc_ptr,      # [num_reqs + 1] int32
    seq_lens_ptr,             # [num_reqs] int32
    prefill_len_ptr,          # [max_num_reqs] int32
    draft_tokens_ptr,         # [max_num_reqs, num_spec] int64
    draft_tokens_stride,
    cu_num_logits_ptr,        # [num_reqs + 1] int32
    logits_indices_ptr,       # [num_logits] int64, written
    BLOCK: tl.constexpr,      # >= num_spec + 1: a row's logits and its drafts fit in one block
):
    b = tl.program_id(0)
    slot = tl.load(idx_mapping_ptr + b)
    logits_begin = tl.load(cu_num_logits_ptr + b)
    num_logits = tl.load(cu_num_logits_ptr + b + 1) - logits_begin
    # One logit for the bonus token (sampled after the last accepted draft), one per draft to verify.
    num_drafts = num_logits - 1
    k = tl.arange(0, BLOCK)

    # The logits rows are the query's last num_logits tokens: [last real token, draft_1, ..., draft_n].
    query_end = tl.load(query_start_loc_ptr + b + 1)
    first_logit = query_end - num_logits
    tl.store(logits_indices_ptr + logits_begin + k, (first_logit + k).to(tl.int64), mask=k < num_logits)

    seq_len = tl.load(seq_lens_ptr + b)
    prefill_len = tl.load(prefill_len_ptr + slot)
    if seq_len <= prefill_len:
        # Every input id of this row is a prompt token, already written by prepare_prefill_inputs.
        return
    # The token sampled last step is known only on the device (asynchronous scheduling): it goes in here. If the
    # first logit row still lies in the prompt (a prompt tail scheduled with drafts), that id is a prompt token.
    if seq_len - num_logits >= prefill_len:
        token = tl.load(last_sampled_tokens_ptr + slot * last_sampled_stride)
        tl.store(input_ids_ptr + first_logit, token.to(input_ids_ptr.dtype.element_ty))
    if num_drafts > 0:
        mask = k < num_drafts
        drafts = tl.load(draft_tokens_ptr + slot * draft_tokens_stride + k, mask=mask)
        tl.store(input_ids_ptr + query_end - num_drafts + k, drafts.to(input_ids_ptr.dtype.element_ty), mask=mask)


def combine_sampled_and_draft_tokens_ref(input_ids: torch.Tensor, idx_mapping: torch.Tensor,
                                         last_sampled_tokens: torch.Tensor, query_start_loc: torch.Tensor,
                                         seq_lens: torch.Tensor, prefill_len: torch.Tensor,
                                         draft_tokens: torch.Tensor, cu_num_logits: torch.Tensor,
                                         num_logits: int) -> torch.Tensor:
    """PyTorch reference of :func:`combine_sampled_and_draft_tokens` (same arguments, same result)."""
    num_reqs = idx_mapping.shape[0]
    device = input_ids.device
    if num_reqs == 0:
        return torch.empty(0, dtype=torch.int64, device=device)
    query_end = query_start_loc[1:num_reqs + 1].long()
    cu = cu_num_logits[:num_reqs + 1].long()
    row_logits = cu[1:] - cu[:-1]
    first_logit = query_end - row_logits
    # logits_indices[cu[b] + k] = first_logit[b] + k: the running index plus one shift per row.
    shift = torch.repeat_interleave(first_logit - cu[:-1], row_logits, output_size=num_logits)
    logits_indices = torch.arange(num_logits, device=device) + shift

    seq = seq_lens[:num_reqs]
    prompt = prefill_len[idx_mapping]
    generating = seq > prompt
    takes_sampled = generating & (seq - row_logits >= prompt)
    slots = idx_mapping[takes_sampled]
    input_ids[first_logit[takes_sampled]] = _column(last_sampled_tokens)[slots].to(input_ids.dtype)

    num_drafts = torch.where(generating, row_logits - 1, 0)
    total = int(num_drafts.sum())
    if total:
        k = _row_offsets(num_drafts, total)
        dst = torch.repeat_interleave(query_end - num_drafts, num_drafts, output_size=total) + k
        src_slot = torch.repeat_interleave(idx_mapping, num_drafts, output_size=total)
        input_ids[dst] = draft_tokens[src_slot, k].to(input_ids.dtype)
    return logits_indices


def combine_sampled_and_draft_tokens(input_ids: torch.Tensor, idx_mapping: torch.Tensor,
                                     last_sampled_tokens: torch.Tensor, query_start_loc: torch.Tensor,
                                     seq_lens: torch.Tensor, prefill_len: torch.Tensor, draft_tokens: torch.Tensor,
                                     cu_num_logits: torch.Tensor, num_logits: int,
                                     use_triton: bool | None = None) -> torch.Tensor:
    """Put last step's sampled token and this step's drafts into ``input_ids``; return the rows to take logits at.

    Row ``b`` (slot ``s``) has ``n = cu_num_logits[b + 1] - cu_num_logits[b]`` logits, taken at the last ``n``
    tokens of its query. When the row has passed its prompt (``seq_lens[b] > prefill_len[s]``), the first of
    those tokens is the token sampled last step, ``last_sampled_tokens[s]`` (written only if that position is at or
    past ``prefill_len[s]``), and the ``n - 1`` after it are the drafts ``draft_tokens[s, :n - 1]``.

    Args:
        input_ids: ``[>= num_tokens]`` int32 or int64, written in place.
        idx_mapping: ``[num_reqs]`` int64, batch row -> slot.
        last_sampled_tokens: ``[max_num_reqs, 1]`` int64, each slot's last sampled token.
        query_start_loc: ``[num_reqs + 1]`` int32.
        seq_lens: ``[>= num_reqs]`` int32, from :func:`prepare_pos_seq_lens`.
        prefill_len: ``[max_num_reqs]`` int32.
        draft_tokens: ``[max_num_reqs, num_spec]`` int64 (``num_spec`` may be 0), each slot's drafts.
        cu_num_logits: ``[num_reqs + 1]`` int32, cumulative logits per row, ``cu_num_logits[0] == 0``; each row
            has ``1 <= n <= min(query_len, num_spec + 1)``.
        num_logits: ``cu_num_logits[num_reqs]``, a Python int (the output's size without a device sync).
        use_triton: the kernel (``True``), the reference (``False``), or by device (``None``).

    Returns:
        logits_indices: ``[num_logits]`` int64, the token rows of the hidden states to compute logits for.

    vLLM counterpart: ``vllm/v1/worker/gpu/input_batch.py:combine_sampled_and_draft_tokens`` with
    ``num_new_sampled_tokens=1``.
    """
    if not _pick_triton(use_triton, input_ids):
        return combine_sampled_and_draft_tokens_ref(input_ids, idx_mapping, last_sampled_tokens, query_start_loc,
                                                    seq_lens, prefill_len, draft_tokens, cu_num_logits, num_logits)
    num_reqs = idx_mapping.shape[0]
    logits_indices = torch.empty(num_logits, dtype=torch.int64, device=input_ids.device)
    if num_reqs == 0:
        return logits_indices
    _combine_sampled_and_draft_tokens_kernel[(num_reqs,)](
        input_ids, idx_mapping, last_sampled_tokens, last_sampled_tokens.stride(0), query_start_loc, seq_lens,
        prefill_len, draft_tokens, draft_tokens.stride(0), cu_num_logits, logits_indices,
        BLOCK=triton.next_power_of_2(draft_tokens.shape[-1] + 1),
    )
    return logits_indices


# ----------------------------------------------------------------------------------------------------------------
# get_num_sampled_and_rejected
# ----------------------------------------------------------------------------------------------------------------
@triton.jit
def _get_num_sampled_and_rejected_kernel(
    num_sampled_ptr,    # [num_reqs] int32, read and written
    num_rejected_ptr,   # [num_reqs] int32, written
    seq_lens_ptr,       # [num_reqs] int32
    cu_num_logits_ptr,  # [num_reqs + 1] int32
    idx_mapping_ptr,    # [num_reqs] int64
    prefill_len_ptr,    # [max_num_reqs] int32
):
    b = tl.program_id(0)
    slot = tl.load(idx_mapping_ptr + b)
    # A chunk that ends before the prompt does was sampled only because the batch samples every row: its token is
    # thrown away and nothing was verified. (seq_len == prefill_len is the last chunk: its token is the first output.)
    chunked = tl.load(seq_lens_ptr + b) < tl.load(prefill_len_ptr + slot)
    num_logits = tl.load(cu_num_logits_ptr + b + 1) - tl.load(cu_num_logits_ptr + b)
    num_sampled = tl.load(num_sampled_ptr + b)
    tl.store(num_rejected_ptr + b, tl.where(chunked, 0, num_logits - num_sampled))
    tl.store(num_sampled_ptr + b, tl.where(chunked, 0, num_sampled))


def get_num_sampled_and_rejected_ref(num_sampled: torch.Tensor, seq_lens: torch.Tensor, cu_num_logits: torch.Tensor,
                                     idx_mapping: torch.Tensor,
                                     prefill_len: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """PyTorch reference of :func:`get_num_sampled_and_rejected` (same arguments, same result)."""
    num_reqs = idx_mapping.shape[0]
    chunked = seq_lens[:num_reqs] < prefill_len[idx_mapping]
    row_logits = cu_num_logits[1:num_reqs + 1] - cu_num_logits[:num_reqs]
    num_rejected = (row_logits - num_sampled).to(num_sampled.dtype).masked_fill_(chunked, 0)
    num_sampled.masked_fill_(chunked, 0)
    return num_sampled, num_rejected


def get_num_sampled_and_rejected(num_sampled: torch.Tensor, seq_lens: torch.Tensor, cu_num_logits: torch.Tensor,
                                 idx_mapping: torch.Tensor, prefill_len: torch.Tensor,
                                 use_triton: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """How many tokens each row keeps and how many of its logits were rejected drafts.

    A row with ``n`` logits that kept ``num_sampled[b]`` tokens (accepted drafts plus the bonus token) rejected
    ``n - num_sampled[b]`` drafts. A row still in chunked prefill (``seq_lens[b] < prefill_len[s]``) keeps 0 and
    rejects 0: its sampled token is not an output.

    Args:
        num_sampled: ``[num_reqs]`` int32, tokens the sampler kept per row; chunked-prefill rows set to 0 in place.
        seq_lens: ``[>= num_reqs]`` int32.
        cu_num_logits: ``[num_reqs + 1]`` int32.
        idx_mapping: ``[num_reqs]`` int64, batch row -> slot.
        prefill_len: ``[max_num_reqs]`` int32.
        use_triton: the kernel (``True``), the reference (``False``), or by device (``None``).

    Returns:
        ``(num_sampled, num_rejected)``: the argument itself, and a new ``[num_reqs]`` tensor of its dtype.

    vLLM counterpart: ``vllm/v1/worker/gpu/input_batch.py:get_num_sampled_and_rejected``.
    """
    if not _pick_triton(use_triton, num_sampled):
        return get_num_sampled_and_rejected_ref(num_sampled, seq_lens, cu_num_logits, idx_mapping, prefill_len)
    num_reqs = idx_mapping.shape[0]
    num_rejected = torch.empty_like(num_sampled)
    if num_reqs == 0:
        return num_sampled, num_rejected
    _get_num_sampled_and_rejected_kernel[(num_reqs,)](
        num_sampled, num_rejected, seq_lens, cu_num_logits, idx_mapping, prefill_len,
    )
    return num_sampled, num_rejected


# ----------------------------------------------------------------------------------------------------------------
# post_update
# ----------------------------------------------------------------------------------------------------------------
@triton.jit
def _post_update_kernel(
    idx_mapping_ptr,          # [num_reqs] int64; negative: skip the row
    num_computed_tokens_ptr,  # [max_num_reqs] int32, updated
    last_sampled_tokens_ptr,  # [max_num_reqs, 1] int64, updated
    last_sampled_stride,
    output_bin_counts_ptr,    # [max_num_reqs, vocab_size] int32, updated (if HAS_BIN_COUNTS)
    output_bin_counts_stride,
    sampled_tokens_ptr,       # [num_reqs, k + 1] int64 or int32
    sampled_tokens_stride,
    num_sampled_ptr,          # [num_reqs] int32
    num_rejected_ptr,         # [num_reqs] int32
    query_start_loc_ptr,      # [num_reqs + 1] int32 (if HAS_QUERY_START_LOC)
    all_token_ids_ptr,        # [max_num_reqs, max_model_len] int32, appended to
    all_token_ids_stride,
    total_len_ptr,            # [max_num_reqs] int32, updated
    draft_tokens_ptr,         # [num_reqs, num_spec] (if HAS_DRAFTS)
    draft_tokens_stride,
    draft_tokens_out_ptr,     # [max_num_reqs, num_spec], written (if HAS_DRAFTS)
    draft_tokens_out_stride,
    num_spec,
    HAS_BIN_COUNTS: tl.constexpr,
    HAS_QUERY_START_LOC: tl.constexpr,
    HAS_DRAFTS: tl.constexpr,
    BLOCK_K: tl.constexpr,    # >= k + 1 and >= num_spec: one row's sampled tokens (or drafts) in one block
):
    b = tl.program_id(0)
    slot = tl.load(idx_mapping_ptr + b)
    if slot < 0:
        # A row kept in the batch for its shape only (a padding or dummy row): it owns no state.
        return
    i = tl.arange(0, BLOCK_K)

    if HAS_DRAFTS:
        # The drafts proposed for the next step, moved from batch order into the slot's row.
        mask = i < num_spec
        drafts = tl.load(draft_tokens_ptr + b * draft_tokens_stride + i, mask=mask)
        tl.store(draft_tokens_out_ptr + slot * draft_tokens_out_stride + i,
                 drafts.to(draft_tokens_out_ptr.dtype.element_ty), mask=mask)

    total_len = tl.load(total_len_ptr + slot)
    num_sampled = tl.load(num_sampled_ptr + b)
    if num_sampled > 0:
        # The last kept token is next step's input (combine_sampled_and_draft_tokens reads it).
        last = tl.load(sampled_tokens_ptr + b * sampled_tokens_stride + num_sampled - 1)
        tl.store(last_sampled_tokens_ptr + slot * last_sampled_stride, last.to(tl.int64))
        tl.store(total_len_ptr + slot, total_len + num_sampled)

    mask = i < num_sampled
    tokens = tl.load(sampled_tokens_ptr + b * sampled_tokens_stride + i, mask=mask, other=0)
    tl.store(all_token_ids_ptr + slot * all_token_ids_stride + total_len + i, tokens.to(tl.int32), mask=mask)
    if HAS_BIN_COUNTS:
        # Atomic, not load-add-store: one row may keep the same token twice, and both must count.
        tl.atomic_add(output_bin_counts_ptr + slot * output_bin_counts_stride + tokens, 1, mask=mask)

    if HAS_QUERY_START_LOC:
        query_len = tl.load(query_start_loc_ptr + b + 1) - tl.load(query_start_loc_ptr + b)
    else:
        query_len = 0
    # The query's tokens are now cached, except the rejected drafts, whose KV will be overwritten.
    num_computed = tl.load(num_computed_tokens_ptr + slot)
    tl.store(num_computed_tokens_ptr + slot, num_computed + query_len - tl.load(num_rejected_ptr + b))


def post_update_ref(idx_mapping: torch.Tensor, num_computed_tokens: torch.Tensor, last_sampled_tokens: torch.Tensor,
                    output_bin_counts: torch.Tensor | None, sampled_tokens: torch.Tensor, num_sampled: torch.Tensor,
                    num_rejected: torch.Tensor, query_start_loc: torch.Tensor | None, all_token_ids: torch.Tensor,
                    total_len: torch.Tensor, draft_tokens: torch.Tensor | None = None,
                    draft_tokens_out: torch.Tensor | None = None) -> None:
    """PyTorch reference of :func:`post_update` (same arguments, same result)."""
    num_reqs = idx_mapping.shape[0]
    rows = (idx_mapping >= 0).nonzero().squeeze(1)
    slots = idx_mapping[rows]
    if draft_tokens is not None and draft_tokens_out is not None:
        draft_tokens_out[slots] = draft_tokens[rows].to(draft_tokens_out.dtype)

    kept = num_sampled[rows].long()
    old_total = total_len[slots].long()
    some = kept > 0
    _column(last_sampled_tokens)[slots[some]] = sampled_tokens[rows[some], kept[some] - 1].long()
    total = int(kept.sum())
    if total:
        i = _row_offsets(kept, total)
        tokens = sampled_tokens[torch.repeat_interleave(rows, kept, output_size=total), i]
        token_slots = torch.repeat_interleave(slots, kept, output_size=total)
        cols = torch.repeat_interleave(old_total, kept, output_size=total) + i
        all_token_ids[token_slots, cols] = tokens.to(all_token_ids.dtype)
        if output_bin_counts is not None:
            # accumulate=True adds once per occurrence: a token kept twice counts twice.
            ones = torch.ones(total, dtype=output_bin_counts.dtype, device=output_bin_counts.device)
            output_bin_counts.index_put_((token_slots, tokens.long()), ones, accumulate=True)
    total_len[slots] = (old_total + kept).to(total_len.dtype)

    delta = -num_rejected[rows]
    if query_start_loc is not None:
        qsl = query_start_loc[:num_reqs + 1]
        delta = delta + (qsl[1:] - qsl[:-1])[rows]
    num_computed_tokens.index_add_(0, slots, delta.to(num_computed_tokens.dtype))


def post_update(idx_mapping: torch.Tensor, num_computed_tokens: torch.Tensor, last_sampled_tokens: torch.Tensor,
                output_bin_counts: torch.Tensor | None, sampled_tokens: torch.Tensor, num_sampled: torch.Tensor,
                num_rejected: torch.Tensor, query_start_loc: torch.Tensor | None, all_token_ids: torch.Tensor,
                total_len: torch.Tensor, draft_tokens: torch.Tensor | None = None,
                draft_tokens_out: torch.Tensor | None = None, use_triton: bool | None = None) -> None:
    """Fold a step's sampling results into the slots' state, in place.

    For each row ``b`` with slot ``s = idx_mapping[b] >= 0`` (negative rows are skipped) that kept
    ``n = num_sampled[b]`` tokens: ``sampled_tokens[b, :n]`` are appended to ``all_token_ids[s]`` at ``total_len[s]``
    (which grows by ``n``), counted in ``output_bin_counts[s]``, and the last becomes ``last_sampled_tokens[s]``;
    ``num_computed_tokens[s]`` grows by ``query_len - num_rejected[b]``; ``draft_tokens[b]`` is copied to
    ``draft_tokens_out[s]``.

    Args:
        idx_mapping: ``[num_reqs]`` int64, batch row -> slot; negative: no slot, skip the row.
        num_computed_tokens: ``[max_num_reqs]`` int32, updated.
        last_sampled_tokens: ``[max_num_reqs, 1]`` int64, updated where a row kept a token.
        output_bin_counts: ``[max_num_reqs, vocab_size]`` int32, per-slot output token counts (for penalties),
            updated; ``None`` when no request uses them.
        sampled_tokens: ``[num_reqs, k + 1]`` int64 or int32, the sampler's tokens, the kept ones first.
        num_sampled: ``[num_reqs]`` int32, tokens kept per row (from :func:`get_num_sampled_and_rejected`).
        num_rejected: ``[num_reqs]`` int32, rejected drafts per row.
        query_start_loc: ``[num_reqs + 1]`` int32, or ``None``: every query length counts as 0.
        all_token_ids: ``[max_num_reqs, max_model_len]`` int32, appended to.
        total_len: ``[max_num_reqs]`` int32, tokens in ``all_token_ids[s]``, updated.
        draft_tokens: ``[num_reqs, num_spec]``, next step's drafts in batch order, or ``None``.
        draft_tokens_out: ``[max_num_reqs, num_spec]``, the slots' drafts; required with ``draft_tokens``.
        use_triton: the kernel (``True``), the reference (``False``), or by device (``None``).

    Raises:
        ValueError: ``draft_tokens`` without ``draft_tokens_out``, or of another width.

    vLLM counterpart: ``vllm/v1/worker/gpu/input_batch.py:post_update``.
    """
    num_spec = 0
    if draft_tokens is not None:
        if draft_tokens_out is None or draft_tokens.shape[1] != draft_tokens_out.shape[1]:
            raise ValueError(f"draft_tokens {tuple(draft_tokens.shape)} needs a draft_tokens_out of the same width, "
                             f"got {None if draft_tokens_out is None else tuple(draft_tokens_out.shape)}")
        num_spec = draft_tokens.shape[1]
    if not _pick_triton(use_triton, sampled_tokens):
        post_update_ref(idx_mapping, num_computed_tokens, last_sampled_tokens, output_bin_counts, sampled_tokens,
                        num_sampled, num_rejected, query_start_loc, all_token_ids, total_len, draft_tokens,
                        draft_tokens_out)
        return
    num_reqs = idx_mapping.shape[0]
    if num_reqs == 0:
        return
    _post_update_kernel[(num_reqs,)](
        idx_mapping, num_computed_tokens, last_sampled_tokens, last_sampled_tokens.stride(0),
        output_bin_counts, output_bin_counts.stride(0) if output_bin_counts is not None else 0,
        sampled_tokens, sampled_tokens.stride(0), num_sampled, num_rejected, query_start_loc,
        all_token_ids, all_token_ids.stride(0), total_len,
        draft_tokens, draft_tokens.stride(0) if draft_tokens is not None else 0,
        draft_tokens_out, draft_tokens_out.stride(0) if draft_tokens_out is not None else 0, num_spec,
        HAS_BIN_COUNTS=output_bin_counts is not None, HAS_QUERY_START_LOC=query_start_loc is not None,
        HAS_DRAFTS=draft_tokens is not None,
        BLOCK_K=triton.next_power_of_2(max(sampled_tokens.shape[1], num_spec, 1)),
        num_warps=1,  # a few scalars and one short vector per row
    )
