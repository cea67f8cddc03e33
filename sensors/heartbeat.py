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

# Polls in a row a straggler must stay flagged before its node is excluded (reporting
# takes 3): a rank slowed for a few seconds by a noisy neighbour is reported, not replaced.
EXCLUDE_POLLS = 10


class HeartbeatTrigger(BaseTrigger):
    """Poll ``<run_dir>/heartbeats`` until every rank is done, or one stalls.

    :param run_dir: the run's workspace.
    :param world_size: ranks expected.
    :param timeout: seconds without progress that make a rank stalled.
    :param startup_timeout: seconds to wait for every rank's first heartbeat.
    :param started_at: wall-clock start of the watch; a restarted trigger opens its startup
        window again when it starts.
    :param poll_interval: seconds between polls.
    :param max_remediations: node replacements requested before the watch gives up.
    :param straggler_margin: compute-time excess over the peers' median that flags a straggler.
    :param exclude_stragglers: replace a confirmed straggler's node after the next checkpoint.
    :param checkpoint_timeout: seconds a rank may go without a step while it saves or evaluates.
    :param stall_timeout: seconds a program without the SDK may go without output or a new
        checkpoint.
    """

    def __init__(
        self,
        *,
        run_dir: str,
        world_size: int,
        timeout: float,
        startup_timeout: float,
        started_at: float,
        poll_interval: float = 1.0,
        max_remediations: int = 0,
        straggler_margin: float = 0.5,
        exclude_stragglers: bool = False,
        checkpoint_timeout: float | None = None,
        stall_timeout: float | None = None,
    ) -> None:
        super().__init__()
        self.checkpoint_timeout = checkpoint_timeout
        self.stall_timeout = stall_timeout
        self.exclude_stragglers = exclude_stragglers
        self.max_remediations = max_remediations
        self.straggler_margin = straggler_margin
        self.run_dir = run_dir
        self.world_size = world_size
        self.timeout = timeout
        self.startup_timeout = startup_timeout
        self.started_at = started_at
        self.poll_interval = poll_interval

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (
            f"{type(self).__module__}.{type(self).__qualname__}",
            {
                "run_dir": self.run_dir,
                "world_size": self.world_size,
                "timeout": self.timeout,
                "startup_timeout": self.startup_timeout,
                "checkpoint_timeout": self.checkpoint_timeout,
                "stall_timeout": self.stall_timeout,
                "started_at": self.started_at,
                "poll_interval": self.poll_interval,
                "max_remediations": self.max_remediations,
                "straggler_margin": self.straggler_margin,
                "exclude_stragglers": self.exclude_stragglers,
            },
        )

    def check(self, beats: dict[int, dict], now: float, node_started: dict[int, float] | None = None):
        from trainflow.heartbeat import HeartbeatPolicy, classify

        return classify(
            beats,
            now=now,
            world_size=self.world_size,
            started_at=self.started_at,
            policy=HeartbeatPolicy(
                timeout=self.timeout,
                startup_timeout=self.startup_timeout,
                checkpoint_timeout=self.checkpoint_timeout,
                stall_timeout=self.stall_timeout,
            ),
            node_started=node_started,
        )

    def watch_stragglers(
        self, run_dir, beats: dict[int, dict], suspects: dict[int, int], reported: dict[int, dict]
    ) -> None:
        """Report a rank flagged as a straggler in 3 consecutive polls (once per rank);
        with ``exclude_stragglers``, replace its node once a newer checkpoint commits."""
        from trainflow.checkpoint.manifest import list_checkpoints
        from trainflow.heartbeat import find_stragglers
        from trainflow.remediation import exclude_straggler
        from trainflow.timeline import record

        found = {s["rank"]: s for s in find_stragglers(beats, margin=self.straggler_margin)}
        for rank in list(suspects):
            if rank not in found:
                del suspects[rank]
        newest = next(iter(list_checkpoints(run_dir / "checkpoints")), (0, None))[0]
        for rank, info in found.items():
            suspects[rank] = suspects.get(rank, 0) + 1
            if suspects[rank] >= 3 and rank not in reported:
                reported[rank] = {**info, "confirmed_at_checkpoint": newest}
                self.log.warning(
                    "straggler: rank %d on node %s computes %.2f ms/step, %.0f%% slower "
                    "than the median of its peers (%.2f ms)",
                    rank,
                    info["node"],
                    info["compute_ms"],
                    100 * info["slower_by"],
                    info["median_ms"],
                )
                record(run_dir, "straggler", **info)
        if not self.exclude_stragglers:
            return
        for rank, info in reported.items():
            # Still flagged, for EXCLUDE_POLLS polls in a row, and a newer checkpoint is safe.
            if (
                not info.get("excluded")
                and suspects.get(rank, 0) >= EXCLUDE_POLLS
                and newest > info["confirmed_at_checkpoint"]
            ):
                info["excluded"] = True
                node = exclude_straggler(run_dir, info, checkpoint_step=newest, now=time.time())
                # The re-formed gang's startup window opens once the node is gone; until
                # then its peers still train, so their progress must not count as a stall.
                self.started_at = time.time() + self.timeout
                self.log.warning("straggler rank %d: checkpoint %d committed, replacing node %d", rank, newest, node)

    def event(self, status: str, verdict: str, message: str, result=None) -> TriggerEvent:
        return TriggerEvent(
            {
                "status": status,
                "verdict": verdict,
                "message": message,
                "ranks": list(result.ranks) if result else [],
                "steps": {str(k): v for k, v in result.steps.items()} if result else {},
                "run_dir": self.run_dir,
            }
        )

    async def run(self) -> AsyncIterator[TriggerEvent]:
        from pathlib import Path

        from trainflow.heartbeat import Action, decide, node_starts, read_all
        from trainflow.remediation import abort_source, aborted, remediations, request_node_restart
        from trainflow.workspace import preempted

        run_dir, last = Path(self.run_dir), None
        # The startup window opens when this watch starts, also when a triggerer restart
        # re-creates it: a watch that was not running cannot tell a hang from its own absence
        # (after a whole-stack stop every rank's last beat is old), and lost node tasks are
        # Airflow's to retry; a real hang still shows after the startup window.
        self.started_at = max(self.started_at, time.time())
        suspects: dict[int, int] = {}  # rank → consecutive polls flagged
        reported: dict[int, dict] = {}  # rank → its straggler report
        paused = False
        while True:
            if (stop := await asyncio.to_thread(preempted, run_dir)) is not None:
                # Preempted (or asked to stop for it): no progress is expected until the run
                # is admitted again; the re-formed gang then gets a fresh startup window.
                if not paused:
                    self.log.info("run preempted (%s): watch paused until it is admitted again", stop)
                paused, self.started_at, last = True, time.time(), None
                suspects.clear()
                await asyncio.sleep(self.poll_interval)
                continue
            if paused:
                self.log.info("run admitted again: watching its gang's startup")
                paused = False
            beats = await asyncio.to_thread(read_all, run_dir / "heartbeats")  # once per poll
            starts = await asyncio.to_thread(node_starts, run_dir)
            await asyncio.to_thread(self.watch_stragglers, run_dir, beats, suspects, reported)
            abort = await asyncio.to_thread(aborted, run_dir)
            now = time.time()
            result = self.check(beats, now, starts)
            done = await asyncio.to_thread(remediations, run_dir)
            action = decide(result.verdict, replacements=done, budget=self.max_remediations, aborted=abort is not None)
            if result.verdict != last:
                self.log.info("heartbeats: %s — %s", result.verdict.value, result.message)
                last = result.verdict
            if action == Action.FAIL and abort is not None:
                yield self.event(
                    "error",
                    "aborted",
                    f"run aborted by {abort_source(abort)} ({abort.get('kind')}): {abort.get('message')}",
                )
                return
            if action == Action.FAIL:
                yield self.event(
                    "error",
                    result.verdict.value,
                    f"{result.message}; {done} node replacements already requested (budget {self.max_remediations})",
                    result,
                )
                return
            if action == Action.SUCCEED:
                yield self.event("success", result.verdict.value, result.message, result)
                return
            if action == Action.REPLACE_NODES:
                nodes = await asyncio.to_thread(request_node_restart, run_dir, result, now)
                self.log.warning("hang detected: %s → replacing nodes %s", result.message, nodes)
                # A fresh startup window for the re-formed gang, opening once the replaced
                # nodes are gone: until then peers of a node that only looked stalled
                # (withheld heartbeats) still train, and their progress must not count.
                self.started_at = now + self.timeout
            await asyncio.sleep(self.poll_interval)


