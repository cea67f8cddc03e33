"""trainflow's state database of both kinds: the rendezvous store and backend on SQLite and
on PostgreSQL (the machine's server), the switch, and concurrent atomicity."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import pytest

from trainflow import statedb
from trainflow.cluster.allocator import Allocator
from trainflow.errors import AdmissionError
from trainflow.launch import rdzv_db


def test_the_switch(monkeypatch, tmp_path):
    monkeypatch.delenv("TRAINFLOW_STATE_DB", raising=False)
    monkeypatch.setenv("TRAINFLOW_HOME", str(tmp_path))
    assert statedb.default_target() == str(tmp_path / "state.db")
    monkeypatch.setenv("TRAINFLOW_STATE_DB", "postgresql://tf@db:5432/trainflow")
    assert statedb.is_postgres(statedb.default_target())
    assert statedb.redact("postgresql://tf:s3cret@db/x") == "postgresql://tf:***@db/x"
    assert statedb.redact("postgresql://tf@db/x") == "postgresql://tf@db/x"
    assert rdzv_db.database("postgresql://tf@db/x") == "postgresql://tf@db/x"
    with pytest.raises(ValueError, match="expected sqlite:////absolute/path.db or postgresql://"):
        rdzv_db.database("redis://x")


def test_rendezvous_store_and_backend(state_target):
    from trainflow.launch import rdzv_store  # loads torch: only where a store is used

    db = state_target
    rdzv_db.ensure_schema(db)
    store = rdzv_store.DBStore(db, "run-a", timeout=timedelta(seconds=1))
    other = rdzv_store.DBStore(db, "run-b", timeout=timedelta(seconds=1))
    store.set("k", b"\x00\xffbinary")
    assert store.get("k") == b"\x00\xffbinary"
    assert not other.check(["k"])  # rendezvous ids are isolated
    assert store.add("n", 2) == 2 and store.add("n", 3) == 5
    assert store.compare_set("c", b"", b"one") == b"one"
    assert store.compare_set("c", b"wrong", b"two") == b"one"
    store.multi_set(["a", "b"], [b"1", "2"])
    assert store.multi_get(["a", "b"]) == [b"1", b"2"]
    with pytest.raises(Exception, match=r"keys \['missing'\] not set within 0.2s"):
        store.wait(["missing"], timedelta(seconds=0.2))
    assert store.delete_key("a") and not store.delete_key("a")
    backend = rdzv_store.DBRendezvousBackend(db, "run-a")
    assert backend.get_state() is None
    state, token, written = backend.set_state(b"s1")
    assert (state, written) == (b"s1", True)
    assert backend.set_state(b"s2", token + 7)[2] is False  # a stale fencing token loses
    assert backend.set_state(b"s2", token) == (b"s2", token + 1, True)
    assert rdzv_db.purge(db, "run-a") >= 4
    assert backend.get_state() is None and other.check([]) is True
    assert "answers" in rdzv_db.reachable(rdzv_db.endpoint(db))


def test_concurrent_adds_are_atomic(state_target):
    from trainflow.launch import rdzv_store  # loads torch: only where a store is used

    rdzv_db.ensure_schema(state_target)
    stores = [rdzv_store.DBStore(state_target, "r") for _ in range(4)]
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda s: [s.add("count", 1) for _ in range(25)], stores))
    assert stores[0].get("count") == b"100"


def test_concurrent_admissions_never_overcommit(state_target):
    Allocator(state_target).set_pool("p", 5)

    def admit(i: int) -> int:
        try:
            return Allocator(state_target).admit(f"run-{i}", tenant="t", pool="p", nodes=2, ttl=60).nodes
        except AdmissionError:
            return 0

    with ThreadPoolExecutor(6) as pool:
        granted = list(pool.map(admit, range(6)))
    assert sum(granted) == 4 and granted.count(2) == 2


def test_a_password_in_the_state_url_is_kept_out_of_the_plan(tmp_path, monkeypatch):
    from trainflow.launch.local import prepare
    from trainflow.spec import TrainingSpec

    monkeypatch.setenv("TRAINFLOW_STATE_DB", "postgresql://tf:hunter2@127.0.0.1:5432/trainflow")
    with pytest.raises(ValueError, match=r"carries a password.*PGPASSWORD") as err:
        prepare(TrainingSpec(), tmp_path / "run")
    assert "hunter2" not in str(err.value)


def test_the_profile_switch():
    from trainflow.stack import EmbeddedStack

    assert EmbeddedStack.from_env({}).broker_url == ""
    env = {
        "TRAINFLOW_PROFILE": "distributed",
        "TRAINFLOW_AIRFLOW_DB": "postgresql+psycopg2://p@h/a",
        "TRAINFLOW_BROKER_URL": "redis://h:6379/0",
        "TRAINFLOW_STATE_DB": "postgresql://p@h/t",
    }
    stack = EmbeddedStack.from_env(env)
    assert [w["name"] for w in stack.workers] == ["control", "cpu-1", "cpu-2"]
    assert stack.env()["AIRFLOW__CORE__EXECUTOR"] == "executors.placement.PlacementCeleryExecutor"
    assert stack.env()["AIRFLOW__CELERY__RESULT_BACKEND"] == "db+postgresql+psycopg2://p@h/a"
    assert stack.env()["TRAINFLOW_STATE_DB"] == "postgresql://p@h/t"
    with pytest.raises(ValueError, match="needs TRAINFLOW_BROKER_URL"):
        EmbeddedStack.from_env({k: v for k, v in env.items() if k != "TRAINFLOW_BROKER_URL"})
    with pytest.raises(ValueError, match="TRAINFLOW_PROFILE='cluster'"):
        EmbeddedStack.from_env({"TRAINFLOW_PROFILE": "cluster"})
    with pytest.raises(ValueError, match="workers are Celery workers"):
        EmbeddedStack(workers=({"name": "a", "queues": "cpu"},))


def _open_when_released(path, barrier, out):
    from trainflow.launch.rdzv_db import ensure_schema  # imported by the parent: nothing to load

    try:
        barrier.wait(timeout=30)
        ensure_schema(path)
        out.put(None)
    except Exception as exc:  # noqa: BLE001 - reported to the test
        out.put(f"{type(exc).__name__}: {exc}")


@pytest.mark.integration  # real worker processes
def test_a_gang_opening_a_new_database_together_never_sees_it_locked(tmp_path):
    """Switching a new SQLite database to WAL answers "database is locked" at once (no busy
    timeout) to whoever opens it at the same moment — a gang's agents opening the run's
    rendezvous database. Without the retry ~2% of such openings failed and the node's agent
    died before the rendezvous, leaving its peers waiting out the join timeout."""
    import multiprocessing as mp
    import queue

    # The children fork from a forkserver that loaded what they run once: forked straight
    # from the threaded pytest worker, a child could inherit a lock another thread held and
    # never answer (seen on a loaded machine).
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["trainflow.launch.rdzv_db", "trainflow.statedb"])
    errors = []
    for trial in range(60):
        barrier, out = ctx.Barrier(3), ctx.Queue()
        procs = [
            ctx.Process(target=_open_when_released, args=(tmp_path / f"r{trial}.db", barrier, out)) for _ in range(3)
        ]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=60)
        for p in procs:
            try:
                errors.append(out.get(timeout=5))
            except queue.Empty:
                errors.append(f"trial {trial}: a child never answered (exit codes {[q.exitcode for q in procs]})")
        errors = [e for e in errors if e]
    assert errors == []
