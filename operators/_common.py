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
from typing import TYPE_CHECKING, Any

from trainflow.errors import SpecError, UserCodeError

if TYPE_CHECKING:
    import logging

RUN_DIR_TEMPLATE = "{{ ti.xcom_pull(task_ids='provision', key='run_dir') }}"


def load_plan(run_dir: str | Path) -> dict[str, Any]:
    return json.loads((Path(run_dir) / "plan.json").read_text())


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

    def __init__(self, argv: list[str], *, log: "logging.Logger", env: dict[str, str] | None = None):
        self.argv, self.log = argv, log
        self.env = {**os.environ, **(env or {})}
        self.proc: subprocess.Popen | None = None

    def run(self) -> int:
        self.proc = subprocess.Popen(self.argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     env=self.env, start_new_session=True, text=True, bufsize=1)
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.log.info("%s", line.rstrip())
        return self.proc.wait()

    def kill(self, grace: float = 5.0) -> None:
        from trainflow.proctree import signal_tree

        if self.proc is None or self.proc.poll() is not None:
            return
        signal_tree(self.proc.pid, signal.SIGTERM)
        deadline = time.time() + grace
        while time.time() < deadline and self.proc.poll() is None:
            time.sleep(0.1)
        signal_tree(self.proc.pid, signal.SIGKILL)


def python() -> str:
    return sys.executable
