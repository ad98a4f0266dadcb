"""Build a connector from a :class:`~minillm.config.KVTransferConfig`, by class name.

vLLM counterpart: ``vllm/distributed/kv_transfer/kv_connector/factory.py`` (``KVConnectorFactory``: a registry of
names, and ``kv_connector_module_path`` for connectors outside it).
"""
from __future__ import annotations

import importlib

from minillm.config import KVTransferConfig, LlamaConfig
from minillm.distributed.kv_transfer.base import KVConnectorBase_V1, KVConnectorRole

_REGISTRY = {
    "SharedStorageConnector": "minillm.distributed.kv_transfer.shared_storage_connector",
    "TorchDistributedConnector": "minillm.distributed.kv_transfer.torch_distributed_connector",
}


class KVConnectorFactory:
    """Create either half of the connector a config names."""

    @staticmethod
    def create_connector(config: KVTransferConfig, role: KVConnectorRole, model_config: LlamaConfig,
                         block_size: int) -> KVConnectorBase_V1:
        """The ``role`` half of ``config.kv_connector``.

        Raises:
            ValueError: an unknown connector name (the known ones are listed), or a class that is not a
                :class:`KVConnectorBase_V1`.
        """
        return KVConnectorFactory.get_connector_class(config)(config, role, model_config, block_size)

    @staticmethod
    def get_connector_class(config: KVTransferConfig) -> type[KVConnectorBase_V1]:
        """The class ``config.kv_connector`` names (raises as :meth:`create_connector`)."""
        module = config.kv_connector_module_path or _REGISTRY.get(config.kv_connector)
        if module is None:
            raise ValueError(f"unknown kv_connector {config.kv_connector!r}; built in: {sorted(_REGISTRY)} (or give "
                             f"kv_connector_module_path)")
        try:
            cls = getattr(importlib.import_module(module), config.kv_connector)
        except (ImportError, AttributeError) as e:
            raise ValueError(f"cannot import {config.kv_connector!r} from {module!r}: {e}") from None
        if not (isinstance(cls, type) and issubclass(cls, KVConnectorBase_V1)):
            raise ValueError(f"{module}.{config.kv_connector} is not a KVConnectorBase_V1 subclass")
        return cls
