"""The batch's sampling parameters as tensors: one row per request, so the sampler works on the whole batch at once.

vLLM counterpart: ``vllm/v1/sample/metadata.py`` (``SamplingMetadata``); vLLM fills it from its persistent
``InputBatch`` instead of rebuilding it every step.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from minillm.sampling_params import SAMPLING_EPS, SamplingParams, SamplingType

# The largest top_k put in the tensor. SamplingParams accepts any k >= 1 (as vLLM does), but a Python int of 2**63 or
# more does not fit int64. A k at least the vocabulary size means "keep every token" (`apply_top_k_top_p`), and no
# vocabulary comes near 2**31, so clamping there changes no result and fits int32 as well as int64.
TOP_K_CLAMP = 2**31 - 1


def make_generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    """A generator for one seeded request. Keep it for the request's whole life: it must advance step by step."""
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    return g


@dataclass
class SamplingMetadata:
    """Per-request sampling settings for a batch of ``num_reqs`` rows.

    Attributes:
        temperature: float32 ``[num_reqs]``; 0 for greedy rows.
        all_greedy / all_random: shortcuts that skip the other path entirely.
        top_k: int64 ``[num_reqs]`` (0 = off; values above ``TOP_K_CLAMP`` are stored as ``TOP_K_CLAMP``, which is
            just as "off" for any real vocabulary) or ``None`` when no row uses top-k.
        top_p: float32 ``[num_reqs]`` or ``None`` when no row uses top-p.
        min_p: float32 ``[num_reqs]`` or ``None`` when no row uses min-p.
        generators: row index -> the ``torch.Generator`` of a seeded request; other rows use the global generator.
        max_num_logprobs: the largest ``logprobs`` any row asked for, or ``None``.
        no_penalties: ``True`` when no row has a penalty (skips that stage).
        presence_penalties / frequency_penalties / repetition_penalties: float32 ``[num_reqs]``.
        prompt_token_ids: the prompt of each row (repetition penalty counts prompt tokens too).
        output_token_ids: the tokens generated so far by each row.
        min_tokens: row -> ``(min_tokens, token ids to block)`` for rows that have not reached ``min_tokens``.
    """

    temperature: torch.Tensor
    all_greedy: bool
    all_random: bool
    top_k: torch.Tensor | None
    top_p: torch.Tensor | None
    min_p: torch.Tensor | None
    generators: dict[int, torch.Generator]
    max_num_logprobs: int | None
    no_penalties: bool
    presence_penalties: torch.Tensor
    frequency_penalties: torch.Tensor
    repetition_penalties: torch.Tensor
    prompt_token_ids: list[list[int]]
    output_token_ids: list[list[int]]
    min_tokens: dict[int, tuple[int, set[int]]] = field(default_factory=dict)

    @property
    def num_reqs(self) -> int:
        return self.temperature.shape[0]

    @classmethod
    def from_params(cls, params: Sequence[SamplingParams], *,
                    prompt_token_ids: Sequence[Sequence[int]] | None = None,
                    output_token_ids: Sequence[Sequence[int]] | None = None,
                    eos_token_id: int | None = None,
                    generators: dict[int, torch.Generator] | None = None,
                    device: torch.device | str = "cpu") -> SamplingMetadata:
        """Build the batch tensors from one :class:`SamplingParams` per row.

        Args:
            params: one per request, in batch order.
            prompt_token_ids / output_token_ids: per row; default empty (needed for penalties and ``min_tokens``).
            eos_token_id: blocked, with each row's ``stop_token_ids``, while a row is under ``min_tokens``, even
                when the row sets ``ignore_eos``: vLLM v0.33.0 adds the EOS id to ``_all_stop_token_ids`` whatever
                ``ignore_eos`` is (``vllm/sampling_params.py:SamplingParams.update_from_generation_config``), and
                its min-tokens processor blocks that whole set
                (``vllm/v1/sample/logits_processor/builtin.py:MinTokensLogitsProcessor.add_request``). So
                ``min_tokens=n, ignore_eos=True`` never samples EOS in its first ``n`` tokens, as transformers'
                ``generate(min_new_tokens=n)`` does not.
            generators: row -> generator for seeded rows. Pass the same generator objects every step (the engine
                keeps one per request). When ``None``, fresh generators are made from the seeds, which is right
                for a single step only.
        """
        n = len(params)
        if n == 0:
            raise ValueError("params is empty: a batch needs at least one request")
        prompts = [list(p) for p in prompt_token_ids] if prompt_token_ids is not None else [[] for _ in range(n)]
        outputs = [list(o) for o in output_token_ids] if output_token_ids is not None else [[] for _ in range(n)]
        if len(prompts) != n or len(outputs) != n:
            raise ValueError(f"got {n} params but {len(prompts)} prompts and {len(outputs)} output lists")

        def f32(values: list[float]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.float32, device=device)

        greedy = [p.sampling_type == SamplingType.GREEDY for p in params]
        temperature = f32([0.0 if g else float(p.temperature) for p, g in zip(params, greedy, strict=True)])
        top_k = torch.tensor([min(int(p.top_k), TOP_K_CLAMP) for p in params], dtype=torch.int64, device=device)
        top_p = f32([p.top_p for p in params])
        min_p = f32([p.min_p for p in params])
        if generators is None:
            generators = {i: make_generator(p.seed, device) for i, p in enumerate(params)
                          if p.sampling_type == SamplingType.RANDOM_SEED and p.seed is not None}
        logprobs = [p.logprobs for p in params if p.logprobs is not None]
        min_tokens = {}
        for i, p in enumerate(params):
            if len(outputs[i]) < p.min_tokens:
                block = set(p.all_stop_token_ids)
                # Blocked whatever ignore_eos is: ignore_eos only says EOS does not *stop* the request
                # (check_stop); under min_tokens EOS must not even be *sampled*, as in vLLM.
                if eos_token_id is not None:
                    block.add(eos_token_id)
                if block:
                    min_tokens[i] = (p.min_tokens, block)
        return cls(
            temperature=temperature,
            all_greedy=all(greedy),
            all_random=not any(greedy),
            top_k=top_k if bool((top_k > 0).any()) else None,
            top_p=top_p if bool((top_p < 1.0).any()) else None,
            min_p=min_p if bool((min_p > SAMPLING_EPS).any()) else None,
            generators=dict(generators),
            max_num_logprobs=max(logprobs) if logprobs else None,
            no_penalties=not any(p.has_penalties for p in params),
            presence_penalties=f32([p.presence_penalty for p in params]),
            frequency_penalties=f32([p.frequency_penalty for p in params]),
            repetition_penalties=f32([p.repetition_penalty for p in params]),
            prompt_token_ids=prompts,
            output_token_ids=outputs,
            min_tokens=min_tokens,
        )

    def expand_for_drafts(self, draft_token_ids: Sequence[Sequence[int]]) -> SamplingMetadata:
        """Settings for the rows the rejection sampler scores: request ``i`` with ``d_i`` drafts gets ``d_i + 1``
        rows (one per draft position, then the bonus position). Row ``j`` of request ``i`` sees the outputs so far
        plus drafts ``0..j-1`` as its history, so penalties and ``min_tokens`` act as if the drafts had been
        generated one by one. Generators stay per request (the rejection sampler draws from them itself)."""
        if len(draft_token_ids) != self.num_reqs:
            raise ValueError(f"draft_token_ids has {len(draft_token_ids)} rows, the batch has {self.num_reqs}")
        rows = [(i, j) for i, d in enumerate(draft_token_ids) for j in range(len(d) + 1)]
        idx = torch.tensor([i for i, _ in rows], dtype=torch.long)

        def pick(t: torch.Tensor) -> torch.Tensor:
            return t[idx.to(t.device)]

        def pick_optional(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else pick(t)

        outputs = [self.output_token_ids[i] + list(draft_token_ids[i][:j]) for i, j in rows]
        min_tokens = {}
        for r, (i, _) in enumerate(rows):
            if i in self.min_tokens and len(outputs[r]) < self.min_tokens[i][0]:
                min_tokens[r] = self.min_tokens[i]
        return SamplingMetadata(
            temperature=pick(self.temperature), all_greedy=self.all_greedy, all_random=self.all_random,
            top_k=pick_optional(self.top_k), top_p=pick_optional(self.top_p), min_p=pick_optional(self.min_p),
            generators={},
            max_num_logprobs=None, no_penalties=self.no_penalties,
            presence_penalties=pick(self.presence_penalties), frequency_penalties=pick(self.frequency_penalties),
            repetition_penalties=pick(self.repetition_penalties),
            prompt_token_ids=[self.prompt_token_ids[i] for i, _ in rows], output_token_ids=outputs,
            min_tokens=min_tokens)
