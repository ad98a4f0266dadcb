"""Moving KV caches between engines (chapter 9: disaggregated prefill).

- :mod:`~minillm.distributed.kv_transfer.base`: the connector interface, in vLLM's two halves (scheduler, worker).
- :mod:`~minillm.distributed.kv_transfer.prompt_connector`: what the course's connectors share (a prompt's K/V,
  saved once it is complete, loaded into a decode engine, recomputed when a load fails).
- :mod:`~minillm.distributed.kv_transfer.shared_storage_connector`: through files.
- :mod:`~minillm.distributed.kv_transfer.torch_distributed_connector`: through ``torch.distributed`` sends.
- :mod:`~minillm.distributed.kv_transfer.factory`: a connector by name.
- :mod:`~minillm.distributed.kv_transfer.kv_transfer_utils`: the hooks in every attention layer.

vLLM counterpart: ``vllm/distributed/kv_transfer/``.
"""
from minillm.distributed.kv_transfer.base import KVConnectorBase_V1, KVConnectorMetadata, KVConnectorRole
from minillm.distributed.kv_transfer.factory import KVConnectorFactory
from minillm.distributed.kv_transfer.prompt_connector import (
                                                              KVLoadError,
                                                              PromptKVConnector,
                                                              PromptKVConnectorMetadata,
                                                              ReqMeta,
)
from minillm.distributed.kv_transfer.shared_storage_connector import SharedStorageConnector, prompt_key
from minillm.distributed.kv_transfer.torch_distributed_connector import TorchDistributedConnector

__all__ = ["KVConnectorBase_V1", "KVConnectorFactory", "KVConnectorMetadata", "KVConnectorRole", "KVLoadError",
           "PromptKVConnector", "PromptKVConnectorMetadata", "ReqMeta", "SharedStorageConnector",
           "TorchDistributedConnector", "prompt_key"]
