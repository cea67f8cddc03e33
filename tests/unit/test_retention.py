"""Retention: what goes, what stays, and that nothing outside the roots is touched."""

from __future__ import annotations

import json
import os
import time
from datetime import datetime, timezone

import pytest

from trainflow import retention as ret
from trainflow.cli import main
from trainflow.errors import SpecError

NOW = 1_900_000_000.0
DAY = ret.DAY


def _age(path, days):
    """Set ``path`` and everything under it to ``days`` before NOW."""
    t = NOW - days * DAY
    for p in [path, *path.rglob("*")] if path.is_dir() else [path]:
        os.utime(p, (t, t), follow_symlinks=False)


def _run(root, tenant, dag, run, *, released_days=None, written_days=0.0, size=100):
    d = root / tenant / dag / run
    (d / "checkpoints" / "step-00000010").mkdir(parents=True)
    (d / "checkpoints" / "step-00000010" / "shard.bin").write_bytes(b"x" * size)
    (d / "nodes").mkdir()
    _age(d, written_days)
    if released_days is not None:
        (d / "nodes" / "released.json").write_text("{}")
        _age(d / "nodes" / "released.json", released_days)
    return d


def test_policy_from_env_names_the_variable_and_checks_bounds():
    p = ret.Retention.from_env({"TRAINFLOW_RETAIN_WORKSPACE_DAYS": "2", "TRAINFLOW_LOG_MAX_BYTES": "8192"})
    assert (p.workspace_days, p.log_max_bytes, p.abandoned_days) == (2.0, 8192, 30.0)
    assert ret.Retention.from_env({}, workspace_days=0.5).workspace_days == 0.5
    with pytest.raises(SpecError, match="TRAINFLOW_RETAIN_LOG_DAYS='two'"):
        ret.Retention.from_env({"TRAINFLOW_RETAIN_LOG_DAYS": "two"})
    with pytest.raises(SpecError, match=r"retention.workspace_days=-1"):
        ret.Retention(workspace_days=-1)
    with pytest.raises(SpecError, match="must be >= workspace_days"):
        ret.Retention(workspace_days=40)
    with pytest.raises(SpecError, match="log_max_bytes"):
        ret.Retention(log_max_bytes=10)


def test_released_runs_go_after_their_days_unfinished_ones_only_when_abandoned(tmp_path):
    root = tmp_path / "runs"
    old = _run(root, "acme", "train_digits", "old", released_days=8, written_days=8)
    fresh = _run(root, "acme", "train_digits", "fresh", released_days=1, written_days=1)
    live = _run(root, "acme", "train_digits", "live", written_days=40)
    (live / "heartbeats").mkdir()
    (live / "heartbeats" / "rank-0.json").write_text("{}")  # written just now: alive
    _age(live / "heartbeats" / "rank-0.json", 0.01)
    abandoned = _run(root, "zeta", "train_tinylm", "crashed", written_days=31)
    policy = ret.Retention()

    dry = ret.prune_workspaces(root, policy, now=NOW, dry_run=True)
    assert {(r["path"], r["why"]) for r in dry} == {(str(old), "released"), (str(abandoned), "abandoned")}
    assert old.exists() and abandoned.exists()

    gone = ret.prune_workspaces(root, policy, now=NOW)
    assert sorted(r["path"] for r in gone) == sorted([str(old), str(abandoned)])
    assert {r["path"]: r["bytes"] for r in gone} == {str(old): 102, str(abandoned): 100}  # + released.json
    assert not old.exists() and not abandoned.exists()
    assert fresh.exists() and live.exists()
    assert not (root / "zeta").exists()  # its only run went: the empty tenant folder too
    assert ret.prune_workspaces(root, policy, now=NOW) == []


def test_links_are_never_followed_out_of_the_root(tmp_path):
    root = tmp_path / "runs"
    outside = tmp_path / "precious"
    (outside / "nodes").mkdir(parents=True)
    (outside / "nodes" / "released.json").write_text("{}")
    _age(outside, 100)
    (root / "acme" / "dag").mkdir(parents=True)
    (root / "acme" / "dag" / "evil").symlink_to(outside, target_is_directory=True)
    (root / "mallory").symlink_to(outside, target_is_directory=True)
    assert ret.prune_workspaces(root, ret.Retention(), now=NOW) == []
    assert (outside / "nodes" / "released.json").exists()


def test_old_task_logs_go_component_logs_stay(tmp_path):
    logs = tmp_path / "logs"
    task_log = logs / "dag_id=train_digits" / "run_id=r1" / "task_id=provision" / "attempt=1.log"
    task_log.parent.mkdir(parents=True)
    task_log.write_text("old\n")
    _age(task_log, 20)
    new_log = logs / "dag_id=train_digits" / "run_id=r2" / "task_id=provision" / "attempt=1.log"
    new_log.parent.mkdir(parents=True)
    new_log.write_text("new\n")
    _age(new_log, 1)
    component = logs / "scheduler.log"
    component.write_text("component\n")
    _age(component, 100)
    out = ret.prune_logs(logs, ret.Retention(), now=NOW)
    assert out == {"files": 1, "bytes": 4}
    assert not (logs / "dag_id=train_digits" / "run_id=r1").exists()  # emptied folders removed
    assert new_log.exists() and component.exists()


