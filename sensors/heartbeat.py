"""``heartbeat_watch``: a deferrable sensor over the run's training-progress heartbeats.

The trigger polls the heartbeat files and asks the pure ``trainflow.heartbeat.classify``
what they mean; it yields one event when the run is complete, stalled, or never started.
No worker slot is held while watching.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, AsyncIterator

from airflow.sdk import BaseSensorOperator
from airflow.triggers.base import BaseTrigger, TriggerEvent

from operators._common import RUN_DIR_TEMPLATE


class HeartbeatTrigger(BaseTrigger):
    """Poll ``<run_dir>/heartbeats`` until every rank is done, or one stalls.

    :param run_dir: the run's workspace.
    :param world_size: ranks expected.
    :param timeout: seconds without progress that make a rank stalled.
    :param startup_timeout: seconds to wait for every rank's first heartbeat.
    :param started_at: wall-clock start of the watch (kept across trigger restarts).
    :param poll_interval: seconds between polls.
    """

    def __init__(self, *, run_dir: str, world_size: int, timeout: float, startup_timeout: float,
                 started_at: float, poll_interval: float = 1.0) -> None:
        super().__init__()
        self.run_dir = run_dir
        self.world_size = world_size
        self.timeout = timeout
        self.startup_timeout = startup_timeout
        self.started_at = started_at
        self.poll_interval = poll_interval

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (f"{type(self).__module__}.{type(self).__qualname__}", {
            "run_dir": self.run_dir, "world_size": self.world_size, "timeout": self.timeout,
            "startup_timeout": self.startup_timeout, "started_at": self.started_at,
            "poll_interval": self.poll_interval,
        })

    def check(self, now: float):
        from pathlib import Path

        from trainflow.heartbeat import HeartbeatPolicy, classify, read_all

        return classify(read_all(Path(self.run_dir) / "heartbeats"), now=now,
                        world_size=self.world_size, started_at=self.started_at,
                        policy=HeartbeatPolicy(timeout=self.timeout, startup_timeout=self.startup_timeout))

    async def run(self) -> AsyncIterator[TriggerEvent]:
        last = None
        while True:
            result = await asyncio.to_thread(self.check, time.time())
            if result.verdict != last:
                self.log.info("heartbeats: %s — %s", result.verdict.value, result.message)
                last = result.verdict
            if result.terminal:
                yield TriggerEvent({
                    "status": "success" if result.verdict.value == "complete" else "error",
                    "verdict": result.verdict.value, "message": result.message,
                    "ranks": list(result.ranks), "steps": {str(k): v for k, v in result.steps.items()},
                    "run_dir": self.run_dir,
                })
                return
            await asyncio.sleep(self.poll_interval)


class HeartbeatSensor(BaseSensorOperator):
    """Watch a run's heartbeats without holding a worker slot.

    Succeeds when every rank reports done; fails, naming the ranks and their steps, when a
    rank stops progressing for ``heartbeat_timeout`` or never reports.

    :param run_dir: the run's workspace (templated; default: provision's XCom).
    :param poll_interval: seconds between heartbeat polls in the triggerer.
    """

    template_fields = ("run_dir",)

    def __init__(self, *, run_dir: str = RUN_DIR_TEMPLATE, poll_interval: float = 1.0,
                 **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.run_dir = run_dir
        self.poll_interval = poll_interval

    def execute(self, context) -> None:
        from operators._common import load_plan

        spec = load_plan(self.run_dir)["spec"]
        self.defer(
            trigger=HeartbeatTrigger(
                run_dir=self.run_dir, world_size=spec["nodes"] * spec["nproc_per_node"],
                timeout=spec["heartbeat_timeout"], startup_timeout=spec["startup_timeout"],
                started_at=time.time(), poll_interval=self.poll_interval),
            method_name="execute_complete",
        )

    def execute_complete(self, context, event: dict[str, Any]) -> dict[str, Any]:
        from airflow.sdk.exceptions import AirflowException

        if event["status"] != "success":
            raise AirflowException(f"heartbeat watch: {event['verdict']}: {event['message']}")
        self.log.info("heartbeat watch: %s", event["message"])
        return {"verdict": event["verdict"], "steps": event["steps"]}
