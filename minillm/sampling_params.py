"""How one request wants its tokens chosen and when it wants to stop.

The names and the meaning of every field follow vLLM's ``SamplingParams`` (``vllm/sampling_params.py``), so code
written against minillm reads the same against vLLM. Every value is checked when the object is built: a bad value
raises a :class:`ValueError` that names the field, the value and what is allowed.

vLLM counterpart: ``vllm/sampling_params.py`` (``SamplingParams``, ``SamplingType``).
"""
from __future__ import annotations

import enum
import numbers
from dataclasses import dataclass, field
from typing import Any, TypeGuard

# Below this temperature a request is sampled greedily (vLLM uses the same threshold, ``_SAMPLING_EPS``).
SAMPLING_EPS = 1e-5
# The most top log-probabilities one token may ask for; vLLM's engine argument ``max_logprobs`` (default 20). Without
# a bound, ``logprobs=10**6`` would only fail inside a step, in the sampler's ``topk``.
MAX_LOGPROBS = 20
# The seeds ``torch.Generator.manual_seed`` takes: any 64-bit value, signed or unsigned (a negative seed wraps
# around, -1 is the same generator as 2**64 - 1). Outside this range it fails with "Overflow when unpacking long
# long", and it would do so inside a step, so the range is checked here.
MIN_SEED = -(2**63)
MAX_SEED = 2**64 - 1


class SamplingType(enum.IntEnum):
    """How a request's token is drawn: argmax, random from the global generator, or random from its own seed."""

    GREEDY = 0
    RANDOM = 1
    RANDOM_SEED = 2


def is_int(x: object) -> TypeGuard[int]:
    """A Python, NumPy or other ``numbers.Integral`` integer, but not a bool: ``bool`` is an int subclass, and
    ``max_tokens=True`` (or a token id, a rank, a seed of ``True``) is a bug, not 1. (For the type checker an
    ``int``: every ``Integral`` compares and converts with ``int()`` as one.)"""
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _is_number(x: object) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


