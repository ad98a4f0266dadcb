"""A KV connector whose loads all fail, for exercise 10.1's check: it promises the K/V of the prompts of the
requests named in ``kv_connector_extra_config["fail_load"]``, once each, and loads nothing.

The scheduler then does what it does after any failed load (vLLM's ``kv_load_failure_policy="recompute"``): it rolls
the request back to the first block the load was to fill and recomputes from there, in the blocks it holds. The
request stays in its slot of the runner's persistent batch, and the next plan resends its tokens
(``CachedRequestData.all_token_ids``) without the one it sampled from the missing K/V: the runner writes them over
that slot's tokens. No other run of the tiny engine resends tokens to a request that still holds its slot.

vLLM's tests use a connector of the same kind, ``tests/v1/kv_connector/unit/reject_recompute_connector.py``.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from minillm.distributed.kv_transfer.prompt_connector import KVLoadError, PromptKVConnector, ReqMeta

if TYPE_CHECKING:
    from minillm.request import Request


class FailedLoadConnector(PromptKVConnector):
    """A decode engine's connector (``kv_role="kv_consumer"``) whose every load fails, without a warning."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._fail_load = set(self._config.kv_connector_extra_config.get("fail_load", ()))
        self._promised: set[str] = set()  # a request is promised its prompt once: after the failure it recomputes

    def _key(self, request: Request) -> str:
        return request.request_id

    def _num_available_tokens(self, request: Request) -> int:
        rid = request.request_id
        if rid not in self._fail_load or rid in self._promised:
            return 0
        self._promised.add(rid)
        return request.num_prompt_tokens

    def _store(self, save: ReqMeta, kv: torch.Tensor) -> None:
        raise RuntimeError("FailedLoadConnector only loads (kv_role='kv_consumer')")

    def _fetch(self, load: ReqMeta) -> torch.Tensor:
        raise KVLoadError(f"request {load.req_id!r}: this connector fails every load")

    def _fetch_checked(self, load: ReqMeta) -> torch.Tensor | None:
        return None  # the failure is the point: no warning for it
