from __future__ import annotations

import pickle

import pytest

from trainflow.errors import SpecError
from trainflow.sched import Occupancy, Pool, Queue, Request, Running, decide
from trainflow.sched.capacity import FreeMap, place
from trainflow.sched.model import Node

POLICIES = ["fifo", "backfill", "priority", "fairshare"]


def req(id, chips, *, nodes=1, t=0.0, est=None, prio=0, tenant="a"):
    return Request(id=id, chips_per_node=chips, nodes=nodes, submitted=t, estimate=est, priority=prio, tenant=tenant)


def run(request, *placement, started=0.0):
    return Running(request=request, placement=tuple(placement), started=started)


def started(decision):
    return {s.request.id: s.placement for s in decision.start}


@pytest.mark.parametrize("policy", POLICIES)
def test_a_gang_is_never_split_nor_partly_started(policy):
    pool = Pool.uniform(3, chips=8)
    busy = [run(req("half", 4, est=100), 0)]  # 20 chips free, but only 2 whole nodes
    gang = req("gang", 8, nodes=3, t=1, est=10)
    d = decide(policy, pool=pool, running=busy, waiting=[gang], now=5, quotas={"a": 24})
    assert d.start == () and d.preempt == ()
    assert "needs 3 nodes × 8 chips, 2 such nodes free" in d.waiting[0].reason
    d = decide(policy, pool=pool, running=busy, waiting=[req("pair", 8, nodes=2, est=10)], now=5, quotas={"a": 24})
    assert started(d) == {"pair": (1, 2)}


def test_fifo_blocks_behind_the_head():
    pool = Pool.uniform(2, chips=8)
    busy = [run(req("a", 8, est=100), 0)]
    waiting = [req("big", 8, nodes=2, t=1, est=50), req("small", 1, t=2, est=5)]
    d = decide("fifo", pool=pool, running=busy, waiting=waiting, now=10)
    assert d.start == ()
    assert [(w.request.id, w.position) for w in d.waiting] == [("big", 0), ("small", 1)]
    assert d.waiting[0].reason == "needs 2 nodes × 8 chips, 1 such node free; first in line"
    assert d.waiting[1].reason == "fits now, but fifo keeps arrival order: behind 1 earlier request, 'big' first"
    # Once the head fits, the queue drains in order.
    d = decide("fifo", pool=pool, running=[], waiting=waiting, now=100)
    assert list(started(d)) == ["big"]


def test_the_reason_names_the_shape_what_is_free_and_the_place_in_line():
    pool = Pool.uniform(4, chips=8)
    busy = [run(req("x", 8, est=100), 0), run(req("y", 8, est=100), 1)]
    waiting = [req(f"w{i}", 8, nodes=3, t=i) for i in range(3)] + [req("big", 8, nodes=4, t=9)]
    d = decide("fifo", pool=pool, running=busy, waiting=waiting, now=1)
    assert d.waiting[3].reason == "needs 4 nodes × 8 chips, 2 such nodes free; behind 3 earlier requests"


def test_backfill_starts_a_short_job_without_delaying_the_head():
    pool = Pool.uniform(2, chips=8)
    busy = [run(req("a", 8, est=100), 0)]
    waiting = [req("big", 8, nodes=2, t=1, est=50), req("long", 8, t=2, est=200), req("short", 8, t=3, est=80)]
    d = decide("backfill", pool=pool, running=busy, waiting=waiting, now=10)
    assert started(d) == {"short": (1,)}  # ends at 90, before big's reservation at 100
    assert d.reservation == 100
    reasons = {w.request.id: w.reason for w in d.waiting}
    assert reasons["big"].endswith("reserved to start at t=100 on nodes [0, 1]")
    assert reasons["long"] == "needs 1 node × 8 chips, 0 such nodes free; behind 1 earlier request"
    d = decide("backfill", pool=pool, running=busy, waiting=waiting[:2], now=10)
    assert d.start == ()
    assert d.waiting[1].reason == (
        "needs 1 node × 8 chips, 1 such node free; starting now would delay 'big' "
        "(reserved at t=100): it would run until after that and needs chips "
        "reserved for it"
    )
    # The reservation holds: when a ends at 100 (short has ended at 90), big goes first.
    d = decide("backfill", pool=pool, running=[], waiting=waiting[:2], now=100)
    assert list(started(d)) == ["big"]
    # fifo would have kept the chips idle.
    assert decide("fifo", pool=pool, running=busy, waiting=waiting, now=10).start == ()


