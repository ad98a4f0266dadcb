"""What both connectors share: they move the K/V of a request's *whole prompt*, once.

A producer saves a request's K/V in the step that computes its last prompt token (however it was chunked or
prefix-cached). A consumer, admitting a request, loads all prompt tokens but the last (whose forward pass gives the
first output token), counts them as computed and goes straight to decoding. A failed load writes nothing and
reports its blocks (:meth:`get_block_ids_with_load_errors`); the request recomputes from there. Under tensor
parallelism a save all-gathers every KV head and rank 0 stores the whole, so any tensor-parallel size can load it.
Subclasses say where the K/V lives: files or ``torch.distributed`` sends.

vLLM counterpart: ``vllm/distributed/kv_transfer/kv_connector/v1/example_connector.py`` (``ExampleConnector``,
``ReqMeta``, ``ExampleConnectorMetadata``), which saves in the step a request is *new* (missing a chunked prompt's
later chunks); this one saves when the prompt is complete.
"""
from __future__ import annotations

import logging
from abc import abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from minillm.attention.paged import compute_slot_mapping
from minillm.distributed.kv_transfer.base import KVCache, KVConnectorBase_V1, KVConnectorMetadata

if TYPE_CHECKING:
    from minillm.attention.metadata import AttentionMetadata
    from minillm.core.kv_cache_utils import KVCacheBlock
    from minillm.core.sched.output import SchedulerOutput
    from minillm.request import Request

logger = logging.getLogger(__name__)


class KVLoadError(RuntimeError):
    """A transfer could not be loaded (missing, partial, corrupt, or of the wrong shape)."""


