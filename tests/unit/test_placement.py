"""Placement of gangs on registered hosts (a pool of hosts, not a ``set_pool`` size): which
hosts a run gets, how a node task's try is routed to its host, and when a slot moves."""

from __future__ import annotations

import logging

import pytest

from trainflow.cluster.allocator import Allocator, Lease, Waiting
from trainflow.cluster.hosts import HostRegistry
from trainflow.errors import AdmissionError, SpecError
from trainflow.routing import host_queue, placed_queue

RACKS = {"a1": "r1", "a2": "r1", "b1": "r2", "b2": "r2", "b3": "r2"}


@pytest.fixture
def hosts(state_target):
    """Pool ``gpu``: rack r1 with two 8-chip hosts, rack r2 with three."""
    registry = HostRegistry(state_target)
    for host, rack in RACKS.items():
        registry.register(host, queue="nvidia-gpu", family="nvidia", devices=8, pool="gpu", labels={"rack": rack})
    return registry


@pytest.fixture
def alloc(state_target, hosts):
    return Allocator(state_target)


def _ask(alloc, key, nodes, now, **kw):
    return alloc.request(key, tenant=key.split("/")[0], pool="gpu", nodes=nodes, ttl=600, now=now, **kw)


def test_a_gang_is_placed_in_one_rack_best_fit_and_runs_never_share_a_host(alloc):
    first = _ask(alloc, "t/d/one", 2, 0, chips=8)
    assert isinstance(first, Lease) and first.hosts == ("a1", "a2")  # the rack it fills exactly
    second = _ask(alloc, "t/d/two", 2, 1, chips=8)
    assert isinstance(second, Lease) and set(second.hosts) < {"b1", "b2", "b3"}
    third = _ask(alloc, "t/d/three", 2, 2, chips=8)
    assert isinstance(third, Waiting)  # one host left
    assert alloc.placement("t/d/one") == {0: "a1", 1: "a2"}
    assert {h for lease in alloc.leases("gpu", now=3) for h in lease.hosts} == {"a1", "a2", *second.hosts}
    alloc.release("t/d/one")
    third = _ask(alloc, "t/d/three", 2, 3, chips=8)
    # The free hosts: a1, a2 (r1) and one of r2: the gang stays in one rack.
    assert isinstance(third, Lease) and third.hosts == ("a1", "a2")
    assert _ask(alloc, "t/d/three", 2, 4, chips=8).hosts == ("a1", "a2")  # renewal: same hosts


def test_a_gang_spans_the_fewest_racks_and_keeps_rack_mates_on_adjacent_slots(alloc):
    lease = _ask(alloc, "t/d/wide", 4, 0)
    # 3 hosts of r2 + 1 of r1 (not 2 + 2): listed by rack, so rack-mates are adjacent slots.
    assert isinstance(lease, Lease) and lease.hosts[0] in ("a1", "a2") and set(lease.hosts[1:]) == {"b1", "b2", "b3"}


def test_hosts_with_too_few_chips_cordoned_hosts_and_oversized_gangs(state_target, hosts, alloc):
    hosts.register("small", queue="nvidia-gpu", family="nvidia", devices=4, pool="gpu", labels={"rack": "r3"})
    lease = _ask(alloc, "t/d/half", 1, 0, chips=4)
    assert lease.hosts == ("small",)  # best fit: the 4-chip host, whole 8-chip hosts stay free
    hosts.cordon("b1", reason="ECC errors")
    lease = _ask(alloc, "t/d/big", 3, 1, chips=8)
    assert isinstance(lease, Lease) and "b1" not in lease.hosts and "small" not in lease.hosts
    alloc.release("t/d/half")
    # 2 free hosts (counted), but one has 4 chips: the gang waits for hosts, saying so.
    waiting = _ask(alloc, "t/d/more", 2, 2, chips=8)
    assert isinstance(waiting, Waiting)
    assert "needs 2 hosts with 8 chips or more; 1 free host of the pool has that many" in waiting.reason
    # Never fits: 5 healthy hosts, but only 4 with 8 chips. Refused at once, with the numbers.
    with pytest.raises(SpecError, match=r"pool 'gpu' has only 4 hosts with 8 chips or more.*ask for at most 4"):
        _ask(alloc, "t/d/huge", 5, 3, chips=8)
    with pytest.raises(SpecError, match="16 chips"):
        _ask(alloc, "t/d/fat", 1, 3, chips=16)


