"""The CLI's run commands against the real embedded stack: submit and watch a run to its
end, read its status, runs and logs; cancel a live run (exit code 1 when watched)."""

from __future__ import annotations

import json
import time

import pytest

from trainflow.cli import main

pytestmark = pytest.mark.e2e
DAG = "train_digits"


@pytest.fixture
def cli_env(stack, client, monkeypatch):
    user, password = stack.credentials()
    monkeypatch.setenv("TRAINFLOW_URL", stack.url)
    monkeypatch.setenv("TRAINFLOW_USER", user)
    monkeypatch.setenv("TRAINFLOW_PASSWORD", password)
    client.wait_for_dag(DAG, timeout=180)
    return client


def test_submit_watch_status_runs_logs(cli_env, capsys):
    code = main(
        [
            "submit",
            "--set",
            "steps=120",
            "--set",
            "checkpoint_interval=60",
            "--set",
            "tenant=cli",
            "--run-id",
            "cli-1",
            "--watch",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    assert "submitted train_digits/cli-1" in out and "success" in out and "120/120" in out
    assert main(["status", "cli-1", "--json"]) == 0
    st = json.loads(capsys.readouterr().out)
    assert st["state"] == "success" and st["progress"]["step"] == 120
    assert st["tasks"]["shard_train[0]"]["state"] == "success"
    assert main(["runs", "--json"]) == 0
    assert "cli-1" in [r["run_id"] for r in json.loads(capsys.readouterr().out)]
    assert main(["logs", "cli-1", "--map-index", "1"]) == 0
    assert "agent" in capsys.readouterr().out  # the node task log: its agent started
    assert main(["logs", "cli-1", "--task", "evaluate"]) == 0
    assert "accuracy" in capsys.readouterr().out


def test_cancel_stops_a_live_run_and_watch_reports_it(cli_env, capsys):
    assert main(["submit", "--set", "steps=20000", "--set", "tenant=cli", "--run-id", "cli-cancel"]) == 0
    deadline = time.time() + 300
    while time.time() < deadline and not any(  # training has started
        t["task_id"] == "shard_train" and t["state"] == "running" for t in cli_env.task_instances(DAG, "cli-cancel")
    ):
        time.sleep(1)
    assert main(["cancel", "cli-cancel"]) == 0
    assert "cancelled train_digits/cli-cancel" in capsys.readouterr().out
    assert main(["watch", "cli-cancel", "--interval", "1", "--timeout", "300"]) == 1
    assert cli_env.run(DAG, "cli-cancel")["state"] == "failed"
    tis = {(t["task_id"], t["map_index"]): t for t in cli_env.task_instances(DAG, "cli-cancel")}
    assert tis[("shard_train", 0)]["state"] == "failed" and tis[("shard_train", 0)]["try_number"] == 1
    assert tis[("release", -1)]["state"] == "success"  # the nodes were given back
    assert main(["status", "no-such-run"]) == 2
    assert "HTTP 404" in capsys.readouterr().err
