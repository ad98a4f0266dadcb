"""The KV connector interface: how an engine hands a request's KV cache to another engine, or takes one in.

Two halves, as in vLLM. The **scheduler side** says how many tokens' K/V it can get from outside
(:meth:`KVConnectorBase_V1.get_num_new_matched_tokens`; the scheduler counts them as computed, like prefix-cache
hits), learns the blocks allocated for them, writes each step's plan (:class:`KVConnectorMetadata`, in the
``SchedulerOutput``) and says when a finished request's blocks may be freed. The **worker side** copies around the
forward pass (``start_load_kv``, per-layer ``wait_for_layer_load`` / ``save_kv_layer``, ``wait_for_save``) and
reports back through a ``KVConnectorOutput`` (in the ``ModelRunnerOutput``).

vLLM counterpart: ``vllm/distributed/kv_transfer/kv_connector/v1/base.py`` (``KVConnectorBase_V1``,
``KVConnectorRole``, ``KVConnectorMetadata``); vLLM names layers by string (``layer_name``), here by index.
"""
from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from minillm.config import KVTransferConfig, LlamaConfig

if TYPE_CHECKING:
    from minillm.attention.metadata import AttentionMetadata
    from minillm.core.kv_cache_manager import KVCacheManager
    from minillm.core.kv_cache_utils import KVCacheBlock
    from minillm.core.sched.output import KVConnectorOutput, SchedulerOutput
    from minillm.distributed.parallel_state import TensorParallelGroup
    from minillm.request import Request

KVCache = tuple[torch.Tensor, torch.Tensor]


class KVConnectorRole(enum.Enum):
    """Which half of a connector an object is: the scheduler's or the worker's."""

    SCHEDULER = 0
    WORKER = 1


class KVConnectorMetadata:
    """What the scheduler side tells the worker side for one step; each connector subclasses it."""


