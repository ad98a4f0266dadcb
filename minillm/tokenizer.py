"""The tokenizer and chat template, read from the same file as the weights (via transformers).

vLLM counterpart: ``vllm/tokenizers/registry.py:get_tokenizer``, which also wraps transformers (a Hugging Face
tokenizer is loaded by ``vllm/tokenizers/hf.py:CachedHfTokenizer``); older releases had ``get_tokenizer`` in
``vllm/transformers_utils/tokenizer.py``.
"""
from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # transformers is imported only when a tokenizer is loaded: it costs ~1.5 s per process
    from transformers import PreTrainedTokenizerBase


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    """Tokenizer for a ``.gguf`` file (vocabulary, merges and chat template from its metadata) or an HF directory.

    A ``.gguf`` file's tokenizer is kept on disk after the first load (:mod:`minillm.loaders.gguf_cache`): building
    it from the file's metadata takes seconds, reading it back a fraction of one."""
    from transformers import AutoTokenizer

    from minillm.loaders import gguf_cache

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    path = Path(path)
    if path.suffix == ".gguf":
        cached = gguf_cache.tokenizer_dir(path)
        if cached is not None:
            return AutoTokenizer.from_pretrained(str(cached))
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        gguf_cache.save_tokenizer(path, tokenizer)
        return tokenizer
    return AutoTokenizer.from_pretrained(str(path))


def chat_prompt_ids(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, str]] | str) -> list[int]:
    """Token ids of ``messages`` (or one user message) rendered with the model's chat template, ready to answer."""
    if isinstance(messages, str):
        messages = [{"role": "user", "content": messages}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if isinstance(ids, Mapping):  # transformers >= 5 returns a BatchEncoding
        ids = ids["input_ids"]
    return list(ids)
