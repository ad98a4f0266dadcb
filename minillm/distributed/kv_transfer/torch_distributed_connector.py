"""A KV connector between two processes over ``torch.distributed`` point-to-point (gloo on a CPU, NCCL on GPUs).

The producer *pushes*: once a prompt is complete it posts a header (magic, token count, crc32, request id) and the
payload ``[num_layers, 2, num_tokens, num_kv_heads, head_dim]``; the request's blocks are freed when both sends
complete. The consumer's receiver thread takes transfers as they come; until a request's K/V has arrived the
scheduler side answers ``None`` (ask again next step), and after ``timeout_s`` or a failed transfer 0 (prefill
locally). Both engines must give a request the same id. Settings (``kv_connector_extra_config``): ``peer_rank``,
``group``, ``timeout_s``.

vLLM counterpart: none by this name; ``NixlConnector`` (``vllm/distributed/kv_transfer/kv_connector/v1/nixl/``)
moves the same blocks with RDMA, pulled by the decode side; ``NixlPushConnector`` pushes, as here.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
import zlib
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from minillm.distributed.kv_transfer.base import KVConnectorRole
from minillm.distributed.kv_transfer.prompt_connector import KVLoadError, PromptKVConnector, ReqMeta

if TYPE_CHECKING:
    from minillm.core.sched.output import KVConnectorOutput
    from minillm.request import Request

logger = logging.getLogger(__name__)

MAGIC = 0x6B76  # "kv": a header that does not start with it is not ours
CLOSE = -1  # num_tokens of the header a producer sends when it shuts down
MAX_ID_BYTES = 256
HEADER_LEN = 4 + MAX_ID_BYTES
HEADER_TAG, PAYLOAD_TAG = 17, 18


def crc32(t: torch.Tensor) -> int:
    """A checksum of a tensor's bytes (what the header carries, so the receiver can tell a damaged payload)."""
    return zlib.crc32(t.contiguous().view(torch.uint8).numpy().tobytes())


def make_header(request_id: str, num_tokens: int, checksum: int) -> torch.Tensor:
    """``[HEADER_LEN]`` int64: magic, tokens, checksum, id length, then the id's UTF-8 bytes."""
    raw = request_id.encode()
    if len(raw) > MAX_ID_BYTES:
        raise ValueError(f"request id {request_id[:40]!r}... is {len(raw)} bytes; at most {MAX_ID_BYTES} fit a header")
    header = torch.zeros(HEADER_LEN, dtype=torch.int64)
    header[:4] = torch.tensor([MAGIC, num_tokens, checksum, len(raw)])
    header[4:4 + len(raw)] = torch.tensor(list(raw), dtype=torch.int64)
    return header


def parse_header(header: torch.Tensor) -> tuple[str, int, int]:
    """``(request_id, num_tokens, checksum)`` from :func:`make_header`'s tensor; ValueError if it is not one."""
    magic, num_tokens, checksum, n = (int(x) for x in header[:4])
    if magic != MAGIC or not 0 <= n <= MAX_ID_BYTES:
        raise ValueError(f"not a KV transfer header (magic {magic:#x}, id length {n})")
    return bytes(header[4:4 + n].tolist()).decode(), num_tokens, checksum


