"""Helpers shared by the trainflow operators: reading a run's plan, the edge translation
of core errors, and streaming a subprocess into the task log."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from trainflow.errors import SpecError, UserCodeError

if TYPE_CHECKING:
    import logging

RUN_DIR_TEMPLATE = "{{ ti.xcom_pull(task_ids='provision', key='run_dir') }}"


def load_plan(run_dir: str | Path) -> dict[str, Any]:
    return json.loads((Path(run_dir) / "plan.json").read_text())


def s3_client_from_connection(env=None):
    """A boto3 S3 client from the Airflow Connection ``TRAINFLOW_S3_CONN_ID`` (default
    ``trainflow_s3``: login = access key, password = secret, host or extra ``endpoint_url``,
    extra ``region_name``/``aws_session_token``), or from boto3's standard chain when the
    connection does not exist. Secrets never leave this function."""
    from airflow.sdk import Connection
    from airflow.sdk.exceptions import AirflowNotFoundException

    from trainflow.checkpoint import s3

    env = os.environ if env is None else env
    try:
        conn = Connection.get(env.get("TRAINFLOW_S3_CONN_ID", "trainflow_s3"))
    except AirflowNotFoundException:
        return s3.client()
    extra = conn.extra_dejson or {}
    return s3.client(
        endpoint_url=extra.get("endpoint_url") or conn.host or None,
        region_name=extra.get("region_name"),
        aws_access_key_id=conn.login or None,
        aws_secret_access_key=conn.password or None,
        aws_session_token=extra.get("aws_session_token"),
    )


def durable_store(plan: dict[str, Any]):
    """The run's durable checkpoint store (``trainflow.checkpoint.store``), or None."""
    from trainflow.checkpoint.store import open_store

    spec = plan["spec"]
    uri = spec.get("store_uri") or ""
    if not uri:
        return None
    return open_store(
        uri,
        spec["tenant"],
        plan["dag_id"],
        plan["run_id"],
        s3_client=s3_client_from_connection() if uri.startswith("s3://") else None,
    )


def airflow_run_state(dag_id: str, run_id: str) -> str | None:
    """A DAG run's state as Airflow has it now (asked from a running task), None when the
    run does not exist (deleted)."""
    from airflow.sdk.execution_time.task_runner import RuntimeTaskInstance

    if RuntimeTaskInstance.get_dr_count(dag_id=dag_id, run_ids=[run_id]) == 0:
        return None
    return str(RuntimeTaskInstance.get_dagrun_state(dag_id=dag_id, run_id=run_id))


def translate(exc: BaseException) -> BaseException:
    """Core error → Airflow error: user/config errors are never retried."""
    from airflow.sdk.exceptions import AirflowException, AirflowFailException

    if isinstance(exc, (SpecError, UserCodeError)):
        return AirflowFailException(str(exc))
    return AirflowException(f"{type(exc).__name__}: {exc}")


class Subprocess:
    """A child process in its own session whose output goes to the task log.

    ``kill`` signals the whole process tree (workers of the elastic agent live in sessions
    of their own), SIGTERM first so the tree can shut down, then SIGKILL.
    """

    def __init__(
        self, argv: list[str], *, log: "logging.Logger", env: dict[str, str] | None = None, inherit: bool = True
    ):
        self.argv, self.log = argv, log
        self.env = {**(os.environ if inherit else {}), **(env or {})}
        self.proc: subprocess.Popen | None = None

    def run(self, poll: Callable[[], str | None] | None = None, interval: float = 0.5) -> int | str:
        """Run to completion, streaming output; return the exit code.

        ``poll`` is called every ``interval`` seconds while the child runs; if it returns a
        reason, the child's tree is killed and the reason is returned instead of a code.
        """
        import threading

        self.proc = subprocess.Popen(
            self.argv,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=self.env,
            start_new_session=True,
            text=True,
            bufsize=1,
        )

        def pump() -> None:
            from trainflow.tracebacks import TracebackLevels

            assert self.proc is not None and self.proc.stdout is not None
            levels = TracebackLevels()  # a worker's traceback shows at ERROR
            for line in self.proc.stdout:
                line = line.rstrip()
                self.log.log(levels.level(line), "%s", line)

        reader = threading.Thread(target=pump, name="subprocess-log", daemon=True)
        reader.start()
        while self.proc.poll() is None:
            reason = poll() if poll is not None else None
            if reason:
                self.kill(grace=0)
                reader.join(timeout=5)
                return reason
            time.sleep(interval)
        reader.join(timeout=5)
        return self.proc.returncode

    def kill(self, grace: float = 5.0) -> None:
        from trainflow.proctree import signal_tree

        if self.proc is None or self.proc.poll() is not None:
            return
        if grace > 0:
            signal_tree(self.proc.pid, signal.SIGTERM)
        deadline = time.time() + grace
        while time.time() < deadline and self.proc.poll() is None:
            time.sleep(0.1)
        signal_tree(self.proc.pid, signal.SIGKILL)


def abort_message(abort: dict) -> str:
    what = "failed in user code" if abort.get("kind") == "user" else "stopped the run"
    from trainflow.remediation import abort_source

    return (
        f"{abort_source(abort)} {what}, not retried: {abort.get('message')} (to train the run "
        f"again, clear the whole run: provision sets this record aside)\n{abort.get('traceback', '')}"
    )


def python() -> str:
    return sys.executable
