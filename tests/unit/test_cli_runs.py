"""The run commands of the CLI against a stand-in HTTP server on loopback (the real stack is
in tests/e2e/test_cli_e2e.py): exit codes, the server's message instead of a traceback, and
input refused before anything is sent."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from trainflow.cli import main
from trainflow.cli_runs import progress_line

RUNS = {"r-ok": "success", "r-bad": "failed", "r-live": "running"}


class Handler(BaseHTTPRequestHandler):
    seen: list[tuple[str, str]] = []

    def log_message(self, *args) -> None:
        pass

    def _send(self, code: int, body) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_POST(self) -> None:
        Handler.seen.append(("POST", self.path))
        if self.path == "/auth/token":
            return self._send(201, {"access_token": "t"})
        self._send(404, {"detail": "nope"})

    def do_GET(self) -> None:
        Handler.seen.append(("GET", self.path))
        parts = self.path.split("?")[0].split("/")
        if self.path.startswith("/api/v2/dags/train_digits/dagRuns/") and len(parts) == 7:
            run = parts[6]
            if run not in RUNS:
                return self._send(
                    404, {"detail": f"The DagRun with dag_id: `train_digits` and run_id: `{run}` was not found"}
                )
            return self._send(200, {"dag_run_id": run, "state": RUNS[run], "conf": {"tenant": "t"}})
        if self.path.endswith("/taskInstances?limit=1000"):
            return self._send(
                200,
                {"task_instances": [{"task_id": "shard_train", "map_index": 0, "state": "success", "try_number": 1}]},
            )
        if self.path.startswith("/trainflow/api/runs/t/train_digits/"):
            return self._send(
                200,
                {
                    "step": 150,
                    "total_steps": 300,
                    "loss": 0.25,
                    "samples_per_s": 900.0,
                    "ranks": [{"healthy": True}, {"healthy": False}],
                    "state_reason": "healing: rank 1 exited (signal SIGKILL) at 10:00:00 UTC; the gang restarts",
                    "node_agents": [
                        {
                            "node": 0,
                            "state": "running",
                            "host": "gpu-7",
                            "try": 2,
                            "tries_left": 1,
                            "cordoned": {"since": 1.0, "reason": "3 failures in 600 s"},
                        },
                    ],
                },
            )
        self._send(404, {"detail": "unknown path"})


@pytest.fixture
def server(monkeypatch):
    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    monkeypatch.setenv("TRAINFLOW_URL", f"http://127.0.0.1:{srv.server_address[1]}")
    monkeypatch.setenv("TRAINFLOW_USER", "u")
    monkeypatch.setenv("TRAINFLOW_PASSWORD", "p")
    Handler.seen = []
    yield srv
    srv.shutdown()


@pytest.mark.parametrize("run_id, code", [("r-ok", 0), ("r-live", 0), ("r-bad", 1)])
def test_status_exit_codes_follow_the_run(server, capsys, run_id, code):
    assert main(["status", run_id]) == code
    out = capsys.readouterr().out
    assert f"train_digits/{run_id}" in out and "150/300" in out and "ranks 1/2 healthy" in out


def test_an_unknown_run_prints_the_servers_message_and_exits_2(server, capsys):
    assert main(["status", "no-such-run"]) == 2
    err = capsys.readouterr().err
    assert "HTTP 404" in err and "was not found" in err and "Traceback" not in err


def test_submit_refuses_bad_input_before_sending_anything(server, capsys):
    assert main(["submit", "--set", "steps=0"]) == 2
    assert "invalid steps=0" in capsys.readouterr().err
    assert main(["submit", "--set", "nonsense"]) == 2
    assert "write field=value" in capsys.readouterr().err
    assert [s for s in Handler.seen if s[1] != "/auth/token"] == []


def test_an_unreachable_server_exits_3(monkeypatch, capsys):
    monkeypatch.setenv("TRAINFLOW_URL", "http://127.0.0.1:9")
    monkeypatch.setenv("TRAINFLOW_USER", "u")
    monkeypatch.setenv("TRAINFLOW_PASSWORD", "p")
    assert main(["runs"]) == 3
    assert "cannot reach the server" in capsys.readouterr().err


def test_progress_line_shows_steps_loss_eta_and_health():
    st = {
        "state": "running",
        "progress": {
            "step": 100,
            "total_steps": 400,
            "loss": 0.5,
            "samples_per_s": 1200.0,
            "ranks": [{"healthy": True, "in_gang": True}] * 2,
        },
    }
    line = progress_line(st, started=0.0, now=60.0)
    assert "[######..................] 100/400" in line
    assert "loss 0.5000" in line and "1200 samples/s" in line and "ETA 3m00s" in line
    assert "ranks 2/2 healthy" in line


class _RacingAirflow:
    """Task instances of a run as Airflow's REST API shows them; the heartbeat sensor is
    deferring as it is cancelled, and its deferral lands just after the new state."""

    def __init__(self) -> None:
        self.states = {
            ("heartbeat_watch", -1): "running",
            ("shard_train", 0): "running",
            ("shard_train", 1): "running",
            ("release", -1): None,
        }
        self.patched: list[str] = []
        self.landed = False

    def _deferral_lands(self) -> None:
        """The sensor's deferral, sent before the cancel, lands after it."""
        if self.patched and not self.landed:
            self.landed = True
            self.states[("heartbeat_watch", -1)] = "deferred"

    def run(self, dag, run_id):
        self._deferral_lands()
        open_ = any(s in ("running", "deferred") for k, s in self.states.items() if k[0] != "release")
        return {"state": "running" if open_ else "failed"}

    def task_instances(self, dag, run_id):
        self._deferral_lands()
        return [{"task_id": t, "map_index": m, "state": s} for (t, m), s in self.states.items()]

    def call(self, method, path, body=None):
        assert method == "PATCH" and body["new_state"] == "failed", (method, path, body)
        self.patched.append(path.split("/taskInstances/")[1])
        task, _, index = self.patched[-1].partition("/")
        self.states[(task, int(index) if index else -1)] = "failed"
        return {}


