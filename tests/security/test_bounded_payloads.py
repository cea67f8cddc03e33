"""What a workload writes for others to read is bounded: its exception messages, its
metrics, and everything the timeline and the run report collect from a run (``bounds``)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from trainflow import timeline
from trainflow.bounds import MAX_MESSAGE, MAX_METRICS, MAX_REPORT_ITEMS, check_metrics, clip
from trainflow.errors import WorkloadOutputError

ROOT = Path(__file__).resolve().parents[2]


def test_clip_says_how_much_was_cut():
    assert clip("short") == "short"
    text = clip("y" * (MAX_MESSAGE + 123))
    assert text.startswith("y" * MAX_MESSAGE) and text.endswith("… [123 more characters]")


def test_metrics_are_a_small_mapping_of_numbers_or_short_strings():
    np = pytest.importorskip("numpy")
    assert check_metrics({"accuracy": np.float32(0.5), "n": np.int64(3), "ok": True, "note": "fine"}) == {
        "accuracy": 0.5,
        "n": 3,
        "ok": True,
        "note": "fine",
    }
    for bad, match in (
        ([1.0], "returned list"),
        ({f"m{i}": 1.0 for i in range(MAX_METRICS + 1)}, f"at most {MAX_METRICS}"),
        ({"x" * 65: 1.0}, "metric name"),
        ({"confusion": [[1, 2]]}, "metric 'confusion': value of type list"),
        ({"log": "z" * 10_000}, "metric 'log': value of type str of 10000 characters"),
    ):
        with pytest.raises(WorkloadOutputError, match=match):
            check_metrics(bad)


def test_a_huge_event_is_clipped_not_lost(tmp_path):
    timeline.record(tmp_path, "user_error", rank=1, message="m" * 1_000_000)
    timeline.record(tmp_path, "noisy", **{f"field{i}": "v" * 100 for i in range(200)})
    raw = (tmp_path / "timeline.jsonl").read_bytes().splitlines()
    assert all(len(line) < timeline.MAX_LINE for line in raw)
    first, second = timeline.read(tmp_path)
    assert (first["event"], first["rank"]) == ("user_error", 1) and "more characters]" in first["message"]
    assert second["event"] == "noisy" and second["clipped"] is True


def test_the_report_of_a_hostile_run_is_bounded(tmp_path):
    from trainflow.report import build_report

    (tmp_path / "plan.json").write_text(
        json.dumps(
            {"dag_id": "d", "run_id": "r", "tenant": "t", "world_size": 2, "queue": "cpu", "spec": {"steps": 10}}
        )
    )
    for i in range(5000):
        timeline.record(tmp_path, "straggler", rank=i % 2, message="s" * 300)
        timeline.record(tmp_path, "membership", change="replaced", world_from=2, world_to=2)
    (tmp_path / "errors").mkdir()
    for rank in range(64):
        (tmp_path / "errors" / f"rank-{rank:05d}.json").write_text(
            json.dumps({"rank": rank, "type": "ValueError", "message": "e" * 1_000_000})
        )
    report = build_report(tmp_path, metrics={}, checkpoint=None)
    assert len(report["stragglers"]) == len(report["membership"]) == MAX_REPORT_ITEMS
    assert all(len(e["message"]) < MAX_MESSAGE + 40 for e in report["errors"])
    assert len(json.dumps(report)) < 2_000_000  # ~ 64 GB of messages in, a bounded report out


@pytest.mark.integration  # real worker processes
def test_a_workload_raising_a_huge_message_is_recorded_clipped(tmp_path, monkeypatch):
    """Real ranks: the workload's 1 MB exception message is clipped in the error record, the
    run's abort record and the timeline; the run still fails as a user error naming it."""
    from trainflow.launch.local import run_local
    from trainflow.spec import TrainingSpec

    monkeypatch.setenv("TRAINFLOW_WORKLOAD_MODULES", "trainflow.workloads,tests.security.loud_workload")
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    spec = TrainingSpec(
        workload="tests.security.loud_workload:loud", nodes=2, steps=50, batch_size=16, checkpoint_interval=25
    )
    codes = run_local(spec, tmp_path)
    assert codes and set(codes) <= {3}, codes
    abort = json.loads((tmp_path / "ABORT").read_text())
    assert abort["type"] == "ValueError" and abort["kind"] == "user"
    assert len(abort["message"]) < MAX_MESSAGE + 100 and "more characters]" in abort["message"]
    for err in (tmp_path / "errors").glob("rank-*.json"):
        assert err.stat().st_size < 20_000
    events = [e for e in timeline.read(tmp_path) if e["event"] == "user_error"]
    assert events and all("more characters]" in e["message"] for e in events)  # every failing rank's


@pytest.mark.integration  # real worker processes
def test_an_evaluate_with_unbounded_metrics_fails_as_the_workloads_error(tmp_path, monkeypatch):
    from trainflow.launch.local import run_local
    from trainflow.spec import TrainingSpec
    from trainflow.worker.evaluate import USER_ERROR_EXIT_CODE

    env = {"TRAINFLOW_WORKLOAD_MODULES": "trainflow.workloads,tests.security.loud_workload", "PYTHONPATH": str(ROOT)}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    spec = TrainingSpec(
        workload="tests.security.loud_workload:bad_metrics", nodes=1, steps=20, batch_size=16, checkpoint_interval=10
    )
    assert set(run_local(spec, tmp_path)) == {0}
    out = subprocess.run(
        [sys.executable, "-m", "trainflow.worker.evaluate", "--run-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == USER_ERROR_EXIT_CODE, out.stderr[-2000:]
    assert "metric 'confusion': value of type list" in out.stderr
    assert not (tmp_path / "metrics.json").exists()
