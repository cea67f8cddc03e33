"""Injected faults on real gangs (no Airflow): the run heals itself and ends with the
same weights as a clean run; a user bug aborts at once."""

from __future__ import annotations

import json
import time

import pytest

from trainflow.launch.local import run_local
from trainflow.spec import TrainingSpec
from trainflow.timeline import read as read_timeline
from trainflow.worker.evaluate import evaluate

BASE = dict(workload="digits", nodes=2, steps=400, batch_size=16, checkpoint_interval=20, keep_last=3, seed=5)


@pytest.fixture(scope="module")
def clean_digest(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("clean")
    assert run_local(TrainingSpec(**BASE), run_dir) == [0, 0]
    return evaluate(run_dir)["weights_sha256"]


def _events(run_dir, name):
    return [e for e in read_timeline(run_dir) if e["event"] == name]


def test_killed_rank_restarts_in_node_and_ends_bit_identical(tmp_path, clean_digest):
    spec = TrainingSpec(**BASE, faults=[{"kind": "kill_rank", "rank": 1, "step": 250}])
    assert run_local(spec, tmp_path) == [0, 0]  # healed inside the agents: no task failed
    assert evaluate(tmp_path)["weights_sha256"] == clean_digest
    (fault,) = _events(tmp_path, "fault_injected")
    resumed = _events(tmp_path, "resumed")
    assert fault["kind"] == "kill_rank" and fault["step"] == 250
    # The gang resumed from the newest checkpoint committed by then. Saves are asynchronous,
    # one in flight at a time: the one started at step 240 may not have committed when rank 1
    # died (a loaded machine), and then 220 is the newest; lost work stays under two intervals.
    committed = [e["step"] for e in _events(tmp_path, "checkpoint_committed") if e["time"] <= resumed[-1]["time"]]
    assert resumed and resumed[-1]["step"] == max(committed) in (220, 240)
    assert 0 <= fault["step"] - 1 - resumed[-1]["step"] < 2 * spec.checkpoint_interval


def test_corrupt_newest_checkpoint_is_skipped_on_resume(tmp_path, clean_digest):
    spec = TrainingSpec(**BASE, faults=[{"kind": "corrupt_checkpoint", "rank": 0, "step": 200}])
    assert run_local(spec, tmp_path) == [0, 0]
    assert evaluate(tmp_path)["weights_sha256"] == clean_digest
    resumed = _events(tmp_path, "resumed")
    assert resumed and resumed[0]["step"] == 180  # step 200 was corrupt: the previous one is used


def test_user_bug_aborts_the_run_without_restarts(tmp_path):
    spec = TrainingSpec(**BASE, faults=[{"kind": "raise", "rank": 1, "step": 30}])
    t0 = time.time()
    codes = run_local(spec, tmp_path)
    assert time.time() - t0 < 60
    assert set(codes) <= {3} and codes
    abort = json.loads((tmp_path / "ABORT").read_text())
    assert abort["rank"] == 1 and abort["kind"] == "user" and abort["type"] == "ValueError"
    assert "injected user bug at step 30" in abort["message"]
    assert "Traceback" in abort["traceback"]
    assert not _events(tmp_path, "resumed")


def test_crash_loop_stops_with_a_clear_error(tmp_path):
    spec = TrainingSpec(**{**BASE, "crash_loop_limit": 2}, faults=[{"kind": "crash_rank", "rank": 1, "step": 30}])
    codes = run_local(spec, tmp_path)
    assert codes and set(codes) == {3}
    abort = json.loads((tmp_path / "ABORT").read_text())
    assert abort["kind"] == "crash_loop" and "restarted 2 times from step 20" in abort["message"]
    starts = [e["step"] for e in _events(tmp_path, "gang_start")]
    assert starts == [0, 20, 20, 20]


def test_slow_rank_shows_as_straggler_in_its_heartbeats(tmp_path, clean_digest):
    from trainflow.heartbeat import RankState, find_stragglers, read_all

    spec = TrainingSpec(**BASE, faults=[{"kind": "slow_rank", "rank": 1, "step": 10}])
    assert run_local(spec, tmp_path) == [0, 0]
    beats = read_all(tmp_path / "heartbeats")
    for b in beats.values():  # the last heartbeat while training carries the compute time
        b["state"] = RankState.TRAINING.value
    (s,) = find_stragglers(beats, margin=spec.straggler_margin)
    assert s["rank"] == 1 and s["slower_by"] > 1.0
    assert evaluate(tmp_path)["weights_sha256"] == clean_digest  # slow, not wrong


LONG = {**BASE, "steps": 1500}


@pytest.fixture(scope="module")
def clean_long_digest(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("clean-long")
    assert run_local(TrainingSpec(**LONG), run_dir) == [0, 0]
    return evaluate(run_dir)["weights_sha256"]


def _start_training(run_dir):
    """A 2-node gang of ``LONG`` under way (past step 100); returns its agents."""
    from trainflow.heartbeat import read_all
    from trainflow.launch.local import prepare, start_agents

    procs = start_agents(prepare(TrainingSpec(**LONG), run_dir), 2, log_dir=run_dir / "logs")
    deadline = time.time() + 120
    while time.time() < deadline:
        beats = read_all(run_dir / "heartbeats")
        if len(beats) == 2 and min(b["step"] for b in beats.values()) > 100:
            break
        time.sleep(0.1)
    return procs


def test_chaos_command_kills_a_running_rank_and_the_run_heals(tmp_path, clean_long_digest):
    from trainflow.cli import chaos

    procs = _start_training(tmp_path)
    hit = chaos(tmp_path, "kill_rank", 1)
    assert hit["rank"] == 1 and hit["step"] > 100
    assert [p.wait(timeout=300) for p in procs] == [0, 0]
    (fault,) = _events(tmp_path, "fault_injected")
    assert fault["source"] == "chaos" and fault["kind"] == "kill_rank"
    assert _events(tmp_path, "resumed")
    assert evaluate(tmp_path)["weights_sha256"] == clean_long_digest


def test_a_worker_killed_from_outside_is_counted_as_a_fault(tmp_path, clean_long_digest):
    """A plain SIGKILL to a worker's pid (not trainflow's injector): the gang heals to the
    clean weights and the books count the fault: its cause, its recovery, the steps redone."""
    import os
    import signal

    from trainflow.goodput import summarize
    from trainflow.heartbeat import read_all

    procs = _start_training(tmp_path)
    beat = read_all(tmp_path / "heartbeats")[1]
    os.kill(int(beat["pid"]), signal.SIGKILL)
    assert [p.wait(timeout=300) for p in procs] == [0, 0]
    assert evaluate(tmp_path)["weights_sha256"] == clean_long_digest
    assert not _events(tmp_path, "fault_injected")
    exits = _events(tmp_path, "worker_exited")  # rank 0's broken collective may be seen first
    (exited,) = [e for e in exits if e["rank"] == 1]
    others = [e for e in exits if e is not exited]
    assert exited["signal"] == "SIGKILL" and exited["step"] >= beat["step"], exits
    events = read_timeline(tmp_path)
    books = summarize(tmp_path, started=events[0]["time"], ended=events[-1]["time"], steps=LONG["steps"])
    (fault,) = books["faults"]
    assert (fault["kind"], fault["source"], fault["cause"]) == ("worker_exit", "outside", "rank 1 ended by SIGKILL")
    assert fault["recovery_s"] > 0 and fault["resumed_from_step"] <= fault["step"]
    assert fault["exits"] == 1 + len(others)  # the peers' exits follow from it: one fault
    assert books["goodput"] < 1.0


@pytest.fixture
def small_checkpoint_fs(tmp_path):
    """The run's checkpoint directory on its own 16 MiB tmpfs: a disk that really fills."""
    import subprocess

    ckpt = tmp_path / "run" / "checkpoints"
    ckpt.mkdir(parents=True)
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(ckpt)], capture_output=True, text=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {mounted.stderr.strip()}")
    yield tmp_path / "run"
    subprocess.run(["umount", "-l", str(ckpt)], check=False)


def test_full_checkpoint_disk_fails_the_save_and_keeps_the_previous_checkpoint(small_checkpoint_fs, clean_digest):
    from trainflow.checkpoint.manifest import newest_verified

    run_dir = small_checkpoint_fs
    # The disk fills at step 90: the save of step 100 hits ENOSPC. Rank 0 is then killed
    # at step 110, so the gang must resume from step 80, the newest checkpoint intact.
    spec = TrainingSpec(
        **BASE, faults=[{"kind": "fill_disk", "rank": 1, "step": 90}, {"kind": "kill_rank", "rank": 0, "step": 110}]
    )
    assert run_local(spec, run_dir) == [0, 0]
    failed = _events(run_dir, "checkpoint_failed")
    assert failed and {e["step"] for e in failed} == {100}
    assert any("No space left on device" in e["error"] or "ENOSPC" in e["error"] for e in failed)
    (released,) = _events(run_dir, "disk_released")
    assert released["save_ok"] is False and released["bytes"] > 1 << 20
    resumed = _events(run_dir, "resumed")
    assert [e["step"] for e in resumed] == [80]
    assert newest_verified(run_dir / "checkpoints").step == spec.steps
    assert evaluate(run_dir)["weights_sha256"] == clean_digest
