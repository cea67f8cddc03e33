from __future__ import annotations

import pytest

from trainflow.cluster.allocator import Allocator
from trainflow.errors import AdmissionError, SpecError


@pytest.fixture
def alloc(state_target):
    a = Allocator(state_target)
    a.set_pool("cpu", 4)
    return a


def test_gang_is_all_or_nothing(alloc):
    alloc.admit("r1", tenant="t", pool="cpu", nodes=3, ttl=60, now=0)
    with pytest.raises(AdmissionError, match="2 nodes asked, 1 of 4 free"):
        alloc.admit("r2", tenant="t", pool="cpu", nodes=2, ttl=60, now=1)
    assert [lease.run_key for lease in alloc.leases(now=1)] == ["r1"]
    assert alloc.release("r1") and not alloc.release("r1")
    alloc.admit("r2", tenant="t", pool="cpu", nodes=2, ttl=60, now=2)


def test_admission_is_idempotent_per_run(alloc):
    alloc.admit("r1", tenant="t", pool="cpu", nodes=4, ttl=60, now=0)
    lease = alloc.admit("r1", tenant="t", pool="cpu", nodes=4, ttl=60, now=30)
    assert lease.expires == 90


def test_leases_expire_as_a_backstop(alloc):
    alloc.admit("crashed", tenant="t", pool="cpu", nodes=4, ttl=10, now=0)
    alloc.admit("next", tenant="t", pool="cpu", nodes=4, ttl=10, now=11)


def test_runs_deleted_or_ended_without_release_give_their_nodes_back(alloc):
    alloc.admit("t/d/deleted", tenant="t", pool="cpu", nodes=2, ttl=3600, now=0)
    alloc.admit("t/d/ended", tenant="t", pool="cpu", nodes=1, ttl=3600, now=0)
    alloc.admit("t/d/running", tenant="t", pool="cpu", nodes=1, ttl=3600, now=0)
    alloc.admit("t/other/unknown", tenant="t", pool="cpu", nodes=0, ttl=3600, now=0)
    alloc.admit("no-key-shape", tenant="t", pool="cpu", nodes=0, ttl=3600, now=0)
    states = {("d", "ended"): "failed", ("d", "running"): "running"}

    def state(dag_id, run_id):
        if dag_id == "other":
            raise ConnectionError("the API server is restarting")  # unknown is not gone
        return states.get((dag_id, run_id))

    freed = alloc.release_gone(state, now=1)
    assert freed == [
        {"run_key": "t/d/deleted", "why": "the run was deleted"},
        {"run_key": "t/d/ended", "why": "the run is failed and its release task did not run"},
    ]
    assert sorted(lease.run_key for lease in alloc.leases(now=1)) == ["no-key-shape", "t/d/running", "t/other/unknown"]
    assert alloc.release_gone(state, now=2) == []


def test_requests_that_never_fit_are_refused_with_numbers(alloc):
    with pytest.raises(SpecError, match="only 4 nodes in total"):
        alloc.admit("big", tenant="t", pool="cpu", nodes=5, ttl=10)
    with pytest.raises(SpecError, match="unknown pool; known pools: cpu"):
        alloc.admit("x", tenant="t", pool="gpu", nodes=1, ttl=10)


def test_elastic_admission_takes_what_is_free_up_to_the_full_size(alloc):
    alloc.admit("other", tenant="t", pool="cpu", nodes=1, ttl=60, now=0)
    lease = alloc.admit("elastic", tenant="t", pool="cpu", nodes=2, up_to=4, ttl=60, now=0)
    assert lease.nodes == 3  # 1 of 4 taken: min 2 granted, one more free
    assert not alloc.grow("elastic", now=1)
    alloc.release("other")
    assert alloc.grow("elastic", now=2) and not alloc.grow("elastic", now=2)
    assert {lease.run_key: lease.nodes for lease in alloc.leases(now=2)} == {"elastic": 4}
    with pytest.raises(AdmissionError, match="1 nodes asked, 0 of 4 free"):
        alloc.admit("late", tenant="t", pool="cpu", nodes=1, ttl=60, now=3)


