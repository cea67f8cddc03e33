"""The node task's side of a preemption (``trainflow.cluster.preemption``), on a real state DB."""

from __future__ import annotations

import json

from trainflow.cluster.allocator import Allocator, Lease, Waiting
from trainflow.cluster.preemption import PreemptionWatch, grace_from_env
from trainflow.timeline import read
from trainflow.workspace import PREEMPT_REQUEST, PREEMPTED, preempted, write_json_atomic


def test_an_order_reaches_the_gang_then_the_run_requeues_and_resumes(tmp_path, state_target):
    alloc = Allocator(state_target)
    alloc.set_pool("cpu", 2)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    assert isinstance(alloc.request("t/low/1", tenant="t", pool="cpu", nodes=2, ttl=60, preemptible=True, now=0), Lease)
    watches = [PreemptionWatch(run_dir, "t/low/1", n, allocator=alloc, grace=30, check_every=1) for n in (0, 1)]
    assert watches[0].poll(now=1) is None and not (run_dir / "control" / PREEMPT_REQUEST).exists()
    assert isinstance(alloc.request("t/hi/1", tenant="t", pool="cpu", nodes=1, ttl=60, priority=3, now=2), Waiting)
    assert watches[0].poll(now=1.5) is None  # throttled: no read within check_every
    assert watches[0].poll(now=2.5) is None and watches[1].poll(now=2.5) is None
    order = json.loads((run_dir / "control" / PREEMPT_REQUEST).read_text())
    assert order["by"] == "t/hi/1" and preempted(run_dir) == {"requested": order}
    # The gang stops at a checkpoint (rank 0's record), both node tasks requeue: one does it.
    write_json_atomic(run_dir / "control" / PREEMPTED, {"step": 60, "time": 3, "by": "t/hi/1"})
    assert watches[0].stopped_at() == 60 and watches[1].ordered()
    assert watches[0].holds_lease(now=3)
    assert [w.requeue(nodes=2) for w in watches] == [True, False]
    assert not watches[1].holds_lease(now=3)
    assert watches[0].poll(now=5) is None  # no order is left
    assert isinstance(alloc.request("t/hi/1", tenant="t", pool="cpu", nodes=1, ttl=60, priority=3, now=6), Lease)
    assert alloc.queue("cpu") == ["t/low/1"]
    alloc.release("t/hi/1")
    assert isinstance(alloc.request("t/low/1", tenant="t", pool="cpu", nodes=2, ttl=60, preemptible=True, now=7), Lease)
    for w in watches:
        w.resumed(waited_s=4)
    assert preempted(run_dir) is None
    events = [e["event"] for e in read(run_dir)]
    assert events.count("preempt_ordered") == 2 and events.count("requeued") == 1
    assert events.count("readmitted") == 1


def test_a_gang_that_does_not_stop_within_the_grace_is_stopped(tmp_path, state_target):
    alloc = Allocator(state_target)
    alloc.set_pool("cpu", 1)
    alloc.request("t/low/1", tenant="t", pool="cpu", nodes=1, ttl=60, preemptible=True, now=100)
    alloc.request("t/hi/1", tenant="t", pool="cpu", nodes=1, ttl=60, priority=1, now=100)
    watch = PreemptionWatch(tmp_path, "t/low/1", 0, allocator=alloc, grace=30, check_every=1)
    assert watch.poll(now=110) is None
    assert watch.poll(now=129.5) is None
    why = watch.poll(now=130.2)
    assert "did not stop at a checkpoint within 30 s" in why and "'t/hi/1'" in why
    assert grace_from_env({"TRAINFLOW_PREEMPT_GRACE_S": "7"}) == 7.0 and grace_from_env({}) == 120.0
