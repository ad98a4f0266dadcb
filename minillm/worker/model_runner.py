"""The model runner: one :class:`SchedulerOutput` in, one forward pass over every scheduled token, tokens out.

Each step it updates its requests (:class:`CachedRequestState`) and the persistent batch from the plan's diffs alone
(``_update_states``), builds one flat batch of every scheduled token (:class:`BatchInputs`: ``input_ids``,
``positions``, ``query_start_loc``, ``seq_lens``, ``block_table``, ``slot_mapping``, ``logits_indices``), runs the
model once through the paged KV cache, samples every request and discards the rows of those still mid-prefill
(``discard_request_mask``; a seeded generator is rewound after such a draw). With drafts the
:class:`~minillm.sample.rejection_sampler.RejectionSampler` verifies them and an n-gram proposer drafts the next
ones; with a KV connector its worker side loads and saves K/V around the forward pass.

vLLM counterpart: ``vllm/v1/worker/gpu_model_runner.py`` (``GPUModelRunner``: ``_update_states``,
``_prepare_inputs``, ``execute_model``, ``_bookkeeping_sync``, which clears the discarded rows); Model Runner V2
(``vllm/v1/worker/gpu/``) seeds its noise by position and has no generator to rewind.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Required, TypedDict

import numpy as np
import torch

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
from minillm.worker.input_batch import InputBatch

# The slots of the persistent batch when the caller does not say (the engine passes its max_num_seqs).
DEFAULT_MAX_NUM_REQS = 1024


@dataclass
class CachedRequestState:
    """The runner's copy of one request.

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


class ModelRunnerArgs(TypedDict, total=False):
    """:class:`ModelRunner`'s keyword arguments, as the engine core hands them to each worker."""

    num_blocks: Required[int]
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


