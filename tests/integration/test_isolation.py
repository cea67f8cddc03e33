"""Two tenants' runs side by side on one machine: disjoint workspaces, rendezvous ids and
databases, and heartbeats; each gang trains exactly what it would alone (the same final
weights as a solo run of the same spec), so neither saw nor disturbed the other."""

from __future__ import annotations

import json
import threading

from trainflow.heartbeat import read_all
from trainflow.launch.local import run_local
from trainflow.spec import TrainingSpec
from trainflow.worker.evaluate import evaluate
from trainflow.workspace import Workspace

BASE = dict(workload="digits", nodes=2, steps=120, batch_size=16, checkpoint_interval=40, seed=9)


def test_two_tenants_run_concurrently_without_seeing_each_other(tmp_path):
    solo_dir = tmp_path / "solo"
    assert run_local(TrainingSpec(**BASE, tenant="solo"), solo_dir) == [0, 0]
    solo = evaluate(solo_dir)["weights_sha256"]

    runs = {t: Workspace(tmp_path / "runs", t, "train_digits", "same-run-id").create().dir for t in ("alpha", "beta")}
    codes: dict[str, list[int]] = {}

    def train(tenant: str) -> None:
        codes[tenant] = run_local(TrainingSpec(**BASE, tenant=tenant), runs[tenant])

    threads = [threading.Thread(target=train, args=(t,)) for t in runs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=900)
    assert codes == {"alpha": [0, 0], "beta": [0, 0]}

    plans = {t: json.loads((d / "plan.json").read_text()) for t, d in runs.items()}
    assert plans["alpha"]["rendezvous"]["id"] != plans["beta"]["rendezvous"]["id"]
    assert plans["alpha"]["rendezvous"]["endpoint"] != plans["beta"]["rendezvous"]["endpoint"]
    for tenant, run_dir in runs.items():
        assert str(run_dir).split("/runs/")[1].startswith(f"{tenant}/")  # the same run id, apart
        beats = read_all(run_dir / "heartbeats")
        assert sorted(beats) == [0, 1]  # its own two ranks only
        assert evaluate(run_dir)["weights_sha256"] == solo  # trained exactly as alone
