"""The runner's request states: every request it holds, each in a fixed slot from a free list.

A request gets a slot when it arrives and keeps it until it finishes or is preempted; nothing moves when another
request leaves (its slot just goes back on the free list). Each step then picks the slots it runs with an
``idx_mapping`` (batch row -> slot), so the step's batch is gathered from the slots, whatever their order::

    slots        0    1    2    3          free list [3]
    holds        A    B    C    -
    step plans   C (prefill chunk), A (decode)      ->  idx_mapping [0, 2] after sorting decodes first

Per slot it keeps the request's tokens (``all_token_ids``: prompt, then every token sampled so far), ``prompt_len``,
``prefill_len`` (the tokens fed as a prefill: the prompt, plus the outputs of a request resumed after preemption),
``total_len``, ``num_computed_tokens`` (tokens whose K/V are cached), the token sampled last (the next decode's
input) and the drafts to verify next. The sampled tokens are written by :func:`kernels.input_batch.post_update`
after each step: the scheduler never sends them back.

vLLM counterpart: ``vllm/v1/worker/gpu/states.py:RequestState`` (Model Runner V2), whose slot tensors live on the GPU
(or in pinned memory the GPU reads) and whose writes are staged and applied once per step; on a CPU the NumPy and
torch views here are one memory.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


def _positive_int(name: str, value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    return value


class HostDeviceTensor:
    """A per-slot array kept on the host (``np``, read by the step's Python) and on the runner's device (``gpu``,
    read by the input kernels). On a CPU both are one memory; elsewhere :meth:`copy_to_device` copies the host
    values over after they change.

    vLLM counterpart: ``vllm/v1/worker/gpu/buffer_utils.py:UvaBackedTensor`` (``np``, ``gpu``, ``copy_to_uva``).
    """

    def __init__(self, shape: int | tuple[int, ...], dtype: type[np.int32], device: torch.device) -> None:
        # np.zeros maps zero pages lazily: slots and tokens never used cost no memory.
        self.np = np.zeros(shape, dtype=dtype)
        host = torch.from_numpy(self.np)
        self.gpu = host if device.type == "cpu" else host.to(device)

    def copy_to_device(self) -> None:
        if self.gpu.device.type != "cpu":
            self.gpu.copy_(torch.from_numpy(self.np), non_blocking=True)


class RequestState:
    """Slots of request state, taken from a free list.

    Args:
        max_num_reqs: slots: the most requests the runner holds at once.
        max_model_len: the most tokens one request may hold (prompt and outputs together).
        num_speculative_steps: the most drafts a request verifies in one step (0 without speculative decoding).
        device: where the slot tensors the kernels read live.

    Attributes:
        req_id_to_index / index_to_req_id: request id <-> slot.
        free_indices: the free slots; :meth:`add_request` takes the last one.
        all_token_ids: ``[max_num_reqs, max_model_len]`` int32 (device), each slot's tokens so far.
        prompt_len / prefill_len: ``[max_num_reqs]`` int32 (:class:`HostDeviceTensor`).
        total_len: ``[max_num_reqs]`` int32 (device), tokens in ``all_token_ids[s]``.
        num_computed_tokens: ``[max_num_reqs]`` int32 (device), where the slot's next step starts.
        num_computed_tokens_np: its host copy, written from the scheduler's numbers before each step.
        num_computed_prefill_tokens: ``[max_num_reqs]`` int32 (host), ``min(num_computed_tokens, prefill_len)``.
        last_sampled_tokens: ``[max_num_reqs, 1]`` int64 (device), the token each slot sampled last.
        draft_tokens: ``[max_num_reqs, num_speculative_steps]`` int64 (device), each slot's drafts to verify.

    Raises:
        ValueError: a size that is not a positive integer (``num_speculative_steps``: negative); later, a request
            that does not fit (no free slot, more than ``max_model_len`` tokens).
    """

    def __init__(self, max_num_reqs: int, max_model_len: int, num_speculative_steps: int = 0,
                 device: torch.device | str = "cpu") -> None:
        self.max_num_reqs = _positive_int("max_num_reqs", max_num_reqs)
        self.max_model_len = _positive_int("max_model_len", max_model_len)
        if not isinstance(num_speculative_steps, int) or num_speculative_steps < 0:
            raise ValueError(f"num_speculative_steps must be an integer >= 0, got {num_speculative_steps!r}")
        self.num_speculative_steps = num_speculative_steps
        self.device = device = torch.device(device)
        self.req_id_to_index: dict[str, int] = {}
        self.index_to_req_id: dict[int, str] = {}
        self.free_indices = list(range(max_num_reqs))

        self.all_token_ids = HostDeviceTensor((max_num_reqs, max_model_len), np.int32, device).gpu
        self.prompt_len = HostDeviceTensor(max_num_reqs, np.int32, device)
        self.prefill_len = HostDeviceTensor(max_num_reqs, np.int32, device)
        self.total_len = torch.zeros(max_num_reqs, dtype=torch.int32, device=device)
        self.num_computed_tokens = torch.zeros(max_num_reqs, dtype=torch.int32, device=device)
        self.num_computed_tokens_np = np.zeros(max_num_reqs, dtype=np.int32)
        self.num_computed_prefill_tokens = np.zeros(max_num_reqs, dtype=np.int32)
        self.last_sampled_tokens = torch.zeros(max_num_reqs, 1, dtype=torch.int64, device=device)
        self.draft_tokens = torch.zeros(max_num_reqs, num_speculative_steps, dtype=torch.int64, device=device)

    @property
    def num_reqs(self) -> int:
        return len(self.req_id_to_index)

    def add_request(self, req_id: str, prompt_len: int, all_token_ids: Sequence[int],
                    num_computed_tokens: int) -> int:
        """Put a request in a free slot: its tokens (the prompt, or prompt and outputs of a resumed request, all fed
        as a prefill), its prompt length and where its next step starts. Returns the slot.

        Raises:
            ValueError: the id already holds a slot, no slot is free, or the tokens do not fit ``max_model_len``.
                Then nothing changed.
        """
        if req_id in self.req_id_to_index:
            raise ValueError(f"request {req_id!r} already holds slot {self.req_id_to_index[req_id]}")
        if not self.free_indices:
            raise ValueError(f"every one of the {self.max_num_reqs} slots (max_num_reqs) is taken, so {req_id!r} "
                             f"does not fit; raise max_num_reqs (the engine's max_num_seqs)")
        n = len(all_token_ids)
        self._check_fits(req_id, n)
        if not 0 < prompt_len <= n:
            raise ValueError(f"request {req_id!r}: prompt_len must be in 1..{n} (its tokens), got {prompt_len}")
        idx = self.free_indices.pop()
        self.req_id_to_index[req_id] = idx
        self.index_to_req_id[idx] = req_id
        self.prompt_len.np[idx] = prompt_len
        self.prefill_len.np[idx] = n
        self.prompt_len.copy_to_device()
        self.prefill_len.copy_to_device()
        self._write_tokens(idx, all_token_ids)
        self.set_num_computed_tokens(idx, num_computed_tokens)
        if self.num_speculative_steps:
            self.draft_tokens[idx].zero_()
        return idx

    def remove_request(self, req_id: str) -> int | None:
        """Free the request's slot. Returns it, or ``None`` when the request holds none."""
        idx = self.req_id_to_index.pop(req_id, None)
        if idx is None:
            return None
        del self.index_to_req_id[idx]
        self.free_indices.append(idx)
        return idx

    def set_num_computed_tokens(self, idx: int, num_computed_tokens: int) -> None:
        """Where slot ``idx``'s next step starts (the scheduler's number: it knows how many drafts were accepted)."""
        self.num_computed_tokens_np[idx] = num_computed_tokens
        self.num_computed_tokens[idx] = num_computed_tokens
        self.num_computed_prefill_tokens[idx] = min(num_computed_tokens, int(self.prefill_len.np[idx]))

    def replace_tokens(self, idx: int, all_token_ids: Sequence[int]) -> None:
        """Slot ``idx``'s tokens, resent whole by the scheduler (a token this runner appended was dropped, or the
        request recomputes from an earlier position): all of them are fed as a prefill from now on."""
        self._check_fits(self.index_to_req_id.get(idx), len(all_token_ids))
        self.prefill_len.np[idx] = len(all_token_ids)
        self.prefill_len.copy_to_device()
        self._write_tokens(idx, all_token_ids)
        self.num_computed_prefill_tokens[idx] = min(int(self.num_computed_tokens_np[idx]), len(all_token_ids))

    def token_ids(self, req_id: str) -> list[int]:
        """The request's tokens so far (prompt, then outputs), read back from its slot."""
        idx = self.req_id_to_index[req_id]
        return self.all_token_ids[idx, :int(self.total_len[idx])].tolist()

    def _write_tokens(self, idx: int, tokens: Sequence[int]) -> None:
        n = len(tokens)
        self.all_token_ids[idx, :n] = torch.as_tensor(np.asarray(tokens, dtype=np.int32), device=self.device)
        self.total_len[idx] = n
        if n:  # a resumed request's last token is also what its first decode would read
            self.last_sampled_tokens[idx, 0] = int(tokens[-1])

    def _check_fits(self, req_id: str | None, num_tokens: int) -> None:
        if num_tokens > self.max_model_len:
            raise ValueError(f"request {req_id!r} would hold {num_tokens} tokens, more than max_model_len "
                             f"({self.max_model_len}); raise max_model_len")