@dataclass
class ReqMeta:
    """One request's load or save in one step.

    Attributes:
        req_id: the request.
        key: what names its K/V outside (a hash of the prompt for files, the request id for point-to-point).
        block_ids: the request's blocks in token order (its ``block_table`` row).
        start, end: the token positions ``start ... end - 1`` to load into, or save from, those blocks.
    """

    req_id: str
    key: str
    block_ids: list[int]
    start: int
    end: int

    def slots(self, block_size: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """``[end - start]`` int64: the cache slots of those positions."""
        return compute_slot_mapping(self.block_ids, self.start, self.end, block_size, device)

    def block_ids_of_range(self, block_size: int) -> list[int]:
        """The blocks that hold positions ``start ... end - 1`` (what a failed load leaves unfilled)."""
        if self.end <= self.start:
            return []
        return self.block_ids[self.start // block_size:(self.end - 1) // block_size + 1]


@dataclass
class PromptKVConnectorMetadata(KVConnectorMetadata):
    """One step's plan: the loads to do before the forward pass, the saves to do during it."""

    loads: list[ReqMeta] = field(default_factory=list)
    saves: list[ReqMeta] = field(default_factory=list)


def gather_kv_slots(kv_layer: KVCache, slots: torch.Tensor) -> torch.Tensor:
    """Read the K and V at ``slots`` of one layer: ``[2, num_slots, num_kv_heads, head_dim]`` (a copy)."""
    key_cache, value_cache = kv_layer
    num_slots = key_cache.shape[0] * key_cache.shape[1]
    flat_k = key_cache.view(num_slots, *key_cache.shape[2:])
    flat_v = value_cache.view(num_slots, *value_cache.shape[2:])
    return torch.stack([flat_k[slots], flat_v[slots]])


def scatter_kv_slots(kv_layer: KVCache, slots: torch.Tensor, kv: torch.Tensor) -> None:
    """Write ``kv`` ``[2, num_slots, num_kv_heads, head_dim]`` into one layer's cache at ``slots``, in place."""
    key_cache, value_cache = kv_layer
    num_slots = key_cache.shape[0] * key_cache.shape[1]
    key_cache.view(num_slots, *key_cache.shape[2:])[slots] = kv[0].to(key_cache.dtype)
    value_cache.view(num_slots, *value_cache.shape[2:])[slots] = kv[1].to(value_cache.dtype)


class PromptKVConnector(KVConnectorBase_V1):
    """A connector that saves each prompt's K/V once it is complete and loads it into a decode engine.

    Subclasses implement where the K/V goes: :meth:`_key`, :meth:`_num_available_tokens` (scheduler side),
    :meth:`_store` and :meth:`_fetch` (worker side), and may override :meth:`request_finished` and
    :meth:`get_finished` for asynchronous transfers.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # scheduler side
        self._requests: dict[str, Request] = {}
        self._need_load: dict[str, tuple[int, int]] = {}  # request id -> (start, end) to load this step
        self._saved: set[str] = set()  # requests whose save was planned (once each)
        self._loaded: set[str] = set()  # requests that got their prompt from outside: no need to save it again
        # worker side
        self._layer_saves: dict[str, dict[int, torch.Tensor]] = {}
        self._invalid_block_ids: set[int] = set()
        self.stats = {"saved_requests": 0, "saved_tokens": 0, "loaded_requests": 0, "loaded_tokens": 0,
                      "failed_loads": 0}

    # -- where the K/V lives (subclasses) --------------------------------------------------------------------------
    @abstractmethod
    def _key(self, request: Request) -> str:
        """What names ``request``'s K/V outside."""

    @abstractmethod
    def _num_available_tokens(self, request: Request) -> int | None:
        """Scheduler side: how many leading tokens of ``request``'s prompt have K/V outside (0: none; ``None``: not
        known yet, ask again next step)."""

    @abstractmethod
    def _store(self, save: ReqMeta, kv: torch.Tensor) -> None:
        """Worker side: save or send ``kv`` ``[num_layers, 2, num_tokens, num_kv_heads, head_dim]``, the K/V of
        positions ``save.start ... save.end - 1``."""

    @abstractmethod
    def _fetch(self, load: ReqMeta) -> torch.Tensor:
        """Worker side: the stored K/V of ``load.key``, ``[num_layers, 2, >= load.end, num_kv_heads, head_dim]``;
        raise :class:`KVLoadError` (or ``OSError``/``ValueError``) if it cannot be had whole."""

    def _should_save(self, request: Request) -> bool:
        """Scheduler side: whether to save this request's prompt (default: unless it was loaded from outside)."""
        return request.request_id not in self._loaded

    # -- scheduler side --------------------------------------------------------------------------------------------
    def on_new_request(self, request: Request) -> None:
        self._requests[request.request_id] = request

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        if not self._config.is_kv_consumer:
            return 0, False
        available = self._num_available_tokens(request)
        if available is None:
            return None, False
        # All but the last token: its forward pass gives the first output token's logits.
        usable = min(available, request.num_tokens - 1) - num_computed_tokens
        return max(usable, 0), False

    def update_state_after_alloc(self, request: Request, blocks: list[KVCacheBlock], num_external_tokens: int
                                 ) -> None:
        if num_external_tokens > 0:
            start = request.num_computed_tokens  # the local prefix-cache hit ends here
            self._need_load[request.request_id] = (start, start + num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> PromptKVConnectorMetadata:
        meta = PromptKVConnectorMetadata()
        assert self._kv_cache_manager is not None, "bind_kv_cache_manager first"
        for rid, (start, end) in self._need_load.items():
            request = self._requests[rid]
            meta.loads.append(ReqMeta(rid, self._key(request), self._kv_cache_manager.get_block_ids(rid), start, end))
            self._loaded.add(rid)
        self._need_load = {}
        if self._config.is_kv_producer:
            so = scheduler_output
            starts = {r.req_id: r.num_computed_tokens for r in so.scheduled_new_reqs}
            cached = so.scheduled_cached_reqs
            starts.update(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
            for rid, start in starts.items():
                request = self._requests[rid]
                num_prompt = request.num_prompt_tokens
                # The step that computes the last prompt token: every prompt position is in the cache after it.
                if rid in self._saved or not start < num_prompt <= start + so.num_scheduled_tokens[rid]:
                    continue
                self._saved.add(rid)
                if self._should_save(request):
                    meta.saves.append(ReqMeta(rid, self._key(request), self._kv_cache_manager.get_block_ids(rid), 0,
                                              num_prompt))
        return meta

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        rid = request.request_id
        self._requests.pop(rid, None)
        self._need_load.pop(rid, None)
        self._loaded.discard(rid)
        self._saved.discard(rid)
        return False, None

    # -- worker side -----------------------------------------------------------------------------------------------
    def start_load_kv(self, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, PromptKVConnectorMetadata)
        fetched: list[torch.Tensor | None] = [self._fetch_checked(load) for load in meta.loads]
        if self._tp_group is not None and meta.loads:
            # Every rank must drop the same loads: only rank 0's report of failed blocks reaches the scheduler.
            failed = torch.tensor([float(kv is None) for kv in fetched])
            self._tp_group.all_reduce(failed, what="KV load failures")
            fetched = [kv if not failed[i] else None for i, kv in enumerate(fetched)]
        for load, kv in zip(meta.loads, fetched, strict=True):
            if kv is None:
                # Nothing was written: the scheduler recomputes from the first of these blocks.
                self._invalid_block_ids.update(load.block_ids_of_range(self._block_size))
                self.stats["failed_loads"] += 1
                continue
            if self._kv_heads is not None:
                kv = kv[:, :, :, self._kv_heads]  # this rank caches only its KV heads
            slots = load.slots(self._block_size, self._kv_caches[0][0].device)
            for layer_idx, kv_layer in enumerate(self._kv_caches):
                scatter_kv_slots(kv_layer, slots, kv[layer_idx, :, load.start:load.end])
            self.stats["loaded_requests"] += 1
            self.stats["loaded_tokens"] += load.end - load.start

    def _fetch_checked(self, load: ReqMeta) -> torch.Tensor | None:
        """The stored K/V of ``load``, every KV head, checked against this model; ``None`` (and a warning) if it
        cannot be had whole."""
        try:
            kv = self._fetch(load)
            expected = (len(self._kv_caches), 2, self._model_config.num_key_value_heads, self._model_config.head_dim)
            got = (kv.shape[0], kv.shape[1], kv.shape[3], kv.shape[4]) if kv.dim() == 5 else tuple(kv.shape)
            if got != expected or kv.shape[2] < load.end:
                raise KVLoadError(f"the stored K/V has shape {tuple(kv.shape)}; this load needs [{expected[0]}, 2, "
                                  f">= {load.end}, {expected[2]}, {expected[3]}]")
        except Exception as e:  # noqa: BLE001 - whatever broke (a reader's own error types too), recompute
            logger.warning("KV load of request %r failed, it will recompute: %s", load.req_id, e)
            return None
        return kv

    def wait_for_layer_load(self, layer_idx: int) -> None:
        return  # loads are complete when start_load_kv returns

    def save_kv_layer(self, layer_idx: int, kv_layer: KVCache, attn_metadata: AttentionMetadata,
                      **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, PromptKVConnectorMetadata)
        for save in meta.saves:
            slots = save.slots(self._block_size, kv_layer[0].device)
            self._layer_saves.setdefault(save.req_id, {})[layer_idx] = gather_kv_slots(kv_layer, slots)

    def wait_for_save(self) -> None:
        meta = self._connector_metadata
        if not isinstance(meta, PromptKVConnectorMetadata):
            return
        for save in meta.saves:
            layers = self._layer_saves.pop(save.req_id, {})
            if len(layers) != len(self._kv_caches):
                raise RuntimeError(f"request {save.req_id!r}: {len(layers)} of {len(self._kv_caches)} layers were "
                                   f"saved in this step; save_kv_layer must run in every attention layer")
            kv = torch.stack([layers[i] for i in range(len(self._kv_caches))]).cpu()
            if self._tp_group is not None:
                kv = self._gather_kv_heads(kv)
            if self._tp_group is None or self._tp_group.rank == 0:  # one rank stores what all of them computed
                self._store(save, kv)
            self.stats["saved_requests"] += 1
            self.stats["saved_tokens"] += save.end - save.start

    def _gather_kv_heads(self, kv: torch.Tensor) -> torch.Tensor:
        """``[num_layers, 2, num_tokens, num_kv_heads, head_dim]``, every KV head, from each rank's ``kv`` of its own
        heads (an all-gather along the head dimension; when ranks outnumber KV heads, one replica of each)."""
        assert self._tp_group is not None
        world, heads = self._tp_group.world_size, self._model_config.num_key_value_heads
        replicas = max(1, world // heads)  # ranks r*replicas ... hold the same heads: take the first of each
        gathered = self._tp_group.all_gather(kv.contiguous(), dim=3, what="KV heads of a saved prompt")
        n = kv.shape[3]
        full = torch.cat([gathered.narrow(3, r * n, n) for r in range(0, world, replicas)], dim=3)
        assert full.shape[3] == heads, (tuple(full.shape), heads)
        return full

    def get_block_ids_with_load_errors(self) -> set[int]:
        out, self._invalid_block_ids = self._invalid_block_ids, set()
        return out