def test_a_lost_node_leaves_the_lease_and_the_pool_until_it_returns(alloc):
    alloc.admit("r", tenant="t", pool="cpu", nodes=4, ttl=600, now=0)
    alloc.lose_node("r", until=100, reason="host gone")
    assert {lease.run_key: lease.nodes for lease in alloc.leases(now=1)} == {"r": 3}
    assert alloc.offline("cpu", now=1) == 1
    assert not alloc.grow("r", now=50)  # 3 leased + 1 offline: nothing free
    assert alloc.grow("r", now=101)  # the node is back
    assert alloc.offline("cpu", now=101) == 0
    assert not alloc.grow("unknown-run", now=101)
    alloc.lose_node("r", until=float("inf"), reason="for good")
    assert alloc.offline("cpu", now=1e9) == 1
    alloc.release("r")  # a run's lost nodes count no longer once it ends
    assert alloc.offline("cpu", now=1e9) == 0


def test_slots_hold_give_back_and_acquire(tmp_path, alloc):
    from trainflow.cluster.slots import SlotLeases, mark_lost

    alloc.admit("r", tenant="t", pool="cpu", nodes=2, up_to=3, ttl=600)
    leases = SlotLeases.create(tmp_path, "r", "cpu", 3, alloc)
    assert [leases.holds(n) for n in range(4)] == [True, True, True, False]
    opened = SlotLeases.open(tmp_path, alloc)
    assert opened.acquire(3)  # the 4th node of the pool
    assert SlotLeases.open(tmp_path / "elsewhere") is None
    mark_lost(tmp_path, 1, seconds=0, reason="test")
    assert opened.settle_loss(1)["reason"] == "test" and opened.settle_loss(1) is None
    assert not opened.holds(1) and not opened.acquire(1)  # lost for good: no capacity
    assert alloc.offline("cpu") == 1


def test_requests_wait_in_order_and_are_admitted_when_capacity_frees(alloc):
    from trainflow.cluster.allocator import Lease, Waiting

    assert isinstance(alloc.request("a", tenant="t", pool="cpu", nodes=2, ttl=60, now=0), Lease)
    assert isinstance(alloc.request("b", tenant="t", pool="cpu", nodes=2, ttl=60, now=1), Lease)
    c = alloc.request("c", tenant="t", pool="cpu", nodes=2, ttl=60, now=2)
    assert isinstance(c, Waiting) and c.position == 1
    assert c.reason == "pool 'cpu': needs 2 nodes, 0 of 4 free"
    d = alloc.request("d", tenant="u", pool="cpu", nodes=1, ttl=60, now=3)
    assert (d.position, d.reason) == (2, "pool 'cpu': needs 1 node, 0 of 4 free, 1 earlier request ahead")
    assert alloc.queue("cpu") == ["c", "d"]
    alloc.release("a")
    # d asks again first, but c came first and takes the two free nodes.
    assert isinstance(alloc.request("d", tenant="u", pool="cpu", nodes=1, ttl=60, now=4), Waiting)
    assert isinstance(alloc.request("c", tenant="t", pool="cpu", nodes=2, ttl=60, now=5), Lease)
    alloc.release("b")
    assert isinstance(alloc.request("d", tenant="u", pool="cpu", nodes=1, ttl=60, now=6), Lease)
    assert alloc.queue("cpu") == []


def test_a_large_gang_is_not_starved_by_small_ones_behind_it(alloc):
    from trainflow.cluster.allocator import Lease, Waiting

    alloc.request("running", tenant="t", pool="cpu", nodes=3, ttl=60, now=0)
    assert isinstance(alloc.request("big", tenant="t", pool="cpu", nodes=4, ttl=60, now=1), Waiting)
    small = alloc.request("small", tenant="t", pool="cpu", nodes=1, ttl=60, now=2)
    assert isinstance(small, Waiting) and small.position == 2  # 1 node is free, but big is first
    alloc.release("running")
    assert isinstance(alloc.request("small", tenant="t", pool="cpu", nodes=1, ttl=60, now=3), Waiting)
    assert isinstance(alloc.request("big", tenant="t", pool="cpu", nodes=4, ttl=60, now=4), Lease)


