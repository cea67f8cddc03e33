from __future__ import annotations

import pytest

from trainflow.errors import SpecError
from trainflow.faults import FaultKind, parse_faults
from trainflow.goodput import fault_records, summarize
from trainflow.timeline import record


def test_fault_detection_and_recovery_are_paired():
    events = [
        {"event": "fault_injected", "kind": "stop_rank", "step": 120, "time": 100.0},
        {"event": "stall_detected", "time": 105.0},
        {"event": "resumed", "step": 100, "time": 113.0},
    ]
    (rec,) = fault_records(events)
    assert rec["detection_s"] == 5.0 and rec["recovery_s"] == 13.0
    assert rec["steps_lost"] == 19 and rec["resumed_from_step"] == 100


def test_an_exit_from_outside_opens_a_fault_and_an_injected_one_gives_its_cause():
    outside = [
        {"event": "worker_exited", "rank": 1, "signal": "SIGKILL", "exitcode": -9, "step": 140, "time": 10.0},
        {"event": "worker_exited", "rank": 0, "signal": None, "exitcode": 1, "step": 140, "time": 10.5},
        {"event": "resumed", "step": 100, "time": 14.0},
        {"event": "worker_exited", "rank": 0, "signal": None, "exitcode": 137, "step": 300, "time": 30.0},
        {"event": "resumed", "step": 300, "time": 33.0},
    ]
    (swapped,) = fault_records([outside[1], outside[0], outside[2]])  # the peer's exit seen first
    assert (swapped["cause"], swapped["rank"], swapped["exits"]) == ("rank 1 ended by SIGKILL", 1, 2)
    first, second = fault_records(outside)
    assert (first["kind"], first["source"], first["cause"]) == ("worker_exit", "outside", "rank 1 ended by SIGKILL")
    assert first["exits"] == 2 and first["recovery_s"] == 4.0 and first["steps_lost"] == 39
    assert second["cause"] == "rank 0 exited with code 137" and second["steps_lost"] == 0
    injected = [
        {"event": "fault_injected", "kind": "kill_rank", "step": 140, "rank": 1, "time": 9.9},
        *outside[:3],
    ]
    (rec,) = fault_records(injected)  # the same fault, seen twice: one record
    assert (rec["kind"], rec["source"], rec["cause"]) == ("kill_rank", "injected", "rank 1 ended by SIGKILL")
    assert rec["exits"] == 2 and rec["steps_lost"] == 39


def test_summary_goodput(tmp_path):
    record(tmp_path, "fault_injected", kind="kill_rank", step=51, rank=1)
    record(tmp_path, "resumed", step=50)
    s = summarize(tmp_path, started=0.0, ended=1e12, steps=100)
    assert s["steps_lost"] == 0 and 0.99 < s["goodput"] <= 1.0
    assert summarize(tmp_path / "none", started=0, ended=10, steps=10)["goodput"] == 1.0


def test_an_open_fault_is_charged_up_to_now(tmp_path):
    """A rank killed from outside 30 s ago and no resume yet: the fault is open and the
    live run's goodput counts those 30 s lost, not 100 %."""
    record(tmp_path, "worker_exited", rank=1, signal="SIGKILL", exitcode=-9, step=40, time=70.0)
    s = summarize(tmp_path, started=0.0, ended=100.0, steps=40)
    (fault,) = s["faults"]
    assert fault["open"] is True and fault["open_s"] == 30.0 and "recovery_s" not in fault
    assert s["recovery_s"] == 30.0 and s["goodput"] == pytest.approx(0.7)
    record(tmp_path, "resumed", step=40, time=75.0)
    assert summarize(tmp_path, started=0.0, ended=100.0, steps=80)["faults"][0].get("open") is None


def test_a_restart_with_no_checkpoint_ends_its_fault_at_the_first_step():
    events = [
        {"event": "worker_exited", "rank": 1, "signal": "SIGKILL", "exitcode": -9, "step": 30, "time": 10.0},
        {"event": "gang_start", "step": 0, "time": 12.0},
        {"event": "first_step", "step": 1, "time": 14.0},
    ]
    (rec,) = fault_records(events)
    assert rec["recovery_s"] == 4.0 and rec["resumed_from_step"] == 0 and rec["steps_lost"] == 29


def test_parse_faults():
    (f,) = parse_faults([{"kind": "stop_rank", "step": 3, "rank": 1}], world_size=2, steps=10)
    assert f.kind == FaultKind.STOP_RANK and f.to_dict() == {"kind": "stop_rank", "step": 3, "rank": 1}
    with pytest.raises(SpecError, match=r"faults\[0\]"):
        parse_faults([{"kind": "kill_rank", "step": 3, "extra": 1}], world_size=2, steps=10)


def test_parse_faults_with_durations():
    (f,) = parse_faults([{"kind": "delay_heartbeats", "step": 3, "rank": 1, "seconds": 7}], world_size=2, steps=10)
    assert f.seconds == 7.0 and f.to_dict()["seconds"] == 7.0
    with pytest.raises(SpecError, match=r"faults\[0\]\.seconds.*needs seconds > 0"):
        parse_faults([{"kind": "delay_heartbeats", "step": 3}], world_size=2, steps=10)
    with pytest.raises(SpecError, match=r"faults\[0\]\.seconds.*only delay_heartbeats"):
        parse_faults([{"kind": "kill_rank", "step": 3, "seconds": 2}], world_size=2, steps=10)
    (g,) = parse_faults([{"kind": "fill_disk", "step": 3}], world_size=2, steps=10)
    assert g.to_dict() == {"kind": "fill_disk", "step": 3, "rank": 0}