def test_admit_places_too(alloc):
    lease = alloc.admit("t/d/x", tenant="t", pool="gpu", nodes=2, up_to=5, ttl=60, now=0)
    assert lease.nodes == 5 and sorted(lease.hosts) == sorted(RACKS)
    with pytest.raises(AdmissionError, match="1 nodes asked, 0 of 5 free"):
        alloc.admit("t/d/y", tenant="t", pool="gpu", nodes=1, ttl=60, now=1)


def test_a_try_is_routed_to_its_host_and_a_retry_moves_to_a_free_host_in_the_run_rack(alloc, caplog):
    lease = _ask(alloc, "t/d/run", 2, 0, chips=8)
    assert lease.hosts == ("a1", "a2")
    assert alloc.route("d", "run", 0, 1) == "a1" and alloc.route("d", "run", 1, 1) == "a2"
    assert alloc.route("d", "run", 0, 1) == "a1"  # the same try queued again: same host
    assert alloc.route("d", "run", 2, 1) is None  # no such slot
    assert alloc.route("d", "other", 0, 1) is None
    asked = []

    def lost(run_key, slot, try_number):
        asked.append((run_key, slot, try_number))
        return slot == 1  # node 1's try was lost with its host; node 0's failed in order

    # Try 2 of node 0 (its gang restarted): its host answered, it stays.
    assert alloc.route("d", "run", 0, 2, lost=lost) == "a1"
    # Try 2 of node 1 (lost with its host): no free host in r1, so one of r2.
    moved = alloc.route("d", "run", 1, 2, lost=lost)
    assert moved in ("b1", "b2", "b3") and asked == [("t/d/run", 0, 1), ("t/d/run", 1, 1)]
    assert alloc.placement("t/d/run") == {0: "a1", 1: moved}
    assert alloc.route("d", "run", 1, 2, lost=lost) == moved  # the same try again: not asked again
    assert len(asked) == 2
    # a2 is free again: another run can have it.
    assert "a2" in _ask(alloc, "u/d/next", 1, 1).hosts
    # A cordoned host is suspect whatever its try did; but with no free host at all, the
    # retry stays where it is.
    assert len(_ask(alloc, "u/d/rest", 2, 2).hosts) == 2
    HostRegistry(alloc.db).cordon("a1", reason="ECC errors")
    with caplog.at_level(logging.WARNING, logger="trainflow.cluster.allocator"):
        assert alloc.route("d", "run", 0, 3, lost=lost) == "a1"
    assert "t/d/run node 0: host a1 is suspect and no other host of pool" in caplog.text
    assert "try 3 waits for it" in caplog.text
    alloc.release("u/d/rest")
    assert alloc.route("d", "run", 0, 4, lost=lost) in ("b1", "b2", "b3")


def test_a_try_is_lost_when_it_never_began_or_never_ended(tmp_path):
    from trainflow.cluster.nodes import try_lost
    from trainflow.workspace import write_json_atomic

    marker = tmp_path / "nodes" / "task-0001.json"
    assert try_lost(tmp_path, 1, 1)  # never began
    marker.parent.mkdir()
    write_json_atomic(marker, {"host": "a1", "try": 1, "pid": 7})
    assert try_lost(tmp_path, 1, 1)  # began, never ended: killed with its host
    assert try_lost(tmp_path, 1, 2)  # try 2 never began
    write_json_atomic(marker, {"host": "a1", "try": 2, "ended": "exit 1"})
    assert not try_lost(tmp_path, 1, 2)


def test_the_default_judge_reads_the_run_workspace(state_target, hosts, tmp_path, monkeypatch):
    from trainflow.workspace import write_json_atomic

    monkeypatch.setenv("TRAINFLOW_HOME", str(tmp_path))
    alloc = Allocator(state_target)
    _ask(alloc, "t/d/run", 2, 0, chips=8)
    assert alloc.route("d", "run", 0, 1) == "a1" and alloc.route("d", "run", 1, 1) == "a2"
    nodes = tmp_path / "runs" / "t" / "d" / "run" / "nodes"
    nodes.mkdir(parents=True)
    write_json_atomic(nodes / "task-0000.json", {"host": "a1", "try": 1, "ended": "replaced"})
    write_json_atomic(nodes / "task-0001.json", {"host": "a2", "try": 1, "pid": 9})
    assert alloc.route("d", "run", 0, 2) == "a1"
    assert alloc.route("d", "run", 1, 2) in ("b1", "b2", "b3")


