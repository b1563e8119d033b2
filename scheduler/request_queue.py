"""The waiting queue, in the order the scheduling policy admits from it.

``fcfs``: arrival order, with preempted requests back at the front.
``priority``: by (priority, arrival_index): lower priority values first, ties
by arrival; a preempted request goes back to its place by that key.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Iterator

from scheduler.request import Request


def priority_key(request: Request) -> tuple[int, int]:
    return request.priority, request.arrival_index


class RequestQueue:
    """Iteration and indexing follow admission order."""

    def __init__(self, policy: str = "fcfs") -> None:
        self.policy = policy
        self._fcfs: deque[Request] = deque()
        self._sorted: list[Request] = []

    def add(self, request: Request) -> None:
        """A new arrival."""
        if self.policy == "priority":
            bisect.insort(self._sorted, request, key=priority_key)
        else:
            self._fcfs.append(request)

    def add_preempted(self, request: Request) -> None:
        """A request taken off the running batch: first in line under fcfs,
        in its place by priority otherwise."""
        if self.policy == "priority":
            bisect.insort(self._sorted, request, key=priority_key)
        else:
            self._fcfs.appendleft(request)

    def remove(self, request: Request) -> None:
        self._items.remove(request)

    @property
    def _items(self) -> deque[Request] | list[Request]:
        return self._sorted if self.policy == "priority" else self._fcfs

    def __iter__(self) -> Iterator[Request]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __bool__(self) -> bool:
        return bool(self._items)

    def __getitem__(self, index: int) -> Request:
        return self._items[index]

    def check_order(self) -> None:
        if self.policy == "priority":
            keys = [priority_key(r) for r in self._sorted]
            if keys != sorted(keys):
                raise AssertionError("the priority queue is out of order")
