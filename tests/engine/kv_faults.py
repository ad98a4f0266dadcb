"""Faulty KV connectors for the tests (loaded in worker processes through ``kv_connector_module_path``)."""
from __future__ import annotations

import torch

from minillm.distributed.kv_transfer.prompt_connector import KVLoadError, ReqMeta
from minillm.distributed.kv_transfer.shared_storage_connector import SharedStorageConnector
from minillm.distributed.kv_transfer.torch_distributed_connector import TorchDistributedConnector


class CorruptingConnector(TorchDistributedConnector):
    """Damages the K/V of the requests in ``extra["corrupt"]`` on the way (after the header's checksum was taken), and
    loses those in ``extra["drop"]`` (never sent)."""

    def _store(self, save: ReqMeta, kv: torch.Tensor) -> None:
        if save.req_id in self._config.kv_connector_extra_config.get("drop", ()):
            with self._lock:
                self._sent.add(save.req_id)  # nothing in flight: the blocks may go
            return
        super()._store(save, kv)

    def _send(self, rid: str, header: torch.Tensor, payload: torch.Tensor) -> None:
        if rid in self._config.kv_connector_extra_config.get("corrupt", ()):
            payload = payload.clone()
            payload.view(-1)[12345 % payload.numel()] += 1.0
        super()._send(rid, header, payload)


class OneRankFailsToLoadConnector(SharedStorageConnector):
    """Fails every load on tensor-parallel rank ``extra["fail_rank"]`` only (the others read the files fine), as a
    file that vanishes between two ranks' reads would."""

    def _fetch(self, load: ReqMeta) -> torch.Tensor:
        if self._tp_group is not None and self._tp_group.rank == self._config.kv_connector_extra_config["fail_rank"]:
            raise KVLoadError(f"rank {self._tp_group.rank} was told to fail")
        return super()._fetch(load)
