"""The waiting queue and the running set, indexed the way the policies read them.

``decide`` accepts plain sequences (it indexes them itself, O(n log n)) or these indexes,
kept up to date by a caller that holds thousands of requests (the simulator): then a
decision reads only the prefix of the queue it needs and the free chips it needs, instead
of re-sorting and re-summing everything at every event. ``decide`` never changes what they
hold (it may fill ``Occupancy``'s cache of when each node frees up).
"""

from __future__ import annotations

import math
from bisect import bisect_left, insort
from collections.abc import Iterable, Iterator

from trainflow.errors import SpecError
from trainflow.sched.capacity import FreeMap
from trainflow.sched.model import Pool, Request, Running


def _arrival(r: Request) -> tuple:
    return (r.submitted, r.id)


def _by_priority(r: Request) -> tuple:
    return (-r.priority, r.submitted, r.id)


def _by_end(run: Running) -> tuple:
    return (run.end, run.started, run.request.id)


def _delete(items: list, item, key) -> None:
    i = bisect_left(items, key(item), key=key)
    assert items[i] is item, (item, i)
    del items[i]


class Queue:
    """Waiting requests in arrival order (``submitted``, then id), in priority order and
    per tenant. A request that never fits the pool is refused when added."""

    def __init__(self, pool: Pool, requests: Iterable[Request] = ()) -> None:
        self.pool = pool
        self.arrival: list[Request] = []
        self.by_priority: list[Request] = []
        self.by_tenant: dict[str, list[Request]] = {}
        self._ids: dict[str, Request] = {}
        for r in requests:
            self.add(r)

    def add(self, request: Request) -> None:
        """Raises:
        SpecError: the request could never fit the pool, or its id is already waiting."""
        self.pool.check(request)
        if request.id in self._ids:
            raise SpecError("id", request.id, "a request with this id is already waiting; ids must be unique")
        self._ids[request.id] = request
        insort(self.arrival, request, key=_arrival)
        insort(self.by_priority, request, key=_by_priority)
        insort(self.by_tenant.setdefault(request.tenant, []), request, key=_arrival)

    def remove(self, request_id: str) -> Request:
        r = self._ids.pop(request_id)
        _delete(self.arrival, r, _arrival)
        _delete(self.by_priority, r, _by_priority)
        mine = self.by_tenant[r.tenant]
        _delete(mine, r, _arrival)
        if not mine:
            del self.by_tenant[r.tenant]
        return r

    def __len__(self) -> int:
        return len(self.arrival)

    def __iter__(self) -> Iterator[Request]:
        return iter(self.arrival)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._ids


class Occupancy:
    """Running requests: free chips per node, chips per tenant, expected ends per node."""

    def __init__(self, pool: Pool, running: Iterable[Running] = ()) -> None:
        self.pool = pool
        self.free = FreeMap([n.chips for n in pool.nodes], pool.max_chips)
        self.usage: dict[str, int] = {}
        self.priorities: dict[int, int] = {}
        """Running requests per priority (so "is anything preemptible" is cheap)."""
        self.on_node: list[list[Running]] = [[] for _ in pool.nodes]
        """Per node, its runs by expected end."""
        self._ids: dict[str, Running] = {}
        self._times: dict[int, list[float]] = {}
        self._stale: dict[int, set[int]] = {}
        for run in running:
            self.add(run)

    def add(self, run: Running) -> None:
        """Raises:
        SpecError: the placement does not match the request or does not fit now."""
        r, p = run.request, run.placement
        if run.request.id in self._ids:
            raise SpecError("id", r.id, "this request is already running; ids must be unique")
        if len(p) != r.nodes or len(set(p)) != len(p) or not all(0 <= i < len(self.on_node) for i in p):
            raise SpecError(
                "placement", p, f"request {r.id!r} needs {r.nodes} distinct node indices in 0..{len(self.on_node) - 1}"
            )
        if any(self.free.free[i] < r.chips_per_node for i in p):
            raise SpecError(
                "placement",
                p,
                f"request {r.id!r} needs {r.chips_per_node} chips on each "
                f"node; free there: {[self.free.free[i] for i in p]}",
            )
        self._ids[r.id] = run
        self.free.take(p, r.chips_per_node)
        self.usage[r.tenant] = self.usage.get(r.tenant, 0) + r.chips
        self.priorities[r.priority] = self.priorities.get(r.priority, 0) + 1
        for i in p:
            insort(self.on_node[i], run, key=_by_end)
        for stale in self._stale.values():
            stale.update(p)

    def remove(self, request_id: str) -> Running:
        run = self._ids.pop(request_id)
        r = run.request
        self.free.give(run.placement, r.chips_per_node)
        left = self.usage[r.tenant] - r.chips
        if left:
            self.usage[r.tenant] = left
        else:
            del self.usage[r.tenant]
        if self.priorities[r.priority] == 1:
            del self.priorities[r.priority]
        else:
            self.priorities[r.priority] -= 1
        for i in run.placement:
            _delete(self.on_node[i], run, _by_end)
        for stale in self._stale.values():
            stale.update(run.placement)
        return run

    def ready_times(self, chips: int) -> list[float]:
        """Per node, when it is expected to have ``chips`` free (-inf: now; inf: not from the
        runs with an estimate). Cached per ``chips``; a change to a node's runs marks only
        that node for recomputing. Callers must not modify the list."""
        times = self._times.get(chips)
        if times is None:
            times = self._times[chips] = [
                ready_at(self.free.free[x], self.on_node[x], chips) for x in range(len(self.on_node))
            ]
            self._stale[chips] = set()
        else:
            stale = self._stale[chips]
            for x in stale:
                times[x] = ready_at(self.free.free[x], self.on_node[x], chips)
            stale.clear()
        return times

    def __len__(self) -> int:
        return len(self._ids)

    def __iter__(self) -> Iterator[Running]:
        return iter(self._ids.values())

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._ids

    def get(self, request_id: str) -> Running:
        return self._ids[request_id]


def ready_at(free: int, runs: Iterable[Running], chips: int) -> float:
    """When a node with ``free`` chips and these runs (by expected end) has ``chips`` free."""
    need = chips - free
    if need <= 0:
        return -math.inf
    for run in runs:
        need -= run.request.chips_per_node
        if need <= 0:
            return run.end
    return math.inf
