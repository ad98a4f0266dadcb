"""A disk cache of what a GGUF file turns into: the dequantized fp32 weights and the tokenizer.

Reading SmolLM2's GGUF file costs about 12 s of one core (the reader parses ~50 000 vocabulary entries, twice, then
dequantizes); the first load keeps the result (fp32 safetensors after the Q/K unpermute, the tokenizer's
``save_pretrained``) and later loads read it back in about a second. Where: ``$MINILLM_CACHE_DIR``, else
``$XDG_CACHE_HOME/minillm``, else ``~/.cache/minillm`` (about 520 MB); ``MINILLM_CACHE_DIR=off`` turns it off. An
entry is keyed by the file's path, size, mtime and :data:`CACHE_VERSION`, and written to a temporary directory
renamed into place, so concurrent loads never see half of one.

vLLM counterpart: none; it loads safetensors checkpoints, which need no conversion.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from minillm.config import LlamaConfig

# Bump when what the loader produces from a GGUF file changes: older entries are then never read.
CACHE_VERSION = 1
_OFF = ("off", "0", "none", "")


def cache_root() -> Path | None:
    """The cache's directory, or ``None`` when ``MINILLM_CACHE_DIR=off``."""
    explicit = os.environ.get("MINILLM_CACHE_DIR")
    if explicit is not None:
        return None if explicit.strip().lower() in _OFF else Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "minillm"


def entry_dir(gguf_path: str | Path, kind: str) -> Path | None:
    """Where ``kind`` (``"model"`` or ``"tokenizer"``) of ``gguf_path`` is cached; ``None`` with the cache off."""
    root = cache_root()
    if root is None:
        return None
    path = Path(gguf_path).resolve()
    st = path.stat()
    key = hashlib.sha256(f"{CACHE_VERSION}|{path}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:20]
    return root / f"{path.stem}-{key}" / kind


def _publish(tmp: Path, target: Path) -> None:
    """Rename the finished ``tmp`` directory to ``target``; if another process got there first, keep theirs."""
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.rename(tmp, target)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not target.is_dir():
            raise


def _write(target: Path | None, fill: Any) -> None:
    """Call ``fill(tmp_dir)`` and publish it as ``target``. A failure to write (a read-only home, a full disk) only
    costs the next load its speed, so it is not raised."""
    if target is None or target.is_dir():
        return
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}-"))
        try:
            fill(tmp)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        _publish(tmp, target)
    except OSError:
        pass


def load_state(gguf_path: str | Path) -> tuple[LlamaConfig, dict[str, torch.Tensor]] | None:
    """The cached ``(config, fp32 state dict)`` of ``gguf_path``, or ``None`` when it is not cached."""
    d = entry_dir(gguf_path, "model")
    if d is None or not (d / "model.safetensors").is_file():
        return None
    from safetensors.torch import load_file

    config = LlamaConfig(**json.loads((d / "config.json").read_text()))
    return config, load_file(str(d / "model.safetensors"))


def save_state(gguf_path: str | Path, config: LlamaConfig, state: dict[str, torch.Tensor]) -> None:
    """Keep ``config`` and the fp32 ``state`` (names as :class:`~minillm.model.llama.LlamaForCausalLM`'s)."""
    from safetensors.torch import save_file

    def fill(tmp: Path) -> None:
        save_file({k: v.contiguous() for k, v in state.items()}, str(tmp / "model.safetensors"))
        (tmp / "config.json").write_text(json.dumps(dataclasses.asdict(config)))

    _write(entry_dir(gguf_path, "model"), fill)


def tokenizer_dir(gguf_path: str | Path) -> Path | None:
    """The directory of ``gguf_path``'s cached tokenizer (``save_pretrained``'s files), or ``None``."""
    d = entry_dir(gguf_path, "tokenizer")
    return d if d is not None and (d / "tokenizer_config.json").is_file() else None


def save_tokenizer(gguf_path: str | Path, tokenizer: Any) -> None:
    _write(entry_dir(gguf_path, "tokenizer"), lambda tmp: tokenizer.save_pretrained(str(tmp)))