def test_backfill_fits_long_jobs_only_in_chips_the_reservation_leaves_spare():
    pool = Pool.uniform(3, chips=8)
    busy = [run(req("a", 4, est=100), 0), run(req("b", 8, est=1000), 1), run(req("c", 6, est=1000), 2)]
    # head needs a whole node: node 0 at t=100 (a ends). Node 0's 4 free chips are its;
    # node 2's 2 free chips are spare.
    waiting = [
        req("head", 8, t=1, est=50),
        req("long4", 4, t=2, est=500),
        req("long2", 2, t=3, est=500),
        req("guess", 1, t=4),
    ]
    d = decide("backfill", pool=pool, running=busy, waiting=waiting, now=10)
    assert started(d) == {"long2": (2,)}
    assert d.reservation == 100
    reasons = {w.request.id: w.reason for w in d.waiting}
    assert "starting now would delay 'head'" in reasons["long4"]
    assert "no runtime estimate, so never started ahead of 'head'" in reasons["guess"]


def test_backfill_window_bounds_the_scan():
    pool = Pool.uniform(2, chips=8)
    busy = [run(req("a", 8, est=100), 0)]
    waiting = (
        [req("big", 8, nodes=2, t=1, est=50)]
        + [req(f"late{i}", 8, t=2 + i, est=500) for i in range(3)]
        + [req("short", 1, t=9, est=5)]
    )
    assert decide("backfill", pool=pool, running=busy, waiting=waiting, now=10, backfill_window=3).start == ()
    d = decide("backfill", pool=pool, running=busy, waiting=waiting, now=10, backfill_window=4)
    assert started(d) == {"short": (1,)}


def test_backfill_does_not_jump_a_head_that_waits_on_runs_without_estimates():
    pool = Pool.uniform(2, chips=8)
    busy = [run(req("forever", 8), 0)]
    waiting = [req("big", 8, nodes=2, t=1, est=50), req("short", 1, t=2, est=5)]
    d = decide("backfill", pool=pool, running=busy, waiting=waiting, now=10)
    assert d.start == () and d.reservation is None
    assert "no reservation" in d.waiting[0].reason


def _prio_pool():
    pool = Pool.uniform(2, chips=8)
    busy = [
        run(req("A", 8, est=100), 0, started=0),
        run(req("B", 4, est=100), 1, started=5),
        run(req("C", 4, est=100), 1, started=10),
    ]
    return pool, busy


@pytest.mark.parametrize(
    "chips,victims,node",
    [
        pytest.param(4, ["C"], (1,), id="one-victim-the-most-recent"),
        pytest.param(8, ["A"], (0,), id="fewest-victims"),
    ],
)
def test_priority_preempts_the_fewest_most_recent_lower_priority_runs(chips, victims, node):
    pool, busy = _prio_pool()
    urgent = req("urgent", chips, t=20, prio=5, est=10)
    d = decide("priority", pool=pool, running=busy, waiting=[urgent], now=20)
    assert [p.running.request.id for p in d.preempt] == victims
    assert d.start[0].placement == node and d.start[0].after == tuple(victims)
    assert "preempted for 'urgent' (priority 5 > 0)" == d.preempt[0].reason


