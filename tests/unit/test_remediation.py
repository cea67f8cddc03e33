"""The run's abort record and a gang that can no longer become whole (pure, on a workspace)."""

from __future__ import annotations

import json

import pytest

from trainflow import remediation
from trainflow.timeline import read
from trainflow.worker.train import crash_restarts


@pytest.mark.parametrize(
    "states, me, ended",
    [
        ({0: "running", 1: "running"}, 1, None),
        ({0: "up_for_retry", 1: "running"}, 1, None),  # a retry is coming: the gang waits for it
        ({0: "failed", 1: "running"}, 1, (0, "failed")),  # marked failed, or its tries spent
        ({0: "running", 1: "removed", 2: "upstream_failed"}, 0, (1, "removed")),
        ({0: "running", 1: "failed"}, 1, None),  # a node does not end the run for itself
    ],
    ids=["running", "retrying", "failed", "removed", "itself"],
)
def test_a_member_that_ended_for_good_is_found(states, me, ended):
    assert remediation.ended_member(states, me=me) == ended


def test_a_member_marked_success_while_the_gang_trains_has_ended(tmp_path):
    states = {0: "success", 1: "running"}
    assert remediation.ended_member(states, me=1, finished=lambda n: remediation.node_finished(tmp_path, n)) == (
        0,
        "success",
    )
    marker = tmp_path / "nodes" / "task-0000.json"
    marker.parent.mkdir()
    marker.write_text(json.dumps({"host": "h", "try": 1, "ended": "succeeded"}))  # trained to the end
    assert remediation.ended_member(states, me=1, finished=lambda n: remediation.node_finished(tmp_path, n)) is None
    message = remediation.end_for_member(tmp_path, 0, "success", now=1.0)
    assert "marked success by a user while the gang trained" in message


def test_ending_for_a_member_writes_one_abort_that_names_it(tmp_path):
    message = remediation.end_for_member(tmp_path, 0, "failed", now=5.0)
    assert "node 0's task is failed" in message and "marked failed by a user" in message
    error = remediation.aborted(tmp_path)
    assert (error["node"], error["kind"], error["message"]) == (0, "member_ended", message)
    remediation.end_for_member(tmp_path, 1, "failed", now=6.0)  # first writer wins
    assert remediation.aborted(tmp_path)["node"] == 0
    assert [e["event"] for e in read(tmp_path)] == ["member_ended"]


def test_a_cleared_run_is_provisioned_again_with_its_abort_set_aside(tmp_path):
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"run_id": "r"}))
    assert remediation.plan_epoch(tmp_path) == 1  # a plan from before epochs
    assert remediation.provisioned(tmp_path, plan, 0, now=1.0) == 1 and remediation.plan_epoch(tmp_path) == 1
    remediation.end_for_member(tmp_path, 0, "failed", now=2.0)
    assert remediation.provisioned(tmp_path, plan, remediation.plan_epoch(tmp_path), now=3.0) == 2
    assert remediation.aborted(tmp_path) is None and (tmp_path / "ABORT.cleared-0").exists()
    assert json.loads(plan.read_text()) == {"run_id": "r", "epoch": 2}
    again = [e for e in read(tmp_path) if e["event"] == "provisioned_again"]
    assert again[0]["epoch"] == 2 and "cannot become whole" in again[0]["after"]
    assert remediation.plan_epoch(tmp_path / "nothing") == 0


def test_crash_loop_counts_gang_starts_since_the_last_provision():
    starts = [{"event": "gang_start", "step": 100}] * 3
    assert crash_restarts(starts, 100) == 3
    assert (
        crash_restarts([*starts, {"event": "provisioned_again", "epoch": 2}, {"event": "gang_start", "step": 100}], 100)
        == 1
    )
