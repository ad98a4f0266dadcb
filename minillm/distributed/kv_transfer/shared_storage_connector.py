"""A KV connector through a shared directory: the prefill engine writes each prompt's K/V to files, the decode
engine reads them.

Layout: ``<shared_storage_path>/<key>/layer_<i>.safetensors`` (``{"kv": [2, num_tokens, num_kv_heads, head_dim]}``)
and ``meta.json``, ``<key>`` a SHA-256 of the prompt's token ids. A request's files are written to a temporary
directory renamed into place, so a reader sees them whole or not at all; a file damaged later fails its load and the
request recomputes. Saving is synchronous (in ``wait_for_save``), so a finished request's blocks are freed at once.

vLLM counterpart: ``vllm/distributed/kv_transfer/kv_connector/v1/example_connector.py`` (``ExampleConnector``,
formerly ``SharedStorageConnector``), with the same ``shared_storage_path`` setting and one file per layer.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import safetensors.torch
import torch

from minillm.distributed.kv_transfer.prompt_connector import KVLoadError, PromptKVConnector, ReqMeta

if TYPE_CHECKING:
    from minillm.request import Request


def prompt_key(token_ids: list[int]) -> str:
    """The name of a prompt's K/V: SHA-256 of its token ids as int64 bytes (hex)."""
    return hashlib.sha256(np.asarray(token_ids, dtype=np.int64).tobytes()).hexdigest()


class SharedStorageConnector(PromptKVConnector):
    """Save and load whole prompts' K/V as files under ``kv_connector_extra_config["shared_storage_path"]``
    (default: ``<tmp>/minillm_kv``).

    Under tensor parallelism the files hold every KV head all the same (rank 0 writes what the ranks all-gathered;
    each rank reads the files and keeps its heads), so engines of different tensor-parallel sizes share them. vLLM's
    ``ExampleConnector`` does not take tensor parallelism into account: every rank would write the same file names.
    """

    supports_tensor_parallel = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        path = self._config.kv_connector_extra_config.get("shared_storage_path",
                                                           os.path.join(tempfile.gettempdir(), "minillm_kv"))
        if not isinstance(path, (str, os.PathLike)):
            raise ValueError(f"shared_storage_path must be a directory path, got {path!r}")
        self.storage_path = Path(path)
        self.storage_path.mkdir(parents=True, exist_ok=True)

    def _key(self, request: Request) -> str:
        return prompt_key(request.prompt_token_ids)

    def _dir(self, key: str) -> Path:
        return self.storage_path / key

    def _read_meta(self, key: str) -> dict | None:
        try:
            meta = json.loads((self._dir(key) / "meta.json").read_text())
        except (OSError, ValueError):
            return None
        cfg = self._model_config
        same_model = (meta.get("num_layers") == cfg.num_hidden_layers and meta.get("num_kv_heads") ==
                      cfg.num_key_value_heads and meta.get("head_dim") == cfg.head_dim)
        return meta if same_model else None

    # -- scheduler side ------------------------------------------------------------------------------------------
    def _num_available_tokens(self, request: Request) -> int | None:
        meta = self._read_meta(self._key(request))
        return 0 if meta is None else int(meta["num_tokens"])

    def _should_save(self, request: Request) -> bool:
        return super()._should_save(request) and self._read_meta(self._key(request)) is None

    # -- worker side ---------------------------------------------------------------------------------------------
    def _store(self, save: ReqMeta, kv: torch.Tensor) -> None:
        final = self._dir(save.key)
        if final.exists():
            return  # an engine saved the same prompt already
        tmp = Path(tempfile.mkdtemp(prefix=f".{save.key[:16]}-", dir=self.storage_path))
        try:
            for layer_idx in range(kv.shape[0]):
                path = tmp / f"layer_{layer_idx}.safetensors"
                safetensors.torch.save_file({"kv": kv[layer_idx].contiguous()}, str(path))
            meta = {"num_tokens": int(kv.shape[2]), "num_layers": int(kv.shape[0]), "num_kv_heads": int(kv.shape[3]),
                    "head_dim": int(kv.shape[4]), "dtype": str(kv.dtype)}
            (tmp / "meta.json").write_text(json.dumps(meta))
            os.replace(tmp, final)  # atomic: readers see all of it or none of it
        except OSError:
            if final.exists():  # another engine won the race with the same prompt: theirs is as good
                return
            raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def _fetch(self, load: ReqMeta) -> torch.Tensor:
        meta = self._read_meta(load.key)
        if meta is None:
            raise KVLoadError(f"no complete K/V under {self._dir(load.key)}")
        layers = []
        for layer_idx in range(meta["num_layers"]):
            path = self._dir(load.key) / f"layer_{layer_idx}.safetensors"
            layers.append(safetensors.torch.load_file(str(path))["kv"])
        shapes = {tuple(t.shape) for t in layers}
        if len(shapes) != 1:
            raise KVLoadError(f"the layers' files disagree on their shape: {sorted(shapes)}")
        return torch.stack(layers)
