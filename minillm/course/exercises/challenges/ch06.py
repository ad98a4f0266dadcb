"""Challenge 6: parallel sampling, ``n`` answers to one prompt that share the prompt's KV blocks.

vLLM v0.33.0 serves ``SamplingParams(n=3)`` by fanning the request out into ``n`` child requests
(``vllm/v1/engine/llm_engine.py:LLMEngine.add_request``, with ``vllm/v1/engine/parallel_sampling.py:ParentRequest``):
child ``index`` gets the id ``f"{index}_{request_id}"``
(``ParentRequest.get_child_info``) and a shallow copy of the parent's sampling parameters with ``n = 1`` and, when
the parent has a seed, the seed ``seed + index`` (``ParentRequest._get_child_sampling_params``), so the ``n``
answers differ yet are reproducible. The children are ordinary requests with the same prompt: the scheduler admits
them one after another, and every child after the first finds the prompt's full blocks in the prefix cache (a
block is cached as soon as it is allocated, ``vllm/v1/core/kv_cache_manager.py:KVCacheManager.allocate_slots``), so
the prompt is computed once. ``ParentRequest.get_outputs`` gathers the children's final ``CompletionOutput`` s into one
list, each at its ``index`` (the non-streaming ``FINAL_ONLY`` case).

minillm's ``SamplingParams`` has no ``n``; here ``n`` is an argument. :func:`parallel_sample` is the reference the
challenge's check compares with.
"""
from __future__ import annotations

import copy
import dataclasses

from minillm.engine.llm_engine import LLMEngine
from minillm.engine.outputs import CompletionOutput
from minillm.sampling_params import SamplingParams

# What a delegating answer could call: the check runs the learner's answer with these replaced by a tripwire.
TARGETS = ("minillm.course.exercises.challenges.ch06:parallel_sample",
           "minillm.course.exercises.challenges.ch06:child_sampling_params")


def child_sampling_params(params: SamplingParams, index: int) -> SamplingParams:
    """Child ``index``'s parameters: the parent's, with the seed ``seed + index`` when there is a seed
    (``ParentRequest._get_child_sampling_params``). The parent's object is never changed."""
    if params.seed is None:
        return params  # vLLM shares one copy between the children: nothing differs
    child = copy.copy(params)
    child.seed = params.seed + index
    return child


def parallel_sample(engine: LLMEngine, request_id: str, prompt_ids: list[int], params: SamplingParams,
                    n: int) -> list[CompletionOutput]:
    """Generate ``n`` answers to one prompt on ``engine``; returns their final ``CompletionOutput`` s, answer
    ``i`` at ``outputs[i]`` with ``index == i``.

    All ``n`` children are added before the first step, so they run side by side and the later ones reuse the
    first one's prompt blocks through the prefix cache.
    """
    children = {}
    for index in range(n):
        child_id = f"{index}_{request_id}"  # ParentRequest.get_child_info
        engine.add_request(child_id, list(prompt_ids), child_sampling_params(params, index))
        children[child_id] = index
    outputs: list[CompletionOutput | None] = [None] * n
    while any(o is None for o in outputs):
        for out in engine.step():
            slot = children.get(out.request_id)
            if slot is not None and out.finished:
                outputs[slot] = dataclasses.replace(out.outputs[0], index=slot)
    return [o for o in outputs if o is not None]  # all of them: the loop ran until none is None
