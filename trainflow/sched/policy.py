"""``decide``: the one pure scheduling decision, used by the simulator and the allocator.

Given the pool, what runs, what waits and the time, a policy says which waiting requests
start now (and where), which running ones are preempted, and why every other one waits.
No I/O, no clock: the same inputs always give the same decision.

- ``fifo``: arrival order, strictly; the first request that does not fit blocks the rest.
- ``backfill``: EASY backfill. The first blocked request (the head) is reserved the
  earliest time its gang fits, from the running requests' estimates; a later request with
  an estimate starts now if it ends by then, or if it fits in chips the head's reservation
  leaves spare. The scan stops ``backfill_window`` requests after the head.
- ``priority``: highest priority first, FIFO within one; a request that does not fit
  preempts lower-priority runs when that frees enough (``preempt.victims``); the first
  request that cannot start blocks the lower ones (a big gang is never starved).
- ``fairshare``: tenants have chip quotas; requests within their tenant's quota go first
  (earliest first) and reclaim chips from tenants over their quota by preemption; idle
  quota is lent to the others, least-served tenant first. While a request within its
  quota cannot start, nobody borrows, so it is never starved.

Every policy places with ``capacity.place`` (best fit, fewest racks).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from trainflow.errors import SpecError
from trainflow.sched import explain
from trainflow.sched.capacity import FreeMap, place
from trainflow.sched.model import Decision, Policy, Pool, Preempt, Request, Running, Start
from trainflow.sched.preempt import victims
from trainflow.sched.state import Occupancy, Queue, ready_at

DEFAULT_BACKFILL_WINDOW = 256
"""Requests examined past the head per backfill decision (Slurm's ``bf_max_job_test`` idea):
it bounds a decision's cost when thousands wait."""


@dataclass(frozen=True)
class _Ctx:
    policy: Policy
    pool: Pool
    occ: Occupancy
    queue: Queue
    now: float
    quotas: Mapping[str, int] | None
    window: int


def decide(
    policy: Policy | str,
    *,
    pool: Pool,
    running: Sequence[Running] | Occupancy,
    waiting: Sequence[Request] | Queue,
    now: float,
    quotas: Mapping[str, int] | None = None,
    backfill_window: int = DEFAULT_BACKFILL_WINDOW,
) -> Decision:
    """Decide what starts and what is preempted now.

    Args:
        policy: ``fifo``, ``backfill``, ``priority`` or ``fairshare``.
        pool: the nodes.
        running: what holds chips now (or an ``Occupancy`` index the caller keeps).
        waiting: what waits, in any order (or a ``Queue`` index the caller keeps).
        now: the time of the decision, on the clock of ``submitted`` and ``started``.
        quotas: ``fairshare``: chips per tenant (a tenant not named has 0 and only
            borrows); None: the pool split evenly among the tenants running or waiting.
        backfill_window: ``backfill``: requests examined past the head.

    Returns:
        The decision: apply ``preempt`` first, then ``start``.

    Raises:
        SpecError: an unknown policy, a request that could never fit the pool (naming the
            field, value and what fits), a placement that does not fit, bad quotas.
    """
    kind = Policy.parse(policy)
    if isinstance(now, bool) or not isinstance(now, (int, float)) or not math.isfinite(now):
        raise SpecError("now", now, "the decision time, a finite number of seconds")
    if not isinstance(backfill_window, int) or backfill_window < 0:
        raise SpecError("backfill_window", backfill_window, "a whole number of requests, 0 or more")
    if quotas is not None:
        for tenant, chips in quotas.items():
            if isinstance(chips, bool) or not isinstance(chips, int) or chips < 0:
                raise SpecError("quotas", {tenant: chips}, "give each tenant a whole number of chips, 0 or more")
    occ = running if isinstance(running, Occupancy) else Occupancy(pool, running)
    queue = waiting if isinstance(waiting, Queue) else Queue(pool, waiting)
    for index in (occ, queue):
        if index.pool is not pool and index.pool != pool:
            raise SpecError("pool", pool, f"the {type(index).__name__} index was built for another pool")
    if not isinstance(running, Occupancy) or not isinstance(waiting, Queue):
        both = [r.id for r in queue if r.id in occ]
        if both:
            raise SpecError("waiting", both, "these requests are running too; a request waits or runs")
    ctx = _Ctx(kind, pool, occ, queue, float(now), quotas, backfill_window)
    return _POLICIES[kind](ctx)


def _fifo(ctx: _Ctx) -> Decision:
    free = ctx.occ.free.copy()
    starts: list[Start] = []
    for r in ctx.queue.arrival:
        p = place(free, r.nodes, r.chips_per_node, ctx.pool.racks)
        if p is None:
            break
        free.take(p, r.chips_per_node)
        starts.append(Start(r, p))
    order = ctx.queue.arrival[len(starts) :]
    return Decision(ctx.policy, ctx.now, tuple(starts), (), context=explain.Fifo(free, order))


class Reservation:
    """The head's reservation: when (``at``) and where (``nodes``) its gang fits, from the
    running requests' estimates, and the chips of those nodes it leaves spare (``extra``)."""

    def __init__(self, ctx: _Ctx, free: FreeMap, local: dict[int, list[Running]], head: Request) -> None:
        c, n = head.chips_per_node, head.nodes
        have = free.free
        times = ctx.occ.ready_times(c)
        if local:  # the nodes this decision started requests on: their times changed
            times = times.copy()
            for x in local:
                times[x] = ready_at(have[x], self._runs(ctx, local, x), c)
        if n == 1:
            first = min(times)
            chosen = [(first, times.index(first))]
        else:
            chosen = [(times[x], x) for x in sorted(range(len(times)), key=times.__getitem__)[:n]]
        self.head = head
        self.at: float | None = max(chosen[-1][0], ctx.now) if chosen[-1][0] < math.inf else None
        self.nodes = tuple(sorted(x for _, x in chosen)) if self.at is not None else ()
        self.extra: dict[int, int] = {}
        for x in self.nodes:
            ending = sum(run.request.chips_per_node for run in self._runs(ctx, local, x) if run.end <= self.at)
            self.extra[x] = have[x] + ending - c
        self._free = free
        self._spare: FreeMap | None = None

    @property
    def spare(self) -> FreeMap:
        """Chips free now that the reservation leaves alone: all but the reserved nodes' share."""
        if self._spare is None:
            self._spare = self._free.copy()
            for x in self.nodes:
                self._spare.set(x, max(0, min(self._free.free[x], self.extra[x])))
        return self._spare

    @staticmethod
    def _runs(ctx: _Ctx, local: dict[int, list[Running]], x: int) -> list[Running]:
        runs = ctx.occ.on_node[x]
        if x in local:
            runs = sorted(runs + local[x], key=lambda run: (run.end, run.started, run.request.id))
        return runs

    def took(self, placement: tuple[int, ...], chips: int, *, late: bool) -> None:
        """Account a start on ``placement`` (already taken from the free chips); ``late``: it
        runs past the reservation."""
        for x in placement:
            if late and x in self.extra:
                self.extra[x] -= chips
            if self._spare is not None:
                self._spare.set(x, max(0, min(self._free.free[x], self.extra.get(x, self._free.free[x]))))


def _backfill(ctx: _Ctx) -> Decision:
    free = ctx.occ.free.copy()
    arrival, racks, now = ctx.queue.arrival, ctx.pool.racks, ctx.now
    starts: list[Start] = []
    local: dict[int, list[Running]] = {}

    def start(r: Request, p: tuple[int, ...]) -> None:
        free.take(p, r.chips_per_node)
        starts.append(Start(r, p))
        run = Running(request=r, placement=p, started=now)
        for x in p:
            local.setdefault(x, []).append(run)

    head_at = len(arrival)
    for i, r in enumerate(arrival):
        p = place(free, r.nodes, r.chips_per_node, racks)
        if p is None:
            head_at = i
            break
        start(r, p)
    res: Reservation | None = None
    if head_at < len(arrival):
        head = arrival[head_at]
        failed: set[tuple[int, int, bool]] = set()
        # Computed even when nothing can be backfilled: ``Decision.reservation`` reports it,
        # and it must not be worked out later from indexes the caller has since updated.
        res = Reservation(ctx, free, local, head)
        for j in range(head_at + 1, min(len(arrival), head_at + 1 + ctx.window)):
            if free.total == 0 or res.at is None:
                break  # no chips left, or the head waits on runs without an estimate
            r = arrival[j]
            if r.estimate is None:
                continue
            late = now + r.estimate > res.at
            shape = (r.nodes, r.chips_per_node, late)
            if shape in failed:
                continue
            p = place(res.spare if late else free, r.nodes, r.chips_per_node, racks)
            if p is None:
                failed.add(shape)
                continue
            start(r, p)
            res.took(p, r.chips_per_node, late=late)
    view = explain.Backfill(free, arrival[head_at:], {s.request.id for s in starts}, res, now, ctx.window)
    return Decision(ctx.policy, now, tuple(starts), (), context=view)


def _priority(ctx: _Ctx) -> Decision:
    free = ctx.occ.free.copy()
    starts: list[Start] = []
    preempts: list[Preempt] = []
    gone: set[str] = set()
    for r in ctx.queue.by_priority:
        p = place(free, r.nodes, r.chips_per_node, ctx.pool.racks)
        after: tuple[str, ...] = ()
        if p is None:
            lower = any(p < r.priority for p in ctx.occ.priorities)
            vs = (
                victims(
                    ctx.pool, free, ctx.occ.on_node, r, lambda run, prio=r.priority: run.request.priority < prio, gone
                )
                if lower
                else None
            )
            if vs is None:
                break
            for v in vs:
                free.give(v.placement, v.request.chips_per_node)
                gone.add(v.request.id)
                preempts.append(Preempt(v, f"preempted for {r.id!r} (priority {r.priority} > {v.request.priority})"))
            after = tuple(v.request.id for v in vs)
            p = place(free, r.nodes, r.chips_per_node, ctx.pool.racks)
            assert p is not None, (r, vs)
        free.take(p, r.chips_per_node)
        starts.append(Start(r, p, after))
    order = ctx.queue.by_priority[len(starts) :]
    return Decision(ctx.policy, ctx.now, tuple(starts), tuple(preempts), context=explain.Priority(free, order))


def equal_shares(pool: Pool, tenants: Sequence[str]) -> dict[str, int]:
    """The pool's chips split evenly among ``tenants`` (the remainder to the first, by name)."""
    names = sorted(set(tenants))
    if not names:
        return {}
    each, rest = divmod(pool.total_chips, len(names))
    return {t: each + (1 if i < rest else 0) for i, t in enumerate(names)}


def _fairshare(ctx: _Ctx) -> Decision:
    by_tenant = ctx.queue.by_tenant
    quotas = ctx.quotas if ctx.quotas is not None else equal_shares(ctx.pool, [*by_tenant, *ctx.occ.usage])
    usage = dict(ctx.occ.usage)
    free = ctx.occ.free.copy()
    nxt = dict.fromkeys(by_tenant, 0)
    blocked: set[str] = set()
    lending = True
    starts: list[Start] = []
    preempts: list[Preempt] = []
    gone: set[str] = set()
    while True:
        best = None
        for t, reqs in by_tenant.items():
            if t in blocked or nxt[t] >= len(reqs):
                continue
            r = reqs[nxt[t]]
            used, q = usage.get(t, 0), quotas.get(t, 0)
            key = (used + r.chips > q, used / q if q else math.inf, r.submitted, r.id)
            if best is None or key < best[0]:
                best = (key, t, r)
        if best is None:
            break
        (borrows, *_), t, r = best
        if borrows and not lending:
            break
        p = place(free, r.nodes, r.chips_per_node, ctx.pool.racks)
        after: tuple[str, ...] = ()
        if p is None and not borrows:
            over = {u for u, used in usage.items() if used > quotas.get(u, 0)}
            vs = (
                victims(ctx.pool, free, ctx.occ.on_node, r, lambda run: run.request.tenant in over, gone)
                if over
                else None
            )
            if vs:
                for v in vs:
                    u = v.request.tenant
                    preempts.append(
                        Preempt(
                            v,
                            f"reclaimed for {r.id!r} of tenant {t!r} (holds {usage.get(t, 0)} "
                            f"of its {quotas.get(t, 0)}-chip quota): tenant {u!r} holds "
                            f"{usage[u]}, over its quota of {quotas.get(u, 0)}",
                        )
                    )
                    free.give(v.placement, v.request.chips_per_node)
                    usage[u] -= v.request.chips
                    gone.add(v.request.id)
                after = tuple(v.request.id for v in vs)
                p = place(free, r.nodes, r.chips_per_node, ctx.pool.racks)
                assert p is not None, (r, vs)
        if p is None:
            # A blocked request within its quota stops all borrowing (it is never starved);
            # a blocked borrower stops the borrowers behind it (borrowers go in order).
            blocked.add(t)
            lending = False
            continue
        free.take(p, r.chips_per_node)
        usage[t] = usage.get(t, 0) + r.chips
        nxt[t] += 1
        starts.append(Start(r, p, after))
    left = {t: reqs[nxt[t] :] for t, reqs in by_tenant.items() if nxt[t] < len(reqs)}
    view = explain.Fairshare(free, left, usage, quotas)
    return Decision(ctx.policy, ctx.now, tuple(starts), tuple(preempts), context=view)


_POLICIES = {Policy.FIFO: _fifo, Policy.BACKFILL: _backfill, Policy.PRIORITY: _priority, Policy.FAIRSHARE: _fairshare}
