"""The waiting queue: the order in which requests are admitted, under the ``"fcfs"`` or ``"priority"`` policy.

Both queues offer the same operations, so the scheduler never asks which policy it runs:

- ``add_request`` (a new arrival), ``peek_request`` / ``pop_request`` (the next one to admit),
- ``prepend_request`` (a preempted request goes back *ahead* of new arrivals under FCFS; under priority its
  ``(priority, arrival_time)`` alone decides where it goes),
- ``remove_request(s)`` (aborts), ``len``, ``bool`` and iteration in policy order.

vLLM counterpart: ``vllm/v1/core/sched/request_queue.py`` (``SchedulingPolicy``, ``FCFSRequestQueue``,
``PriorityRequestQueue``, ``create_request_queue``).
"""
from __future__ import annotations

import enum
import heapq
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Iterable, Iterator

from minillm.request import Request


class SchedulingPolicy(enum.Enum):
    """Which waiting request is admitted next, and which running request is preempted first."""

    FCFS = "fcfs"
    PRIORITY = "priority"


class RequestQueue(ABC):
    """The operations the scheduler needs from its waiting queue."""

    @abstractmethod
    def add_request(self, request: Request) -> None:
        """Queue a new arrival in policy order."""

    @abstractmethod
    def pop_request(self) -> Request:
        """Remove and return the next request to admit (``IndexError`` if empty)."""

    @abstractmethod
    def peek_request(self) -> Request:
        """The next request to admit, left in place (``IndexError`` if empty)."""

    @abstractmethod
    def prepend_request(self, request: Request) -> None:
        """Put a request back at the front (FCFS) or in its priority place (priority)."""

    @abstractmethod
    def remove_requests(self, requests: Iterable[Request]) -> None:
        """Drop these requests, wherever they are."""

    def remove_request(self, request: Request) -> None:
        self.remove_requests([request])

    @abstractmethod
    def __len__(self) -> int: ...

    def __bool__(self) -> bool:
        return len(self) > 0

    @abstractmethod
    def __iter__(self) -> Iterator[Request]:
        """Requests in the order they would be admitted (the queue is unchanged)."""


class FCFSRequestQueue(RequestQueue):
    """First come, first served: a deque; arrivals join the back, preempted requests rejoin the front."""

    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def add_request(self, request: Request) -> None:
        self._queue.append(request)

    def pop_request(self) -> Request:
        if not self._queue:
            raise IndexError("pop from an empty waiting queue")
        return self._queue.popleft()

    def peek_request(self) -> Request:
        if not self._queue:
            raise IndexError("peek at an empty waiting queue")
        return self._queue[0]

    def prepend_request(self, request: Request) -> None:
        # A preempted request has waited longest of all, so it is the next to be admitted again.
        self._queue.appendleft(request)

    def remove_requests(self, requests: Iterable[Request]) -> None:
        drop = {id(r) for r in requests}
        self._queue = deque(r for r in self._queue if id(r) not in drop)

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(list(self._queue))


class PriorityRequestQueue(RequestQueue):
    """A binary heap ordered by ``Request.__lt__``: lower ``priority`` first, then earlier ``arrival_time``.

    There is no "front" to prepend to: a preempted request re-enters at the place its priority gives it.
    """

    def __init__(self) -> None:
        self._heap: list[Request] = []

    def add_request(self, request: Request) -> None:
        heapq.heappush(self._heap, request)

    def pop_request(self) -> Request:
        if not self._heap:
            raise IndexError("pop from an empty waiting queue")
        return heapq.heappop(self._heap)

    def peek_request(self) -> Request:
        if not self._heap:
            raise IndexError("peek at an empty waiting queue")
        return self._heap[0]

    def prepend_request(self, request: Request) -> None:
        self.add_request(request)

    def remove_requests(self, requests: Iterable[Request]) -> None:
        drop = {id(r) for r in requests}
        self._heap = [r for r in self._heap if id(r) not in drop]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return iter(sorted(self._heap))


def create_request_queue(policy: SchedulingPolicy | str) -> RequestQueue:
    """An empty waiting queue for ``policy`` (``"fcfs"`` or ``"priority"``)."""
    try:
        policy = SchedulingPolicy(policy)
    except ValueError:
        allowed = [p.value for p in SchedulingPolicy]
        raise ValueError(f"unknown scheduling policy {policy!r}; allowed: {allowed}") from None
    return PriorityRequestQueue() if policy is SchedulingPolicy.PRIORITY else FCFSRequestQueue()
