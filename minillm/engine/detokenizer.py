"""Token ids to text, step by step, and the stop-string check that needs that text.

``check_stop`` (``minillm/core/sched/utils.py``) sees only token ids. A stop *string* such as ``"\\n\\n"`` or
``"Question:"`` can span several tokens, or sit inside one token together with other characters, so it is checked
on the detokenized text after each step, and the text is cut where the stop string begins.

vLLM counterpart: ``vllm/v1/engine/detokenizer.py`` (``IncrementalDetokenizer``, ``check_stop_strings``); the
output processor then finishes the request with ``finish_reason="stop"`` and ``stop_reason=<the string>``.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from minillm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def check_stop_strings(output_text: str, new_char_count: int, stop: Sequence[str],
                       include_in_output: bool) -> tuple[str, int] | None:
    """Find the first stop string that ends in the newest ``new_char_count`` characters of ``output_text``.

    Only matches that end in the new characters are searched (older text was checked on earlier steps), but a
    match may start before them: that is how a stop string spanning several tokens is found.

    Args:
        output_text: all text generated so far.
        new_char_count: how many characters at the end of ``output_text`` are new this step.
        stop: the stop strings.
        include_in_output: keep the stop string in the text.

    Returns:
        ``(stop_string, truncate_to)`` where the text must be cut to ``output_text[:truncate_to]``, or ``None``.
        When several stop strings match, the one that starts first wins (ties: the one listed first).
    """
    if new_char_count < 0 or new_char_count > len(output_text):
        raise ValueError(f"new_char_count must be in [0, {len(output_text)}], got {new_char_count}")
    best: tuple[int, str] | None = None
    for s in stop:
        if not s:
            raise ValueError("stop strings must be non-empty")
        # The match must end inside the new characters: start >= len(text) - new - len(s) + 1.
        begin = max(0, len(output_text) - new_char_count - len(s) + 1)
        i = output_text.find(s, begin)
        if i != -1 and (best is None or i < best[0]):
            best = (i, s)
    if best is None:
        return None
    i, s = best
    return s, (i + len(s) if include_in_output else i)


class IncrementalDetokenizer:
    """The text of one request's output, updated after each step, with stop strings applied.

    Args:
        tokenizer: a Hugging Face tokenizer (``decode``).
        params: the request's :class:`SamplingParams` (``stop``, ``include_stop_str_in_output``).
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, params: SamplingParams) -> None:
        self.tokenizer = tokenizer
        self.stop = list(params.stop or [])
        self.include_stop_str_in_output = params.include_stop_str_in_output
        self.token_ids: list[int] = []
        self.output_text = ""
        self.stop_reason: str | None = None

    def _decode(self) -> str:
        text = self.tokenizer.decode(self.token_ids, skip_special_tokens=True)
        assert isinstance(text, str)  # one sequence in, one string out
        # A multi-byte character split across tokens decodes to U+FFFD until its last byte arrives: hold it back.
        return text.rstrip("\ufffd")

    def update(self, new_token_ids: Sequence[int], stop_terminated: bool = False) -> str | None:
        """Add this step's tokens; return the stop string if one now appears (the text is then cut).

        Args:
            new_token_ids: the tokens appended to the request this step (several with speculative decoding).
            stop_terminated: ``check_stop`` finished the request with ``FINISHED_STOPPED`` on its last token (EOS
                or a stop id); that token's text is left out, unless ``include_stop_str_in_output``. Pass ``False``
                for a length cap (``FINISHED_LENGTH_CAPPED``): the last token is ordinary text then.
        """
        if self.stop_reason is not None:
            raise ValueError("this request already stopped on a stop string; it gets no more tokens")
        new_token_ids = list(new_token_ids)
        if stop_terminated and not self.include_stop_str_in_output and new_token_ids:
            new_token_ids = new_token_ids[:-1]
        self.token_ids.extend(new_token_ids)
        old_len = len(self.output_text)
        text = self._decode()
        self.output_text = text
        if not self.stop:
            return None
        hit = check_stop_strings(text, max(0, len(text) - old_len), self.stop, self.include_stop_str_in_output)
        if hit is None:
            return None
        self.stop_reason, cut = hit
        self.output_text = text[:cut]
        return self.stop_reason