def test_faults_that_do_not_restart_are_not_paired_with_a_later_resume():
    events = [
        {"event": "fault_injected", "kind": "fill_disk", "step": 90, "time": 10.0},
        {"event": "fault_injected", "kind": "delay_heartbeats", "step": 95, "time": 11.0},
        {"event": "fault_injected", "kind": "kill_rank", "step": 110, "time": 20.0},
        {"event": "resumed", "step": 80, "time": 24.0},
    ]
    fill, delay, kill = fault_records(events)
    assert "resumed_time" not in fill and "resumed_time" not in delay
    assert kill["recovery_s"] == 4.0 and kill["steps_lost"] == 29


def test_withheld_heartbeats_become_a_stall_when_they_outlast_the_timeout():
    events = [
        {"event": "fault_injected", "kind": "delay_heartbeats", "step": 40, "time": 10.0},
        {"event": "stall_detected", "time": 15.0},
        {"event": "resumed", "step": 40, "time": 22.0},
    ]
    (rec,) = fault_records(events)
    assert rec["detection_s"] == 5.0 and rec["recovery_s"] == 12.0 and rec["restarts"]


def test_muted_heartbeat_writer_writes_nothing_until_the_delay_ends(tmp_path):
    import json
    import time

    from trainflow.heartbeat import HeartbeatWriter, RankState

    w = HeartbeatWriter(tmp_path, rank=0, node=0, interval=0.0)
    w.beat(step=1, total=9, state=RankState.TRAINING)
    w.mute(until=time.time() + 60)
    w.beat(step=2, total=9, state=RankState.TRAINING, force=True)
    assert json.loads((tmp_path / "rank-00000.json").read_text())["step"] == 1
    w.mute(until=0)
    w.beat(step=3, total=9, state=RankState.TRAINING)
    assert json.loads((tmp_path / "rank-00000.json").read_text())["step"] == 3


def test_a_lost_node_task_a_users_control_and_a_preemption_are_faults_too():
    events = [
        # the survivors' workers exit when node 1's task is SIGKILLed; its next try says why
        {"event": "worker_exited", "rank": 0, "signal": None, "exitcode": 1, "step": 140, "time": 10.0},
        {"event": "node_task_lost", "node": 1, "try": 1, "host": "h1", "time": 12.0},
        {"event": "resumed", "step": 100, "time": 20.0},
        {
            "event": "member_ended",
            "node": 0,
            "state": "failed",
            "message": "node 0 marked failed",
            "step": 200,
            "time": 30.0,
        },  # fmt: skip
        {"event": "resumed", "step": 200, "time": 90.0},  # cleared, provisioned again
        {"event": "preempted", "step": 250, "by": "t/d/hi", "time": 100.0},
        {"event": "resumed", "step": 250, "time": 160.0},
    ]
    lost, user, preempted = fault_records(events)
    assert (lost["kind"], lost["source"], lost["cause"]) == (
        "node_lost",
        "outside",
        "node 1's task (try 1 on h1) was lost",
    )
    assert lost["recovery_s"] == 10.0 and lost["steps_lost"] == 39
    assert (user["kind"], user["source"], user["cause"], user["recovery_s"]) == (
        "user_action",
        "user",
        "node 0 marked failed",
        60.0,
    )
    assert (preempted["kind"], preempted["source"], preempted["steps_lost"]) == ("preemption", "pool", 0)
    assert preempted["recovery_s"] == 60.0 and preempted["cause"] == "preempted for t/d/hi"
    # a lost node task with no exit seen first opens its own record
    (alone,) = fault_records([{"event": "node_task_lost", "node": 2, "try": 3, "host": "h2", "time": 5.0}])
    # a hang from outside (SIGSTOP): the watch's record counts the steps the gang redoes
    (stall,) = fault_records(
        [
            {"event": "stall_detected", "ranks": [1], "steps": {"0": 102, "1": 101}, "time": 50.0},
            {"event": "resumed", "step": 100, "time": 70.0},
        ]
    )
    assert (stall["kind"], stall["step"], stall["steps_lost"], stall["recovery_s"]) == ("stall_detected", 102, 1, 20.0)
    assert alone["kind"] == "node_lost" and alone["node"] == 2 and alone["restarts"]


def test_an_agent_killed_from_outside_is_the_cause_not_the_exits_that_follow():
    # node 1's agent is SIGKILLed: its worker dies with it unobserved, rank 0's collective
    # breaks (exit code 1), and node 1's task sees its agent's signal — in either order
    for order in ((0, 1), (1, 0)):
        pair = [
            {"event": "worker_exited", "rank": 0, "signal": None, "exitcode": 1, "step": 117, "time": 10.0},
            {"event": "agent_exited", "node": 1, "host": "vm", "signal": "SIGKILL", "time": 10.2},
        ]
        (rec,) = fault_records([pair[order[0]], pair[order[1]], {"event": "resumed", "step": 100, "time": 16.0}])
        assert (rec["kind"], rec["source"], rec["cause"]) == ("node_lost", "outside", "node 1's agent ended by SIGKILL")
        assert rec["restarts"] and rec["recovery_s"] == pytest.approx(16.0 - pair[order[0]]["time"])
        assert (rec["step"], rec["steps_lost"]) == (117, 16)  # the step the exit saw, either order
