"""A small client for Airflow's REST API v2 (token auth), used by the demo, the CLI,
the benchmarks and the end-to-end tests. Standard library only."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Any


class RestError(RuntimeError):
    def __init__(self, status: int, method: str, path: str, detail: Any) -> None:
        self.status, self.method, self.path, self.detail = status, method, path, detail
        super().__init__(status, method, path, detail)

    def __str__(self) -> str:
        return f"{self.method} {self.path} → HTTP {self.status}: {self.detail}"


class AirflowClient:
    """Airflow REST v2 with a JWT from ``POST /auth/token`` (refreshed on 401)."""

    def __init__(self, base_url: str, username: str, password: str, timeout: float = 30) -> None:
        self.base_url = base_url.rstrip("/")
        self.username, self.password, self.timeout = username, password, timeout
        self._token: str | None = None

    def token(self) -> str:
        if self._token is None:
            out = self._call("POST", "/auth/token", {"username": self.username, "password": self.password}, auth=False)
            self._token = out["access_token"]
        return self._token

    def _call(self, method: str, path: str, body: Any = None, *, auth: bool = True) -> Any:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.base_url + path, data=data, method=method)
        req.add_header("Content-Type", "application/json")
        req.add_header("Accept", "application/json")
        if auth:
            req.add_header("Authorization", f"Bearer {self.token()}")
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as exc:
            raw = exc.read()
            try:
                detail = json.loads(raw).get("detail", raw.decode(errors="replace"))
            except (ValueError, AttributeError):
                detail = raw.decode(errors="replace")
            raise RestError(exc.code, method, path, detail) from None
        return json.loads(raw) if raw else None

    # Transient answers of a busy embedded stack (SQLite locked → 500/503, a slow answer →
    # socket timeout): requests that are safe to repeat are tried this many times in all.
    ATTEMPTS = 4

    def call(self, method: str, path: str, body: Any = None, *, retry: bool | None = None) -> Any:
        """One REST call; 401 logs in again once; transient failures of idempotent calls
        (GET, PATCH, PUT, DELETE, or ``retry=True``) are retried with backoff."""
        retry = method in ("GET", "PATCH", "PUT", "DELETE") if retry is None else retry
        for attempt in range(1, self.ATTEMPTS + 1):
            try:
                try:
                    return self._call(method, path, body)
                except RestError as exc:
                    if exc.status != 401:
                        raise
                    self._token = None  # expired: log in again once
                    return self._call(method, path, body)
            except (RestError, TimeoutError, urllib.error.URLError) as exc:
                transient = not isinstance(exc, RestError) or exc.status in (500, 502, 503, 504)
                if not (retry and transient) or attempt == self.ATTEMPTS:
                    raise
                time.sleep(2 ** (attempt - 1))
        raise AssertionError("unreachable")

    # -- the calls trainflow uses ------------------------------------------------------
    def health(self) -> dict:
        return self._call("GET", "/api/v2/monitor/health", auth=False)

    def dag(self, dag_id: str) -> dict:
        return self.call("GET", f"/api/v2/dags/{_q(dag_id)}")

    def wait_for_dag(self, dag_id: str, timeout: float = 120) -> dict:
        deadline = time.time() + timeout
        while True:
            try:
                return self.dag(dag_id)
            except RestError as exc:
                if exc.status != 404 or time.time() > deadline:
                    raise
            time.sleep(0.5)

    def unpause(self, dag_id: str) -> dict:
        return self.call("PATCH", f"/api/v2/dags/{_q(dag_id)}", {"is_paused": False})

    def trigger(self, dag_id: str, conf: dict, run_id: str | None = None) -> dict:
        body: dict[str, Any] = {"logical_date": None, "conf": conf}
        if not run_id:
            return self.call("POST", f"/api/v2/dags/{_q(dag_id)}/dagRuns", body)
        body["dag_run_id"] = run_id
        try:  # with a run id a repeat is safe: a 409 means an earlier attempt created it
            return self.call("POST", f"/api/v2/dags/{_q(dag_id)}/dagRuns", body, retry=True)
        except RestError as exc:
            if exc.status != 409:
                raise
            run = self.run(dag_id, run_id)
            if run.get("conf") != conf:
                raise
            return run

    def run(self, dag_id: str, run_id: str) -> dict:
        return self.call("GET", f"/api/v2/dags/{_q(dag_id)}/dagRuns/{_q(run_id)}")

    def task_instances(self, dag_id: str, run_id: str) -> list[dict]:
        out = self.call("GET", f"/api/v2/dags/{_q(dag_id)}/dagRuns/{_q(run_id)}/taskInstances?limit=1000")
        return out["task_instances"]

    def xcom(self, dag_id: str, run_id: str, task_id: str, key: str = "return_value", map_index: int = -1) -> Any:
        out = self.call(
            "GET",
            f"/api/v2/dags/{_q(dag_id)}/dagRuns/{_q(run_id)}/taskInstances/"
            f"{_q(task_id)}/xcomEntries/{_q(key)}?map_index={map_index}&deserialize=true",
        )
        return out["value"]

    def state_store(self, dag_id: str, run_id: str, task_id: str, key: str, map_index: int = -1) -> Any:
        """A task's ``task_state_store`` value (survives the task's retries)."""
        out = self.call(
            "GET",
            f"/api/v2/dags/{_q(dag_id)}/dagRuns/{_q(run_id)}/taskInstances/"
            f"{_q(task_id)}/state-store/{_q(key)}?map_index={map_index}",
        )
        return out["value"]

    def task_log(self, dag_id: str, run_id: str, task_id: str, try_number: int = 1, map_index: int = -1) -> str:
        """The task's log as text (one line per structured log event)."""
        out = self.call(
            "GET",
            f"/api/v2/dags/{_q(dag_id)}/dagRuns/{_q(run_id)}/taskInstances/"
            f"{_q(task_id)}/logs/{try_number}?map_index={map_index}&full_content=true",
        )
        content = out.get("content", [])
        if isinstance(content, str):
            return content
        return "\n".join(json.dumps(c) if not isinstance(c, str) else c for c in content)

    def runs(self, dag_id: str) -> list[dict]:
        return self.call("GET", f"/api/v2/dags/{_q(dag_id)}/dagRuns?limit=100")["dag_runs"]

    def wait_run(self, dag_id: str, run_id: str, timeout: float, poll: float = 1.0, on_poll=None) -> dict:
        deadline = time.time() + timeout
        while True:
            run = self.run(dag_id, run_id)
            if on_poll is not None:
                on_poll(run)
            if run["state"] in ("success", "failed"):
                return run
            if time.time() > deadline:
                raise TimeoutError(f"run {dag_id}/{run_id} still {run['state']} after {timeout}s")
            time.sleep(poll)


def _q(part: str) -> str:
    return urllib.parse.quote(str(part), safe="")
