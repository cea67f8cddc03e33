"""AirflowClient against a real local HTTP server: transient failures are retried only
where repeating is safe."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from trainflow.rest import AirflowClient, RestError


@pytest.fixture
def server():
    script: list[tuple[int, dict]] = []
    seen: list[str] = []

    class Handler(BaseHTTPRequestHandler):
        def _answer(self):
            seen.append(f"{self.command} {self.path}")
            length = int(self.headers.get("Content-Length") or 0)
            self.rfile.read(length)
            status, body = script.pop(0) if script else (200, {})
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        do_GET = do_POST = do_PATCH = _answer

        def log_message(self, *args):
            return

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    client = AirflowClient(f"http://127.0.0.1:{httpd.server_address[1]}", "u", "p", timeout=5)
    client._token = "t"
    client.ATTEMPTS = 3
    yield client, script, seen
    httpd.shutdown()


def test_transient_errors_of_safe_calls_are_retried(server, monkeypatch):
    client, script, seen = server
    monkeypatch.setattr("trainflow.rest.time.sleep", lambda s: None)
    script += [(500, {"detail": "Database error"}), (503, {}), (200, {"state": "running"})]
    assert client.run("d", "r") == {"state": "running"}
    assert len(seen) == 3
    script += [(500, {"detail": "x"})] * 3
    with pytest.raises(RestError, match="HTTP 500"):
        client.run("d", "r")


def test_a_client_error_is_not_retried_and_a_plain_post_never(server, monkeypatch):
    client, script, seen = server
    monkeypatch.setattr("trainflow.rest.time.sleep", lambda s: None)
    script += [(404, {"detail": "no such run"})]
    with pytest.raises(RestError, match="404"):
        client.run("d", "r")
    script += [(500, {"detail": "x"})]
    with pytest.raises(RestError, match="500"):
        client.trigger("d", {"steps": 1})  # no run id: a repeat could start a second run
    assert len(seen) == 2


def test_a_trigger_with_a_run_id_is_retried_and_a_409_of_its_own_run_is_success(server, monkeypatch):
    client, script, seen = server
    monkeypatch.setattr("trainflow.rest.time.sleep", lambda s: None)
    script += [
        (500, {"detail": "Database error"}),
        (409, {"detail": "exists"}),
        (200, {"dag_run_id": "r", "conf": {"steps": 1}}),
    ]
    assert client.trigger("d", {"steps": 1}, run_id="r")["dag_run_id"] == "r"
    assert [s.split()[0] for s in seen] == ["POST", "POST", "GET"]
    script += [(409, {"detail": "exists"}), (200, {"dag_run_id": "r", "conf": {"steps": 2}})]
    with pytest.raises(RestError, match="409"):  # someone else's run under that id
        client.trigger("d", {"steps": 1}, run_id="r")
