"""A user's own training program through the DAG over REST, on the shared embedded stack:
``examples/ddp_program.py`` (a plain DDP script with trainflow's SDK) as ``program`` in the
run's conf.

- A clean run and a run one of whose ranks is SIGKILLed from outside mid-training train
  side by side: both succeed, the killed one resumed from a verified checkpoint (not from
  scratch) and ends with the clean run's weights; the fault is on its books.
- A program outside the allowed roots fails provision naming the field, with nothing
  allocated.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from trainflow.checkpoint import manifest
from trainflow.cluster.allocator import Allocator
from trainflow.heartbeat import read_all
from trainflow.timeline import read

pytestmark = pytest.mark.e2e
DAG = "train_digits"
EXAMPLE = str(Path(__file__).resolve().parents[2] / "examples" / "ddp_program.py")
STEPS, EVERY = 3000, 300


def _conf(tenant: str) -> dict:
    return {"tenant": tenant, "steps": STEPS, "checkpoint_interval": EVERY, "keep_last": 2,
            "heartbeat_interval": 0.5, "heartbeat_timeout": 30.0,
            "program": ["python", EXAMPLE, "--steps", str(STEPS), "--every", str(EVERY), "--resume", "{resume_from}"]}


def test_a_program_trains_over_rest_and_heals_a_rank_killed_from_outside(client):
    client.wait_for_dag(DAG, timeout=180)
    client.unpause(DAG)
    client.trigger(DAG, _conf("prog-clean"), run_id="prog-clean")
    client.trigger(DAG, _conf("prog-kill"), run_id="prog-kill")
    run_dir = None
    killed = None
    deadline = time.time() + 600
    while time.time() < deadline and killed is None:
        states = {t["task_id"]: t["state"] for t in client.task_instances(DAG, "prog-kill")}
        if run_dir is None and states.get("provision") == "success":
            run_dir = Path(client.xcom(DAG, "prog-kill", "provision", "run_dir"))
        if run_dir is not None:
            ref = manifest.newest_verified(run_dir / "checkpoints")
            beat = read_all(run_dir / "heartbeats").get(1)
            if ref is not None and beat and beat["state"] == "training" and STEPS > beat["step"] > ref.step:
                os.kill(beat["pid"], signal.SIGKILL)  # the program's own process: a plain signal
                killed = ref.step
        assert client.run(DAG, "prog-kill")["state"] in ("queued", "running"), "the run ended before the kill"
        time.sleep(0.05)
    assert killed is not None, "no checkpoint verified while rank 1 trained"
    for run_id in ("prog-clean", "prog-kill"):
        run = client.wait_run(DAG, run_id, timeout=600)
        states = {(t["task_id"], t["map_index"]): (t["state"], t["try_number"])
                  for t in client.task_instances(DAG, run_id)}
        assert run["state"] == "success", (run_id, states)
    clean = client.xcom(DAG, "prog-clean", "evaluate", "metrics")
    healed = client.xcom(DAG, "prog-kill", "evaluate", "metrics")
    assert clean["step"] == healed["step"] == STEPS and clean["loss"] < 0.5
    assert healed["weights_sha256"] == clean["weights_sha256"]
    events = read(run_dir)
    starts = [e for e in events if e["event"] == "gang_start"]
    assert len(starts) >= 2 and starts[-1]["step"] >= killed > 0  # resumed, not from scratch
    assert any(e["event"] == "worker_exited" and e["signal"] == "SIGKILL" for e in events)
    pointer = client.xcom(DAG, "prog-kill", "checkpoint_sync", "checkpoint")
    assert pointer["step"] == STEPS


def test_a_program_outside_the_allowed_roots_fails_provision_naming_it(client, stack, tmp_path):
    script = tmp_path / "train.py"
    script.write_text("print('never runs')\n")
    client.unpause(DAG)
    conf = {**_conf("prog-bad"), "program": ["python", str(script)]}
    client.trigger(DAG, conf, run_id="prog-bad")
    run = client.wait_run(DAG, "prog-bad", timeout=180)
    assert run["state"] == "failed"
    tis = {t["task_id"]: t for t in client.task_instances(DAG, "prog-bad") if t["map_index"] == -1}
    assert tis["provision"]["state"] == "failed" and tis["provision"]["try_number"] == 1
    log = client.task_log(DAG, "prog-bad", "provision", 1)
    assert "invalid program[1]=" in log and "TRAINFLOW_PROGRAM_ROOTS" in log
    assert not (stack.trainflow_home / "runs" / "prog-bad").exists()
    assert not any(lease.run_key.startswith("prog-bad/") for lease in Allocator(stack.trainflow_home / "state.db").leases())
