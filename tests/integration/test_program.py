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
    return TrainingSpec(
        nodes=2,
        steps=steps,
        checkpoint_interval=EVERY,
        keep_last=2,
        heartbeat_interval=0.5,
        program=[
            "python",
            EXAMPLE,
            "--steps",
            str(program_steps or steps),
            "--every",
            str(EVERY),
            "--resume",
            "{resume_from}",
        ],
        **kw,
    )


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


def test_a_preempted_program_stops_at_a_verified_checkpoint_and_resumes_bit_identical(clean, tmp_path):
    """The node tasks' preemption order (``control/preempt-request.json``): the program's
    ``sdk.should_stop()`` turns true on every rank at the same step, it commits a checkpoint
    there and exits 0; the agents answer ``preempted`` instead of judging the short run.
    Launched again (as the requeued run is), it resumes from that checkpoint and ends with
    the clean run's weights."""
    from trainflow.workspace import PREEMPT_REQUEST, PREEMPTED, completed, write_json_atomic

    spec = _spec()
    run_dir = tmp_path / "preempted"
    procs = start_agents(prepare(spec, run_dir), spec.nodes, log_dir=run_dir / "logs")
    try:
        deadline = time.time() + 300
        while time.time() < deadline:
            beats = read_all(run_dir / "heartbeats")
            if len(beats) == 2 and min(b["step"] for b in beats.values()) >= 20:
                break
            time.sleep(0.01)
        write_json_atomic(run_dir / "control" / PREEMPT_REQUEST, {"by": "t/hi/1", "reason": "test", "at": 0})
        assert [p.wait(timeout=120) for p in procs] == [0, 0]
    finally:
        for p in procs:
            if p.poll() is None:
                kill_tree(p)
    stop = json.loads((run_dir / "control" / PREEMPTED).read_text())
    assert 20 <= stop["step"] < STEPS and stop["by"] == "t/hi/1", stop
    assert manifest.newest_verified(run_dir / "checkpoints").step == stop["step"]
    assert not completed(run_dir)
    states = {json.loads(p.read_text())["state"] for p in (run_dir / "nodes").glob("node-*.json")}
    assert states == {"preempted"}
    for name in (PREEMPT_REQUEST, PREEMPTED):  # what the node tasks do once admitted again
        (run_dir / "control" / name).unlink()
    assert run_local(spec, run_dir) == [0, 0]
    assert [e["step"] for e in read(run_dir) if e["event"] == "gang_start"][-1] == stop["step"]
    assert evaluate(run_dir)["weights_sha256"] == evaluate(clean)["weights_sha256"]


def test_a_program_without_the_sdk_heals_a_kill_from_its_own_checkpoint_layout(tmp_path):
    """``examples/dcp_program.py`` knows nothing of trainflow: it saves DCP folders
    ``ckpt-<step>`` into ``{checkpoint_dir}`` and resumes from ``--resume``. trainflow seals
    each complete folder (its ``.metadata`` present) as a verified checkpoint, heartbeats
    for its ranks from that progress, and after a rank is SIGKILLed hands the newest to the
    restarted gang: it ends with an uninterrupted run's state."""
    program = [
        "python",
        str(REPO / "examples" / "dcp_program.py"),
        "--steps",
        "3000",
        "--every",
        "300",
        "--out",
        "{checkpoint_dir}",
        "--resume",
        "{resume_from}",
    ]
    spec = TrainingSpec(
        nodes=2,
        steps=3000,
        checkpoint_interval=300,
        keep_last=2,
        heartbeat_interval=0.5,
        program=program,
        exit_codes_no_retry=[2],
    )
    clean = tmp_path / "clean"
    assert run_local(spec, clean) == [0, 0]
    assert [s for s, _ in manifest.list_checkpoints(clean / "checkpoints")] == [3000, 2700]
    assert all(e.get("layout") == "dcp" for e in read(clean) if e["event"] == "checkpoint_committed")
    run_dir = tmp_path / "killed"
    procs = start_agents(prepare(spec, run_dir), spec.nodes, log_dir=run_dir / "logs")
    killed = None
    try:
        import psutil

        deadline = time.time() + 300
        while time.time() < deadline and killed is None:
            ref = manifest.newest_verified(run_dir / "checkpoints")
            if ref is not None and ref.step < 2400:
                workers = [
                    c
                    for p in procs
                    for c in psutil.Process(p.pid).children(recursive=True)
                    if "dcp_program.py" in " ".join(c.cmdline())
                ]
                if len(workers) == 2:
                    os.kill(workers[-1].pid, signal.SIGKILL)
                    killed = ref.step
            time.sleep(0.01)
        assert killed is not None, "no checkpoint before the program ended"
        assert [p.wait(timeout=300) for p in procs] == [0, 0]
    finally:
        for p in procs:
            if p.poll() is None:
                kill_tree(p)
    starts = [e for e in read(run_dir) if e["event"] == "gang_start"]
    assert len(starts) == 2 and starts[1]["step"] >= killed > 0
    assert evaluate(run_dir)["weights_sha256"] == evaluate(clean)["weights_sha256"]


