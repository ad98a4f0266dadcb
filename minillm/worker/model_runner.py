"""The model runner: one :class:`SchedulerOutput` in, one forward pass over every scheduled token, tokens out.

It is vLLM v0.33.0's Model Runner V2. Each request holds a fixed slot of request state
(:class:`~minillm.worker.states.RequestState`) from its arrival until it finishes or is preempted; each step frees and
fills slots from the plan's diffs (``finish_requests``, ``add_requests``, ``update_requests``), builds the step's
:class:`~minillm.worker.input_batch.InputBatch` from the slots by index with the input kernels (``prepare_inputs``:
``input_ids``, ``positions``, ``query_start_loc``, ``seq_lens``, ``block_table``, ``slot_mapping``,
``logits_indices``) and runs the model once through the paged KV cache (``execute_model``). Then ``sample_tokens``
samples every request, discards the rows of those still mid-prefill (``discard_request_mask``; a seeded generator is
rewound after such a draw), folds the kept tokens into the slots and proposes n-gram drafts; with drafts the
:class:`~minillm.sample.rejection_sampler.RejectionSampler` verifies them. With a KV connector its worker side loads
and saves K/V around the forward pass.

Chapter 6's formulation of the flat batch stays here too: :func:`prepare_inputs` builds the same batch from each
scheduled request's :class:`CachedRequestState` (exercise 6.1), and the runner calls a learner's version through
``prepare_inputs_fn`` (chapter 8).

vLLM counterpart: ``vllm/v1/worker/gpu/model_runner.py:GPUModelRunner`` (``finish_requests``, ``add_requests``,
``update_requests``, ``prepare_inputs``, ``execute_model``, ``sample_tokens``, ``postprocess_sampled``), which seeds
its noise by position and has no generator to rewind; the V1 runner (``vllm/v1/worker/gpu_model_runner.py``) is its
fallback, and the course keeps its persistent batch in ``minillm/course/persistent_batch.py``.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Required, TypedDict

import numpy as np
import torch

from kernels.input_batch import (
    combine_sampled_and_draft_tokens,
    post_update,
    prepare_pos_seq_lens,
    prepare_prefill_inputs,
)
from minillm.attention.backend import AttentionImpl
from minillm.attention.metadata import AttentionMetadata
from minillm.attention.paged import BACKENDS, PagedAttention, allocate_kv_caches
from minillm.attention.torch_sdpa import TorchSDPAAttention
from minillm.config import SpeculativeConfig
from minillm.core.sched.output import KVConnectorOutput, ModelRunnerOutput, SchedulerOutput
from minillm.distributed.kv_transfer.base import KVConnectorBase_V1
from minillm.distributed.kv_transfer.kv_transfer_utils import KVConnectorAttention
from minillm.model.llama import LlamaForCausalLM
from minillm.model.llama_tp import TensorParallelLlamaForCausalLM
from minillm.outputs import SamplerOutput
from minillm.sample.metadata import SamplingMetadata, make_generator
from minillm.sample.ops.topk_topp import apply_top_k_top_p
from minillm.sample.rejection_sampler import RejectionSampler
from minillm.sample.sampler import Sampler
from minillm.sampling_params import SamplingParams, SamplingType
from minillm.spec_decode.metadata import SpecDecodeMetadata
from minillm.spec_decode.ngram_proposer import NgramProposer
from minillm.worker.block_table import BlockTables
from minillm.worker.input_batch import InputBatch
from minillm.worker.states import RequestState

# The runner's request slots when the caller does not say (the engine passes its max_num_seqs).
DEFAULT_MAX_NUM_REQS = 1024


@dataclass
class CachedRequestState:
    """One request as chapter 6 sees it: what :func:`prepare_inputs` reads (the runner reads it back from the
    request's slot: :meth:`ModelRunner.request_views`).

    Attributes:
        token_ids: prompt then outputs, every token the runner knows (it appends the tokens it samples).
        block_ids: the request's KV blocks in token order (its ``block_table`` row).
        num_computed_tokens: tokens whose K/V are in those blocks before this step.
        generator: the request's own random generator when it has a ``seed``. Kept across preemptions, so a seeded
            request draws the same tokens whether it was preempted or not.
    """

    req_id: str
    num_prompt_tokens: int
    sampling_params: SamplingParams
    token_ids: list[int]
    block_ids: list[int]
    num_computed_tokens: int
    generator: torch.Generator | None = None

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]


@dataclass
class BatchInputs:
    """The flat batch of one step (all tensors on the model's device).

    Attributes:
        req_ids: the scheduled requests, in batch order (request ``i`` owns rows ``query_start_loc[i] :
            query_start_loc[i+1]``).
        input_ids: ``[num_tokens]`` int64 token ids.
        positions: ``[num_tokens]`` int64 absolute positions (``num_computed_tokens + j`` for the ``j``-th new token).
        attn_metadata: ``query_start_loc`` ``[num_reqs + 1]``, ``seq_lens`` ``[num_reqs]``, ``block_table``
            ``[num_reqs, max_num_blocks]``, ``slot_mapping`` ``[num_tokens]``.
        logits_indices: ``[num_reqs]`` int64, the last row of each request (``query_start_loc[1:] - 1``). Every
            request's row is sent to the LM head and sampled, mid-prefill or not (as in vLLM).
        discard_request_mask: ``[num_reqs]`` bool (NumPy), ``True`` where this step's tokens stop short of the
            request's tokens (``seq_lens < num_tokens``: mid-prefill), so the token sampled at its
            ``logits_indices`` row is thrown away. vLLM's name (``GPUModelRunner.discard_request_mask``).
        draft_token_ids: per request, the draft tokens at the end of its rows (empty without speculative decoding).
    """

    req_ids: list[str]
    input_ids: torch.Tensor
    positions: torch.Tensor
    attn_metadata: AttentionMetadata
    logits_indices: torch.Tensor
    discard_request_mask: np.ndarray
    draft_token_ids: list[list[int]]

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def query_start_loc(self) -> torch.Tensor:
        return self.attn_metadata.query_start_loc

    @property
    def seq_lens(self) -> torch.Tensor:
        return self.attn_metadata.seq_lens

    @property
    def block_table(self) -> torch.Tensor:
        return self.attn_metadata.block_table

    @property
    def slot_mapping(self) -> torch.Tensor:
        return self.attn_metadata.slot_mapping


def prepare_inputs(scheduler_output: SchedulerOutput, requests: dict[str, CachedRequestState], block_size: int,
                   device: torch.device | str = "cpu") -> BatchInputs:
    """The flat batch of one step: every scheduled token of every request, prefill chunks and decodes together.

    Args:
        scheduler_output: this step's :class:`SchedulerOutput`; request ``i`` of the batch is the ``i``-th key of
            ``num_scheduled_tokens``, and gets that many tokens.
        requests: the runner's request states, already updated for this step (``num_computed_tokens`` is where
            this step starts, ``block_ids`` cover every scheduled token).
        block_size: tokens per KV block.
        device: where the tensors go.

    Returns:
        :class:`BatchInputs`: ``input_ids``/``positions``/``slot_mapping`` ``[num_tokens]``, ``query_start_loc``
        ``[num_reqs + 1]``, ``seq_lens`` ``[num_reqs]``, ``block_table`` ``[num_reqs, max_num_blocks]`` (rows padded
        with the null block 0), ``logits_indices`` ``[num_reqs]`` (each request's last row) and
        ``discard_request_mask`` ``[num_reqs]``.

    The model runner calls it as its ``prepare_inputs_fn`` when it is given a learner's, which is how chapter 8 runs a
    learner's own version in the engine.
    vLLM v0.33.0: ``vllm/v1/worker/gpu_model_runner.py:GPUModelRunner._prepare_inputs``, which fills persistent
    buffers of the ``InputBatch`` in place instead of building new arrays.
    """
    so = scheduler_output
    req_ids = list(so.num_scheduled_tokens)
    states = [requests[rid] for rid in req_ids]
    num_reqs = len(states)
    num_sched = np.fromiter(so.num_scheduled_tokens.values(), dtype=np.int64, count=num_reqs)
    num_computed = np.fromiter((s.num_computed_tokens for s in states), dtype=np.int64, count=num_reqs)
    cu = np.cumsum(num_sched)
    total = int(cu[-1])
    query_start_loc = np.zeros(num_reqs + 1, dtype=np.int32)
    query_start_loc[1:] = cu

    # Token j of the batch belongs to request req_idx[j]; its position is that request's context + offset.
    req_idx = np.repeat(np.arange(num_reqs), num_sched)
    positions = np.arange(total, dtype=np.int64) - np.repeat(cu - num_sched - num_computed, num_sched)
    input_ids = np.empty(total, dtype=np.int64)
    drafts = [so.scheduled_spec_decode_tokens.get(rid, []) for rid in req_ids]
    for i, s in enumerate(states):
        c, n = int(num_computed[i]), int(num_sched[i])
        known = len(s.token_ids) + len(drafts[i])
        if c + n > known or (drafts[i] and c + n != known):  # drafts are always the last scheduled tokens
            raise RuntimeError(f"request {s.req_id!r}: scheduled tokens {c}..{c + n} but the runner knows "
                               f"{len(s.token_ids)} tokens and {len(drafts[i])} drafts")
        # Slice before appending the drafts: copying the whole history every step would cost O(seq_len).
        input_ids[query_start_loc[i]:query_start_loc[i] + n] = s.token_ids[c:c + n] + drafts[i]

    max_blocks = max(len(s.block_ids) for s in states)
    block_table = np.zeros((num_reqs, max_blocks), dtype=np.int32)  # the null block 0 pads short rows
    for i, s in enumerate(states):
        block_table[i, :len(s.block_ids)] = s.block_ids
    slot_mapping = (block_table[req_idx, positions // block_size].astype(np.int64) * block_size
                    + positions % block_size)
    seq_lens = (num_computed + num_sched).astype(np.int32)
    # Mid-prefill: this step ends before the request's known tokens do (drafts count as known: they are the
    # last scheduled tokens), so the token predicted at its last row is already known. vLLM v0.33.0:
    # discard_request_mask = seq_lens < num_tokens (gpu_model_runner.py:GPUModelRunner._prepare_inputs).
    discard_request_mask = seq_lens < np.fromiter(
        (len(s.token_ids) + len(d) for s, d in zip(states, drafts, strict=True)), dtype=np.int64, count=num_reqs)

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


def sort_batch_req_ids(num_scheduled_tokens: dict[str, int], draft_tokens: dict[str, list[int]],
                       decode_query_len: int = 1) -> list[str]:
    """The step's batch order: requests verifying drafts first, then decodes (``decode_query_len`` tokens), then the
    others by their number of tokens (short extends before long prefills); ties keep the scheduler's order.

    vLLM v0.33.0: ``vllm/v1/worker/gpu/model_runner.py:sort_batch_req_ids`` (attention backends that split a batch
    into decodes and prefills want the decode-like rows first).
    """
    return sorted(num_scheduled_tokens, key=lambda r: (not draft_tokens.get(r),
                                                        (n := num_scheduled_tokens[r]) != decode_query_len, n))


class ModelRunnerArgs(TypedDict, total=False):
    """:class:`ModelRunner`'s keyword arguments, as the engine core hands them to each worker (without
    ``num_blocks``: the worker gets it from the engine core at ``initialize_from_config``)."""

    num_blocks: int
    block_size: Required[int]
    attention_backend: str
    kv_cache_dtype: torch.dtype | None
    eos_token_id: int | None
    speculative_config: SpeculativeConfig | None
    attention_fn: Callable[..., torch.Tensor] | None
    top_k_top_p: Callable[..., torch.Tensor]
    prepare_inputs_fn: Callable[..., BatchInputs]
    kv_connector: KVConnectorBase_V1 | None
    max_num_reqs: int | None
    max_model_len: int | None
    num_kv_heads: int | None


@dataclass
class RequestInfo:
    """What the runner keeps of a request from its arrival until it finishes, whether it holds a slot or not (a
    preempted request gives its slot back and gets a new one when it resumes).

    Attributes:
        sampling_params: how to sample its tokens.
        prompt_len: tokens of its prompt (the rest of its tokens are outputs: penalties and ``min_tokens`` tell them
            apart).
        generator: its own random generator when it has a ``seed``; kept across preemptions, so a seeded request
            draws the same tokens whether it was preempted or not.
    """

    sampling_params: SamplingParams
    prompt_len: int
    generator: torch.Generator | None = None


@dataclass
class ExecuteModelState:
    """What :meth:`ModelRunner.execute_model` leaves for :meth:`ModelRunner.sample_tokens`: the step's batch and
    the hidden states of its tokens, ``[num_tokens, hidden_size]``."""

    input_batch: InputBatch
    hidden_states: torch.Tensor
    kv_connector_output: KVConnectorOutput | None
    start: float


class ModelRunner:
    """Owns the paged KV cache and runs the model on scheduler outputs, as vLLM v0.33.0's Model Runner V2 does.

    Each step comes in two calls. :meth:`execute_model` frees the slots of finished and preempted requests, gives
    new and resumed ones a slot (:class:`~minillm.worker.states.RequestState`), writes the step's new blocks and
    context lengths, builds the step's :class:`~minillm.worker.input_batch.InputBatch` by index from the slots
    (:meth:`prepare_inputs`, with the input kernels) and runs the model. :meth:`sample_tokens` then samples (between
    the two calls vLLM's engine core computes the grammar bitmask of structured outputs), folds the kept tokens into
    the slots (:func:`kernels.input_batch.post_update`) and proposes n-gram drafts.

    Args:
        model: the model (:class:`~minillm.model.llama.LlamaForCausalLM`), or a tensor-parallel rank's shard of it
            (:class:`~minillm.model.llama_tp.TensorParallelLlamaForCausalLM`, whose logits come back whole).
        num_blocks: KV cache blocks, the null block 0 included (the scheduler's ``num_gpu_blocks``).
        block_size: tokens per block.
        attention_backend: ``"torch"`` or ``"triton"``.
        kv_cache_dtype: the cache's dtype (default: the model's).
        eos_token_id: the EOS id that ``min_tokens`` blocks (default: the model config's).
        speculative_config: ``None``, or a :class:`~minillm.config.SpeculativeConfig`: propose drafts after each
            step.
        attention_fn: ``None`` for the configured backend, or exercise 1.2's ``(q, k, v, ctx_len) -> out``, run
            request by request over its gathered paged K/V (chapter 8 hands a learner's down here).
        top_k_top_p: the sampler's top-k/top-p filter (exercise 5.1's signature; default: the package's).
        prepare_inputs_fn: the step's input build (exercise 6.1's signature); the package's own
            :func:`prepare_inputs` means: build it from the slots with the input kernels. A learner's (chapter 8) is
            called as ``prepare_inputs(scheduler_output, requests, block_size, device)`` with
            :meth:`request_views` of the scheduled requests.
        kv_connector: the worker side of a KV connector (chapter 9), or ``None``.
        max_num_reqs: slots, the most requests the runner holds at once (the engine's ``max_num_seqs``); ``None``:
            ``num_blocks - 1`` (each request holds a block of its own), at most :data:`DEFAULT_MAX_NUM_REQS`.
        max_model_len: the most tokens one request may reach (the engine's ``max_model_len``); ``None``: the
            model's ``max_position_embeddings``.
        num_kv_heads: the KV heads its cache holds: ``None`` for all of them; a tensor-parallel rank's share
            (its :class:`~minillm.model.llama_tp.TensorParallelLlamaForCausalLM` ``num_kv_heads``).

    Attributes:
        req_states: the slots (:class:`~minillm.worker.states.RequestState`).
        block_tables: their block tables (:class:`~minillm.worker.block_table.BlockTables`).
        requests_info: request id -> :class:`RequestInfo`, every request the runner holds (preempted ones too).
        kv_caches: one ``(key_cache, value_cache)`` per layer, each ``[num_blocks, block_size, num_kv_heads,
            head_dim]``.
        last_inputs: the :class:`~minillm.worker.input_batch.InputBatch` of the latest step (for inspection and
            teaching).
        last_sampler_output: the latest step's :class:`~minillm.outputs.SamplerOutput`, one row per scheduled
            request in ``last_inputs.req_ids`` order: ``sampled_token_ids`` int32 ``[num_reqs, 1]`` without drafts,
            ``[num_reqs, max_num_draft + 1]`` with them. Rows where ``last_inputs.discard_request_mask`` is set hold
            a token that was sampled and then dropped (it never reaches the request or the outputs).
        last_step_seconds: wall time of the latest step, both calls.
    """

    def __init__(self, model: LlamaForCausalLM | TensorParallelLlamaForCausalLM, num_blocks: int, block_size: int,
                 attention_backend: str = "torch", kv_cache_dtype: torch.dtype | None = None,
                 eos_token_id: int | None = None, speculative_config: SpeculativeConfig | None = None,
                 attention_fn: Callable[..., torch.Tensor] | None = None,
                 top_k_top_p: Callable[..., torch.Tensor] = apply_top_k_top_p,
                 prepare_inputs_fn: Callable[..., BatchInputs] = prepare_inputs,
                 kv_connector: KVConnectorBase_V1 | None = None, max_num_reqs: int | None = None,
                 max_model_len: int | None = None, num_kv_heads: int | None = None) -> None:
        if attention_backend not in BACKENDS:
            raise ValueError(f"attention_backend must be one of {BACKENDS}, got {attention_backend!r}")
        self.model = model
        self.device = model.device
        self.block_size = block_size
        self.attention_backend = attention_backend
        self.vocab_size = model.config.vocab_size
        self.eos_token_id = model.config.eos_token_id if eos_token_id is None else eos_token_id
        self.kv_caches = allocate_kv_caches(model.config, num_blocks, block_size, kv_cache_dtype or model.dtype,
                                            self.device, num_kv_heads)
        self.attention_fn = attention_fn
        self.prepare_inputs_fn = prepare_inputs_fn
        self.sampler = Sampler(top_k_top_p=top_k_top_p)
        self.rejection_sampler = RejectionSampler()
        self.drafter: NgramProposer | None = None
        if speculative_config is not None:
            self.drafter = NgramProposer(speculative_config.prompt_lookup_min, speculative_config.prompt_lookup_max,
                                         speculative_config.num_speculative_tokens)
        if max_num_reqs is None:
            # Every scheduled request computes at least its last token into a block of its own, so no more than
            # num_blocks - 1 requests run in one step; the cap keeps a huge cache from sizing the slots.
            max_num_reqs = max(1, min(num_blocks - 1, DEFAULT_MAX_NUM_REQS))
        self.max_num_reqs = max_num_reqs
        self.max_model_len = model.config.max_position_embeddings if max_model_len is None else max_model_len
        num_spec = 0 if speculative_config is None else speculative_config.num_speculative_tokens
        self.req_states = RequestState(max_num_reqs, self.max_model_len, num_spec, self.device)
        self.block_tables = BlockTables(block_size, max_num_reqs, -(-self.max_model_len // block_size), self.device)
        self.requests_info: dict[str, RequestInfo] = {}
        self.execute_model_state: ExecuteModelState | None = None
        self.last_inputs: InputBatch | None = None
        self.last_sampler_output: SamplerOutput | None = None
        self.last_step_seconds = 0.0
        self.kv_connector = kv_connector
        if kv_connector is not None:
            kv_connector.register_kv_caches(self.kv_caches)

    # -- 1. requests in and out of the slots ------------------------------------------------------------------------
    def finish_requests(self, so: SchedulerOutput) -> None:
        """Free the slots of the requests that finished or were preempted, in sorted order (so every
        tensor-parallel rank frees them alike). A finished request is forgotten; a preempted one keeps its
        :class:`RequestInfo` (its sampling parameters and seeded generator) for its resumption."""
        for rid in sorted(so.finished_req_ids | so.preempted_req_ids):
            self.req_states.remove_request(rid)
        for rid in so.finished_req_ids:
            self.requests_info.pop(rid, None)

    def add_requests(self, so: SchedulerOutput) -> None:
        """Give each new request, and each request resumed after preemption, a slot: its tokens (the prompt; for a
        resumed one the prompt and its outputs, all fed again as a prefill), its blocks (the whole list) and where its
        step starts."""
        for new in so.scheduled_new_reqs:
            params = new.sampling_params
            gen = None
            if params.sampling_type == SamplingType.RANDOM_SEED and params.seed is not None:
                gen = make_generator(params.seed, self.device)
            self.requests_info[new.req_id] = RequestInfo(params, len(new.prompt_token_ids), gen)
            self._add(new.req_id, new.prompt_token_ids, new.block_ids, new.num_computed_tokens)
        cached = so.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            if rid in cached.resumed_req_ids:
                if rid not in cached.all_token_ids:
                    raise RuntimeError(f"request {rid!r} resumes without its tokens: a resumed request's "
                                       f"all_token_ids must come with the plan")
                self._add(rid, cached.all_token_ids[rid], cached.new_block_ids[i], cached.num_computed_tokens[i])

    def _add(self, rid: str, token_ids: list[int], block_ids: list[int], num_computed_tokens: int) -> None:
        if rid not in self.requests_info:
            raise RuntimeError(f"request {rid!r} was never sent to this runner as a new request")
        self.req_states.remove_request(rid)  # resumed while it still held a slot (preempted between two plans)
        idx = self.req_states.add_request(rid, self.requests_info[rid].prompt_len, token_ids, num_computed_tokens)
        self.block_tables.append_block_ids(idx, block_ids, overwrite=True)

    def update_requests(self, so: SchedulerOutput) -> None:
        """The scheduled requests that kept their slot: their new blocks, where their step starts (the scheduler's
        number: it knows how many drafts were accepted), tokens resent whole (a token this runner appended was
        dropped, or the request recomputes after a failed KV load), and the drafts they verify."""
        cached = so.scheduled_cached_reqs
        states = self.req_states
        for i, rid in enumerate(cached.req_ids):
            if rid in cached.resumed_req_ids:
                continue
            idx = states.req_id_to_index.get(rid)
            if idx is None:
                raise RuntimeError(f"request {rid!r} is scheduled as running but holds no slot in this runner")
            if rid in cached.all_token_ids:
                states.replace_tokens(idx, cached.all_token_ids[rid])
            states.set_num_computed_tokens(idx, cached.num_computed_tokens[i])
            if cached.new_block_ids[i]:
                self.block_tables.append_block_ids(idx, cached.new_block_ids[i], overwrite=False)
        for rid, drafts in so.scheduled_spec_decode_tokens.items():
            if drafts:
                idx = states.req_id_to_index[rid]
                states.draft_tokens[idx, :len(drafts)] = torch.tensor(drafts, dtype=torch.int64)

    @property
    def requests(self) -> dict[str, CachedRequestState]:
        """Every request that holds a slot, as chapter 6's :class:`CachedRequestState` (:meth:`request_views`: a
        snapshot read back from the slots, for inspection; a preempted request holds none until it resumes)."""
        return self.request_views()

    def request_views(self, req_ids: Iterable[str] | None = None) -> dict[str, CachedRequestState]:
        """Chapter 6's view of requests that hold a slot (default: all of them), read back from the slots: their
        tokens, blocks and context length (copies: changing them changes nothing here)."""
        states, tables = self.req_states, self.block_tables
        views = {}
        for rid in states.req_id_to_index if req_ids is None else req_ids:
            idx = states.req_id_to_index[rid]
            info = self.requests_info[rid]
            views[rid] = CachedRequestState(
                rid, info.prompt_len, info.sampling_params, states.token_ids(rid),
                tables.block_table.np[idx, :tables.num_blocks.np[idx]].tolist(),
                int(states.num_computed_tokens_np[idx]), info.generator)
        return views

    # -- 2. the step's batch, by index ------------------------------------------------------------------------------
    def prepare_inputs(self, so: SchedulerOutput) -> InputBatch:
        """The step's :class:`~minillm.worker.input_batch.InputBatch`, built from the slots by the input kernels:
        ``prepare_prefill_inputs`` (prompt chunks), ``prepare_pos_seq_lens``, ``combine_sampled_and_draft_tokens``
        (last sampled tokens and drafts; the logits rows), ``gather_block_tables`` and ``compute_slot_mappings``.

        Raises:
            RuntimeError: the plan schedules tokens the runner does not hold (past its tokens and drafts).

        vLLM v0.33.0: ``vllm/v1/worker/gpu/model_runner.py:GPUModelRunner.gather_batch_req_state`` and
        ``prepare_inputs``.
        """
        if self.prepare_inputs_fn is not prepare_inputs:
            return self._from_learners_inputs(so)
        states, dev = self.req_states, self.device
        drafts = so.scheduled_spec_decode_tokens
        req_ids = sort_batch_req_ids(so.num_scheduled_tokens, drafts)
        num_reqs = len(req_ids)
        num_sched = np.fromiter(map(so.num_scheduled_tokens.__getitem__, req_ids), dtype=np.int32, count=num_reqs)
        idx_np = np.fromiter(map(states.req_id_to_index.__getitem__, req_ids), dtype=np.int64, count=num_reqs)
        draft_lists = [drafts.get(rid, []) for rid in req_ids]
        num_drafts = np.fromiter(map(len, draft_lists), dtype=np.int32, count=num_reqs)
        num_computed = states.num_computed_tokens_np[idx_np].astype(np.int64)
        prefill_len = states.prefill_len.np[idx_np]
        # The host's count of each slot's tokens: prefill tokens, plus one per decode step so far.
        idx_mapping = torch.from_numpy(idx_np).to(dev)
        num_known = states.total_len[idx_mapping].cpu().numpy().astype(np.int64) + num_drafts
        seq_lens_np = num_computed + num_sched
        bad = np.nonzero((seq_lens_np > num_known) | ((num_drafts > 0) & (seq_lens_np != num_known)))[0]
        if bad.size:  # drafts are always the last scheduled tokens
            i = int(bad[0])
            raise RuntimeError(f"request {req_ids[i]!r}: scheduled tokens {num_computed[i]}..{seq_lens_np[i]} but the "
                               f"runner knows {num_known[i] - num_drafts[i]} tokens and {num_drafts[i]} drafts")
        num_tokens = int(num_sched.sum())
        # Each step's tensors are its own (vLLM writes them into fixed buffers, InputBuffers, for its CUDA graphs):
        # a batch kept for inspection, like last_inputs, stays as it was.
        qsl_np = np.zeros(num_reqs + 1, dtype=np.int32)
        np.cumsum(num_sched, out=qsl_np[1:])
        query_start_loc = torch.from_numpy(qsl_np.copy()).to(dev)
        cu_logits_np = np.zeros(num_reqs + 1, dtype=np.int32)
        np.cumsum(num_drafts + 1, out=cu_logits_np[1:])
        cu_num_logits = torch.from_numpy(cu_logits_np).to(dev)
        num_logits = int(cu_logits_np[-1])

        is_prefilling = states.num_computed_prefill_tokens[idx_np] < prefill_len
        input_ids = torch.zeros(num_tokens, dtype=torch.int64, device=dev)
        positions = torch.empty(num_tokens, dtype=torch.int64, device=dev)
        seq_lens = torch.empty(num_reqs, dtype=torch.int32, device=dev)
        if is_prefilling.any():
            prepare_prefill_inputs(input_ids, idx_mapping, query_start_loc, states.all_token_ids,
                                   states.prefill_len.gpu, states.num_computed_tokens)
        prepare_pos_seq_lens(idx_mapping, query_start_loc, states.num_computed_tokens, positions, seq_lens)
        logits_indices = combine_sampled_and_draft_tokens(
            input_ids, idx_mapping, states.last_sampled_tokens, query_start_loc, seq_lens,
            states.prefill_len.gpu, states.draft_tokens, cu_num_logits, num_logits)
        max_blocks = int(self.block_tables.num_blocks.np[idx_np].max())
        block_table = self.block_tables.gather_block_tables(idx_mapping, max_blocks)
        slot_mapping = self.block_tables.compute_slot_mappings(idx_mapping, query_start_loc, positions)
        md = AttentionMetadata(query_start_loc=query_start_loc, seq_lens=seq_lens, block_table=block_table,
                               slot_mapping=slot_mapping, max_query_len=int(num_sched.max()),
                               max_seq_len=int(seq_lens_np.max()))
        return InputBatch(
            req_ids=req_ids, num_reqs=num_reqs, idx_mapping=idx_mapping, idx_mapping_np=idx_np,
            num_scheduled_tokens=num_sched, num_tokens=num_tokens, num_draft_tokens=int(num_drafts.sum()),
            num_draft_tokens_per_req=num_drafts if drafts else None, query_start_loc=query_start_loc,
            query_start_loc_np=qsl_np, seq_lens=seq_lens, seq_lens_np=seq_lens_np.astype(np.int32),
            is_prefilling_np=is_prefilling, input_ids=input_ids, positions=positions, logits_indices=logits_indices,
            cu_num_logits=cu_num_logits, cu_num_logits_np=cu_logits_np,
            # Mid-prefill: this step ends before the request's known tokens do, so the token predicted at its last
            # row is already known (vLLM: seq_lens < num_tokens).
            discard_request_mask=seq_lens_np < num_known, attn_metadata=md, draft_token_ids=draft_lists)

    def _from_learners_inputs(self, so: SchedulerOutput) -> InputBatch:
        """The step's batch from a learner's ``prepare_inputs`` (chapter 8), in the learner's row order."""
        views = self.request_views(so.num_scheduled_tokens)
        x = self.prepare_inputs_fn(so, views, self.block_size, self.device)
        dev = self.device
        num_reqs = len(x.req_ids)
        idx_np = np.fromiter(map(self.req_states.req_id_to_index.__getitem__, x.req_ids), dtype=np.int64,
                             count=num_reqs)
        num_drafts = np.fromiter(map(len, x.draft_token_ids), dtype=np.int32, count=num_reqs)
        cu_logits_np = np.zeros(num_reqs + 1, dtype=np.int32)
        np.cumsum(num_drafts + 1, out=cu_logits_np[1:])
        # Each row's logits: its drafts' rows and the one before them, ending at its last row.
        ends = x.logits_indices.tolist()
        logits_indices = torch.tensor([j for e, d in zip(ends, num_drafts.tolist(), strict=True)
                                       for j in range(e - d, e + 1)], dtype=torch.int64, device=dev)
        qsl_np = x.query_start_loc.cpu().numpy().astype(np.int32)
        num_sched = np.diff(qsl_np).astype(np.int32)
        seq_lens_np = x.seq_lens.cpu().numpy().astype(np.int32)
        prefill_len = self.req_states.prefill_len.np[idx_np]
        return InputBatch(
            req_ids=list(x.req_ids), num_reqs=num_reqs, idx_mapping=torch.from_numpy(idx_np).to(dev),
            idx_mapping_np=idx_np, num_scheduled_tokens=num_sched, num_tokens=x.num_tokens,
            num_draft_tokens=int(num_drafts.sum()), num_draft_tokens_per_req=num_drafts if num_drafts.any() else None,
            query_start_loc=x.query_start_loc, query_start_loc_np=qsl_np, seq_lens=x.seq_lens,
            seq_lens_np=seq_lens_np, is_prefilling_np=seq_lens_np - num_sched < prefill_len,
            input_ids=x.input_ids, positions=x.positions, logits_indices=logits_indices,
            cu_num_logits=torch.from_numpy(cu_logits_np).to(dev), cu_num_logits_np=cu_logits_np,
            discard_request_mask=np.asarray(x.discard_request_mask, dtype=bool), attn_metadata=x.attn_metadata,
            draft_token_ids=[list(d) for d in x.draft_token_ids])

    def make_attention(self, md: AttentionMetadata) -> AttentionImpl:
        """The :class:`~minillm.attention.backend.AttentionImpl` of one step: ``attention_fn`` request by request
        when it is set, else the configured backend; wrapped in the KV connector's layer hooks when there is one."""
        attn: AttentionImpl
        if self.attention_fn is not None:
            attn = PagedAttention(self.kv_caches, md, backend="torch", attend=self.attention_fn)
        elif self.attention_backend == "torch":
            attn = TorchSDPAAttention(self.kv_caches, md)
        else:
            attn = PagedAttention(self.kv_caches, md, backend="triton")
        if self.kv_connector is not None:
            return KVConnectorAttention(attn, self.kv_connector, self.kv_caches, md)
        return attn

    # -- 3. the forward pass ----------------------------------------------------------------------------------------
    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        """The first half of a step: update the slots from the plan, build the batch, run the model.

        Returns:
            ``None`` when the step has tokens to sample: :meth:`sample_tokens` returns its output. A plan that
            schedules no token gets its (empty) :class:`ModelRunnerOutput` here, with the KV connector's report.

        vLLM v0.33.0: ``vllm/v1/worker/gpu/model_runner.py:GPUModelRunner.execute_model``.
        """
        # A step never sampled was abandoned (the engine core aborts the requests it touched after a failure or a
        # Ctrl-C between the two calls): its hidden states go.
        self.execute_model_state = None
        start = time.perf_counter()
        so = scheduler_output
        connector = self.kv_connector
        if connector is not None:
            # The connector's step: bind the plan, load before the forward pass (layers save during it), then
            # submit the saves and report what finished. vLLM: vllm/v1/worker/gpu/kv_connector.py.
            if so.kv_connector_metadata is None:
                raise ValueError("a runner with a KV connector needs each plan's kv_connector_metadata: give the "
                                 "scheduler the connector's scheduler side (Scheduler.set_kv_connector)")
            connector.bind_connector_metadata(so.kv_connector_metadata)
        try:
            self.finish_requests(so)
            self.add_requests(so)
            self.update_requests(so)
            if connector is not None:
                connector.start_load_kv()
            if so.total_num_scheduled_tokens == 0:
                output = ModelRunnerOutput([], {}, [])
                output.kv_connector_output = self._connector_output(so)
                self.last_step_seconds = time.perf_counter() - start
                return output
            batch = self.prepare_inputs(so)
            self.last_inputs = batch
            hidden = self.model(batch.input_ids, batch.positions, attn=self.make_attention(batch.attn_metadata))
            kv_output = self._connector_output(so)
        finally:
            if connector is not None:
                connector.clear_connector_metadata()
        self.execute_model_state = ExecuteModelState(batch, hidden, kv_output, start)
        return None

    def _connector_output(self, so: SchedulerOutput) -> KVConnectorOutput | None:
        connector = self.kv_connector
        if connector is None:
            return None
        connector.wait_for_save()
        sending, recving = connector.get_finished(set(so.finished_req_ids))
        return KVConnectorOutput(finished_sending=set(sending or ()), finished_recving=set(recving or ()),
                                 failed_recving=connector.get_failed_recving(),
                                 invalid_block_ids=connector.get_block_ids_with_load_errors())

    # -- 4. sampling ------------------------------------------------------------------------------------------------
    def _sampling_metadata(self, batch: InputBatch) -> SamplingMetadata:
        infos = [self.requests_info[rid] for rid in batch.req_ids]
        params = [i.sampling_params for i in infos]
        need_history = any(p.has_penalties or p.min_tokens > 0 for p in params)
        prompts = outputs = None
        if need_history:
            tokens = [self.req_states.token_ids(rid) for rid in batch.req_ids]
            prompts = [t[:i.prompt_len] for t, i in zip(tokens, infos, strict=True)]
            outputs = [t[i.prompt_len:] for t, i in zip(tokens, infos, strict=True)]
        return SamplingMetadata.from_params(
            params, prompt_token_ids=prompts, output_token_ids=outputs, eos_token_id=self.eos_token_id,
            generators={k: i.generator for k, i in enumerate(infos) if i.generator is not None}, device=self.device)

    @torch.inference_mode()
    def sample_tokens(self, grammar_output: object | None = None) -> ModelRunnerOutput:
        """The second half of a step: sample every row (verifying drafts with the rejection sampler), drop the rows
        still mid-prefill, append the kept tokens to the slots, propose the next drafts.

        Args:
            grammar_output: the structured-output grammar bitmask of the step (vLLM's ``GrammarOutput``); this
                engine has no structured outputs yet, so it must be ``None``.

        Returns:
            one row per scheduled request, in the batch's order: the tokens it keeps (``[token]`` without drafts), or
            ``[]`` if it is still mid-prefill (its row was sampled and discarded).

        vLLM v0.33.0: ``vllm/v1/worker/gpu/model_runner.py:GPUModelRunner.sample_tokens``.
        """
        state = self.execute_model_state
        if state is None:
            raise RuntimeError("sample_tokens needs a step whose execute_model returned None")
        if grammar_output is not None:
            raise ValueError("this engine has no structured outputs: grammar_output must be None")
        self.execute_model_state = None
        batch, hidden = state.input_batch, state.hidden_states
        infos = [self.requests_info[rid] for rid in batch.req_ids]
        discard = np.nonzero(batch.discard_request_mask)[0].tolist()
        # A discarded draw must not advance a seeded request's generator, or its later samples would depend on how
        # its prompt was chunked. vLLM rewinds the CUDA Philox offset by the 4 one draw takes; restoring the saved
        # state is the same thing, exact for any generator (CPU ones have no offset).
        rewind = [(gen, gen.get_state()) for i in discard if (gen := infos[i].generator) is not None]
        md = self._sampling_metadata(batch)
        logits = self.model.compute_logits(hidden[batch.logits_indices])  # [num_logits, vocab]
        if batch.num_draft_tokens:
            spec = SpecDecodeMetadata.make(batch.draft_token_ids)
            out = self.rejection_sampler(spec, None, logits, md)
            sampled = RejectionSampler.parse_output(out.sampled_token_ids, self.vocab_size)
        else:
            out = self.sampler(logits, md)
            sampled = out.sampled_token_ids.tolist()  # [num_reqs][1]
        for gen, gen_state in rewind:
            gen.set_state(gen_state)
        self.last_sampler_output = out
        for i in discard:
            sampled[i] = []  # mid-prefill: the token never reaches the request (vLLM clears the row too)
        self._post_update(batch, out.sampled_token_ids, sampled)

        logprobs: dict[str, list[dict[int, float]]] | None = None
        if out.logprobs_tensors is not None:
            ids, lps, _ = out.logprobs_tensors.tolists()
            logprobs = {}
            for k, (rid, info) in enumerate(zip(batch.req_ids, infos, strict=True)):
                n = info.sampling_params.logprobs
                if n is not None and sampled[k]:
                    logprobs[rid] = [dict(zip(ids[k][:n + 1], lps[k][:n + 1], strict=True))]
        draft_token_ids = self._propose_drafts(batch.req_ids, sampled) if self.drafter is not None else None
        self.last_step_seconds = time.perf_counter() - state.start
        output = ModelRunnerOutput(batch.req_ids, {rid: i for i, rid in enumerate(batch.req_ids)}, sampled, logprobs,
                                   draft_token_ids)
        output.kv_connector_output = state.kv_connector_output
        return output

    def _post_update(self, batch: InputBatch, sampled_tokens: torch.Tensor, sampled: list[list[int]]) -> None:
        """Fold the kept tokens into the slots (:func:`kernels.input_batch.post_update`): appended to
        ``all_token_ids``, the last one as the next decode's input, and ``num_computed_tokens`` advanced past the
        step's tokens less the rejected drafts. vLLM: ``GPUModelRunner.postprocess_sampled``."""
        states, dev = self.req_states, self.device
        num_sampled = torch.tensor([len(s) for s in sampled], dtype=torch.int32, device=dev)
        num_logits = torch.from_numpy(np.diff(batch.cu_num_logits_np)).to(dev)
        num_rejected = torch.where(num_sampled > 0, num_logits - num_sampled, 0).to(torch.int32)
        post_update(batch.idx_mapping, states.num_computed_tokens, states.last_sampled_tokens, None,
                    sampled_tokens.to(dev), num_sampled, num_rejected, batch.query_start_loc, states.all_token_ids,
                    states.total_len)
        num_computed = states.num_computed_tokens[batch.idx_mapping].cpu().numpy()
        states.num_computed_tokens_np[batch.idx_mapping_np] = num_computed
        states.num_computed_prefill_tokens[batch.idx_mapping_np] = np.minimum(
            num_computed, states.prefill_len.np[batch.idx_mapping_np])

    def _propose_drafts(self, req_ids: list[str], sampled: list[list[int]]) -> list[list[int]]:
        """Drafts for the next step of each request that just sampled, never more than its ``max_tokens`` leaves
        room for (the token the next step samples itself included)."""
        assert self.drafter is not None
        drafts: list[list[int]] = []
        for rid, tokens in zip(req_ids, sampled, strict=True):
            info = self.requests_info[rid]
            if not tokens:
                drafts.append([])
                continue
            token_ids = self.req_states.token_ids(rid)
            max_tokens = info.sampling_params.max_tokens
            room = self.drafter.k if max_tokens is None else max_tokens - (len(token_ids) - info.prompt_len) - 1
            drafts.append(self.drafter.propose(token_ids)[:room] if room > 0 else [])
        return drafts

    def remove_requests(self, request_ids: Iterable[str]) -> None:
        """Free the slots and state of these requests now (the engine calls it as soon as they finish; the next
        step's ``finished_req_ids`` names them again, which is then a no-op). In sorted order, as
        :meth:`finish_requests`: which slot the next request takes must not depend on the order of a set."""
        for rid in sorted(request_ids):
            self.req_states.remove_request(rid)
            self.requests_info.pop(rid, None)