def test_rotation_copies_truncates_and_the_open_writer_goes_on(tmp_path):
    log = tmp_path / "scheduler.log"
    writer = open(log, "ab", buffering=0)  # as the stack opens a component's log
    try:
        for part in range(4):
            writer.write(f"part {part} ".encode() + b"x" * 5000)
            assert ret.rotate(log, max_bytes=4096, keep=2)
        writer.write(b"after")
        assert log.read_bytes() == b"after"  # appended at the new end, no hole before it
        assert (tmp_path / "scheduler.log.1").read_bytes().startswith(b"part 3 ")
        assert (tmp_path / "scheduler.log.2").read_bytes().startswith(b"part 2 ")
        assert not (tmp_path / "scheduler.log.3").exists()  # beyond keep: dropped
        assert not ret.rotate(log, max_bytes=4096, keep=2)  # small: left alone
    finally:
        writer.close()
    rotated = ret.rotate_component_logs(tmp_path, ret.Retention(log_max_bytes=4096))
    assert rotated == []


def test_stale_rows_go_live_ones_stay(state_target):
    from trainflow.cluster.allocator import Allocator
    from trainflow.cluster.hosts import CordonPolicy, HostRegistry

    alloc, hosts = Allocator(state_target), HostRegistry(state_target)
    alloc.set_pool("p", 4)
    # A wait nobody renews (its requester is gone) leaves its estimate behind; a live wait
    # and a live preemptible lease keep theirs.
    alloc.request("t/d/pre", tenant="t", pool="p", nodes=1, ttl=3600, preemptible=True, estimate=10, now=NOW - 700)
    alloc.request("t/d/gone", tenant="t", pool="p", nodes=4, ttl=60, estimate=99, now=NOW - 600)
    alloc.request("t/d/waits", tenant="t", pool="p", nodes=4, ttl=60, estimate=50, now=NOW - 5)
    alloc.admit("t/d/live", tenant="t", pool="p", nodes=1, ttl=3600, now=NOW)
    alloc.admit("t/d/dead", tenant="t", pool="p", nodes=1, ttl=60, now=NOW - 7200)
    alloc.lose_node("t/d/live", until=NOW - 1, reason="host gone")
    hosts.register("h9", queue="cpu", family="cpu", devices=1, pool="hp")  # a pool of hosts
    assert alloc.admit("t/d/gone", tenant="t", pool="hp", nodes=1, ttl=60, now=NOW - 7200).hosts == ("h9",)
    policy = CordonPolicy(failures=99, window_s=3600.0)
    hosts.record_failure("h1", reason="old", run_key="t/d/x", node=0, policy=policy, now=NOW - 8 * DAY)
    hosts.record_failure("h1", reason="new", run_key="t/d/y", node=0, policy=policy, now=NOW - 60)
    assert ret.state_rows(state_target)["host_failures"] == 2
    out = ret.prune_state(state_target, ret.Retention(), now=NOW)
    assert out == {
        "leases": 2,
        "offline": 1,
        "waiting": 0,
        "estimates": 1,
        "preemptible": 0,
        "preemptions": 0,
        "host_leases": 1,
        "host_failures": 1,
    }
    rows = ret.state_rows(state_target)
    assert (rows["leases"], rows["offline"], rows["host_failures"], rows["pools"]) == (2, 0, 1, 1)
    assert (rows["estimates"], rows["preemptible"], rows["waiting"]) == (2, 1, 1)


def test_db_clean_argv_cuts_at_the_bound():
    argv = ret.db_clean_argv(ret.Retention(airflow_days=30), now=NOW, airflow="/venv/bin/airflow")
    cutoff = datetime.fromtimestamp(NOW - 30 * DAY, tz=timezone.utc).isoformat(timespec="seconds")
    assert argv == [
        "/venv/bin/airflow",
        "db",
        "clean",
        "--clean-before-timestamp",
        cutoff,
        "--tables",
        ",".join(ret.AIRFLOW_TABLES),
        "--skip-archive",
        "--yes",
        "--error-on-cleanup-failure",
    ]
    assert "dag" not in ret.AIRFLOW_TABLES and "dag_run" in ret.AIRFLOW_TABLES
    assert ret.db_clean_argv(ret.Retention(), now=NOW, dry_run=True)[-1] == "--dry-run"