def test_priority_goes_first_and_gone_requesters_leave_the_queue(alloc):
    from trainflow.cluster.allocator import STALE_WAIT_S, Lease, Waiting

    alloc.request("running", tenant="t", pool="cpu", nodes=4, ttl=600, now=0)
    alloc.request("low", tenant="t", pool="cpu", nodes=4, ttl=60, now=1)
    alloc.request("high", tenant="t", pool="cpu", nodes=4, ttl=60, priority=5, now=2)
    alloc.request("gone", tenant="t", pool="cpu", nodes=1, ttl=60, priority=9, now=3)
    assert alloc.queue("cpu") == ["gone", "high", "low"]
    later = 3 + STALE_WAIT_S + 1
    assert isinstance(alloc.request("low", tenant="t", pool="cpu", nodes=4, ttl=60, now=later), Waiting)
    assert alloc.queue("cpu") == ["low"]  # high and gone stopped renewing: dropped
    alloc.request("high", tenant="t", pool="cpu", nodes=4, ttl=60, priority=5, now=later + 1)
    alloc.release("running")
    assert isinstance(alloc.request("low", tenant="t", pool="cpu", nodes=4, ttl=60, now=later + 2), Waiting)
    assert isinstance(alloc.request("high", tenant="t", pool="cpu", nodes=4, ttl=60, priority=5, now=later + 3), Lease)
    assert alloc.release("high") and alloc.queue("cpu") == ["low"]
    alloc.release("low")
    assert alloc.queue("cpu") == []  # release withdraws a waiting request too


def test_a_request_that_never_fits_is_refused_not_queued(alloc):
    with pytest.raises(SpecError, match="only 4 nodes in total"):
        alloc.request("big", tenant="t", pool="cpu", nodes=5, ttl=10)
    assert alloc.queue("cpu") == []


def test_offline_nodes_are_not_handed_out_by_the_queue(alloc):
    from trainflow.cluster.allocator import Lease, Waiting

    alloc.request("r", tenant="t", pool="cpu", nodes=2, ttl=600, now=0)
    alloc.lose_node("r", until=100, reason="host gone")  # r holds 1, 1 node offline
    big = alloc.request("big", tenant="t", pool="cpu", nodes=3, ttl=60, now=1)
    assert isinstance(big, Waiting) and big.reason == "pool 'cpu': needs 3 nodes, 2 of 4 free"
    alloc.release("big")
    assert isinstance(alloc.request("two", tenant="t", pool="cpu", nodes=2, ttl=60, now=2), Lease)


def test_with_quotas_a_tenant_within_its_share_goes_before_an_earlier_borrower(alloc):
    """Fair share: tenant a fills the pool by borrowing b's idle quota; when a node frees,
    b's run (within its quota) gets it although a's fifth run asked earlier; a's run keeps
    waiting while b's waits (no lending then). Without quotas, first come first served."""
    from trainflow.cluster.allocator import Lease, Waiting

    alloc.set_quota("cpu", "a", 2)
    alloc.set_quota("cpu", "b", 2)
    assert alloc.quotas("cpu") == {"a": 2, "b": 2}
    for i in range(4):  # a2, a3 borrow b's idle quota
        assert isinstance(alloc.request(f"a{i}", tenant="a", pool="cpu", nodes=1, ttl=60, now=i), Lease)
    a5 = alloc.request("a5", tenant="a", pool="cpu", nodes=1, ttl=60, now=10)
    b1 = alloc.request("b1", tenant="b", pool="cpu", nodes=1, ttl=60, now=11)
    assert isinstance(a5, Waiting) and isinstance(b1, Waiting)
    assert "tenant 'b' is within its quota of 2" in b1.reason and "not preemptible" in b1.reason
    assert alloc.queue("cpu") == ["b1", "a5"]  # b is below its share: first
    alloc.release("a0")
    again = alloc.request("a5", tenant="a", pool="cpu", nodes=1, ttl=60, now=12)  # asks first: still waits
    assert isinstance(again, Waiting) and again.position == 2
    assert isinstance(alloc.request("b1", tenant="b", pool="cpu", nodes=1, ttl=60, now=13), Lease)
    assert isinstance(alloc.request("a5", tenant="a", pool="cpu", nodes=1, ttl=60, now=14), Waiting)

    alloc.set_quota("cpu", "a", None)
    alloc.set_quota("cpu", "b", None)
    assert alloc.quotas("cpu") == {}
    alloc.release("a1")  # no quotas: the queue's order again (a5 is the only one waiting)
    assert isinstance(alloc.request("a5", tenant="a", pool="cpu", nodes=1, ttl=60, now=15), Lease)


