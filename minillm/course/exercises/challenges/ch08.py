"""Challenge 8's reference: ``bad_words``, the words a request must never produce, enforced one token at a time.

vLLM v0.33.0 has it and minillm's engine does not. ``vllm/sampling_params.py:SamplingParams.update_from_tokenizer``
turns each bad word into token ids twice, as it would start a text and with a leading space (mid-text), keeping the
second only when it tokenizes to as many tokens and starts with another one. Then, at every sampling step,
``vllm/v1/sample/sampler.py:Sampler.apply_logits_processors`` calls ``vllm/v1/sample/ops/bad_words.py:
apply_bad_words(logits, bad_words_token_ids, output_token_ids)``: for each request and each bad word of ``L``
tokens, if the request's last ``L - 1`` *output* tokens equal the word's first ``L - 1``, the word's last token gets
``-inf``, in place. A one-token word is always banned. A word longer than the outputs so far plus one cannot be
completed at this step and is skipped, and the prompt never counts: only the outputs are looked at.

Chapter 8's challenge asks for :func:`apply_bad_words`; its check compares the learner's with this one on random
batches and on a greedy run of SmolLM2 that must avoid a word it would otherwise say.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

# What a delegating answer could call (the tripwire replaces it while the learner's answer runs).
TARGETS = ("minillm.course.exercises.challenges.ch08:apply_bad_words",)


def apply_bad_words(logits: torch.Tensor, bad_words_token_ids: dict[int, list[list[int]]],
                    past_tokens_ids: Sequence[Sequence[int]]) -> None:
    """Set to ``-inf``, in place, the logit of every token that would complete a bad word.

    Args:
        logits: ``[num_reqs, vocab_size]``, the scores of this step, one row per request.
        bad_words_token_ids: request row -> its bad words, each a list of token ids (rows without bad words are
            absent).
        past_tokens_ids: per row, the request's output token ids so far (not its prompt).
    """
    for row, words in bad_words_token_ids.items():
        past = list(past_tokens_ids[row])
        for word in words:
            if len(word) > len(past) + 1:
                continue  # even this step's token cannot complete it
            prefix = word[:-1]
            if not prefix or past[len(past) - len(prefix):] == prefix:
                logits[row, word[-1]] = float("-inf")


def bad_words_token_ids(tokenizer, words: Sequence[str]) -> list[list[int]]:  # noqa: ANN001 - any HF-style tokenizer
    """Each bad word's token ids as vLLM v0.33.0 makes them (``SamplingParams.update_from_tokenizer``): the word as
    it would begin a text, then with a leading space when that is a different word token of the same length.

    Raises:
        ValueError: a word that tokenizes to nothing.
    """
    out: list[list[int]] = []
    for word in words:
        plain = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        if not plain:
            raise ValueError(f"bad word {word!r} tokenizes to no token; give words that have at least one")
        out.append(plain)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
            out.append(spaced)
    return out