def test_a_lost_node_keeps_its_host_out_of_placement_until_the_run_releases(alloc):
    _ask(alloc, "t/d/run", 2, 0, chips=8)
    alloc.lose_node("t/d/run", until=10**12, reason="host a2 unreachable", slot=1)
    assert alloc.placement("t/d/run") == {0: "a1"}
    lease = _ask(alloc, "u/d/three", 3, 1)
    assert isinstance(lease, Lease) and "a2" not in lease.hosts
    alloc.release("u/d/three")
    alloc.release("t/d/run")
    assert set(_ask(alloc, "u/d/all", 5, 2).hosts) == set(RACKS)


def test_grow_binds_the_host_the_waiting_slot_runs_on(alloc):
    lease = _ask(alloc, "t/d/elastic", 2, 0, up_to=2, chips=8)
    _ask(alloc, "u/d/other", 2, 1, chips=8)
    free = (set(RACKS) - set(lease.hosts) - set(alloc.placement("u/d/other").values())).pop()
    taken = alloc.placement("u/d/other")[0]
    assert not alloc.grow("t/d/elastic", slot=2, host=taken, now=2)  # another run's host
    assert alloc.grow("t/d/elastic", slot=2, host=free, now=2)
    assert alloc.placement("t/d/elastic")[2] == free
    assert not alloc.grow("t/d/elastic", slot=3, now=3)  # the pool is full
    alloc.release("u/d/other")
    with pytest.raises(ValueError, match="slot="):
        alloc.grow("t/d/elastic", now=4)
    assert alloc.grow("t/d/elastic", slot=3, now=4)  # placed next to the run's hosts
    placed = alloc.placement("t/d/elastic")
    assert len(set(placed.values())) == 4 and RACKS[placed[3]] in {RACKS[h] for s, h in placed.items() if s != 3}


def test_leases_that_expire_free_their_hosts(alloc):
    alloc.admit("t/d/crashed", tenant="t", pool="gpu", nodes=5, ttl=10, now=0)
    lease = alloc.admit("t/d/next", tenant="t", pool="gpu", nodes=5, ttl=10, now=11)
    assert sorted(lease.hosts) == sorted(RACKS)
    assert alloc.prune(now=30)["host_leases"] == 5


def test_a_pool_with_a_set_size_is_not_placed(state_target):
    alloc = Allocator(state_target)
    alloc.set_pool("embedded", 4)
    lease = alloc.request("t/d/r", tenant="t", pool="embedded", nodes=2, ttl=60, now=0)
    assert lease.hosts == () and alloc.route("d", "r", 0, 1) is None


def test_only_mapped_node_tasks_are_routed():
    calls = []

    def route(dag_id, run_id, slot, try_number):
        calls.append((dag_id, run_id, slot, try_number))
        return "host-b" if slot == 1 else None

    assert placed_queue("shard_train", "d", "r", 1, 2, "cpu", route) == "cpu@host-b"
    assert placed_queue("shard_train", "d", "r", 1, 3, "cpu@host-a", route) == "cpu@host-b"
    assert placed_queue("shard_train", "d", "r", 0, 1, "cpu", route) is None
    assert placed_queue("provision", "d", "r", -1, 1, "default", route) is None
    assert placed_queue("shard_train", "d", "r", -1, 1, "cpu", route) is None
    assert calls == [("d", "r", 1, 2), ("d", "r", 1, 3), ("d", "r", 0, 1)]
    assert host_queue("huawei-ascend-910b", "n7") == "huawei-ascend-910b@n7"


def test_the_executor_rewrites_a_node_try_queue_from_the_placement(state_target, hosts, monkeypatch):
    from types import SimpleNamespace

    pytest.importorskip("airflow.providers.celery")
    from executors.placement import PlacementCeleryExecutor

    alloc = Allocator(state_target)
    lease = _ask(alloc, "t/d/run", 2, 0, chips=8)
    executor = PlacementCeleryExecutor.__new__(PlacementCeleryExecutor)
    executor._allocator = alloc

    def ti(task_id, map_index, try_number=1, queue="nvidia-gpu"):
        return SimpleNamespace(
            task_id=task_id,
            dag_id="d",
            run_id="run",
            map_index=map_index,
            try_number=try_number,
            queue=queue,
            key=(task_id, map_index),
        )

    node, control = ti("shard_train", 1), ti("evaluate", -1, queue="default")
    executor._route(node)
    executor._route(control)
    assert node.queue == f"nvidia-gpu@{lease.hosts[1]}" and control.queue == "default"
    # A database failure leaves the queue (Celery places the try) and is logged, not raised.
    executor._allocator = SimpleNamespace(route=lambda *a: 1 / 0)
    other = ti("shard_train", 0)
    executor._route(other)
    assert other.queue == "nvidia-gpu"
