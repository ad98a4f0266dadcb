"""The V1 model runner's persistent batch, as chapter 10 compares it with Model Runner V2's slots.

vLLM's V1 runner (``vllm/v1/worker/gpu_model_runner.py`` with ``gpu_input_batch.py`` and ``block_table.py``; in
v0.33.0 the fallback for what Model Runner V2 does not support yet) keeps the requests of the latest step in
per-slot NumPy buffers updated in place from step to step. Slot ``i`` holds a request's ``token_ids_cpu[i]``
(prompt, outputs, then drafts while they are verified), ``num_prompt_tokens[i]``, ``num_computed_tokens_cpu[i]``
and its block-table row. A freed slot is a hole, filled lowest first; :meth:`InputBatch.condense` moves the last
requests down so they sit in slots ``0 .. num_reqs - 1``::

    slots    0  1  2  3  4        remove B and D        condense: E moves into 1
    before   A  B  C  D  E   ->   A  .  C  .  E   ->   A  E  C

:func:`update_states` is V1's ``_update_states`` (exercise 10.1). minillm's engine runs Model Runner V2
(``minillm/worker/states.py``: fixed slots from a free list, nothing condensed); this module is the course's, not
the engine's.
"""
from __future__ import annotations

import bisect
from collections.abc import Sequence

import numpy as np
import torch

from minillm.attention.metadata import AttentionMetadata
from minillm.core.sched.output import SchedulerOutput
from minillm.sample.metadata import make_generator
from minillm.sampling_params import SamplingType
from minillm.worker.model_runner import BatchInputs, CachedRequestState


