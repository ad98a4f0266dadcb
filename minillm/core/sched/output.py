"""What one scheduling step hands to the model runner, and what the runner hands back.

The scheduler sends only what the runner cannot know: a request seen for the first time travels whole
(:class:`NewRequestData`); a request the runner already holds travels as a diff (:class:`CachedRequestData`: its new
blocks and where its context starts). The runner keeps the token ids it sampled itself, so a decode costs the
scheduler one integer per request.

vLLM counterparts: ``vllm/v1/core/sched/output.py`` (``SchedulerOutput``, ``NewRequestData``,
``CachedRequestData``) and ``vllm/v1/outputs.py`` (``ModelRunnerOutput``, ``KVConnectorOutput``); vLLM also carries
encoder inputs, LoRA and structured-output fields, left out here.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from minillm.distributed.kv_transfer.base import KVConnectorMetadata
from minillm.engine import EngineCoreOutput  # noqa: F401  (the scheduler's per-request result; a wire type)
from minillm.request import Request
from minillm.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    """A request scheduled for the first time.

    Attributes:
        req_id: the request id.
        prompt_token_ids: the whole prompt.
        sampling_params: how to sample its tokens.
        block_ids: every KV block the request holds, in order (prefix-cache hits first).
        num_computed_tokens: tokens whose K/V are already in those blocks (a prefix-cache hit; 0 without one) or
            are loaded into them by a KV connector before the forward pass (chapter 9). This step's tokens start at
            this position.
        num_external_computed_tokens: how many of those a KV connector loads (0 without one).
    """

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    num_external_computed_tokens: int = 0

    @classmethod
    def from_request(cls, request: Request, block_ids: list[int]) -> NewRequestData:
        return cls(request.request_id, list(request.prompt_token_ids), request.sampling_params, list(block_ids),
                   request.num_computed_tokens)


@dataclass
class CachedRequestData:
    """Requests the runner has seen before: still running ones, and resumed ones (re-admitted after preemption).

    Parallel lists, one entry per request, in scheduling order.

    Attributes:
        req_ids: the request ids.
        resumed_req_ids: the ids among ``req_ids`` that were preempted and come back. The runner kept their state
            but not their blocks (freed at preemption), so ``new_block_ids`` is their *whole* block list and
            ``all_token_ids`` their tokens (prompt + outputs so far, all to be recomputed). For the others
            ``new_block_ids`` is appended to the blocks they hold.
        new_block_ids: blocks to append (running) or the full block list (resumed); empty when none were needed.
        num_computed_tokens: each request's context length before this step (where its new tokens start).
        num_output_tokens: output tokens each request has so far.
        all_token_ids: token ids of the requests not scheduled in the previous step (resumed ones included).
    """

    req_ids: list[str] = field(default_factory=list)
    resumed_req_ids: set[str] = field(default_factory=set)
    new_block_ids: list[list[int]] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)
    num_output_tokens: list[int] = field(default_factory=list)
    all_token_ids: dict[str, list[int]] = field(default_factory=dict)

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)


@dataclass
class SchedulerOutput:
    """One step's plan: which requests run, how many tokens each.

    Attributes:
        scheduled_new_reqs: requests scheduled for the first time (admitted from the waiting queue this step).
        scheduled_cached_reqs: running requests scheduled again, then resumed ones (admitted this step after a
            preemption).
        num_scheduled_tokens: request id -> tokens it computes this step (a prefill chunk or 1 for a decode).
        total_num_scheduled_tokens: ``sum(num_scheduled_tokens.values())``, never above
            ``max_num_batched_tokens``. It counts the requests admitted from the waiting queue in this very step:
            they run in this step too.
        preempted_req_ids: requests preempted (by recompute) in this step. They are not scheduled, so the runner
            takes them out of its persistent batch but keeps their state (tokens, seeded generator) for the resume,
            which brings a new block list; the engine core counts them.
        finished_req_ids: requests that finished since the previous step; the runner drops their state.
        scheduled_spec_decode_tokens: request id -> the draft tokens it verifies this step (speculative decoding
            only). They are the last ``len(drafts)`` of its ``num_scheduled_tokens``.
        kv_connector_metadata: with a KV connector (chapter 9), what its worker side loads and saves this step
            (built by the scheduler side's ``build_connector_meta``); ``None`` without one.
    """

    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    preempted_req_ids: set[str] = field(default_factory=set)
    finished_req_ids: set[str] = field(default_factory=set)
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    kv_connector_metadata: KVConnectorMetadata | None = None

    @classmethod
    def make_empty(cls) -> SchedulerOutput:
        return cls([], CachedRequestData(), {}, 0)


@dataclass
class ModelRunnerOutput:
    """What the model runner returns after running one :class:`SchedulerOutput`.

    Attributes:
        req_ids: the scheduled request ids, in the runner's row order.
        req_id_to_index: request id -> row.
        sampled_token_ids: per row, the tokens sampled for that request (one without speculative decoding). A
            request still mid-prefill gets an empty row: the runner sampled a token for it and discarded it, as
            vLLM v0.33.0's runner clears that row (``GPUModelRunner._bookkeeping_sync``). The scheduler skips such
            a request whatever its row holds (``num_computed_tokens < num_tokens``), so a runner that does return a
            token there (the fake runners of chapter 4) is harmless.
        logprobs: request id -> one ``{token_id: logprob}`` per sampled token (the sampled token first, then the
            most likely ones), only for requests that asked for ``logprobs``; ``None`` when none did.
        draft_token_ids: per row, the drafts proposed for the next step (speculative decoding only; ``None``
            otherwise). With drafts, ``sampled_token_ids`` holds the accepted drafts then one more token.
        kv_connector_output: with a KV connector, what its worker side reports back (:class:`KVConnectorOutput`).
    """

    req_ids: list[str]
    req_id_to_index: dict[str, int]
    sampled_token_ids: list[list[int]]
    logprobs: dict[str, list[dict[int, float]]] | None = None
    draft_token_ids: list[list[int]] | None = None
    kv_connector_output: KVConnectorOutput | None = None


@dataclass
class KVConnectorOutput:
    """What a KV connector's worker side reports after a step (chapter 9).

    Attributes:
        finished_sending: requests whose KV has left (saved or sent): the scheduler may free their blocks now.
        finished_recving: requests whose KV has arrived and can be loaded.
        failed_recving: requests whose transfer failed (corrupt, partial, or never came): they recompute.
        invalid_block_ids: blocks that a load this step should have filled but did not: the requests that hold them
            go back to the first such block and recompute from there.

    vLLM counterpart: ``vllm/v1/outputs.py:KVConnectorOutput`` (same field names).
    """

    finished_sending: set[str] = field(default_factory=set)
    finished_recving: set[str] = field(default_factory=set)
    failed_recving: set[str] = field(default_factory=set)
    invalid_block_ids: set[int] = field(default_factory=set)

    def is_empty(self) -> bool:
        return not (self.finished_sending or self.finished_recving or self.failed_recving or self.invalid_block_ids)
