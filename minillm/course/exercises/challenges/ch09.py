"""Challenge 9: a KV connector that transfers only the blocks the decode engine lacks.

``SharedStorageConnector`` saves every prompt's K/V whole, positions ``0 ... P - 1``, even when the decode engine
already holds a prefix of it in its own prefix cache (a shared chat template, a system prompt). Here the prefill
engine is told, per prompt, how many leading tokens the decode engine has cached (``decode_hits`` in
``kv_connector_extra_config``: prompt key -> tokens, whole blocks, as a router would learn them from the decode
engine) and saves only positions ``hit ... P - 2``: what the decode engine lacks, less the last prompt token, which
the decode engine computes itself. ``meta.json`` records the saved range: ``"start"`` (the first saved position) and
``"num_tokens"`` (one past the last). The decode engine then loads the tokens beyond its local hit, and only if the
saved range begins at or before that hit; if its cache has lost blocks since (``num_computed_tokens < start``),
the positions in between are nowhere, and it loads nothing and recomputes the prompt.

vLLM v0.33.0: the NIXL connector's decode side pulls only the blocks its prefix cache does not hold
(``vllm/distributed/kv_transfer/kv_connector/v1/nixl/pull_scheduler.py:NixlPullConnectorScheduler.update_state_after_alloc``
takes ``blocks.get_unhashed_block_ids_all_groups()``, and
``vllm/distributed/kv_transfer/kv_connector/v1/nixl/base_worker.py:NixlBaseConnectorWorker._apply_prefix_caching``
end-trims the prefill side's block list to match: "Partial prefix cache hit: just transfer uncomputed blocks"), and
its ``get_num_new_matched_tokens`` counts only the tokens beyond ``num_computed_tokens``. There the prefill engine
keeps every block and the decode engine reads the ones it needs; with a file store in between, the saving side has
to know the hit.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import safetensors.torch
import torch

from minillm.distributed.kv_transfer.prompt_connector import ReqMeta
from minillm.distributed.kv_transfer.shared_storage_connector import SharedStorageConnector

if TYPE_CHECKING:
    from minillm.request import Request

# What a delegating answer could call (the tripwire reads it for "C9").
TARGETS = ("minillm.course.exercises.challenges.ch09:DeltaStorageConnector._store",
           "minillm.course.exercises.challenges.ch09:DeltaStorageConnector._fetch",
           "minillm.course.exercises.challenges.ch09:DeltaStorageConnector.get_num_new_matched_tokens")


class DeltaStorageConnector(SharedStorageConnector):
    """A shared-storage connector whose prefill side saves only the decode side's missing K/V."""

    def _decode_hit(self, key: str) -> int:
        """The decode engine's prefix-cache hit for the prompt named ``key`` (0 when the router said nothing)."""
        return int(self._config.kv_connector_extra_config.get("decode_hits", {}).get(key, 0))

    def _store(self, save: ReqMeta, kv: torch.Tensor) -> None:
        """Save positions ``hit ... P - 2`` of ``kv`` (which holds ``save.start ... save.end - 1``, the whole
        prompt)."""
        final = self._dir(save.key)
        if final.exists():
            return  # an engine saved the same prompt already
        end = save.end - 1  # the decode engine computes the last prompt token itself
        start = min(self._decode_hit(save.key), end)  # it has these already
        tmp = Path(tempfile.mkdtemp(prefix=f".{save.key[:16]}-", dir=self.storage_path))
        try:
            part = kv[:, :, start - save.start:end - save.start]
            for layer_idx in range(part.shape[0]):
                safetensors.torch.save_file({"kv": part[layer_idx].contiguous()},
                                            str(tmp / f"layer_{layer_idx}.safetensors"))
            meta = {"start": start, "num_tokens": end, "num_layers": int(kv.shape[0]),
                    "num_kv_heads": int(kv.shape[3]), "head_dim": int(kv.shape[4]), "dtype": str(kv.dtype)}
            (tmp / "meta.json").write_text(json.dumps(meta))
            os.replace(tmp, final)  # atomic: readers see all of it or none of it
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def _fetch(self, load: ReqMeta) -> torch.Tensor:
        """The saved K/V, put at its positions: ``[num_layers, 2, num_tokens, ...]``, zeros before ``start`` (which
        no load reads: loads start at the local hit, at or after ``start``)."""
        meta = self._read_meta(load.key)
        kv = super()._fetch(load)  # the saved positions only, from 0
        start = int(meta.get("start", 0)) if meta is not None else 0
        before = torch.zeros(kv.shape[0], kv.shape[1], start, *kv.shape[3:], dtype=kv.dtype)
        return torch.cat([before, kv], dim=2)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        if not self._config.is_kv_consumer:
            return 0, False
        meta = self._read_meta(self._key(request))
        if meta is None:
            return 0, False  # never saved: compute the prompt here
        if num_computed_tokens < int(meta.get("start", 0)):
            return 0, False  # the positions between the local hit and the saved range are nowhere: recompute
        return max(min(int(meta["num_tokens"]), request.num_tokens - 1) - num_computed_tokens, 0), False