def test_cancel_fails_again_a_task_whose_deferral_landed_after_it(capsys):
    """The e2e race seen on CI: the sensor was failed while it deferred, stayed deferred and
    held the run open for five minutes; cancel looks again and fails it again."""
    import argparse

    from trainflow.cli_runs import cmd_cancel

    airflow = _RacingAirflow()
    assert cmd_cancel(airflow, argparse.Namespace(dag="train_digits", run_id="r1"), interval=0.0) == 0
    assert airflow.patched.count("heartbeat_watch") == 2, airflow.patched
    assert sorted(set(airflow.patched)) == ["heartbeat_watch", "shard_train/0", "shard_train/1"]
    assert airflow.run("train_digits", "r1")["state"] == "failed"
    assert airflow.states[("release", -1)] is None  # the teardown is left to free the nodes
    assert "cancelled train_digits/r1 (3 task instances failed)" in capsys.readouterr().out


def test_status_says_why_and_shows_each_node(server, capsys):
    """The reason line and, per node, the Airflow task's state beside the agent's host, its
    try within the run's retry budget, the tries left and the host's cordon."""
    assert main(["status", "r-live"]) == 0
    out = capsys.readouterr().out
    assert "why: healing: rank 1 exited (signal SIGKILL)" in out
    (line,) = [x for x in out.splitlines() if x.strip().startswith("node 0")]
    assert "task success" in line and "host gpu-7" in line and "try 2, 1 left" in line
    assert "CORDONED: 3 failures in 600 s" in line
    assert main(["status", "r-live", "--json"]) == 0
    st = json.loads(capsys.readouterr().out)
    assert st["nodes"] == [
        {
            "node": 0,
            "task_state": "success",
            "airflow_try": 1,
            "agent_state": "running",
            "host": "gpu-7",
            "try": 2,
            "tries_left": 1,
            "cordoned": {"since": 1.0, "reason": "3 failures in 600 s"},
        }
    ]
    assert st["reason"].startswith("healing:")