class ModelRunner:
    """Owns the paged KV cache and runs the model on scheduler outputs.

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
            :func:`prepare_inputs` means: gather from the persistent batch.
        kv_connector: the worker side of a KV connector (chapter 9), or ``None``.
        max_num_reqs: slots of the persistent batch, the most requests one step may schedule (the engine's
            ``max_num_seqs``); ``None``: ``num_blocks - 1`` (each scheduled request holds a block of its own), at
            most :data:`DEFAULT_MAX_NUM_REQS`.
        max_model_len: the most tokens one request may reach (the engine's ``max_model_len``); ``None``: the
            model's ``max_position_embeddings``.
        num_kv_heads: the KV heads its cache holds: ``None`` for all of them; a tensor-parallel rank's share
            (its :class:`~minillm.model.llama_tp.TensorParallelLlamaForCausalLM` ``num_kv_heads``).

    Attributes:
        requests: request id -> :class:`CachedRequestState`, every request the runner holds (preempted ones too).
        input_batch: the persistent batch (:class:`~minillm.worker.input_batch.InputBatch`) of the requests
            scheduled in the latest step, updated in place by :meth:`_update_states` and after sampling.
        kv_caches: one ``(key_cache, value_cache)`` per layer, each ``[num_blocks, block_size, num_kv_heads,
            head_dim]``.
        last_inputs: the :class:`BatchInputs` of the latest step (for inspection and teaching).
        last_sampler_output: the latest step's :class:`~minillm.outputs.SamplerOutput`, one row per scheduled
            request in ``last_inputs.req_ids`` order: ``sampled_token_ids`` int32 ``[num_reqs, 1]`` without drafts,
            ``[num_reqs, max_num_draft + 1]`` with them. Rows where ``last_inputs.discard_request_mask`` is set hold
            a token that was sampled and then dropped (it never reaches the request or the outputs).
        last_step_seconds: wall time of the latest :meth:`execute_model`.
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
        self.requests: dict[str, CachedRequestState] = {}
        if max_num_reqs is None:
            # Every scheduled request computes at least its last token into a block of its own, so no more than
            # num_blocks - 1 requests run in one step; the cap keeps a huge cache from sizing the batch.
            max_num_reqs = max(1, min(num_blocks - 1, DEFAULT_MAX_NUM_REQS))
        self.input_batch = InputBatch(max_num_reqs,
                                      model.config.max_position_embeddings if max_model_len is None else max_model_len,
                                      block_size)
        self.last_inputs: BatchInputs | None = None
        self.last_sampler_output: SamplerOutput | None = None
        self.last_step_seconds = 0.0
        self.kv_connector = kv_connector
        if kv_connector is not None:
            kv_connector.register_kv_caches(self.kv_caches)

    # -- 1. requests ----------------------------------------------------------------------------------------------
    def _update_states(self, so: SchedulerOutput) -> None:
        """Apply the step's diffs to the request states and the persistent batch, in vLLM's order: finished requests
        leave both; requests not scheduled now (preempted, or left out by the budget) leave the batch but keep their
        state; new ones arrive; scheduled cached ones get their context length and new blocks (those not in the
        batch come back whole from their state); then the holes are condensed and the drafts written."""
        batch = self.input_batch
        for rid in so.finished_req_ids:
            self.requests.pop(rid, None)
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
                gen = make_generator(params.seed, self.device)
            state = CachedRequestState(new.req_id, len(new.prompt_token_ids), params, list(new.prompt_token_ids),
                                       list(new.block_ids), new.num_computed_tokens, gen)
            self.requests[new.req_id] = state
            to_add.append(state)
        for i, rid in enumerate(cached.req_ids):
            state = self.requests[rid]
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

    # -- 2. the flat batch ----------------------------------------------------------------------------------------
    def _prepare_inputs(self, so: SchedulerOutput) -> BatchInputs:
        """The step's :class:`BatchInputs`. With the package's own :func:`prepare_inputs` as ``prepare_inputs_fn``,
        gathered from the persistent batch (the same batch :func:`prepare_inputs` builds from the request states,
        field by field); with a learner's function there (chapter 8), that function's, called as
        ``prepare_inputs(scheduler_output, requests, block_size, device)``."""
        if self.prepare_inputs_fn is not prepare_inputs:
            return self.prepare_inputs_fn(so, self.requests, self.block_size, self.device)
        batch, bs = self.input_batch, self.block_size
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

        dev = self.device
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

    # -- 3 + 4. model and sampler ---------------------------------------------------------------------------------
    def _sampling_metadata(self, states: list[CachedRequestState]) -> SamplingMetadata:
        params = [s.sampling_params for s in states]
        need_history = any(p.has_penalties or p.min_tokens > 0 for p in params)
        return SamplingMetadata.from_params(
            params,
            prompt_token_ids=[s.token_ids[:s.num_prompt_tokens] for s in states] if need_history else None,
            output_token_ids=[s.output_token_ids for s in states] if need_history else None,
            eos_token_id=self.eos_token_id,
            generators={i: s.generator for i, s in enumerate(states) if s.generator is not None},
            device=self.device)

    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step. Returns one row per scheduled request: the tokens it sampled (``[token]`` without drafts),
        or ``[]`` if it is still mid-prefill (its row was sampled and discarded, as vLLM's runner clears it)."""
        if self.kv_connector is None:
            return self._execute_model(scheduler_output)
        # The connector's step: bind the plan, load before the forward pass (layers save during it), then submit
        # the saves and report what finished. vLLM: KVConnectorModelRunnerMixin._get_kv_connector_output.
        connector, meta = self.kv_connector, scheduler_output.kv_connector_metadata
        if meta is None:
            raise ValueError("a runner with a KV connector needs each plan's kv_connector_metadata: give the scheduler "
                             "the connector's scheduler side (Scheduler.set_kv_connector)")
        connector.bind_connector_metadata(meta)
        try:
            connector.start_load_kv()
            output = self._execute_model(scheduler_output)
            connector.wait_for_save()
            sending, recving = connector.get_finished(set(scheduler_output.finished_req_ids))
            output.kv_connector_output = KVConnectorOutput(
                finished_sending=set(sending or ()), finished_recving=set(recving or ()),
                failed_recving=connector.get_failed_recving(),
                invalid_block_ids=connector.get_block_ids_with_load_errors())
        finally:
            connector.clear_connector_metadata()
        return output

    def _execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        start = time.perf_counter()
        self._update_states(scheduler_output)
        if scheduler_output.total_num_scheduled_tokens == 0:
            return ModelRunnerOutput([], {}, [])
        inputs = self._prepare_inputs(scheduler_output)
        self.last_inputs = inputs
        hidden = self.model(inputs.input_ids, inputs.positions, attn=self.make_attention(inputs.attn_metadata))

        states = [self.requests[rid] for rid in inputs.req_ids]
        discard = np.nonzero(inputs.discard_request_mask)[0].tolist()
        # A discarded draw must not advance a seeded request's generator, or its later samples would depend on how
        # its prompt was chunked. vLLM rewinds the CUDA Philox offset by the 4 one draw takes; restoring the saved
        # state is the same thing, exact for any generator (CPU ones have no offset).
        rewind = {i: (gen, gen.get_state()) for i in discard if (gen := states[i].generator) is not None}
        md = self._sampling_metadata(states)
        if any(inputs.draft_token_ids):
            out = self._verify_drafts(hidden, inputs, md)
            sampled = RejectionSampler.parse_output(out.sampled_token_ids, self.vocab_size)
        else:
            logits = self.model.compute_logits(hidden[inputs.logits_indices])  # [num_reqs, vocab]
            out = self.sampler(logits, md)
            sampled = out.sampled_token_ids.tolist()  # [num_reqs][1]
        for gen, gen_state in rewind.values():
            gen.set_state(gen_state)
        self.last_sampler_output = out
        for i in discard:
            sampled[i] = []  # mid-prefill: the token never reaches the request (vLLM clears the row too)
        batch = self.input_batch
        for s, tokens in zip(states, sampled, strict=True):
            s.token_ids.extend(tokens)
            batch.append_token_ids(batch.req_id_to_index[s.req_id], tokens)  # in place, as vLLM's bookkeeping

        logprobs: dict[str, list[dict[int, float]]] | None = None
        if out.logprobs_tensors is not None:
            ids, lps, _ = out.logprobs_tensors.tolists()
            logprobs = {}
            for k, s in enumerate(states):
                n = s.sampling_params.logprobs
                if n is not None and sampled[k]:
                    logprobs[s.req_id] = [dict(zip(ids[k][:n + 1], lps[k][:n + 1], strict=True))]
        for rid, seq_len in zip(inputs.req_ids, inputs.attn_metadata.seq_lens.tolist(), strict=True):
            self.requests[rid].num_computed_tokens = seq_len  # the scheduler sends the true value (drafts) next step
            batch.num_computed_tokens_cpu[batch.req_id_to_index[rid]] = seq_len
        draft_token_ids = self._propose_drafts(inputs.req_ids, sampled) if self.drafter is not None else None
        self.last_step_seconds = time.perf_counter() - start
        return ModelRunnerOutput(inputs.req_ids, {rid: i for i, rid in enumerate(inputs.req_ids)}, sampled, logprobs,
                                 draft_token_ids)

    def _verify_drafts(self, hidden: torch.Tensor, inputs: BatchInputs, md: SamplingMetadata) -> SamplerOutput:
        """The sampling step when drafts are in the batch: logits for each request's last ``d + 1`` rows (its
        drafts and the token before them; ``d = 0`` for a request without drafts, mid-prefill ones included), then
        the rejection sampler over the whole batch.

        Returns:
            its :class:`SamplerOutput`, ``sampled_token_ids`` int32 ``[num_reqs, max_num_draft + 1]``.
        """
        drafts = inputs.draft_token_ids
        ends = inputs.logits_indices.tolist()  # each request's last row
        sel = torch.tensor([j for e, d in zip(ends, drafts, strict=True) for j in range(e - len(d), e + 1)],
                           dtype=torch.long, device=self.device)
        # Without a query_start_loc, make() lays each request's d + 1 rows side by side, as sel does: its
        # logits_indices are 0 .. len(sel) - 1, the rows of hidden[sel] in order.
        spec = SpecDecodeMetadata.make(drafts)
        logits = self.model.compute_logits(hidden[sel])
        return self.rejection_sampler(spec, None, logits, md)

    def _propose_drafts(self, req_ids: list[str], sampled: list[list[int]]) -> list[list[int]]:
        """Drafts for the next step of each request that just sampled, never more than its ``max_tokens`` leaves
        room for (the token the next step samples itself included)."""
        assert self.drafter is not None
        drafts: list[list[int]] = []
        for rid, tokens in zip(req_ids, sampled, strict=True):
            state = self.requests[rid]
            max_tokens = state.sampling_params.max_tokens
            room = self.drafter.k if max_tokens is None else max_tokens - len(state.output_token_ids) - 1
            drafts.append(self.drafter.propose(state.token_ids)[:room] if tokens and room > 0 else [])
        return drafts

    def remove_requests(self, request_ids: Iterable[str]) -> None:
        """Drop the runner's state of these requests, in the persistent batch too (the engine calls it as soon as
        they finish; the next step's ``finished_req_ids`` names them again, which is then a no-op)."""
        for rid in request_ids:
            self.requests.pop(rid, None)
            self.input_batch.remove_request(rid)
        self.input_batch.condense()
