"""``trainflow.ui.data`` on workspaces written by the project's own writers."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from trainflow import timeline
from trainflow.checkpoint import manifest
from trainflow.errors import SpecError
from trainflow.heartbeat import HeartbeatWriter, RankState
from trainflow.plan import build_plan
from trainflow.remediation import abort
from trainflow.spec import TrainingSpec
from trainflow.ui import data
from trainflow.ui.data import RunNotFoundError, RunState, list_runs, run_detail
from trainflow.workspace import COMPLETE, Workspace, write_json_atomic


def make_run(
    root: Path,
    run_id: str = "manual__1",
    *,
    dag_id: str = "train_digits",
    tenant: str = "default",
    nodes: int = 2,
    steps: int = 60,
    beats: dict[int, dict] | None = None,
) -> Path:
    """A run's workspace as provision and the node agents write it: plan, spec, node
    status files and (``beats``: rank → beat kwargs) heartbeats."""
    spec = TrainingSpec(
        nodes=nodes, steps=steps, checkpoint_interval=20, heartbeat_timeout=10, startup_timeout=30, tenant=tenant
    )
    ws = Workspace(root, tenant, dag_id, run_id).create()
    plan = build_plan(spec, dag_id=dag_id, run_id=run_id, run_dir=str(ws.dir), rdzv_endpoint="sqlite:///x")
    write_json_atomic(ws.spec_file, spec.to_dict())
    write_json_atomic(ws.plan_file, plan)
    for sub in ("nodes", "control"):  # as the node agents and local.prepare make them
        (ws.dir / sub).mkdir()
    for node in range(nodes):
        write_json_atomic(
            ws.dir / "nodes" / f"node-{node:04d}.json",
            {"node": node, "state": "running", "pid": 1, "started": time.time() - 5},
        )
    for rank, kw in (beats or {}).items():
        HeartbeatWriter(ws.heartbeats, rank=rank, node=rank, interval=1, world=nodes).beat(force=True, **kw)
    return ws.dir


def training(step: int, loss: float = 1.0, sps: float = 100.0) -> dict:
    return {"step": step, "total": 60, "state": RankState.TRAINING, "loss": loss, "samples_per_s": sps}


def commit_checkpoint(run_dir: Path, step: int) -> Path:
    part = manifest.partial_dir(run_dir / "checkpoints", step)
    part.mkdir(parents=True)
    (part / "__0_0.distcp").write_bytes(b"w" * (100 + step))
    return Path(manifest.commit(run_dir / "checkpoints", step, world_size=2, training_hash="h").path)


def test_a_running_run_in_the_list_and_in_detail(tmp_path):
    run_dir = make_run(tmp_path, beats={0: training(40, loss=0.5, sps=1000.0), 1: training(39, sps=900.0)})
    for step, loss in ((1, 2.3), (20, 0.9), (40, 0.5)):
        timeline.append(run_dir / "curve.jsonl", {"time": time.time(), "step": step, "loss": loss})
    commit_checkpoint(run_dir, 20)
    timeline.record(run_dir, "checkpoint_committed", step=20, latency_s=0.1)
    timeline.record(run_dir, "fault_injected", kind="kill_rank", rank=1, step=30)
    timeline.record(run_dir, "resumed", step=20, checkpoint="...")
    now = time.time() + 2

    [row] = list_runs(tmp_path, now=now)
    assert row["state"] == RunState.RUNNING.value, row["state_reason"]
    assert (row["tenant"], row["dag_id"], row["run_id"]) == ("default", "train_digits", "manual__1")
    assert (row["workload"], row["chip"], row["nodes"], row["world_size"]) == ("digits", "cpu", 2, 2)
    assert (row["step"], row["total_steps"], row["loss"]) == (39, 60, 0.5)  # slowest rank; rank 0's loss
    assert row["samples_per_s"] == 1900.0  # the gang's, summed over ranks
    assert 1.5 < row["last_heartbeat_age_s"] < 10
    assert json.loads(json.dumps(row)) == row

    d = run_detail(tmp_path, "default", "train_digits", "manual__1", now=now)
    assert [(r["rank"], r["node"], r["step"], r["healthy"]) for r in d["ranks"]] == [(0, 0, 40, True), (1, 1, 39, True)]
    assert all(1.5 < r["progress_age_s"] < 10 for r in d["ranks"])
    assert [(p["step"], p["loss"]) for p in d["loss_curve"]] == [(1, 2.3), (20, 0.9), (40, 0.5)]
    [ckpt] = d["checkpoints"]
    assert (ckpt["step"], ckpt["bytes"], ckpt["verified"]) == (20, 120, True)
    assert ckpt["path"].endswith("checkpoints/step-00000020")
    assert [(e["event"], e["kind"]) for e in d["timeline"]] == [
        ("checkpoint_committed", "info"),
        ("fault_injected", "fault"),
        ("resumed", "recovery"),
    ]
    assert [n["state"] for n in d["node_agents"]] == ["running", "running"]
    assert d["evaluation"] is None and d["errors"] == [] and d["spec"]["steps"] == 60
    assert json.loads(json.dumps(d)) == d


def test_a_corrupted_checkpoint_is_not_verified(tmp_path):
    run_dir = make_run(tmp_path)
    commit_checkpoint(run_dir, 20)
    newest = commit_checkpoint(run_dir, 40)
    (newest / "__0_0.distcp").write_bytes(b"x" * 140)  # same size, other bytes
    d = run_detail(tmp_path, "default", "train_digits", "manual__1")
    assert [(c["step"], c["verified"]) for c in d["checkpoints"]] == [(40, False), (20, True)]


def _completed(run_dir: Path) -> None:
    write_json_atomic(run_dir / "control" / COMPLETE, {"step": 60, "time": time.time(), "world": 2})


def _aborted(run_dir: Path) -> None:
    abort(run_dir, {"rank": 1, "kind": "user", "message": "ZeroDivisionError in loss"})


def _rank_killed(run_dir: Path) -> None:
    commit_checkpoint(run_dir, 20)
    timeline.record(run_dir, "first_step", step=1)
    timeline.record(run_dir, "worker_exited", node=1, rank=1, exitcode=-9, signal="SIGKILL", pid=7, step=25)


def _rank_killed_and_healed(run_dir: Path) -> None:
    _rank_killed(run_dir)
    timeline.record(run_dir, "gang_start", step=20, world=2)
    timeline.record(run_dir, "first_step", step=21)


def _preempted(run_dir: Path) -> None:
    write_json_atomic(run_dir / "control" / "preempted.json", {"by": "t/hi/1", "step": 40, "time": 1.0})


def _preempt_asked(run_dir: Path) -> None:
    write_json_atomic(run_dir / "control" / "preempt-request.json", {"by": "t/hi/1", "reason": "priority"})


def _marked_failed(run_dir: Path) -> None:
    abort(run_dir, {"node": 0, "kind": "member_ended", "message": "node 0's task is failed", "time": 1.0e9})


def _agents_failed(run_dir: Path) -> None:
    for node, state in ((0, "failed"), (1, "succeeded")):
        write_json_atomic(
            run_dir / "nodes" / f"node-{node:04d}.json",
            {"node": node, "state": state, "started": 1.0, "ended": 2.0, "error": "boom"},
        )


@pytest.mark.parametrize(
    "beats, act, later, state, reason",
    [
        ({}, None, 0, RunState.PENDING, "no rank"),
        ({0: training(5), 1: training(5)}, None, 0, RunState.RUNNING, "progressing"),
        ({0: training(5), 1: training(5)}, None, 60, RunState.STALLED, "without progress"),
        ({0: training(5)}, None, 120, RunState.STALLED, "ranks [1]"),
        ({0: training(5), 1: training(5)}, _completed, 600, RunState.COMPLETED, "complete.json"),
        ({0: training(5), 1: training(5)}, _aborted, 0, RunState.FAILED, "ZeroDivisionError"),
        ({0: training(5), 1: training(5)}, _agents_failed, 0, RunState.FAILED, "node 0 failed: boom"),
        (
            {0: training(5), 1: training(5)},
            _rank_killed,
            0,
            RunState.HEALING,
            "healing: rank 1 exited (signal SIGKILL) at",
        ),
        ({0: training(5), 1: training(5)}, _rank_killed, 0, RunState.HEALING, "from checkpoint step 20"),
        ({0: training(5), 1: training(5)}, _rank_killed_and_healed, 0, RunState.RUNNING, "progressing"),
        ({0: training(5), 1: training(5)}, _preempted, 0, RunState.PREEMPTED, "by t/hi/1 at step 40"),
        ({0: training(5), 1: training(5)}, _preempt_asked, 0, RunState.PREEMPTED, "stopping at the next checkpoint"),
        ({0: training(5), 1: training(5)}, _marked_failed, 0, RunState.FAILED, "ended at 01:46:40 UTC: node 0's"),
    ],
    ids=[
        "pending",
        "running",
        "stalled",
        "startup-timeout",
        "completed",
        "aborted",
        "agent-failed",
        "healing",
        "healing-from",
        "healed",
        "preempted",
        "preempt-asked",
        "marked-failed",
    ],
)
def test_run_state_is_derived_from_the_files(tmp_path, beats, act, later, state, reason):
    run_dir = make_run(tmp_path, beats=beats)
    if act:
        act(run_dir)
    [row] = list_runs(tmp_path, now=time.time() + later)
    assert row["state"] == state.value
    assert reason in row["state_reason"]


def test_evaluation_and_errors_are_reported(tmp_path):
    run_dir = make_run(tmp_path, beats={0: {"step": 60, "total": 60, "state": RankState.DONE}})
    metrics = {
        "metrics": {"accuracy": 0.97},
        "step": 60,
        "target": {"metric": "accuracy", "op": ">=", "value": 0.95, "met": True},
    }
    write_json_atomic(run_dir / "metrics.json", metrics)
    (run_dir / "errors").mkdir()
    write_json_atomic(
        run_dir / "errors" / "rank-00001.json",
        {
            "rank": 1,
            "kind": "infrastructure",
            "type": "RuntimeError",
            "message": "gloo",
            "traceback": "long",
            "time": 1.0,
        },
    )
    d = run_detail(tmp_path, "default", "train_digits", "manual__1")
    assert d["evaluated"] and d["evaluation"] == metrics
    assert d["errors"] == [
        {"rank": 1, "kind": "infrastructure", "type": "RuntimeError", "message": "gloo", "time": 1.0}
    ]


def test_list_filters_skips_foreign_directories_and_sorts_newest_first(tmp_path):
    make_run(tmp_path, "old", beats={0: training(1)})
    make_run(tmp_path, "other", dag_id="train_tinylm")
    make_run(tmp_path, "team", tenant="team-a")
    make_run(tmp_path, "new", beats={0: training(2)})
    (tmp_path / "default" / "train_digits" / "no-plan").mkdir()
    (tmp_path / "Bad Tenant" / "dag" / "run").mkdir(parents=True)
    (tmp_path / "default" / "train_digits" / "stray.txt").write_text("x")
    later = time.time() + 1
    assert [r["run_id"] for r in list_runs(tmp_path, now=later, tenant="default", dag_id="train_digits")] == [
        "new",
        "old",
    ]
    assert {r["run_id"] for r in list_runs(tmp_path, now=later)} == {"new", "old", "other", "team"}
    assert [r["run_id"] for r in list_runs(tmp_path, tenant="team-a")] == ["team"]
    assert list_runs(tmp_path / "missing") == []


def test_an_unknown_run_is_a_specific_error(tmp_path):
    make_run(tmp_path)
    with pytest.raises(RunNotFoundError, match="no run default/train_digits/nope"):
        run_detail(tmp_path, "default", "train_digits", "nope")
    (tmp_path / "default" / "train_digits" / "empty").mkdir()
    with pytest.raises(RunNotFoundError):
        run_detail(tmp_path, "default", "train_digits", "empty")


@pytest.mark.parametrize(
    "tenant, dag_id, run_id, field",
    [
        ("default", "train_digits", "..", "run_id"),
        ("default", "train_digits", "a..b", "run_id"),
        ("default", "..", "x", "dag_id"),
        ("../etc", "train_digits", "x", "tenant"),
        ("Default", "train_digits", "x", "tenant"),
        ("default", "train_digits", "a/b", "run_id"),
    ],
    ids=["dotdot-run", "dotdot-inside", "dotdot-dag", "escape-tenant", "upper-tenant", "slash"],
)
def test_names_cannot_escape_the_root(tmp_path, tenant, dag_id, run_id, field):
    with pytest.raises(SpecError) as err:
        run_detail(tmp_path, tenant, dag_id, run_id)
    assert err.value.field == field


def test_a_long_loss_curve_is_thinned_keeping_the_last_point(tmp_path, monkeypatch):
    monkeypatch.setattr(data, "MAX_CURVE_POINTS", 10)
    run_dir = make_run(tmp_path)
    for step in range(1, 36):
        timeline.append(run_dir / "curve.jsonl", {"time": 1.0, "step": step, "loss": 1.0 / step})
    curve = run_detail(tmp_path, "default", "train_digits", "manual__1")["loss_curve"]
    assert len(curve) <= 11 and curve[0]["step"] == 1 and curve[-1]["step"] == 35


def test_torn_files_do_not_break_the_page(tmp_path):
    run_dir = make_run(tmp_path, beats={0: training(3)})
    (run_dir / "plan.json").write_text('{"world_size": 2, "spec"')  # a reader racing a writer
    (run_dir / "heartbeats" / "rank-00001.json").write_text("{")
    (run_dir / "metrics.json").write_text("[]")
    timeline.append(run_dir / "timeline.jsonl", {"no_event": 1})
    [row] = list_runs(tmp_path)
    assert (row["workload"], row["step"], row["ranks_reporting"]) == ("digits", 3, 1)  # spec.json still read
    d = run_detail(tmp_path, "default", "train_digits", "manual__1")
    assert d["evaluation"] is None and d["timeline"] == [] and [r["rank"] for r in d["ranks"]] == [0]


def test_faults_membership_goodput_and_allocation(tmp_path):
    run_dir = make_run(tmp_path, nodes=3, beats={0: training(50), 1: training(50)})
    write_json_atomic(run_dir / "nodes" / "lease.json", {"run_key": "k", "pool": "embedded", "granted": 3})
    for node in (0, 1):
        (run_dir / "nodes" / f"slot-{node:04d}.held").touch()
    t = time.time() - 4
    for event, kw, at in (
        ("gang_start", {"step": 0, "nodes": [0, 1, 2], "world": 3}, t),
        ("fault_injected", {"kind": "kill_node", "node": 2, "step": 31}, t + 1),
        ("stall_detected", {"ranks": [2]}, t + 1.5),
        ("resumed", {"step": 20}, t + 3),
        (
            "membership",
            {
                "step": 20,
                "change": "shrink",
                "world_from": 3,
                "world_to": 2,
                "nodes_from": [0, 1, 2],
                "nodes_to": [0, 1],
                "joined": [],
                "left": [2],
                "spares_used": [],
            },
            t + 3.1,
        ),
    ):
        timeline.append(run_dir / "timeline.jsonl", {"time": at, "event": event, **kw})
    now = t + 4
    [row] = list_runs(tmp_path, now=now)
    assert row["allocation"] == {"pool": "embedded", "held": 2, "slots": 3, "released": None}
    assert 0 < row["goodput"] < 1
    d = run_detail(tmp_path, "default", "train_digits", "manual__1", now=now)
    [fault] = d["faults"]
    assert (
        fault["kind"],
        fault["step"],
        fault["detection_s"],
        fault["recovery_s"],
        fault["resumed_from_step"],
        fault["steps_lost"],
    ) == ("kill_node", 31, 0.5, 2.0, 20, 10)
    assert fault["membership"] == {"change": "shrink", "world_from": 3, "world_to": 2, "joined": [], "left": [2]}
    [change] = d["membership"]
    assert (change["change"], change["nodes_to"], change["left"], change["step"]) == ("shrink", [0, 1], [2], 20)
    assert (d["recovery_s"], d["steps_lost"], d["goodput"]) == (2.0, 10, row["goodput"])
    assert json.loads(json.dumps(d)) == d
    write_json_atomic(run_dir / "nodes" / "released.json", {"time": now, "freed": True})
    assert list_runs(tmp_path, now=now)[0]["allocation"] == {"pool": "embedded", "held": 0, "slots": 3, "released": now}


def test_a_run_before_provision_has_no_allocation_or_goodput(tmp_path):
    run_dir = make_run(tmp_path)
    for p in (run_dir / "nodes").glob("node-*.json"):
        p.unlink()
    [row] = list_runs(tmp_path)
    assert row["allocation"] is None and row["goodput"] is None
    d = run_detail(tmp_path, "default", "train_digits", "manual__1")
    assert d["faults"] == [] and d["membership"] == [] and d["recovery_s"] is None


def test_each_node_shows_its_task_state_host_try_tries_left_and_cordon(tmp_path):
    """What the node task's try marker (``cluster.nodes.NodeTry``) records, and the host
    registry's cordon through the lookup the page is given."""
    from trainflow.cluster.hosts import Cordon

    run_dir = make_run(tmp_path, beats={0: training(5), 1: training(5)})
    write_json_atomic(run_dir / "nodes" / "task-0000.json", {"host": "h0", "try": 1, "run_try": 1, "tries": 3})
    write_json_atomic(run_dir / "nodes" / "task-0001.json", {"host": "h1", "try": 7, "run_try": 2, "tries": 3})
    cordons = {"h1": Cordon("h1", 5.0, "3 failures in 600 s")}
    asked = []

    def task_states(dag_id, run_id):  # Airflow's, as the page reads them: map index → state
        asked.append((dag_id, run_id))
        return {0: "running", 1: "up_for_retry"}

    d = run_detail(tmp_path, "default", "train_digits", "manual__1", cordoned=cordons.get, task_states=task_states)
    assert asked == [("train_digits", "manual__1")]
    rows = {n["node"]: n for n in d["node_agents"]}
    assert (rows[0]["host"], rows[0]["try"], rows[0]["tries_left"], rows[0]["cordoned"]) == ("h0", 1, 2, None)
    assert (rows[1]["host"], rows[1]["try"], rows[1]["tries_left"]) == ("h1", 2, 1)
    assert rows[1]["cordoned"] == {"since": 5.0, "reason": "3 failures in 600 s"}
    assert (rows[0]["task_state"], rows[1]["task_state"]) == ("running", "up_for_retry")
    # without Airflow's states (no lookup given, or it found none) the column is empty
    assert {n["task_state"] for n in run_detail(tmp_path, "default", "train_digits", "manual__1")["node_agents"]} == {
        None
    }


def test_a_gang_that_does_not_train_reads_zero_throughput(tmp_path):
    """Healing (a rank exited, no step since) and stalled runs show 0 samples/s, not their
    ranks' last rates; a stalled rank's own rate reads 0 too."""
    run_dir = make_run(tmp_path, beats={0: training(5), 1: training(5)})
    [row] = list_runs(tmp_path)
    assert row["state"] == RunState.RUNNING.value and row["samples_per_s"] == 200.0
    [row] = list_runs(tmp_path, now=time.time() + 60)
    assert row["state"] == RunState.STALLED.value and row["samples_per_s"] == 0.0
    d = run_detail(tmp_path, "default", "train_digits", "manual__1", now=time.time() + 60)
    assert [r["samples_per_s"] for r in d["ranks"]] == [0.0, 0.0]
    _rank_killed(run_dir)
    [row] = list_runs(tmp_path)
    assert row["state"] == RunState.HEALING.value and row["samples_per_s"] == 0.0