def test_priority_order_and_no_preemption_among_equals():
    pool, busy = _prio_pool()
    peer = req("peer", 4, t=20, prio=0)
    d = decide("priority", pool=pool, running=busy, waiting=[peer], now=20)
    assert d.start == () and d.preempt == ()
    assert d.waiting[0].reason.endswith("no lower-priority run to preempt frees enough")
    free_pool = Pool.uniform(1, chips=8)
    waiting = [req("low", 8, t=1, prio=0), req("high", 8, t=2, prio=3), req("high2", 8, t=3, prio=3)]
    d = decide("priority", pool=free_pool, running=[], waiting=waiting, now=5)
    assert list(started(d)) == ["high"]
    assert [w.request.id for w in d.waiting] == ["high2", "low"]
    # A higher-priority run is never a victim.
    d = decide(
        "priority", pool=free_pool, running=[run(req("vip", 8, prio=9), 0)], waiting=[req("high", 8, prio=3)], now=5
    )
    assert d.preempt == ()


def test_fairshare_lends_idle_quota():
    pool = Pool.uniform(2, chips=8)
    waiting = [req("a1", 8, t=1, tenant="a"), req("a2", 8, t=2, tenant="a")]
    d = decide("fairshare", pool=pool, running=[], waiting=waiting, now=5, quotas={"a": 8, "b": 8})
    assert started(d) == {"a1": (0,), "a2": (1,)}


def test_fairshare_reclaims_borrowed_chips_for_a_tenant_under_quota():
    pool = Pool.uniform(2, chips=8)
    busy = [run(req("a1", 8, tenant="a"), 0, started=0), run(req("a2", 8, tenant="a"), 1, started=5)]
    d = decide(
        "fairshare", pool=pool, running=busy, waiting=[req("b1", 8, t=6, tenant="b")], now=6, quotas={"a": 8, "b": 8}
    )
    assert [p.running.request.id for p in d.preempt] == ["a2"]  # the borrowed, most recent one
    assert started(d) == {"b1": (1,)} and d.start[0].after == ("a2",)
    assert "tenant 'a' holds 16, over its quota of 8" in d.preempt[0].reason
    # a at its quota is not reclaimed from.
    d = decide(
        "fairshare",
        pool=pool,
        running=busy[:1],
        waiting=[req("b1", 8, t=6, tenant="b")],
        now=6,
        quotas={"a": 8, "b": 8},
    )
    assert d.preempt == () and started(d) == {"b1": (1,)}


def test_fairshare_no_one_borrows_while_a_request_within_quota_waits():
    pool = Pool.uniform(2, chips=8)
    quotas = {"a": 12, "b": 4}
    busy = [run(req("a1", 6, tenant="a", est=50), 0), run(req("a2", 6, tenant="a", est=80), 1)]
    waiting = [req("b1", 4, t=1, tenant="b"), req("c1", 2, t=2, tenant="c"), req("a3", 2, t=3, tenant="a")]
    d = decide("fairshare", pool=pool, running=busy, waiting=waiting, now=10, quotas=quotas)
    # 2 + 2 chips are free and c1 / a3 would fit, but they would borrow the chips b1 waits for.
    assert d.start == () and d.preempt == ()
    reasons = {w.request.id: w.reason for w in d.waiting}
    assert reasons["b1"].startswith("tenant 'b' holds 0 of its 4-chip quota; needs 1 node × 4 chips")
    assert "within its quota" in reasons["b1"]
    assert "would borrow 2 chips beyond its quota" in reasons["c1"]
    assert [w.request.id for w in d.waiting][0] == "b1"
    # When a1 ends, b1 goes first; then the borrowers, the least served tenant first.
    d = decide("fairshare", pool=pool, running=busy[1:], waiting=waiting, now=50, quotas=quotas)
    assert [(s.request.id, s.placement) for s in d.start] == [("b1", (0,)), ("a3", (1,)), ("c1", (0,))]


def test_fairshare_splits_the_pool_evenly_without_quotas():
    pool = Pool.uniform(2, chips=8)
    busy = [run(req("a1", 8, tenant="a"), 0, started=0), run(req("a2", 8, tenant="a"), 1, started=5)]
    d = decide("fairshare", pool=pool, running=busy, waiting=[req("b1", 8, t=6, tenant="b")], now=6)
    assert [p.running.request.id for p in d.preempt] == ["a2"]


