"""The user's own training program (``program`` in the spec) under trainflow's node agents,
real torch.distributed (gloo), no Airflow: ``examples/ddp_program.py``, a plain DDP script
with trainflow's SDK.

- A clean run seals every checkpoint the program commits (manifest verified), and the
  program's ranks get the launch contract.
- A rank SIGKILLed from outside (not trainflow's injector) mid-training: the gang restarts
  together, resumes from the newest verified checkpoint (not from scratch) and ends with
  the clean run's checkpoint bytes.
- A program that exits 0 short of the spec's steps fails the run, with that message.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from trainflow.checkpoint import manifest
from trainflow.heartbeat import read_all
from trainflow.launch.local import kill_tree, prepare, run_local, start_agents
from trainflow.remediation import aborted
from trainflow.spec import TrainingSpec
from trainflow.timeline import read
from trainflow.worker.evaluate import evaluate

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = str(REPO / "examples" / "ddp_program.py")
STEPS, EVERY = 2400, 300


def _spec(steps: int = STEPS, program_steps: int | None = None, **kw) -> TrainingSpec:
    return TrainingSpec(nodes=2, steps=steps, checkpoint_interval=EVERY, keep_last=2, heartbeat_interval=0.5,
                        program=["python", EXAMPLE, "--steps", str(program_steps or steps), "--every", str(EVERY),
                                 "--resume", "{resume_from}"], **kw)


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("program") / "clean"
    assert run_local(_spec(), run_dir) == [0, 0]
    return run_dir


def test_a_program_runs_with_the_contract_and_its_checkpoints_are_sealed(clean):
    steps = [s for s, _ in manifest.list_checkpoints(clean / "checkpoints")]
    assert steps == [STEPS, STEPS - EVERY]  # keep_last=2 of the program's eight commits
    ref = manifest.newest_verified(clean / "checkpoints", training_hash=_spec().training_hash())
    assert ref is not None and ref.step == STEPS and ref.world_size == 2
    events = read(clean)
    assert [e["step"] for e in events if e["event"] == "checkpoint_committed"] == list(range(EVERY, STEPS + 1, EVERY))
    assert [e["attempt"] for e in events if e["event"] == "gang_start"] == [0]
    assert json.loads((clean / "control" / "complete.json").read_text())["program"] is True
    beats = read_all(clean / "heartbeats")
    assert sorted(beats) == [0, 1] and all(b["state"] == "done" and b["step"] == STEPS for b in beats.values())
    result = evaluate(clean)
    assert result["program"] and result["step"] == STEPS and result["metrics"]["loss"] < 0.5


def test_a_rank_killed_from_outside_resumes_from_a_verified_checkpoint_bit_identical(clean, tmp_path):
    spec = _spec()
    run_dir = tmp_path / "killed"
    procs = start_agents(prepare(spec, run_dir), spec.nodes, log_dir=run_dir / "logs")
    killed = None
    try:
        deadline = time.time() + 300
        while time.time() < deadline and killed is None:
            ref = manifest.newest_verified(run_dir / "checkpoints")
            beat = read_all(run_dir / "heartbeats").get(1)
            if ref is not None and beat and beat["state"] == "training" and beat["step"] > ref.step:
                os.kill(beat["pid"], signal.SIGKILL)  # a plain signal, as an OOM killer or a user sends
                killed = ref.step
            time.sleep(0.01)
        assert killed is not None, "no checkpoint before the program ended"
        assert [p.wait(timeout=300) for p in procs] == [0, 0]
    finally:
        for p in procs:
            if p.poll() is None:
                kill_tree(p)
    assert 0 < killed < STEPS
    events = read(run_dir)
    starts = [e for e in events if e["event"] == "gang_start"]
    assert [e["attempt"] for e in starts] == [0, 1] and starts[1]["step"] >= killed > 0
    exits = [e for e in events if e["event"] == "worker_exited"]
    assert any(e["rank"] == 1 and e["signal"] == "SIGKILL" for e in exits), exits
    logs = "".join(p.read_text() for p in (run_dir / "logs").glob("agent-*.log"))
    assert f"resuming from verified checkpoint step {starts[1]['step']}" in logs
    assert evaluate(run_dir)["weights_sha256"] == evaluate(clean)["weights_sha256"]


def test_a_program_that_stops_short_of_the_steps_fails_the_run_saying_so(tmp_path):
    spec = _spec(steps=600, program_steps=300)
    run_dir = tmp_path / "short"
    assert run_local(spec, run_dir) != [0, 0]
    record = aborted(run_dir)
    assert record and record["kind"] == "user"
    assert "after reporting step 300 of the 600" in record["message"]
    assert not (run_dir / "control" / "complete.json").exists()
