"""A KV connector that promises a block-aligned prefix of every prompt, then rejects the load (loaded in the engine
core through ``kv_connector_module_path="tests.engine.reject_recompute_connector"``).

It mirrors vLLM's ``tests/v1/kv_connector/unit/reject_recompute_connector.py:RejectRecomputeConnector``: the
scheduler side answers ``get_num_new_matched_tokens`` with the largest block-aligned prefix strictly shorter than the
prompt, loaded synchronously; the worker side then loads nothing and reports the failure. Two ways to report it
(``kv_connector_extra_config["report"]``):

* ``"invalid_blocks"`` (vLLM's): the promised blocks, through ``get_block_ids_with_load_errors``;
* ``"failed_recving"``: the whole load of the request, through ``get_failed_recving``.

Unlike vLLM's, which serves zero bytes into a fresh cache, it writes noise into the promised slots
(``extra["noise"]``, default on), so a scheduler that used them instead of recomputing gives other tokens.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from minillm.attention.paged import compute_slot_mapping
from minillm.distributed.kv_transfer.base import KVConnectorBase_V1, KVConnectorMetadata

if TYPE_CHECKING:
    from minillm.core.kv_cache_utils import KVCacheBlock
    from minillm.core.sched.output import SchedulerOutput
    from minillm.request import Request

REPORTS = ("invalid_blocks", "failed_recving")


@dataclass
class RejectRecomputeMetadata(KVConnectorMetadata):
    # (req_id, block_ids, start, end) of each load promised, to be rejected, in this step.
    loads: list[tuple[str, list[int], int, int]] = field(default_factory=list)


class RejectRecomputeConnector(KVConnectorBase_V1):
    """Promises ``((num_prompt_tokens - 1) // block_size) * block_size`` tokens, then fails every load."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        extra = self._config.kv_connector_extra_config
        self._report = extra.get("report", "invalid_blocks")
        if self._report not in REPORTS:
            raise ValueError(f"report must be one of {REPORTS}, got {self._report!r}")
        self._noise = bool(extra.get("noise", True))
        self._need_load: dict[str, tuple[int, int]] = {}
        self._load_errors: set[int] = set()
        self._failed_recving: set[str] = set()
        # Counted on both sides (one process holds both halves of the connector).
        self.stats = {"promised_loads": 0, "rejected_loads": 0}

    # -- scheduler side ------------------------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        matched = ((request.num_prompt_tokens - 1) // self._block_size) * self._block_size
        return max(matched - num_computed_tokens, 0), False  # a synchronous load

    def update_state_after_alloc(self, request: Request, blocks: list[KVCacheBlock], num_external_tokens: int
                                 ) -> None:
        if num_external_tokens > 0:
            start = request.num_computed_tokens
            self._need_load[request.request_id] = (start, start + num_external_tokens)
            self.stats["promised_loads"] += 1

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> RejectRecomputeMetadata:
        assert self._kv_cache_manager is not None
        meta = RejectRecomputeMetadata()
        for rid, (start, end) in self._need_load.items():
            meta.loads.append((rid, self._kv_cache_manager.get_block_ids(rid), start, end))
        self._need_load = {}
        return meta

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._need_load.pop(request.request_id, None)
        return False, None

    # -- worker side ---------------------------------------------------------------------------------------------
    def start_load_kv(self, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, RejectRecomputeMetadata)
        for rid, block_ids, start, end in meta.loads:
            if self._noise:
                slots = compute_slot_mapping(block_ids, start, end, self._block_size, self._kv_caches[0][0].device)
                g = torch.Generator().manual_seed(len(slots))
                for key_cache, value_cache in self._kv_caches:
                    for cache in (key_cache, value_cache):
                        flat = cache.view(-1, *cache.shape[2:])
                        flat[slots] = torch.randn(flat[slots].shape, generator=g).to(cache.dtype) * 30
            if self._report == "invalid_blocks":
                self._load_errors.update(block_ids[start // self._block_size:(end - 1) // self._block_size + 1])
            else:
                self._failed_recving.add(rid)
            self.stats["rejected_loads"] += 1

    def wait_for_layer_load(self, layer_idx: int) -> None:
        return

    def save_kv_layer(self, layer_idx: int, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        return

    def wait_for_save(self) -> None:
        return

    def get_block_ids_with_load_errors(self) -> set[int]:
        out, self._load_errors = self._load_errors, set()
        return out

    def get_failed_recving(self) -> set[str]:
        out, self._failed_recving = self._failed_recving, set()
        return out