def test_a_tenant_without_quota_borrows_idle_nodes_and_keeps_them_unless_preemptible(alloc):
    from trainflow.cluster.allocator import Lease, Waiting

    alloc.set_quota("cpu", "a", 4)
    c = alloc.request("c1", tenant="c", pool="cpu", nodes=3, ttl=60, now=0)
    assert isinstance(c, Lease) and c.nodes == 3  # a's quota is idle: lent
    a = alloc.request("a1", tenant="a", pool="cpu", nodes=2, ttl=60, now=1)
    assert isinstance(a, Waiting)  # within its quota, but c's run keeps its nodes
    assert "within its quota of 4" in a.reason and "not preemptible keep their nodes" in a.reason
    c2 = alloc.request("c2", tenant="c", pool="cpu", nodes=1, ttl=60, now=2)
    assert isinstance(c2, Waiting)  # a free node, but a run within its quota waits: no lending
    alloc.release("c1")
    assert isinstance(alloc.request("a1", tenant="a", pool="cpu", nodes=2, ttl=60, now=3), Lease)


def test_quotas_are_checked(alloc):
    for bad in (-1, 1.5, True):
        with pytest.raises(SpecError, match="invalid quota"):
            alloc.set_quota("cpu", "a", bad)
    with pytest.raises(SpecError, match="tenant"):
        alloc.set_quota("cpu", "Bad Name", 1)


def test_a_higher_priority_run_preempts_a_preemptible_one_which_requeues_first_in_line(alloc):
    """Priority preemption as admission applies it: only the preemptible run is marked; the
    waiting run starts once the victim yields (not before); the victim goes back to the
    queue with its first submission time, ahead of a later run of its priority, and is
    granted again when the nodes free."""
    from trainflow.cluster.allocator import Lease, Waiting

    def ask(key, nodes, now, priority=0, preemptible=False):
        return alloc.request(
            key, tenant="t", pool="cpu", nodes=nodes, ttl=60, priority=priority, preemptible=preemptible, now=now
        )

    assert isinstance(ask("low", 3, 0, preemptible=True), Lease)
    assert isinstance(ask("keep", 1, 1), Lease)  # not preemptible
    hi = ask("hi", 2, 2, priority=5)
    assert isinstance(hi, Waiting) and "preempting 'low'" in hi.reason, hi
    order = alloc.preemption("low")
    assert order["by"] == "hi" and "priority 5 > 0" in order["reason"] and order["at"] == 2
    assert alloc.preemption("keep") is None and alloc.preemption("hi") is None
    assert isinstance(ask("later", 1, 3), Waiting)
    assert isinstance(ask("hi", 2, 4, priority=5), Waiting)  # the victim still holds its nodes
    assert alloc.yield_lease("low", nodes=3, now=5)
    assert not alloc.yield_lease("low", nodes=3, now=5)  # a second node task of the run: no-op
    assert alloc.preemption("low") is None
    assert isinstance(ask("hi", 2, 6, priority=5), Lease)
    assert alloc.queue("cpu") == ["low", "later"]  # first submitted at 0, before 'later' (3)
    assert isinstance(ask("low", 3, 7, preemptible=True), Waiting)
    alloc.release("hi")
    again = ask("low", 3, 8, preemptible=True)
    assert isinstance(again, Lease) and again.nodes == 3
    # A run that yields without an order leaves its lease alone.
    assert not alloc.yield_lease("low", nodes=3, now=9)
    assert [lease.run_key for lease in alloc.leases(now=9)] == ["keep", "low"]


def test_a_run_not_preemptible_is_never_preempted_by_priority(alloc):
    from trainflow.cluster.allocator import Waiting

    alloc.request("low", tenant="t", pool="cpu", nodes=4, ttl=60, now=0)
    hi = alloc.request("hi", tenant="t", pool="cpu", nodes=2, ttl=60, priority=9, now=1)
    assert isinstance(hi, Waiting) and "preempting" not in hi.reason
    assert alloc.preemption("low") is None


