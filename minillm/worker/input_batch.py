"""The persistent batch: the running requests' tokens, context lengths and block tables, kept in per-slot NumPy
buffers on the worker and updated in place from step to step.

Slot ``i`` holds a request's ``token_ids_cpu[i]`` (prompt, outputs, then drafts while they are verified),
``num_prompt_tokens[i]``, ``num_computed_tokens_cpu[i]`` and its block-table row; a step writes only what changed, and
the flat batch is gathered with fancy indexing. A freed slot is a hole, filled lowest first; :meth:`InputBatch.condense`
moves the last requests down so they sit in slots ``0 .. num_reqs - 1``::

    slots    0  1  2  3  4        remove B and D        condense: E moves into 1
    before   A  B  C  D  E   ->   A  .  C  .  E   ->   A  E  C

vLLM counterpart: ``vllm/v1/worker/gpu_input_batch.py`` (``InputBatch``: ``add_request``, ``remove_request``,
``condense``, ``token_ids_cpu``, ``num_computed_tokens_cpu``); vLLM keeps the sampling parameters per slot too.
"""
from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from minillm.worker.block_table import BlockTable

if TYPE_CHECKING:  # model_runner imports this module
    from minillm.worker.model_runner import CachedRequestState


def _positive_int(name: str, value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    return value


class InputBatch:
    """Per-slot buffers of the requests in the batch.

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
