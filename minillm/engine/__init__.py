"""The messages between the engine's front end (``LLMEngine``, ``AsyncLLM``) and its engine core.

The engine core runs in a process of its own by default, so every type here is a ``msgspec.Struct`` (or a typed
dict), encoded as msgpack by :mod:`minillm.serial_utils`; ``array_like`` structs travel as lists of field values.
The front end sends :class:`EngineCoreRequest` (``ADD``), request ids (``ABORT``) and ``(call_id, method, args)``
(``UTILITY``); the core answers with :class:`EngineCoreOutputs`: a step's new tokens and :class:`SchedulerStats`, or
a :class:`UtilityOutput`. Its first message is the handshake, :class:`EngineCoreReady`.

vLLM counterpart: ``vllm/v1/engine/__init__.py`` (``EngineCoreRequest``, ``EngineCoreOutput``,
``EngineCoreOutputs``, ``EngineCoreRequestType``, ``UtilityOutput``) and ``vllm/v1/metrics/stats.py``
(``SchedulerStats``).
"""
from __future__ import annotations

import enum
from typing import Any, TypedDict

import msgspec

from minillm.config import LlamaConfig
from minillm.sampling_params import SamplingParams


class EngineCoreRequestType(enum.Enum):
    """The first frame of every message to the core: what the payload is (vLLM's byte values)."""

    ADD = b"\x00"
    ABORT = b"\x01"
    UTILITY = b"\x03"


class EngineCoreRequest(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """A request as the core receives it: already tokenized and checked in the caller's process.

    Attributes:
        request_id: unique among unfinished requests.
        prompt_token_ids: ``[num_prompt_tokens]`` token ids.
        sampling_params: a validated private copy (``max_tokens`` filled in).
        eos_token_id: the tokenizer's EOS id (``None``: none).
        arrival_time: seconds since the epoch, for the priority policy's ties.
        priority: lower runs first under ``scheduling_policy="priority"``.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None
    arrival_time: float
    priority: int = 0


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """What one step produced for one request: its new tokens and, if it finished, why.

    Attributes:
        request_id: the request.
        new_token_ids: the tokens this step appended (one, or several with speculative decoding).
        finish_reason: ``"stop"``, ``"length"`` or ``"abort"`` once finished, else ``None``.
        stop_reason: the stop token id that ended it, if one did.
        new_logprobs: per new token ``{token_id: logprob}`` (the sampled token first), when the request asked for
            ``logprobs``.
        num_cached_tokens: prompt tokens that were already computed at admission (prefix cache, KV connector).
    """

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    new_logprobs: list[dict[int, float]] | None = None
    num_cached_tokens: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class EngineStats(msgspec.Struct, omit_defaults=True):
    """The engine core's counters since it started (for tests, benchmarks and the notebooks).

    Attributes:
        num_requests: requests the core received (a request refused by the front end never counts).
        num_steps: steps that ran the model.
        num_scheduled_tokens: tokens computed (prefill chunks + decodes), summed over steps.
        num_generated_tokens: tokens appended to requests.
        num_preemptions: requests preempted (by recompute).
        num_cached_prompt_tokens: prompt tokens served from the prefix cache at admission.
        num_draft_tokens / num_accepted_tokens: speculative decoding's drafts verified, and those the model kept.
        num_external_prompt_tokens: prompt tokens a KV connector loaded from another engine at admission
            (chapter 9), counted as computed like prefix-cache hits.
    """

    num_requests: int = 0
    num_steps: int = 0
    num_scheduled_tokens: int = 0
    num_generated_tokens: int = 0
    num_preemptions: int = 0
    num_cached_prompt_tokens: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_external_prompt_tokens: int = 0

    @property
    def acceptance_rate(self) -> float:
        """Fraction of the verified drafts that were kept (``nan`` before any draft)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else float("nan")


class SchedulerStats(msgspec.Struct, omit_defaults=True):
    """A snapshot of the core after a step, sent with its outputs: what a front end in another process can see.

    Attributes:
        num_running_reqs / num_waiting_reqs: the scheduler's two queues.
        num_blocks: KV cache blocks, the null block included.
        num_free_blocks: blocks that can be allocated now (free, or cached but unused).
        kv_cache_usage: fraction of usable blocks held by requests, in ``[0, 1]``.
        engine: the core's :class:`EngineStats`.
    """

    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    num_blocks: int = 0
    num_free_blocks: int = 0
    kv_cache_usage: float = 0.0
    engine: EngineStats = msgspec.field(default_factory=EngineStats)


class UtilityOutput(msgspec.Struct, array_like=True, gc=False):
    """The answer to one ``UTILITY`` call: its result, or the error it raised (as text)."""

    call_id: int
    failure_message: str | None = None
    result: Any = None


class EngineCoreOutputs(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One message from the core: a step's outputs (possibly none) and stats, or the answer to a utility call.

    Attributes:
        outputs: one :class:`EngineCoreOutput` per request that got tokens or finished in the step.
        scheduler_stats: the core after the step.
        timestamp: ``time.monotonic()`` in the core when the step's outputs were ready.
        utility_output: set on a utility call's answer (then ``outputs`` is empty).
    """

    outputs: list[EngineCoreOutput] = []
    scheduler_stats: SchedulerStats | None = None
    timestamp: float = 0.0
    utility_output: UtilityOutput | None = None


class EngineCoreReady(TypedDict):
    """The engine core's handshake (its first message, ``READY``): what a front end needs to know about it.

    Attributes:
        pid: the process the core runs in (this one when in-process).
        num_gpu_blocks / block_size / max_model_len: the KV cache and the longest sequence it serves.
        async_scheduling: whether it steps with a batch queue (``EngineCore.step_with_batch_queue``).
        attention_backend / dtype: what runs the model.
        model_config: the loaded model's :class:`~minillm.config.LlamaConfig`.
    """

    pid: int
    num_gpu_blocks: int
    max_model_len: int
    block_size: int
    async_scheduling: bool
    attention_backend: str
    dtype: str
    model_config: LlamaConfig


class EngineDeadError(RuntimeError):
    """The engine core has stopped (its process died, it raised, or it was shut down): no request can be served.

    vLLM counterpart: ``vllm/v1/engine/exceptions.py:EngineDeadError``.
    """


__all__ = ["EngineCoreOutput", "EngineCoreOutputs", "EngineCoreReady", "EngineCoreRequest", "EngineCoreRequestType",
           "EngineDeadError", "EngineStats", "SchedulerStats", "UtilityOutput"]
