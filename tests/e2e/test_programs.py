"""Users' own training programs through the DAG over REST, on the shared embedded stack, each
as ``program`` in the run's conf: ``examples/ddp_program.py`` (a plain DDP script with
trainflow's SDK), ``examples/hf_program.py`` (Hugging Face ``Trainer``, a tiny GPT-2 built
from its config) and ``examples/lightning_program.py`` (Lightning, ``strategy="ddp"``).

- For each, a clean run and a run one of whose ranks is SIGKILLed from outside
  mid-training train side by side: both succeed, the killed one resumed from a verified
  checkpoint (not from scratch); the plain script ends with the clean run's weights.
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
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
# Each program: its argv (checkpoints every ``every`` steps), its steps, and whether an
# interrupted run must end with the clean run's very weights (the plain script's promise).
PROGRAMS = {
    "plain-ddp": (
        ["python", str(EXAMPLES / "ddp_program.py"), "--steps", "3000", "--every", "300", "--resume", "{resume_from}"],
        3000,
        300,
        True,
    ),
    "hf-trainer": (["python", str(EXAMPLES / "hf_program.py"), "--steps", "300", "--save-steps", "50"], 300, 50, False),
    "lightning": (
        ["python", str(EXAMPLES / "lightning_program.py"), "--steps", "600", "--every", "100"],
        600,
        100,
        False,
    ),
}


def _conf(name: str, tenant: str) -> dict:
    program, steps, every, _ = PROGRAMS[name]
    return {
        "tenant": tenant,
        "steps": steps,
        "checkpoint_interval": every,
        "keep_last": 2,
        "heartbeat_interval": 0.5,
        "heartbeat_timeout": 60.0,
        "program": program,
    }


@pytest.mark.parametrize("name", list(PROGRAMS))
def test_a_program_trains_over_rest_and_heals_a_rank_killed_from_outside(client, name):
    """A clean run and a run whose rank 1 is SIGKILLed (a plain signal to the program's own
    process) once a checkpoint verified, side by side: both succeed; the killed one resumed
    from a verified checkpoint, not from scratch, and the fault is on its books."""
    _, steps, _, exact = PROGRAMS[name]
    clean_id, kill_id = f"{name}-clean", f"{name}-kill"
    client.wait_for_dag(DAG, timeout=180)
    client.unpause(DAG)
    client.trigger(DAG, _conf(name, clean_id), run_id=clean_id)
    client.trigger(DAG, _conf(name, kill_id), run_id=kill_id)
    run_dir = None
    killed = None
    deadline = time.time() + 600
    while time.time() < deadline and killed is None:
        states = {t["task_id"]: t["state"] for t in client.task_instances(DAG, kill_id)}
        if run_dir is None and states.get("provision") == "success":
            run_dir = Path(client.xcom(DAG, kill_id, "provision", "run_dir"))
        if run_dir is not None:
            ref = manifest.newest_verified(run_dir / "checkpoints")
            beat = read_all(run_dir / "heartbeats").get(1)
            if ref is not None and beat and beat["state"] == "training" and steps > beat["step"] > ref.step:
                os.kill(beat["pid"], signal.SIGKILL)
                killed = ref.step
        assert client.run(DAG, kill_id)["state"] in ("queued", "running"), "the run ended before the kill"
        time.sleep(0.05)
    assert killed is not None, "no checkpoint verified while rank 1 trained"
    for run_id in (clean_id, kill_id):
        run = client.wait_run(DAG, run_id, timeout=600)
        states = {
            (t["task_id"], t["map_index"]): (t["state"], t["try_number"]) for t in client.task_instances(DAG, run_id)
        }
        assert run["state"] == "success", (run_id, states)
    clean = client.xcom(DAG, clean_id, "evaluate", "metrics")
    healed = client.xcom(DAG, kill_id, "evaluate", "metrics")
    assert clean["step"] == healed["step"] == steps and "loss" in healed
    if exact:
        assert healed["weights_sha256"] == clean["weights_sha256"]
    events = read(run_dir)
    starts = [e for e in events if e["event"] == "gang_start"]
    assert len(starts) >= 2 and starts[-1]["step"] >= killed > 0  # resumed, not from scratch
    assert any(e["event"] == "worker_exited" and e["signal"] == "SIGKILL" for e in events)
    assert client.xcom(DAG, kill_id, "checkpoint_sync", "checkpoint")["step"] == steps


def test_a_program_outside_the_allowed_roots_fails_provision_naming_it(client, stack, tmp_path):
    script = tmp_path / "train.py"
    script.write_text("print('never runs')\n")
    client.unpause(DAG)
    conf = {**_conf("plain-ddp", "prog-bad"), "program": ["python", str(script)]}
    client.trigger(DAG, conf, run_id="prog-bad")
    run = client.wait_run(DAG, "prog-bad", timeout=180)
    assert run["state"] == "failed"
    tis = {t["task_id"]: t for t in client.task_instances(DAG, "prog-bad") if t["map_index"] == -1}
    assert tis["provision"]["state"] == "failed" and tis["provision"]["try_number"] == 1
    log = client.task_log(DAG, "prog-bad", "provision", 1)
    assert "invalid program[1]=" in log and "TRAINFLOW_PROGRAM_ROOTS" in log
    assert not (stack.trainflow_home / "runs" / "prog-bad").exists()
    assert not any(
        lease.run_key.startswith("prog-bad/") for lease in Allocator(stack.trainflow_home / "state.db").leases()
    )