class HeartbeatSensor(BaseSensorOperator):
    """Watch a run's heartbeats without holding a worker slot.

    Succeeds when every rank reports done; fails, naming the ranks and their steps, when a
    rank stops progressing for ``heartbeat_timeout`` or never reports.

    :param run_dir: the run's workspace (templated; default: provision's XCom).
    :param poll_interval: seconds between heartbeat polls in the triggerer.
    """

    template_fields = ("run_dir",)

    def __init__(self, *, run_dir: str = RUN_DIR_TEMPLATE, poll_interval: float = 1.0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.run_dir = run_dir
        self.poll_interval = poll_interval

    def execute(self, context) -> None:
        from operators._common import load_plan

        plan = load_plan(self.run_dir)
        spec = plan["spec"]
        self.defer(
            trigger=HeartbeatTrigger(
                run_dir=self.run_dir,
                world_size=plan["world_size"],
                timeout=spec["heartbeat_timeout"],
                startup_timeout=spec["startup_timeout"],
                checkpoint_timeout=spec.get("checkpoint_timeout"),
                stall_timeout=spec.get("stall_timeout"),
                started_at=time.time(),
                poll_interval=self.poll_interval,
                max_remediations=spec["retries"] * len(plan["nodes"]),
                straggler_margin=spec["straggler_margin"],
                exclude_stragglers=spec.get("exclude_stragglers", False),
            ),
            method_name="execute_complete",
        )

    def execute_complete(self, context, event: dict[str, Any]) -> dict[str, Any]:
        from airflow.sdk.exceptions import AirflowException

        if event["status"] != "success":
            raise AirflowException(f"heartbeat watch: {event['verdict']}: {event['message']}")
        self.log.info("heartbeat watch: %s", event["message"])
        from pathlib import Path

        from trainflow.timeline import read

        stragglers = [
            {k: v for k, v in e.items() if k != "event"} for e in read(Path(self.run_dir)) if e["event"] == "straggler"
        ]
        return {"verdict": event["verdict"], "steps": event["steps"], "stragglers": stragglers}