class BlockTable:
    """Per-slot rows of block ids (vLLM V1: ``vllm/v1/worker/block_table.py:BlockTable``; row ``i`` is the blocks of
    slot ``i`` of the :class:`InputBatch`, then 0s, the null block).

    Args:
        max_num_reqs: rows (batch slots).
        max_num_blocks_per_req: columns: the most blocks one request may hold (``ceil(max_model_len /
            block_size)``).

    Attributes:
        block_table: ``[max_num_reqs, max_num_blocks_per_req]`` int32; past a row's blocks, 0 (the null block).
        num_blocks_per_row: ``[max_num_reqs]`` int32, the blocks each row holds.
    """

    def __init__(self, max_num_reqs: int, max_num_blocks_per_req: int) -> None:
        for name, value in (("max_num_reqs", max_num_reqs), ("max_num_blocks_per_req", max_num_blocks_per_req)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        self.max_num_reqs = max_num_reqs
        self.max_num_blocks_per_req = max_num_blocks_per_req
        # np.zeros maps zero pages lazily: rows never used cost no memory.
        self.block_table = np.zeros((max_num_reqs, max_num_blocks_per_req), dtype=np.int32)
        self.num_blocks_per_row = np.zeros(max_num_reqs, dtype=np.int32)

    def append_row(self, block_ids: Sequence[int], row_idx: int) -> None:
        """Append ``block_ids`` to row ``row_idx``. ``ValueError`` if the row would exceed its width."""
        if not block_ids:
            return
        start = int(self.num_blocks_per_row[row_idx])
        end = start + len(block_ids)
        if end > self.max_num_blocks_per_req:
            raise ValueError(f"row {row_idx} would hold {end} blocks, more than max_num_blocks_per_req "
                             f"({self.max_num_blocks_per_req} = ceil(max_model_len / block_size)); raise "
                             f"max_model_len")
        self.block_table[row_idx, start:end] = block_ids
        self.num_blocks_per_row[row_idx] = end

    def add_row(self, block_ids: Sequence[int], row_idx: int) -> None:
        """Make ``block_ids`` the whole of row ``row_idx`` (a request entering the batch)."""
        self.clear_row(row_idx)
        self.append_row(block_ids, row_idx)

    def clear_row(self, row_idx: int) -> None:
        """Empty row ``row_idx``: back to all null blocks."""
        self.block_table[row_idx, :self.num_blocks_per_row[row_idx]] = 0
        self.num_blocks_per_row[row_idx] = 0

    def move_row(self, src: int, tgt: int) -> None:
        """Row ``src`` becomes row ``tgt`` (whose old content is dropped); ``src`` is left empty."""
        n = int(self.num_blocks_per_row[src])
        self.clear_row(tgt)
        self.block_table[tgt, :n] = self.block_table[src, :n]
        self.num_blocks_per_row[tgt] = n
        self.clear_row(src)

    def swap_row(self, src: int, tgt: int) -> None:
        """Exchange rows ``src`` and ``tgt`` (whole rows: both keep their null padding)."""
        # Fancy indexing on the right makes a copy first, so this is a true swap.
        self.block_table[[src, tgt]] = self.block_table[[tgt, src]]
        self.num_blocks_per_row[[src, tgt]] = self.num_blocks_per_row[[tgt, src]]


def _positive_int(name: str, value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    return value


class InputBatch:
    """Per-slot buffers of the requests in the batch (vLLM V1: ``vllm/v1/worker/gpu_input_batch.py:InputBatch``).

    Args:
        max_num_reqs: slots: the most requests the batch holds at once (the engine's ``max_num_seqs``).
        max_model_len: the most tokens one request may hold (prompt, outputs and drafts together).
        block_size: tokens per KV block; the block table is ``ceil(max_model_len / block_size)`` wide.

    Attributes:
        token_ids_cpu: ``[max_num_reqs, max_model_len]`` int32 token ids.
        num_tokens_no_spec: ``[max_num_reqs]`` int32, tokens each slot holds, drafts not counted.
        num_prompt_tokens: ``[max_num_reqs]`` int32.
        num_computed_tokens_cpu: ``[max_num_reqs]`` int32, where the request's next step starts.
        block_table: the :class:`BlockTable` (``block_table.block_table`` ``[max_num_reqs, max_num_blocks]``).
        req_id_to_index: request id -> slot.

    Raises:
        ValueError: a size that is not a positive integer; later, a request that does not fit (no free slot, more
            than ``max_model_len`` tokens or ``ceil(max_model_len / block_size)`` blocks).
    """

    def __init__(self, max_num_reqs: int, max_model_len: int, block_size: int) -> None:
        self.max_num_reqs = _positive_int("max_num_reqs", max_num_reqs)
        self.max_model_len = _positive_int("max_model_len", max_model_len)
        self.block_size = _positive_int("block_size", block_size)
        # np.zeros maps zero pages lazily: only the slots and tokens in use cost memory.
        self.token_ids_cpu = np.zeros((max_num_reqs, max_model_len), dtype=np.int32)
        self.num_tokens_no_spec = np.zeros(max_num_reqs, dtype=np.int32)
        self.num_prompt_tokens = np.zeros(max_num_reqs, dtype=np.int32)
        self.num_computed_tokens_cpu = np.zeros(max_num_reqs, dtype=np.int32)
        # Drafts written after each slot's tokens (update_req_spec_token_ids): a slot that moves takes them along.
        self.num_spec_tokens = np.zeros(max_num_reqs, dtype=np.int32)
        self.block_table = BlockTable(max_num_reqs, -(-max_model_len // block_size))
        self._req_ids: list[str | None] = []  # slot -> request id; None marks a hole until condense()
        self.req_id_to_index: dict[str, int] = {}
        self._holes: list[int] = []  # empty slots below len(self._req_ids), ascending

    # -- what is in the batch ---------------------------------------------------------------------------------------
    @property
    def num_reqs(self) -> int:
        return len(self.req_id_to_index)

    @property
    def req_ids(self) -> list[str | None]:
        """Slot -> request id; ``None`` at holes, which exist only between a removal and :meth:`condense`."""
        return self._req_ids

    def get_token_ids(self, req_id: str) -> np.ndarray:
        """A view of ``req_id``'s tokens, drafts excluded: ``[num_tokens_no_spec]`` int32."""
        i = self.req_id_to_index[req_id]
        return self.token_ids_cpu[i, :self.num_tokens_no_spec[i]]

    # -- requests in and out ----------------------------------------------------------------------------------------
    def add_request(self, request: CachedRequestState) -> int:
        """Copy ``request`` (its tokens, prompt length, context length and blocks) into a slot: the lowest hole, or
        the first slot past the others. Returns the slot.

        Raises:
            ValueError: the id is already in the batch, every slot is taken, or the request has more tokens or
                blocks than a slot holds. Then nothing changed.
        """
        req_id = request.req_id
        if req_id in self.req_id_to_index:
            raise ValueError(f"request {req_id!r} is already in the batch (slot {self.req_id_to_index[req_id]})")
        if not self._holes and len(self._req_ids) >= self.max_num_reqs:
            raise ValueError(f"the batch is full: {self.max_num_reqs} requests (max_num_reqs) already hold every "
                             f"slot, so {req_id!r} does not fit; raise max_num_reqs (the engine's max_num_seqs)")
        self._check_fits(req_id, len(request.token_ids), len(request.block_ids))
        if self._holes:
            i = self._holes.pop(0)
            self._req_ids[i] = req_id
        else:
            i = len(self._req_ids)
            self._req_ids.append(req_id)
        self.req_id_to_index[req_id] = i
        n = len(request.token_ids)
        self.token_ids_cpu[i, :n] = request.token_ids
        self.num_tokens_no_spec[i] = n
        self.num_prompt_tokens[i] = request.num_prompt_tokens
        self.num_computed_tokens_cpu[i] = request.num_computed_tokens
        self.num_spec_tokens[i] = 0
        self.block_table.add_row(request.block_ids, i)
        return i

    def remove_request(self, req_id: str) -> int | None:
        """Take ``req_id`` out, leaving a hole in its slot (call :meth:`condense` after the step's removals and
        additions). Returns the slot, or ``None`` when the request is not in the batch."""
        i = self.req_id_to_index.pop(req_id, None)
        if i is None:
            return None
        self._req_ids[i] = None
        bisect.insort(self._holes, i)
        self.block_table.clear_row(i)
        return i

    def condense(self) -> None:
        """Move the last requests down into the holes, so the requests sit in slots ``0 .. num_reqs - 1``.

        The request in the highest slot goes to the lowest hole, one at a time, as vLLM does: a request moves at
        most once, and only as many requests move as there are holes below the last request.
        """
        while self._holes:
            # Holes at the end need no request moved into them: just drop them.
            while self._req_ids and self._req_ids[-1] is None:
                self._req_ids.pop()
                self._holes.pop()  # the highest hole is that last slot
            if not self._holes:
                break
            hole, last = self._holes.pop(0), len(self._req_ids) - 1
            self._move(last, hole)
            self._req_ids.pop()

    def swap_states(self, i1: int, i2: int) -> None:
        """Exchange the requests in slots ``i1`` and ``i2`` (both must hold one), all their buffers with them.
        vLLM swaps slots to put decodes before prefills for the attention backends that want it."""
        n = len(self._req_ids)
        id1 = self._req_ids[i1] if 0 <= i1 < n else None
        id2 = self._req_ids[i2] if 0 <= i2 < n else None
        if id1 is None or id2 is None:
            raise ValueError(f"swap_states needs two occupied slots, got {i1} ({id1!r}) and {i2} ({id2!r})")
        self._req_ids[i1], self._req_ids[i2] = id2, id1
        self.req_id_to_index[id1], self.req_id_to_index[id2] = i2, i1
        # Only the tokens in use, drafts included: copying whole max_model_len rows would cost O(max_model_len).
        used = self.num_tokens_no_spec + self.num_spec_tokens
        n = int(max(used[i1], used[i2]))
        self.token_ids_cpu[[i1, i2], :n] = self.token_ids_cpu[[i2, i1], :n]  # the right side is a copy
        for buf in (self.num_tokens_no_spec, self.num_prompt_tokens, self.num_computed_tokens_cpu,
                    self.num_spec_tokens):
            buf[[i1, i2]] = buf[[i2, i1]]
        self.block_table.swap_row(i1, i2)

    # -- updates in place -------------------------------------------------------------------------------------------
    def append_token_ids(self, req_index: int, token_ids: Sequence[int]) -> None:
        """Append tokens (the ones a step sampled) to slot ``req_index``. ``ValueError`` past ``max_model_len``."""
        if not token_ids:
            return
        start = int(self.num_tokens_no_spec[req_index])
        end = start + len(token_ids)
        self._check_fits(self._req_ids[req_index], end, 0)
        self.token_ids_cpu[req_index, start:end] = token_ids
        self.num_tokens_no_spec[req_index] = end
        self.num_spec_tokens[req_index] = 0  # the step that verified them is over

    def set_token_ids(self, req_index: int, token_ids: Sequence[int]) -> None:
        """Replace slot ``req_index``'s tokens with ``token_ids`` (the scheduler resent them whole: a token the
        runner appended was dropped). ``ValueError`` past ``max_model_len``."""
        self._check_fits(self._req_ids[req_index], len(token_ids), 0)
        self.token_ids_cpu[req_index, :len(token_ids)] = token_ids
        self.num_tokens_no_spec[req_index] = len(token_ids)
        self.num_spec_tokens[req_index] = 0

    def update_req_spec_token_ids(self, req_id: str, spec_token_ids: Sequence[int]) -> None:
        """Write the draft tokens ``req_id`` verifies this step right after its tokens, where the step's input ids
        are gathered from. They are not counted in ``num_tokens_no_spec``: the tokens the step samples overwrite
        them. ``ValueError`` past ``max_model_len``."""
        i = self.req_id_to_index[req_id]
        start = int(self.num_tokens_no_spec[i])
        self._check_fits(req_id, start + len(spec_token_ids), 0)
        self.token_ids_cpu[i, start:start + len(spec_token_ids)] = spec_token_ids
        self.num_spec_tokens[i] = len(spec_token_ids)

    # -- helpers ----------------------------------------------------------------------------------------------------
    def _check_fits(self, req_id: str | None, num_tokens: int, num_blocks: int) -> None:
        if num_tokens > self.max_model_len:
            raise ValueError(f"request {req_id!r} would hold {num_tokens} tokens, more than max_model_len "
                             f"({self.max_model_len}); raise max_model_len")
        width = self.block_table.max_num_blocks_per_req
        if num_blocks > width:
            raise ValueError(f"request {req_id!r} holds {num_blocks} blocks, more than a block-table row holds "
                             f"({width} = ceil(max_model_len / block_size)); raise max_model_len")

    def _move(self, src: int, tgt: int) -> None:
        """The request in slot ``src`` moves to the empty slot ``tgt``."""
        req_id = self._req_ids[src]
        assert req_id is not None and self._req_ids[tgt] is None
        self._req_ids[tgt], self._req_ids[src] = req_id, None
        self.req_id_to_index[req_id] = tgt
        n = int(self.num_tokens_no_spec[src] + self.num_spec_tokens[src])
        self.token_ids_cpu[tgt, :n] = self.token_ids_cpu[src, :n]
        for buf in (self.num_tokens_no_spec, self.num_prompt_tokens, self.num_computed_tokens_cpu,
                    self.num_spec_tokens):
            buf[tgt] = buf[src]
        self.block_table.move_row(src, tgt)


def update_states(batch: InputBatch, requests: dict[str, CachedRequestState], so: SchedulerOutput,
                  device: torch.device | str = "cpu") -> None:
    """V1's ``GPUModelRunner._update_states`` (``vllm/v1/worker/gpu_model_runner.py``): apply the step's diffs to
    the request states and the persistent batch, in vLLM's order. Finished requests leave both; requests not scheduled
    now (preempted, or left out by the budget) leave the batch but keep their state; new ones arrive; scheduled
    cached ones get their context length and new blocks (those not in the batch come back whole from their state);
    then the holes are condensed and the drafts written.

    Args:
        batch: the persistent batch, changed in place.
        requests: request id -> state, every request the runner holds (preempted ones too), changed in place.
        so: the step's plan.
        device: where a seeded request's generator lives.
    """
    for rid in so.finished_req_ids:
        requests.pop(rid, None)
        batch.remove_request(rid)
    cached = so.scheduled_cached_reqs
    # A resumed request counts as unscheduled: its blocks and tokens are replaced whole, so it re-enters.
    scheduled = so.num_scheduled_tokens.keys() - cached.resumed_req_ids
    for rid in batch.req_id_to_index.keys() - scheduled:
        batch.remove_request(rid)

    to_add: list[CachedRequestState] = []
    for new in so.scheduled_new_reqs:
        params = new.sampling_params
        gen = None
        if params.sampling_type == SamplingType.RANDOM_SEED and params.seed is not None:
            gen = make_generator(params.seed, device)
        state = CachedRequestState(new.req_id, len(new.prompt_token_ids), params, list(new.prompt_token_ids),
                                   list(new.block_ids), new.num_computed_tokens, gen)
        requests[new.req_id] = state
        to_add.append(state)
    for i, rid in enumerate(cached.req_ids):
        state = requests[rid]
        resent = rid in cached.all_token_ids
        if resent:
            state.token_ids = list(cached.all_token_ids[rid])
        if rid in cached.resumed_req_ids:
            state.block_ids = list(cached.new_block_ids[i])  # its old blocks were freed: a whole new list
        else:
            state.block_ids.extend(cached.new_block_ids[i])
        state.num_computed_tokens = cached.num_computed_tokens[i]
        slot = batch.req_id_to_index.get(rid)
        if slot is None:
            to_add.append(state)
            continue
        batch.num_computed_tokens_cpu[slot] = state.num_computed_tokens
        batch.block_table.append_row(cached.new_block_ids[i], slot)
        if resent:
            batch.set_token_ids(slot, state.token_ids)
    for state in to_add:
        batch.add_request(state)  # the lowest holes first
    batch.condense()
    # Last, once every request is in its final slot (a move would carry its drafts along, too).
    for rid, drafts in so.scheduled_spec_decode_tokens.items():
        batch.update_req_spec_token_ids(rid, drafts)


def gather_inputs(batch: InputBatch, so: SchedulerOutput, block_size: int,
                  device: torch.device | str = "cpu") -> BatchInputs:
    """V1's ``GPUModelRunner._prepare_inputs``: the step's flat batch gathered from the persistent batch with NumPy
    fancy indexing, in the plan's order (the same batch as :func:`~minillm.worker.model_runner.prepare_inputs`
    builds from the request states, field by field).

    Raises:
        RuntimeError: the plan schedules tokens the batch does not hold.
    """
    bs = block_size
    req_ids = list(so.num_scheduled_tokens)
    num_reqs = len(req_ids)
    # The batch keeps the scheduler's order; req_indices[i] is the slot of its i-th request.
    req_indices = np.fromiter((batch.req_id_to_index[rid] for rid in req_ids), dtype=np.int64, count=num_reqs)
    num_sched = np.fromiter(so.num_scheduled_tokens.values(), dtype=np.int64, count=num_reqs)
    drafts = [so.scheduled_spec_decode_tokens.get(rid, []) for rid in req_ids]
    num_drafts = np.fromiter(map(len, drafts), dtype=np.int64, count=num_reqs)
    num_computed = batch.num_computed_tokens_cpu[req_indices].astype(np.int64)
    num_known = batch.num_tokens_no_spec[req_indices] + num_drafts  # drafts sit right after the tokens
    seq_lens = num_computed + num_sched
    bad = np.nonzero((seq_lens > num_known) | ((num_drafts > 0) & (seq_lens != num_known)))[0]
    if bad.size:  # drafts are always the last scheduled tokens
        i = int(bad[0])
        raise RuntimeError(f"request {req_ids[i]!r}: scheduled tokens {num_computed[i]}..{seq_lens[i]} but the "
                           f"runner knows {num_known[i] - num_drafts[i]} tokens and {num_drafts[i]} drafts")
    cu = np.cumsum(num_sched)
    total = int(cu[-1])
    query_start_loc = np.zeros(num_reqs + 1, dtype=np.int32)
    query_start_loc[1:] = cu

    # E.g. num_sched [2, 5, 3] -> req_idx [0, 0, 1, 1, 1, 1, 1, 2, 2, 2]; with num_computed [4, 0, 7]
    # positions [4, 5, 0, 1, 2, 3, 4, 7, 8, 9].
    req_idx = np.repeat(np.arange(num_reqs), num_sched)
    positions = np.arange(total, dtype=np.int64) - np.repeat(cu - num_sched - num_computed, num_sched)
    # Token (slot s, position p) is element s * max_model_len + p of the flattened buffer: one gather for the
    # whole step. E.g. slots [3, 0], positions [[4, 5], [0]] -> [3M + 4, 3M + 5, 0] with M = max_model_len.
    token_indices = req_indices[req_idx] * batch.max_model_len + positions
    input_ids = batch.token_ids_cpu.ravel()[token_indices].astype(np.int64)
    max_blocks = int(batch.block_table.num_blocks_per_row[req_indices].max())
    block_table = batch.block_table.block_table[req_indices, :max_blocks]  # rows padded with the null block 0
    slot_mapping = block_table[req_idx, positions // bs].astype(np.int64) * bs + positions % bs
    # Mid-prefill: this step ends before the request's known tokens do (see prepare_inputs).
    discard_request_mask = seq_lens < num_known
    seq_lens = seq_lens.astype(np.int32)

    dev = device
    md = AttentionMetadata(
        query_start_loc=torch.from_numpy(query_start_loc).to(dev),
        seq_lens=torch.from_numpy(seq_lens).to(dev),
        block_table=torch.from_numpy(block_table).to(dev),
        slot_mapping=torch.from_numpy(slot_mapping).to(dev),
        max_query_len=int(num_sched.max()),
        max_seq_len=int(seq_lens.max()),
    )
    return BatchInputs(req_ids, torch.from_numpy(input_ids).to(dev), torch.from_numpy(positions).to(dev), md,
                       torch.from_numpy(cu - 1).to(dev), discard_request_mask, drafts)