class TorchDistributedConnector(PromptKVConnector):
    """Push a prompt's K/V from a prefill process to a decode process with ``torch.distributed`` sends.

    Waiting happens in threads, never in the engine's step: gloo's send and receive handles only say they are done
    through a blocking ``wait()``, so the producer waits for each send in a thread, and the consumer receives in one.

    Not under tensor parallelism: its peer is one process with one process group, and the ranks of a tensor-parallel
    engine would each need a peer of their own (vLLM's NIXL connector pairs the ranks of the two engines).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        extra = self._config.kv_connector_extra_config
        peer = extra.get("peer_rank")
        if isinstance(peer, bool) or not isinstance(peer, int) or peer < 0:
            raise ValueError(f"TorchDistributedConnector needs kv_connector_extra_config['peer_rank'], the other "
                             f"engine's global rank (an int >= 0), got {peer!r}")
        self.peer_rank = peer
        self.group = extra.get("group")
        self.timeout_s = float(extra.get("timeout_s", 60.0))
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {extra.get('timeout_s')!r}")
        # scheduler side (consumer)
        self._arrived: set[str] = set()
        self._failed: set[str] = set()
        self._first_asked: dict[str, float] = {}
        # worker side (producer): request id -> (tensors kept alive until sent, waiting thread)
        self._lock = threading.Lock()
        self._sending: dict[str, tuple[tuple[torch.Tensor, ...], threading.Thread]] = {}
        self._sent: set[str] = set()  # sends complete (or given up), filled by the threads
        self._finished_ids: set[str] = set()
        # worker side (consumer): the receiver thread and what it delivered
        self._receiver: threading.Thread | None = None
        self._inbox: queue.Queue[tuple[str, torch.Tensor | None]] = queue.Queue()
        self._received: dict[str, torch.Tensor] = {}
        self._new_failed: set[str] = set()
        self.receive_error: str | None = None
        self.bytes_sent = 0
        self.bytes_received = 0

    def _key(self, request: Request) -> str:
        return request.request_id

    # -- scheduler side ------------------------------------------------------------------------------------------
    def _num_available_tokens(self, request: Request) -> int | None:
        rid = request.request_id
        if rid in self._failed:
            return 0
        if rid in self._arrived:
            return request.num_prompt_tokens
        first = self._first_asked.setdefault(rid, time.monotonic())
        if time.monotonic() - first > self.timeout_s:
            logger.warning("no KV arrived for request %r within %.0f s: prefilling it here", rid, self.timeout_s)
            self._failed.add(rid)
            return 0
        return None

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self._failed |= connector_output.failed_recving
        self._arrived |= connector_output.finished_recving - connector_output.failed_recving

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        rid = request.request_id
        sending = rid in self._saved and rid not in self._loaded  # a send reads these blocks (or will)
        super().request_finished(request, block_ids)
        self._arrived.discard(rid)
        self._failed.discard(rid)
        self._first_asked.pop(rid, None)
        return sending, None

    # -- worker side: producer -----------------------------------------------------------------------------------
    def _store(self, save: ReqMeta, kv: torch.Tensor) -> None:
        payload = kv.contiguous()
        self._send(save.req_id, make_header(save.req_id, payload.shape[2], crc32(payload)), payload)

    def _send(self, rid: str, header: torch.Tensor, payload: torch.Tensor) -> None:
        """Post the two sends, and a thread that waits for them (the blocks are freed when it is done)."""
        works = [dist.isend(header, self.peer_rank, group=self.group, tag=HEADER_TAG),
                 dist.isend(payload, self.peer_rank, group=self.group, tag=PAYLOAD_TAG)]
        thread = threading.Thread(target=self._wait_for_sends, args=(rid, works), daemon=True,
                                  name=f"kv-send-{rid}")
        self._sending[rid] = ((header, payload), thread)
        thread.start()
        self.bytes_sent += payload.numel() * payload.element_size()

    def _wait_for_sends(self, rid: str, works: list[Any]) -> None:
        try:
            for work in works:
                work.wait(timeout=timedelta(seconds=self.timeout_s))
        except Exception as e:  # noqa: BLE001 - the peer is gone or too slow: give the blocks back anyway
            logger.warning("the KV send of request %r failed (%s: %s); freeing its blocks", rid, type(e).__name__, e)
        with self._lock:
            self._sent.add(rid)

    def _sends_done(self, finished_req_ids: set[str]) -> set[str]:
        self._finished_ids |= finished_req_ids
        with self._lock:
            done = self._sent & self._finished_ids
            self._sent -= done
        for rid in done:
            self._sending.pop(rid, None)
            self._finished_ids.discard(rid)
        return done

    # -- worker side: consumer -----------------------------------------------------------------------------------
    def _receive_loop(self) -> None:
        """The receiver thread: header, then payload, until the producer says goodbye (or the group fails)."""
        cfg = self._model_config
        dtype = self._kv_caches[0][0].dtype if self._kv_caches else torch.float32
        try:
            while True:
                header = torch.zeros(HEADER_LEN, dtype=torch.int64)
                dist.recv(header, self.peer_rank, group=self.group, tag=HEADER_TAG)
                rid, num_tokens, checksum = parse_header(header)
                if num_tokens == CLOSE:
                    return
                payload = torch.empty(cfg.num_hidden_layers, 2, num_tokens, cfg.num_key_value_heads, cfg.head_dim,
                                      dtype=dtype)
                dist.recv(payload, self.peer_rank, group=self.group, tag=PAYLOAD_TAG)
                self.bytes_received += payload.numel() * payload.element_size()
                self._inbox.put((rid, payload if crc32(payload) == checksum else None))
        except Exception as e:  # noqa: BLE001 - requests still waiting will time out and prefill here
            self.receive_error = f"{type(e).__name__}: {e}"
            logger.warning("the KV receiver stopped: %s", self.receive_error)

    def _collect_arrivals(self) -> set[str]:
        if self._receiver is None:
            self._receiver = threading.Thread(target=self._receive_loop, daemon=True, name="kv-receiver")
            self._receiver.start()
        arrived: set[str] = set()
        while True:
            try:
                rid, payload = self._inbox.get_nowait()
            except queue.Empty:
                return arrived
            arrived.add(rid)  # finished receiving, well or not (failures also go to failed_recving)
            if payload is None:
                logger.warning("the K/V of request %r arrived damaged (checksum mismatch): it will recompute", rid)
                self._new_failed.add(rid)
            else:
                self._received[rid] = payload

    def _fetch(self, load: ReqMeta) -> torch.Tensor:
        if load.key not in self._received:
            raise KVLoadError(f"no K/V was received for request {load.key!r}")
        return self._received[load.key]

    # -- both ----------------------------------------------------------------------------------------------------
    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        sending = self._sends_done(finished_req_ids) if self._config.is_kv_producer else set()
        recving: set[str] = set()
        if self._config.is_kv_consumer:
            for rid in finished_req_ids:
                self._received.pop(rid, None)  # the request is over: its buffer can go
            recving = self._collect_arrivals()
        return sending or None, recving or None

    def get_failed_recving(self) -> set[str]:
        out, self._new_failed = self._new_failed, set()
        return out

    def shutdown(self) -> None:
        """Producer: wait (up to ``timeout_s``) for the sends in flight, then tell the consumer it is done.
        Consumer: wait for that goodbye, so no receive is left posted when the process group goes away."""
        end = time.monotonic() + self.timeout_s
        if self._role is not KVConnectorRole.WORKER:
            return
        if self._config.is_kv_producer:
            for _, thread in list(self._sending.values()):
                thread.join(timeout=max(0.0, end - time.monotonic()))
            self._sending.clear()
            goodbye = dist.isend(make_header("", CLOSE, 0), self.peer_rank, group=self.group, tag=HEADER_TAG)
            assert goodbye is not None  # None only on a rank outside the group
            goodbye.wait(timeout=timedelta(seconds=max(0.001, end - time.monotonic())))
        if self._config.is_kv_consumer and self._receiver is not None:
            self._receiver.join(timeout=max(0.0, end - time.monotonic()))
            self._received.clear()