def test_packing_prefers_partly_used_nodes():
    free = FreeMap([6, 8, 3], 8)
    assert place(free, 1, 2) == (2,)
    assert place(free, 1, 4) == (0,)
    assert place(free, 1, 7) == (1,)
    assert place(free, 2, 6) == (0, 1)
    assert place(free, 3, 4) is None
    pool = Pool.uniform(3, chips=8)
    busy = [run(req("x", 2), 0), run(req("y", 5), 2)]
    d = decide("fifo", pool=pool, running=busy, waiting=[req("s", 3, t=1), req("t", 6, t=2)], now=1)
    assert started(d) == {"s": (2,), "t": (0,)}


def test_packing_keeps_a_gang_in_one_rack_or_the_fewest():
    pool = Pool.uniform(4, chips=8, racks=2)  # rack-0: nodes 0, 1; rack-1: nodes 2, 3
    busy = [run(req("x", 1), 0)]
    d = decide("fifo", pool=pool, running=busy, waiting=[req("g", 8, nodes=2)], now=0)
    assert started(d) == {"g": (2, 3)}  # without racks, best fit would take 1 and 2
    assert place(FreeMap([8, 8, 8, 8], 8), 2, 8) == (0, 1)
    six = Pool.uniform(6, chips=8, racks=3)
    assert place(FreeMap([8] * 6, 8), 4, 8, six.racks) == (0, 1, 2, 3)
    assert place(FreeMap([8, 0, 8, 8, 8, 0], 8), 3, 8, six.racks) == (0, 2, 3)
    odd = Pool(
        nodes=(
            Node(chips=8, labels={"rack": "r1"}),
            Node(chips=8, labels={"rack": "r2"}),
            Node(chips=8, labels={"rack": "r2"}),
        )
    )
    assert place(FreeMap([8, 8, 8], 8), 2, 8, odd.racks) == (1, 2)


@pytest.mark.parametrize("policy", POLICIES)
def test_requests_that_can_never_fit_are_refused_with_the_field_and_the_fix(policy):
    pool = Pool.uniform(2, chips=8)
    with pytest.raises(
        ValueError,
        match=r"invalid nodes=3: request 'huge': the pool has 2 nodes with 8 "
        r"chips or more \(16 chips in all\); ask for at most 2",
    ):
        decide(policy, pool=pool, running=[], waiting=[req("huge", 8, nodes=3)], now=0)
    with pytest.raises(SpecError, match=r"invalid chips_per_node=16: .* ask for at most 8 per node"):
        decide(policy, pool=pool, running=[], waiting=[req("wide", 16)], now=0)


@pytest.mark.parametrize(
    "call,message",
    [
        pytest.param(
            lambda: decide("lottery", pool=Pool.uniform(1), running=[], waiting=[], now=0),
            "invalid policy='lottery': choose one of fifo, backfill, priority, fairshare",
            id="policy",
        ),
        pytest.param(lambda: req("x", 0), "invalid chips_per_node=0", id="chips"),
        pytest.param(lambda: req("x", 1, nodes=0), "invalid nodes=0", id="nodes"),
        pytest.param(lambda: req("x", 1, est=0), "invalid estimate=0: request 'x': seconds > 0", id="estimate"),
        pytest.param(lambda: Pool.uniform(0), "invalid capacity=0", id="capacity"),
        pytest.param(
            lambda: decide("fifo", pool=Pool.uniform(2), running=[run(req("x", 8, nodes=2), 0, 0)], waiting=[], now=0),
            "invalid placement=(0, 0)",
            id="placement",
        ),
        pytest.param(
            lambda: decide(
                "fifo", pool=Pool.uniform(1), running=[run(req("x", 4), 0), run(req("y", 5), 0)], waiting=[], now=0
            ),
            "needs 5 chips on each node; free there: [4]",
            id="overfull",
        ),
        pytest.param(
            lambda: decide("fairshare", pool=Pool.uniform(1), running=[], waiting=[], now=0, quotas={"a": -1}),
            "invalid quotas={'a': -1}",
            id="quotas",
        ),
        pytest.param(
            lambda: decide("fifo", pool=Pool.uniform(1), running=[run(req("x", 1), 0)], waiting=[req("x", 1)], now=0),
            "invalid waiting=['x']",
            id="both",
        ),
        pytest.param(lambda: Queue(Pool.uniform(1), [req("x", 1), req("x", 2)]), "invalid id='x'", id="dup"),
    ],
)
def test_bad_input_names_the_field_and_value(call, message):
    with pytest.raises(SpecError) as exc:
        call()
    assert message in str(exc.value)
    assert str(pickle.loads(pickle.dumps(exc.value))) == str(exc.value)