def test_with_quotas_borrowed_nodes_of_a_preemptible_run_are_reclaimed(alloc):
    """Fair share reclaims on demand: tenant a borrows b's idle quota with preemptible runs;
    b's run within its quota preempts a's youngest borrower, which requeues."""
    from trainflow.cluster.allocator import Lease, Waiting

    alloc.set_quota("cpu", "a", 2)
    alloc.set_quota("cpu", "b", 2)
    for i in range(2):
        assert isinstance(
            alloc.request(f"a{i}", tenant="a", pool="cpu", nodes=2, ttl=60, preemptible=True, now=i), Lease
        )
    b = alloc.request("b1", tenant="b", pool="cpu", nodes=2, ttl=60, now=5)
    assert isinstance(b, Waiting) and "preempting 'a1'" in b.reason, b
    assert "reclaimed for 'b1' of tenant 'b'" in alloc.preemption("a1")["reason"]
    assert alloc.preemption("a0") is None  # a keeps its own quota
    assert alloc.yield_lease("a1", nodes=2, now=6)
    assert isinstance(alloc.request("b1", tenant="b", pool="cpu", nodes=2, ttl=60, now=7), Lease)
    assert alloc.queue("cpu") == ["a1"]
    alloc.release("a1")  # withdrawn: nothing of it is left
    assert alloc.queue("cpu") == [] and alloc.preemption("a1") is None


def test_a_backfilling_pool_starts_a_short_run_in_the_gap_before_the_head(alloc):
    """EASY backfill in production admission: the 4-node head waits for the 3-node run
    expected to end at 1000 s; a 1-node run expected to take 100 s starts at once (it ends
    before the head's reservation), one without an estimate waits, and one that would run
    past the reservation waits too (the head's nodes are all reserved). Under the default
    policy the short run would wait behind the head."""
    from trainflow.cluster.allocator import Lease, Waiting

    with pytest.raises(SpecError, match="invalid policy.*priority, fifo, backfill"):
        alloc.set_pool("cpu", 4, policy="sjf")
    assert alloc.policy("cpu") == "priority"

    def ask(key, nodes, now, estimate=None):
        return alloc.request(key, tenant="t", pool="cpu", nodes=nodes, ttl=3600, estimate=estimate, now=now)

    assert isinstance(ask("long", 3, 0, estimate=1000), Lease)
    assert isinstance(ask("head", 4, 1, estimate=500), Waiting)
    assert isinstance(ask("short", 1, 2, estimate=100), Waiting)  # priority: the head blocks it
    alloc.set_pool("cpu", 4, policy="backfill")
    assert alloc.policy("cpu") == "backfill"
    assert isinstance(ask("unknown", 1, 3), Waiting)
    assert isinstance(ask("too-long", 1, 4, estimate=5000), Waiting)
    assert isinstance(ask("short", 1, 5, estimate=100), Lease)
    assert alloc.queue("cpu") == ["head", "unknown", "too-long"]
    alloc.set_pool("cpu", 4)  # resizing keeps the policy
    assert alloc.policy("cpu") == "backfill"
    alloc.set_quota("cpu", "t", 4)
    assert alloc.policy("cpu") == "fairshare"


def test_estimates_come_from_the_history_of_completed_runs(alloc):
    assert alloc.estimate("d|digits|2", 100) is None
    for i, seconds in enumerate((100.0, 140.0, 120.0)):
        alloc.request(f"r{i}", tenant="t", pool="cpu", nodes=1, ttl=3600, now=1000 * i)
        assert alloc.release(f"r{i}", completed=("d|digits|2", 200), now=1000 * i + seconds)
    assert alloc.estimate("d|digits|2", 100) == pytest.approx(60.0)  # median 0.6 s per step
    assert alloc.estimate("d|digits|4", 100) is None
    alloc.release("never-held", completed=("d|digits|2", 200))  # no lease: no history
    for i in range(30):  # only the newest are kept
        alloc.request(f"x{i}", tenant="t", pool="cpu", nodes=1, ttl=3600, now=10_000 + i)
        alloc.release(f"x{i}", completed=("s", 10), now=10_000 + i + 10)
    from trainflow.retention import state_rows

    assert state_rows(alloc.db)["run_history"] == 3 + 20