def test_cli_sweeps_and_reports(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TRAINFLOW_STATE_DB", str(tmp_path / "state.db"))
    root = tmp_path / "runs"
    now = time.time()
    old = _run(root, "acme", "d", "r1", released_days=(NOW - now) / DAY + 3)  # released 3 days ago
    assert (
        main(
            [
                "retention",
                "--workspaces",
                str(root),
                "--logs",
                str(tmp_path / "nologs"),
                "--workspace-days",
                "5",
                "--dry-run",
            ]
        )
        == 0
    )
    out = json.loads(capsys.readouterr().out)
    assert out["dry_run"] and out["workspaces"]["removed"] == 0 and old.exists()
    assert main(["retention", "--workspaces", str(root), "--workspace-days", "2"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["workspaces"] == {"removed": 1, "bytes": 102, "runs": [str(old)]}
    assert out["policy"]["workspace_days"] == 2 and not old.exists()
    assert main(["retention", "--workspaces", str(root), "--workspace-days", "-1"]) == 2
    assert "retention.workspace_days=-1.0" in capsys.readouterr().err


def test_runs_in_flight_bound_the_metadata_cut(tmp_path):
    """The cut never passes the oldest running DAG run's start (read from Airflow's metadata
    database as SQLite stores it: naive UTC text)."""
    import sqlite3

    db = tmp_path / "airflow.db"
    con = sqlite3.connect(db)
    con.execute("CREATE TABLE dag_run (id INTEGER PRIMARY KEY, state TEXT, start_date TIMESTAMP, end_date TIMESTAMP)")
    url = f"sqlite:///{db}"
    assert ret.running_since(url) is None

    def at(days):
        return datetime.fromtimestamp(NOW - days * DAY, tz=timezone.utc).replace(tzinfo=None).isoformat(sep=" ")

    con.executemany(
        "INSERT INTO dag_run (state, start_date, end_date) VALUES (?, ?, ?)",
        [("running", at(40), None), ("success", at(90), at(89)), ("queued", None, None)],
    )
    con.commit()
    assert ret.running_since(url) == NOW - 40 * DAY  # the finished older run does not count
    assert ret.running_since(url, ended_after=NOW - 30 * DAY) == NOW - 40 * DAY
    # A run that started long ago but ended within the bound is kept for the bound after it ended.
    con.execute("INSERT INTO dag_run (state, start_date, end_date) VALUES (?, ?, ?)", ("failed", at(50), at(10)))
    con.commit()
    assert ret.running_since(url, ended_after=NOW - 30 * DAY) == NOW - 50 * DAY
    assert ret.running_since(url) == NOW - 40 * DAY
    argv = ret.db_clean_argv(ret.Retention(airflow_days=30), now=NOW, keep_after=ret.running_since(url) - 1)
    cut = datetime.fromisoformat(argv[argv.index("--clean-before-timestamp") + 1]).timestamp()
    assert cut == NOW - 40 * DAY - 1  # the 40-day run keeps its rows
    argv = ret.db_clean_argv(ret.Retention(airflow_days=30), now=NOW, keep_after=NOW)
    assert argv[argv.index("--clean-before-timestamp") + 1] == datetime.fromtimestamp(
        NOW - 30 * DAY, tz=timezone.utc
    ).isoformat(timespec="seconds")


def test_clean_airflow_db_hands_the_url_and_the_bound_to_airflow(tmp_path):
    """The subprocess gets the database it is to clean and a cut before the oldest running
    run's start and before ``keep_after``, whichever is earlier (a stand-in ``airflow`` that
    records what it was given: the real command is exercised on the stack, e2e)."""
    import sqlite3

    db = tmp_path / "airflow.db"
    con = sqlite3.connect(db)
    con.execute("CREATE TABLE dag_run (id INTEGER PRIMARY KEY, state TEXT, start_date TIMESTAMP, end_date TIMESTAMP)")
    started = datetime.fromtimestamp(NOW - 40 * DAY, tz=timezone.utc)
    con.execute(
        "INSERT INTO dag_run (state, start_date) VALUES ('running', ?)",
        (started.replace(tzinfo=None).isoformat(sep=" "),),
    )
    con.commit()
    fake = tmp_path / "airflow"
    fake.write_text(f'#!/bin/sh\necho "$AIRFLOW__DATABASE__SQL_ALCHEMY_CONN $*" > {tmp_path}/called\nexit 3\n')
    fake.chmod(0o755)
    url = f"sqlite:///{db}"
    done = ret.clean_airflow_db(ret.Retention(airflow_days=30), url, airflow=str(fake), now=NOW)
    assert done["exit_code"] == 3
    called = (tmp_path / "called").read_text()
    assert called.startswith(url + " db clean --clean-before-timestamp ")
    assert done["before"] == datetime.fromtimestamp(NOW - 40 * DAY - 1, tz=timezone.utc).isoformat(timespec="seconds")
    done = ret.clean_airflow_db(
        ret.Retention(airflow_days=30), url, airflow=str(fake), now=NOW, keep_after=NOW - 50 * DAY
    )
    assert done["before"] == datetime.fromtimestamp(NOW - 50 * DAY, tz=timezone.utc).isoformat(timespec="seconds")


def test_the_metadata_cut_never_comes_closer_to_now_than_the_minimum_age():
    """A zero-day bound must not cut the live components' `job` rows (by last heartbeat):
    a scheduler whose row is gone crashes on its next heartbeat."""
    argv = ret.db_clean_argv(ret.Retention(airflow_days=0), now=NOW)
    cut = datetime.fromisoformat(argv[argv.index("--clean-before-timestamp") + 1]).timestamp()
    assert cut == NOW - ret.AIRFLOW_MIN_AGE_S