@pytest.mark.parametrize("policy", POLICIES)
def test_indexes_kept_by_the_caller_decide_like_plain_sequences(policy):
    pool = Pool.uniform(4, chips=8, racks=2)
    busy = [
        run(req(f"r{i}", 1 + i % 8, est=10.0 * (i + 1), tenant="ab"[i % 2], prio=i % 3), i % 4, started=float(i))
        for i in range(6)
    ]
    waiting = [
        req(
            f"w{i}",
            1 + (3 * i) % 8,
            nodes=1 + i % 3 if i % 4 == 0 else 1,
            t=float(i),
            est=5.0 * i + 1,
            tenant="abc"[i % 3],
            prio=(i * 7) % 5,
        )
        for i in range(30)
    ]
    plain = decide(policy, pool=pool, running=busy, waiting=waiting, now=3, quotas={"a": 12, "b": 12, "c": 8})
    again = decide(
        policy,
        pool=pool,
        running=list(reversed(busy)),
        waiting=list(reversed(waiting)),
        now=3,
        quotas={"a": 12, "b": 12, "c": 8},
    )
    occ, queue = Occupancy(pool, busy), Queue(pool, waiting)
    indexed = decide(policy, pool=pool, running=occ, waiting=queue, now=3, quotas={"a": 12, "b": 12, "c": 8})
    # The caller applies the decision before reading why the rest waits: the reasons are
    # those of the decision's state, not of the updated indexes.
    for p in indexed.preempt:
        queue.add(occ.remove(p.running.request.id).request)
    for s in indexed.start:
        occ.add(Running(request=queue.remove(s.request.id), placement=s.placement, started=3))
    for d in (again, indexed):
        assert d.start == plain.start and d.preempt == plain.preempt and d.waiting == plain.waiting
        assert d.reservation == plain.reservation
    assert plain.start  # the scenario does start something
    ids = [s.request.id for s in plain.start] + [w.request.id for w in plain.waiting]
    assert sorted(ids) == sorted(r.id for r in waiting)


def test_backfill_never_pushes_a_reservation_back_on_a_real_trace():
    """Drive ``decide`` over 400 ITP jobs on 8 nodes (exact estimates): the head's
    reservation only ever moves earlier, and the head starts no later than its first one."""
    import heapq

    from trainflow.sched.trace import load

    jobs = load("/work/shared/traces/itp/cluster04.csv", limit=400)
    pool = Pool.uniform(8)
    queue, occ = Queue(pool), Occupancy(pool)
    events = [(j.request.submitted, 1, j.request.id, j) for j in jobs]
    heapq.heapify(events)
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    backfilled = 0
    while events:
        now = events[0][0]
        while events and events[0][0] == now:
            _, kind, rid, j = heapq.heappop(events)
            if kind:
                queue.add(j.request)
            else:
                occ.remove(rid)
        d = decide("backfill", pool=pool, running=occ, waiting=queue, now=now)
        for s in d.start:
            rid = s.request.id
            assert now <= first.get(rid, now), (rid, now, first.get(rid))
            backfilled += rid not in first and bool(queue.arrival) and queue.arrival[0].id != rid
            queue.remove(rid)
            occ.add(Running(request=s.request, placement=s.placement, started=now))
            heapq.heappush(events, (now + s.request.estimate, 0, rid, None))
        if d.queue and d.reservation is not None:
            head = d.queue[0].id
            assert d.reservation <= last.get(head, d.reservation)
            first.setdefault(head, d.reservation)
            last[head] = d.reservation
    assert not queue and not occ and len(first) > 20 and backfilled > 20