class KVConnectorBase_V1(ABC):  # noqa: N801 - vLLM's name
    """One half of a KV connector (see the module docstring for the life cycle).

    With tensor parallelism the scheduler side stays one, in the engine core, and every rank has a worker side of its
    own, told its group and its KV heads by :meth:`bind_tensor_parallel`; only a connector class with
    ``supports_tensor_parallel = True`` accepts that.

    Args:
        config: the engine's :class:`~minillm.config.KVTransferConfig`.
        role: :attr:`KVConnectorRole.SCHEDULER` or :attr:`KVConnectorRole.WORKER`.
        model_config: the model's shape (layers, KV heads, head size), for the size of what moves.
        block_size: tokens per KV block.
    """

    # Whether its worker side can run on each of several tensor-parallel ranks (see bind_tensor_parallel).
    supports_tensor_parallel: ClassVar[bool] = False

    def __init__(self, config: KVTransferConfig, role: KVConnectorRole, model_config: LlamaConfig,
                 block_size: int) -> None:
        if not isinstance(role, KVConnectorRole):
            raise ValueError(f"role must be a KVConnectorRole, got {role!r}")
        self._config = config
        self._role = role
        self._model_config = model_config
        self._block_size = block_size
        self._connector_metadata: KVConnectorMetadata | None = None
        self._kv_caches: list[KVCache] = []
        self._kv_cache_manager: KVCacheManager | None = None
        # Worker side, one rank of several: the group, and the global indices of the KV heads this rank caches.
        self._tp_group: TensorParallelGroup | None = None
        self._kv_heads: list[int] | None = None

    @property
    def role(self) -> KVConnectorRole:
        return self._role

    @property
    def config(self) -> KVTransferConfig:
        return self._config

    # -- worker side ---------------------------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: list[KVCache]) -> None:
        """The model runner's paged cache: one ``(key_cache, value_cache)`` per layer, each ``[num_blocks,
        block_size, num_kv_heads, head_dim]``. Loads write into it, saves read from it."""
        self._kv_caches = kv_caches

    def bind_tensor_parallel(self, tp_group: TensorParallelGroup, kv_heads: list[int]) -> None:
        """Worker side, on one of several tensor-parallel ranks: the group, and the global indices of the KV heads
        this rank's cache holds (its cache is ``[num_blocks, block_size, len(kv_heads), head_dim]`` per layer).

        Raises:
            ValueError: this connector class does not support tensor parallelism.
        """
        if not self.supports_tensor_parallel:
            raise ValueError(f"{type(self).__name__} does not support tensor_parallel_size > 1")
        self._tp_group, self._kv_heads = tp_group, list(kv_heads)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """Before the forward pass: this step's plan from the scheduler side."""
        self._connector_metadata = connector_metadata

    def clear_connector_metadata(self) -> None:
        """After the step: forget the plan."""
        self._connector_metadata = None

    def _get_connector_metadata(self) -> KVConnectorMetadata:
        if self._connector_metadata is None:
            raise RuntimeError("no connector metadata is bound: call bind_connector_metadata first")
        return self._connector_metadata

    @abstractmethod
    def start_load_kv(self, **kwargs: Any) -> None:
        """Before the forward pass: start loading the K/V this step's plan asks for into the paged cache. A load
        this step's forward reads must be complete (or waited for in :meth:`wait_for_layer_load`) before the layer
        attends."""

    @abstractmethod
    def wait_for_layer_load(self, layer_idx: int) -> None:
        """In attention layer ``layer_idx``, before it attends: block until that layer's loads are in the cache.
        (The hook for layer-by-layer pipelining: layer 0 can run while later layers still load.)"""

    @abstractmethod
    def save_kv_layer(self, layer_idx: int, kv_layer: KVCache, attn_metadata: AttentionMetadata,
                      **kwargs: Any) -> None:
        """In attention layer ``layer_idx``, after this step's K/V were written to ``kv_layer`` (the layer's
        ``(key_cache, value_cache)``): start saving what the plan says to save."""

    @abstractmethod
    def wait_for_save(self) -> None:
        """After the forward pass: submit or finish this step's saves. A save still in flight after this returns
        must keep its blocks alive until :meth:`get_finished` reports it."""

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """After the step: ``(finished_sending, finished_recving)``, the requests whose asynchronous transfers
        completed. ``finished_req_ids`` are the requests the scheduler finished since the last step; a request is
        reported as finished sending only once the scheduler has finished it."""
        return None, None

    def get_failed_recving(self) -> set[str]:
        """After the step: requests whose incoming transfer failed since the last call (they recompute)."""
        return set()

    def get_block_ids_with_load_errors(self) -> set[int]:
        """After the step: blocks that a load of this step failed to fill (their requests recompute from there)."""
        return set()

    def shutdown(self) -> None:  # noqa: B027 - an optional hook, a no-op by default
        """Release what the connector holds (files, receive buffers, pending sends)."""

    # -- scheduler side ------------------------------------------------------------------------------------------
    def bind_kv_cache_manager(self, kv_cache_manager: KVCacheManager) -> None:
        """The scheduler's :class:`~minillm.core.kv_cache_manager.KVCacheManager` (for the requests' block ids)."""
        self._kv_cache_manager = kv_cache_manager

    def on_new_request(self, request: Request) -> None:  # noqa: B027 - an optional hook, a no-op by default
        """A request was added to the scheduler."""

    @abstractmethod
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """How many tokens of ``request``, beyond the ``num_computed_tokens`` the local prefix cache already has,
        can be loaded from outside.

        Returns:
            ``(num_tokens, load_async)``. ``num_tokens`` is ``None`` when the connector cannot tell yet (the KV has
            not arrived): the scheduler leaves the request waiting and asks again next step. ``load_async`` is
            ``True`` when the load happens between steps (vLLM's NIXL connector); the connectors here load
            synchronously, at the start of the step that uses the KV, and return ``False``.
        """

    @abstractmethod
    def update_state_after_alloc(self, request: Request, blocks: list[KVCacheBlock], num_external_tokens: int
                                 ) -> None:
        """The scheduler allocated ``blocks`` (all of the request's blocks) for ``request``, of which the tokens
        ``num_computed_tokens ... num_computed_tokens + num_external_tokens - 1`` are to be loaded (0: nothing)."""

    @abstractmethod
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """This step's plan for the worker side (what to load and save where). Must not change
        ``scheduler_output``; resets the per-step state."""

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:  # noqa: B027 - an optional hook, a no-op by default
        """What the worker side reported after the step (arrivals, failures)."""

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """``request`` finished; ``block_ids`` are its blocks, not yet freed.

        Returns:
            ``(delay_free_blocks, kv_transfer_params)``: ``True`` if a transfer still reads the blocks, so the
            scheduler must keep them until :meth:`get_finished` reports the request as finished sending; and
            optional parameters for the engine that continues the request.
        """
        return False, None