@dataclass
class SamplingParams:
    """Per-request sampling and stopping parameters (vLLM names and defaults).

    Args:
        temperature: divides the logits; ``0`` means greedy (argmax). Must be ``>= 0``.
        top_k: keep only the ``k`` most likely tokens; ``0`` or ``-1`` means all (stored as ``0``). Any ``k >= 1``
            is accepted, as in vLLM; a ``k`` at least the vocabulary size keeps every token.
        top_p: keep the smallest set of most likely tokens whose probability sums to at least ``top_p``; in
            ``(0, 1]``, ``1`` means all.
        min_p: drop tokens whose probability is below ``min_p`` times the most likely token's; in ``[0, 1]``.
        seed: a per-request random seed; the same seed gives the same tokens whatever else is in the batch. An
            integer in ``[-2**63, 2**64 - 1]`` (what ``torch.Generator.manual_seed`` accepts).
        max_tokens: the most tokens to generate (``>= 1``), or ``None`` for "until the context is full" (the
            OpenAI helper fills in ``max_model_len - prompt_len``).
        min_tokens: EOS and ``stop_token_ids`` are ignored until this many tokens are generated; ``<= max_tokens``.
        stop: a string or a list of strings that end the generation when they appear in the detokenized output;
            the output is cut just before the stop string (unless ``include_stop_str_in_output``).
        stop_token_ids: a list of token ids (``>= 0``) that end the generation (the token is kept in the output).
        ignore_eos: keep generating after the EOS token.
        logprobs: how many top log-probabilities to return per token besides the sampled one (``0`` to
            :data:`MAX_LOGPROBS`), or ``None``.
        presence_penalty: subtracted once from the logit of every token already generated; in ``[-2, 2]``.
        frequency_penalty: subtracted from a token's logit once per time it was generated; in ``[-2, 2]``.
        repetition_penalty: logits of tokens seen in the prompt or output are divided by it (if positive) or
            multiplied by it (if negative); ``> 0``, ``1`` means off.
        include_stop_str_in_output: keep the matched stop string at the end of the text.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    # Filled from `stop`/`stop_token_ids` in __post_init__; not an argument.
    all_stop_token_ids: set[int] = field(default_factory=set, init=False, repr=False)

    def __post_init__(self) -> None:
        self._normalize()
        self._verify()
        self.all_stop_token_ids = set(self.stop_token_ids or [])

    # ---------------------------------------------------------------- normalisation
    def _normalize(self) -> None:
        # The container types are checked here, before list(): list(5) would raise a TypeError, and list("abc")
        # would silently turn stop_token_ids="abc" into three characters.
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        elif isinstance(self.stop, (list, tuple)):
            self.stop = list(self.stop)
        else:
            raise ValueError(f"stop must be a string or a list of strings, got {self.stop!r} "
                             f"({type(self.stop).__name__})")
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        elif isinstance(self.stop_token_ids, (list, tuple)):
            self.stop_token_ids = list(self.stop_token_ids)
        else:
            raise ValueError(f"stop_token_ids must be a list of non-negative integers, got {self.stop_token_ids!r} "
                             f"({type(self.stop_token_ids).__name__})")
        if is_int(self.top_k) and self.top_k == -1:
            self.top_k = 0  # vLLM accepts -1 as the old spelling of "no top-k"

    # ---------------------------------------------------------------- validation
    def _verify(self) -> None:
        def num(name: str) -> float:
            v = getattr(self, name)
            if not _is_number(v):
                raise ValueError(f"{name} must be a number, got {v!r} ({type(v).__name__})")
            if v != v:  # NaN compares unequal to itself
                raise ValueError(f"{name} must not be NaN")
            return float(v)

        def optional_integer(name: str, allow_none: bool = True) -> int | None:
            v = getattr(self, name)
            if v is None and allow_none:
                return None
            if not is_int(v):
                allowed = "an integer or None" if allow_none else "an integer"
                raise ValueError(f"{name} must be {allowed}, got {v!r} ({type(v).__name__})")
            return v

        def integer(name: str) -> int:
            v = optional_integer(name, allow_none=False)
            assert v is not None  # optional_integer raised on None
            return v

        t = num("temperature")
        if t < 0 or t == float("inf"):
            raise ValueError(f"temperature must be >= 0 and finite (0 means greedy), got {self.temperature}")
        k = integer("top_k")
        if k < 0:
            raise ValueError(f"top_k must be 0 or -1 (disabled) or at least 1, got {self.top_k}")
        p = num("top_p")
        if not 0.0 < p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        mp = num("min_p")
        if not 0.0 <= mp <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        seed = optional_integer("seed")
        if seed is not None and not MIN_SEED <= int(seed) <= MAX_SEED:
            raise ValueError(f"seed must be an integer in [-2**63, 2**64 - 1] (what torch.Generator.manual_seed "
                             f"accepts), got {self.seed}")
        mt = optional_integer("max_tokens")
        if mt is not None and mt < 1:
            raise ValueError(f"max_tokens must be at least 1 (or None), got {self.max_tokens}")
        mn = integer("min_tokens")
        if mn < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if mt is not None and mn > mt:
            raise ValueError(f"min_tokens must be <= max_tokens, got min_tokens={mn} > max_tokens={mt}")
        assert isinstance(self.stop, list) and isinstance(self.stop_token_ids, list)  # made lists by _normalize
        for s in self.stop:
            if not isinstance(s, str):
                raise ValueError(f"stop must be a string or a list of strings, got an element {s!r}")
            if s == "":
                raise ValueError("stop cannot contain an empty string (it would match immediately)")
        for tid in self.stop_token_ids:
            if not is_int(tid) or tid < 0:
                raise ValueError(f"stop_token_ids must be non-negative integers, got an element {tid!r}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        lp = optional_integer("logprobs")
        if lp is not None and not 0 <= lp <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}] (vLLM's max_logprobs) or None, "
                             f"got {self.logprobs}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = num(name)
            if not -2.0 <= v <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {v}")
        rp = num("repetition_penalty")
        if not 0.0 < rp < float("inf"):
            raise ValueError(f"repetition_penalty must be > 0 and finite (1 means off), got {self.repetition_penalty}")
        if not isinstance(self.include_stop_str_in_output, bool):
            raise ValueError(f"include_stop_str_in_output must be a bool, got {self.include_stop_str_in_output!r}")

    # ---------------------------------------------------------------- derived
    @property
    def sampling_type(self) -> SamplingType:
        """``GREEDY`` when the temperature is (nearly) 0; ``RANDOM_SEED`` when a seed is given; else ``RANDOM``."""
        if self.temperature < SAMPLING_EPS:
            return SamplingType.GREEDY
        if self.seed is not None:
            return SamplingType.RANDOM_SEED
        return SamplingType.RANDOM

    @property
    def has_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)

    @classmethod
    def greedy(cls, **kwargs: Any) -> SamplingParams:
        """Shorthand for ``SamplingParams(temperature=0, ...)``."""
        return cls(temperature=0.0, **kwargs)

    def clone(self, **changes: Any) -> SamplingParams:
        """A validated copy with some fields changed."""
        fields = {f: getattr(self, f) for f in self.__dataclass_fields__ if f != "all_stop_token_ids"}
        fields.update(changes)
        copied: dict[str, Any] = {k: (list(v) if isinstance(v, list) else v) for k, v in fields.items()}
        return SamplingParams(**copied)

