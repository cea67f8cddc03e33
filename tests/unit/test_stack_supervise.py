"""``EmbeddedStack.supervise``: a component that dies is started again (real processes)."""

from __future__ import annotations

import os
import signal
import threading
import time

from trainflow.stack import EmbeddedStack


class _Sleepers(EmbeddedStack):
    """The stack's process management over two long sleeps instead of Airflow."""

    @property
    def components(self):
        return ("one", "two")

    def _command(self, component):
        return ["sleep", "600"], dict(os.environ)


def test_supervisor_restarts_a_killed_component_and_logs_it(tmp_path):
    stack = _Sleepers(home=tmp_path / "airflow", trainflow_home=tmp_path / "tf")
    (stack.home / "run").mkdir(parents=True)
    (stack.home / "logs").mkdir()
    assert stack.start() == ["one", "two"]
    heard: list[list[str]] = []
    stop = threading.Event()
    out: list = []
    thread = threading.Thread(target=lambda: out.append(stack.supervise(stop, interval=0.2, on_restart=heard.append)))
    thread.start()
    try:
        first = stack.pid("two")
        os.kill(first, signal.SIGKILL)
        deadline = time.time() + 10
        while time.time() < deadline and not heard:
            time.sleep(0.05)
        assert heard == [["two"]]
        assert stack.pid("two") not in (None, first) and stack.pid("one") is not None
    finally:
        stop.set()
        thread.join(timeout=10)
        stack.stop(grace=2)
    assert [r["components"] for r in out[0]] == [["two"]]
    assert "restarted two" in (stack.home / "logs" / "supervisor.log").read_text()
    assert stack.pid("one") is None and stack.pid("two") is None
