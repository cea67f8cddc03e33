"""Chaos from outside trainflow, as an operator's bad day brings it: no rehearsal faults in
the spec, only plain signals to processes found by pid and a checkpoint corrupted on disk,
each at a random moment (the seed is printed; ``TRAINFLOW_CHAOS_SEED`` replays one).

Four runs of one conf on the shared stack (a pool of 4: two train while two wait):

- a worker SIGKILLed,
- a worker SIGSTOPped (alive, silent: a hang),
- a node's agent SIGKILLed (the node task sees its agent die),
- the newest checkpoint's bytes corrupted on disk, then a worker SIGKILLed (the resume must
  skip the corrupt checkpoint).

Each run ends with the clean run's weights; its fault is on its books (the goodput's fault
records, with the cause observed, not planned); nothing of its gang is left running.
"""

from __future__ import annotations

import json
import os
import random
import signal
import time
from pathlib import Path

import pytest

from trainflow.checkpoint import manifest
from trainflow.heartbeat import read_all
from trainflow.testing.confs import FAULT_RUN
from trainflow.testing.procs import processes_naming

pytestmark = pytest.mark.e2e
DAG = "train_digits"
CONF = {**FAULT_RUN, "tenant": "outside"}  # the clean reference is shared
FAULTS = ("kill-worker", "stop-worker", "kill-agent", "corrupt-then-kill")


def _gang_processes(run_dir: str) -> list[int]:
    """Pids of the run's gang (agents and workers name the run's plan or workspace)."""
    return processes_naming(str(run_dir))


def _corrupt_newest(run_dir: Path) -> int:
    """Flip bytes in the middle of the newest verified checkpoint's largest file; its step."""
    ref = manifest.newest_verified(run_dir / "checkpoints")
    assert ref is not None
    path = max((p for p in Path(ref.path).rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    with open(path, "r+b") as f:
        f.seek(path.stat().st_size // 2)
        chunk = f.read(64)
        f.seek(path.stat().st_size // 2)
        f.write(bytes(b ^ 0xFF for b in chunk))
    return ref.step


def _apply(fault: str, run_dir: Path, rank: int) -> dict:
    beats = read_all(run_dir / "heartbeats")
    beat = beats[rank]
    if fault == "kill-worker":
        os.kill(beat["pid"], signal.SIGKILL)
    elif fault == "stop-worker":
        os.kill(beat["pid"], signal.SIGSTOP)
    elif fault == "kill-agent":
        node = json.loads((run_dir / "nodes" / f"node-{beat['node']:04d}.json").read_text())
        os.kill(node["pid"], signal.SIGKILL)
    else:
        corrupted = _corrupt_newest(run_dir)
        os.kill(beat["pid"], signal.SIGKILL)
        return {"step": beat["step"], "corrupted_step": corrupted}
    return {"step": beat["step"]}


@pytest.fixture(scope="module")
def clean(reference):
    return reference(CONF)


def test_faults_from_outside_heal_to_the_clean_weights_and_are_on_the_books(client, clean):
    seed = int(os.environ.get("TRAINFLOW_CHAOS_SEED") or time.time())
    rng = random.Random(seed)
    print(f"outside chaos seed {seed}")
    runs = {}
    client.wait_for_dag(DAG, timeout=120)
    client.unpause(DAG)
    for fault in FAULTS:
        run_id = f"outside-{fault}"
        # after the first checkpoint (the corrupt one needs one), well before the end
        runs[run_id] = {"fault": fault, "at": rng.randrange(70, 220), "rank": rng.randrange(2), "done": None}
        client.trigger(DAG, CONF, run_id=run_id)
    deadline = time.time() + 900
    pending = set(runs)
    while pending and time.time() < deadline:
        for run_id in sorted(pending):
            run = runs[run_id]
            states = {t["task_id"]: t["state"] for t in client.task_instances(DAG, run_id)}
            if states.get("provision") != "success":
                continue
            run_dir = Path(client.xcom(DAG, run_id, "provision", "run_dir"))
            beats = read_all(run_dir / "heartbeats")
            if len(beats) == 2 and min(b["step"] for b in beats.values()) >= run["at"]:
                run["done"] = {**_apply(run["fault"], run_dir, run["rank"]), "time": time.time()}
                run["run_dir"] = run_dir
                print(f"{run_id}: {run['fault']} on rank {run['rank']} at step {run['done']['step']}")
                pending.discard(run_id)
            elif client.run(DAG, run_id)["state"] not in ("queued", "running"):
                raise AssertionError(f"{run_id} ended before its fault: {states}")
        time.sleep(0.3)
    assert not pending, f"never reached their fault's moment: {sorted(pending)}"

    books = {}
    for run_id, run in runs.items():
        final = client.wait_run(DAG, run_id, timeout=900)
        tis = {
            (t["task_id"], t["map_index"]): (t["state"], t["try_number"]) for t in client.task_instances(DAG, run_id)
        }
        assert final["state"] == "success", (run_id, tis)
        assert client.xcom(DAG, run_id, "evaluate", "metrics")["weights_sha256"] == clean, run_id
        goodput = client.xcom(DAG, run_id, "evaluate", "goodput")
        books[run_id] = goodput
        restarts = [f for f in goodput["faults"] if f.get("restarts")]
        assert restarts and all("recovery_s" in f for f in restarts), (run_id, goodput["faults"])
        (first, *_) = restarts
        if run["fault"] in ("kill-worker", "corrupt-then-kill"):
            assert first["source"] == "outside" and "ended by SIGKILL" in first["cause"], (run_id, first)
        elif run["fault"] == "stop-worker":
            assert first["kind"] == "stall_detected", (run_id, first)
        else:  # the agent's death: its workers go with it, and its node task says why
            assert first["source"] == "outside" and "agent ended by SIGKILL" in first["cause"], (run_id, first)
            # the gang waits for the node's retry as it recovers, not judged hung meanwhile
            assert not [f for f in goodput["faults"] if f["kind"] == "stall_detected"], (run_id, goodput["faults"])
        assert goodput["goodput"] < 1.0 and first.get("steps_lost") is not None
        if run["fault"] == "corrupt-then-kill":  # not from the checkpoint whose bytes were flipped
            assert first["resumed_from_step"] != run["done"]["corrupted_step"], (run_id, first, run["done"])
        deadline = time.time() + 30
        while _gang_processes(str(run["run_dir"])) and time.time() < deadline:
            time.sleep(0.5)
        assert _gang_processes(str(run["run_dir"])) == [], run_id
    for run_id, goodput in books.items():
        print(f"{run_id}: goodput {goodput['goodput']:.3f}, recovery {goodput['recovery_s']:.1f} s, "
              f"steps lost {goodput['steps_lost']}")  # fmt: skip
