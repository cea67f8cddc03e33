"""Elastic gangs on real torch.distributed (gloo) gangs launched by trainflow's node agents,
no Airflow: a hot spare steps in for a lost node, a gang that cannot replace a node shrinks
and keeps training on the resharded checkpoint, a node that comes back grows it again at a
checkpoint boundary.

What each test proves exactly: a gang that never changes its world size (the spare case)
ends bit-identical to a clean run; a gang that changed size trained on exactly the samples
of a clean run, step by step (the recorded sample log of the steps that count), and its
evaluation stays within a stated tolerance of the clean run's.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from trainflow.data import indices_at, sample_lineage
from trainflow.launch.local import prepare, run_local, start_agent
from trainflow.spec import TrainingSpec
from trainflow.timeline import read as read_timeline
from trainflow.worker.evaluate import evaluate

BASE = dict(
    workload="digits", steps=200, batch_size=16, checkpoint_interval=20, keep_last=3, seed=11, record_samples=True
)
# A shrunk gang trains the same samples per step (keep_global) but sums the gradients of
# fewer ranks in another order: the weights differ in the last bits, then drift slightly.
ACCURACY_TOLERANCE = 0.02


def _wait(predicate, timeout: float = 300, what: str = "condition"):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if value := predicate():
            return value
        time.sleep(0.1)
    pytest.fail(f"timed out waiting for {what}")


def _first_exit(procs: list) -> int:
    """Index of the first agent to end (the lost node's: the fault SIGKILLs its tree)."""
    return _wait(lambda: [i for i, p in enumerate(procs) if p.poll() is not None], what="the node loss")[0]


def _events(run_dir: Path, name: str) -> list[dict]:
    return [e for e in read_timeline(run_dir) if e["event"] == name]


def _assert_exact_coverage(run_dir: Path, spec: TrainingSpec, n: int) -> None:
    """The steps the final weights descend from trained, in order, exactly the sample
    sequence of a clean run (so within every epoch each sample once, none skipped), and
    each step the global batch of a clean run's step."""
    steps = sample_lineage(run_dir)
    assert sorted(steps) == list(range(1, spec.steps + 1))
    flat = [i for s in sorted(steps) for i in steps[s]]
    assert flat == indices_at(n=n, seed=spec.seed, positions=range(len(flat)))
    assert {len(v) for v in steps.values()} == {spec.global_batch_size}  # keep_global


def test_hot_spare_replaces_a_lost_node_bit_identical(tmp_path, agents):
    """nodes=2, spares=1: node loss at step 90 → the spare joins at once (no restart of the
    lost agent); the world size never changes, so the weights equal a clean run's."""
    clean = tmp_path / "clean"
    assert run_local(TrainingSpec(**BASE, nodes=2), clean) == [0, 0]
    spec = TrainingSpec(**BASE, nodes=2, spares=1, faults=[{"kind": "kill_node", "rank": 1, "step": 90}])
    run = tmp_path / "spare"
    plan = prepare(spec, run)
    agents.extend(start_agent(plan, node, log_dir=run / "logs") for node in range(3))
    lost = _first_exit(agents)
    assert agents[lost].returncode != 0
    others = [p.wait(timeout=300) for i, p in enumerate(agents) if i != lost]
    assert others == [0, 0]  # the survivor finished with the spare; the spare too
    (change,) = _events(run, "membership")
    assert change["change"] == "spare_used" and change["left"] == [lost], change
    assert change["world_from"] == change["world_to"] == 2
    assert evaluate(run)["weights_sha256"] == evaluate(clean)["weights_sha256"]
    _assert_exact_coverage(run, spec, n=_train_size(run))


def test_gang_shrinks_when_a_node_is_lost_for_good_then_grows_back(tmp_path, agents):
    """nodes='2:3': node loss at step 70 and no replacement within shrink_grace → the gang
    goes on with 2 nodes from the newest checkpoint, resharded; then the node comes back and
    joins at the next checkpoint boundary; the run finishes with 3."""
    spec = TrainingSpec(
        **{**BASE, "steps": 400},
        nodes="2:3",
        shrink_grace=3,
        heartbeat_timeout=30,
        faults=[{"kind": "kill_node", "rank": 2, "step": 70}],
    )
    clean = tmp_path / "clean"
    assert run_local(TrainingSpec(**{**spec.to_dict(), "faults": []}), clean) == [0, 0, 0]
    run = tmp_path / "elastic"
    plan = prepare(spec, run)
    agents.extend(start_agent(plan, node, log_dir=run / "logs") for node in range(3))
    lost = _first_exit(agents)
    shrink = _wait(lambda: _events(run, "membership"), what="the shrink")[0]
    assert shrink["change"] == "shrink" and (shrink["world_from"], shrink["world_to"]) == (3, 2), shrink
    assert shrink["left"] == [lost]
    resumed_at = shrink["step"]
    # the newest checkpoint committed by then: 60, or 40 when the async save of 60 was still
    # in flight when the node died (one save at a time)
    committed = [e["step"] for e in _events(run, "checkpoint_committed") if e["time"] <= shrink["time"]]
    assert resumed_at == max(committed) in (40, 60)
    # capacity returns: the node asks to join and the gang grows at its next checkpoint
    agents.append(start_agent(plan, lost, log_dir=run / "logs"))
    ends = [p.wait(timeout=300) for i, p in enumerate(agents) if i != lost]
    assert ends == [0, 0, 0]
    changes = [e["change"] for e in _events(run, "membership")]
    assert changes == ["shrink", "grow"], changes
    grow = _events(run, "membership")[1]
    assert (grow["world_from"], grow["world_to"]) == (2, 3) and grow["step"] % spec.checkpoint_interval == 0
    (window,) = _events(run, "grow_window")
    assert window["step"] == grow["step"]  # grown at a checkpoint boundary: no step redone
    _assert_exact_coverage(run, spec, n=_train_size(run))
    ours, theirs = evaluate(run), evaluate(clean)
    assert ours["step"] == theirs["step"] == spec.steps
    assert abs(ours["metrics"]["accuracy"] - theirs["metrics"]["accuracy"]) <= ACCURACY_TOLERANCE, (ours, theirs)


def _train_size(run_dir: Path) -> int:
    from trainflow.workloads import load_workload

    return len(load_workload(TrainingSpec.from_json((run_dir / "spec.json").read_text())).train)