def test_an_exit_code_named_no_retry_ends_the_run_at_once(tmp_path):
    """argparse exits 2 on a bad command line: with ``exit_codes_no_retry=[2]`` the run is
    aborted on the first exit instead of restarting the gang."""
    spec = TrainingSpec(
        nodes=2,
        steps=100,
        checkpoint_interval=50,
        exit_codes_no_retry=[2],
        program=["python", str(REPO / "examples" / "dcp_program.py"), "--no-such-flag"],
    )
    run_dir = tmp_path / "bad-flag"
    assert run_local(spec, run_dir, timeout=300) != [0, 0]
    record = aborted(run_dir)
    assert record and record["kind"] == "user" and "exited with code 2" in record["message"], record
    assert sum(1 for e in read(run_dir) if e["event"] == "gang_start") == 1


CHATTY_THEN_SILENT = """
import sys, time
chatty_until = time.time() + float(sys.argv[1])
while time.time() < chatty_until:
    print("step", flush=True)  # no SDK, no checkpoint: only its output says it is alive
    time.sleep(0.2)
time.sleep(600)  # silent: a hang
"""


def test_a_program_without_the_sdk_is_alive_while_it_prints_and_stalled_once_silent(tmp_path):
    """The silence watchdog: a program that reports nothing through the SDK and saves no
    checkpoint is judged by its output. While it prints, no stall past ``stall_timeout``;
    once it is silent that long, the watch calls it stalled."""
    from trainflow.heartbeat import HeartbeatPolicy, Verdict, classify

    script = tmp_path / "chatty.py"
    script.write_text(CHATTY_THEN_SILENT)
    chatty_s, stall_s = 8.0, 2.0
    spec = TrainingSpec(
        nodes=1,
        steps=10,
        checkpoint_interval=10,
        heartbeat_interval=0.2,
        stall_timeout=stall_s,
        program=["python", str(script), str(chatty_s)],
    )
    run_dir = tmp_path / "run"
    policy = HeartbeatPolicy(timeout=60.0, startup_timeout=120.0, stall_timeout=spec.stall_timeout)
    started = time.time()
    (proc,) = start_agents(prepare(spec, run_dir), 1, log_dir=run_dir / "logs")
    verdicts = []
    try:
        deadline = started + 120
        while time.time() < deadline:
            now = time.time()
            verdict = classify(
                read_all(run_dir / "heartbeats"), now=now, world_size=1, started_at=started, policy=policy
            )
            verdicts.append((now, verdict.verdict, read_all(run_dir / "heartbeats").get(0, {}).get("state")))
            if verdict.verdict == Verdict.STALLED:
                break
            assert proc.poll() is None, "the agent ended"
            time.sleep(0.2)
    finally:
        kill_tree(proc)
        proc.wait()
    printing = [t for t, _, state in verdicts if state == "training"]
    assert printing, verdicts  # it was seen alive, by its output
    stalled_at = verdicts[-1][0]
    assert verdicts[-1][1] == Verdict.STALLED, verdicts[-5:]
    # Alive for its whole chatty phase (far longer than stall_timeout), stalled soon after.
    assert stalled_at - printing[0] >= chatty_s - 2.0, (stalled_at - printing[0], verdicts[:5])
    assert (
        "rank 0 without progress"
        in classify(
            read_all(run_dir / "heartbeats"), now=stalled_at, world_size=1, started_at=started, policy=policy
        ).message
    )
    log = (run_dir / "logs" / "agent-0.log").read_text()
    assert log.count("step") >= 10  # the tap passed the program's output on
