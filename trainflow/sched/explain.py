"""Why each request still waits, worked out from the state a decision left, on demand."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from trainflow.sched.capacity import FreeMap
from trainflow.sched.model import Request

if TYPE_CHECKING:
    from trainflow.sched.policy import Reservation


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def _needs(free: FreeMap, r: Request) -> str:
    k = free.count(r.chips_per_node)
    return f"needs {r.shape()}, {k} such node{'' if k == 1 else 's'} free"


def _behind(i: int) -> str:
    return f"behind {_plural(i, 'earlier request')}" if i else "first in line"


class View:
    """What a decision left: the queue in the policy's order, and the reason for each."""

    def __init__(self, free: FreeMap, order: Sequence[Request]) -> None:
        self.free = free
        self._order = order

    def order(self) -> tuple[Request, ...]:
        return tuple(self._order)

    def reservation_at(self) -> float | None:
        return None

    def reason(self, position: int, request: Request) -> str:
        return f"{_needs(self.free, request)}; {_behind(position)}"


class Fifo(View):
    def reason(self, position: int, request: Request) -> str:
        if position and self.free.fits(request.nodes, request.chips_per_node):
            return f"fits now, but fifo keeps arrival order: {_behind(position)}, {self._order[0].id!r} first"
        return super().reason(position, request)


class Backfill(View):
    def __init__(
        self,
        free: FreeMap,
        tail: Sequence[Request],
        started: set[str],
        reservation: Reservation | None,
        now: float,
        window: int,
    ) -> None:
        super().__init__(free, tail)
        self.now = now
        self._started = started
        self.res = reservation
        self.window = window

    def order(self) -> tuple[Request, ...]:
        return tuple(r for r in self._order if r.id not in self._started)

    def reservation_at(self) -> float | None:
        return None if self.res is None else self.res.at

    def reason(self, position: int, request: Request) -> str:
        res = self.res
        base = _needs(self.free, request)
        if position == 0:
            if res is None or res.at is None:
                return f"{base}; no reservation: the chips it needs are held by runs without an estimate"
            return f"{base}; reserved to start at t={res.at:g} on nodes {list(res.nodes)}"
        head = res.head.id if res is not None else "the head"
        if request.estimate is None:
            return f"{base}; no runtime estimate, so never started ahead of {head!r}; {_behind(position)}"
        if not self.free.fits(request.nodes, request.chips_per_node):
            return f"{base}; {_behind(position)}"
        if res is None or res.at is None:
            return f"{base}; {head!r} has no reservation, so nothing is backfilled past it"
        late = self.now + request.estimate > res.at
        if late and not res.spare.fits(request.nodes, request.chips_per_node):
            return (
                f"{base}; starting now would delay {head!r} (reserved at t={res.at:g}): it would "
                f"run until after that and needs chips reserved for it"
            )
        return f"{base}; beyond the backfill window ({self.window} requests after {head!r}); {_behind(position)}"


class Priority(View):
    def reason(self, position: int, request: Request) -> str:
        text = f"priority {request.priority}; {_needs(self.free, request)}; {_behind(position)}"
        if position == 0:
            text += "; no lower-priority run to preempt frees enough"
        return text


class Fairshare(View):
    def __init__(
        self, free: FreeMap, left: Mapping[str, Sequence[Request]], usage: Mapping[str, int], quotas: Mapping[str, int]
    ) -> None:
        super().__init__(free, ())
        self._left, self.usage, self.quotas = left, usage, quotas
        self._ahead: dict[str, int] | None = None

    def _standing(self, tenant: str) -> tuple[bool, float]:
        used, q = self.usage.get(tenant, 0), self.quotas.get(tenant, 0)
        return used >= q, used / q if q else math.inf

    def order(self) -> tuple[Request, ...]:
        everyone = [r for reqs in self._left.values() for r in reqs]
        return tuple(sorted(everyone, key=lambda r: (*self._standing(r.tenant), r.submitted, r.id)))

    def reason(self, position: int, request: Request) -> str:
        t = request.tenant
        used, q = self.usage.get(t, 0), self.quotas.get(t, 0)
        text = f"tenant {t!r} holds {used} of its {q}-chip quota; {_needs(self.free, request)}; "
        if self._ahead is None:
            self._ahead = {r.id: i for reqs in self._left.values() for i, r in enumerate(reqs)}
        ahead = self._ahead[request.id]
        if ahead:
            text += f"behind {_plural(ahead, 'earlier request')} of the same tenant"
        elif used + request.chips <= q:
            text += "within its quota (it may reclaim only from tenants over theirs)"
        else:
            text += (
                f"would borrow {used + request.chips - q} chips beyond its quota: borrowers wait "
                f"while a request within its quota waits, least-served tenant first"
            )
        return f"{text}; position {position}"
