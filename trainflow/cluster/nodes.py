"""One try of one node task on its host: preflight, failure records, replacement requests.

The shard_train operator drives it; everything here is Airflow-free. A marker file per
node (``nodes/task-<n>.json``) says which host runs the current try and whether it ended;
a try that finds its predecessor's marker unended knows that try died without a word
(SIGKILL, a lost host) and charges the failure to that host.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import time
from pathlib import Path

from trainflow import preflight
from trainflow.cluster.hosts import CordonPolicy, HostRegistry, host_name
from trainflow.errors import ChipUnavailableError, PreflightError
from trainflow.remediation import abort
from trainflow.timeline import record
from trainflow.workspace import write_json_atomic

log = logging.getLogger(__name__)


def try_lost(run_dir: Path, node: int, try_number: int) -> bool:
    """Whether try ``try_number`` of node ``node`` was lost with its host: it never began
    (no marker of it: its host never took it) or began and never ended (killed without a
    word: a dead host, a SIGKILL). A try that ended, even failed, was not lost: its host
    answered, and the host's failure record and cordon judge it."""
    try:
        last = json.loads((Path(run_dir) / "nodes" / f"task-{node:04d}.json").read_text())
    except (OSError, ValueError):
        return True
    return int(last.get("try", 0)) < try_number or "ended" not in last


def mark_injected(run_dir: Path, node: int, kind: str) -> None:
    """Note on node ``node``'s marker that its current try is being killed by an injected
    fault (``kill_node``, ``lose_node``): the next try does not charge that death to the
    host (a rehearsal must not cordon a shared host), while placement still treats the
    try as lost."""
    marker = Path(run_dir) / "nodes" / f"task-{node:04d}.json"
    try:
        last = json.loads(marker.read_text())
    except (OSError, ValueError):
        return
    if "ended" not in last:
        write_json_atomic(marker, {**last, "injected": kind})


class NodeTry:
    """Try ``try_number`` of node ``node`` of the run planned in ``plan``."""

    def __init__(
        self,
        plan: dict,
        node: int,
        try_number: int,
        *,
        host: str | None = None,
        registry: HostRegistry | None = None,
        policy: CordonPolicy | None = None,
        run_try: int | None = None,
    ) -> None:
        self.plan, self.node, self.try_number = plan, node, try_number
        # The try within the run's retry budget (a cleared run counts afresh, while Airflow's
        # try numbers go on), shown beside the budget on the training page and in `status`.
        self.run_try = try_number if run_try is None else run_try
        self.run_dir = Path(plan["run_dir"])
        self.host = host or host_name()
        self.hosts = registry or HostRegistry()
        self.policy = policy or CordonPolicy.from_env()
        self.run_key = f"{plan['tenant']}/{plan['dag_id']}/{plan['run_id']}"
        self.marker = self.run_dir / "nodes" / f"task-{node:04d}.json"
        self.request = self.run_dir / "control" / f"restart-node-{node:04d}.json"
        self.started = time.time()

    def begin(self) -> list[preflight.Check]:
        """Charge a silently dead predecessor to its host, then run the preflight.

        Raises:
            PreflightError: the node must not join (recorded against this host).
        """
        if self.marker.exists() and "ended" not in (last := json.loads(self.marker.read_text())):
            if last.get("injected"):
                log.info(
                    "node %d's try %s was killed by an injected %s fault: not charged to host %s",
                    self.node,
                    last["try"],
                    last["injected"],
                    last["host"],
                )
            else:
                self.hosts.record_failure(
                    last["host"],
                    reason=f"node {self.node} task of try {last['try']} died",
                    run_key=self.run_key,
                    node=self.node,
                    policy=self.policy,
                )
                record(self.run_dir, "node_task_lost", node=self.node, host=last["host"], **{"try": last["try"]})
        self.marker.parent.mkdir(parents=True, exist_ok=True)
        self.started = time.time()
        write_json_atomic(self.marker, {**self._marker_fields(), "pid": os.getpid(), "began": self.started})
        try:
            return preflight.run(self.plan, self.node, host=self.host, registry=self.hosts, policy=self.policy)
        except ChipUnavailableError as exc:
            # The worker, not the host, is wrong: no retry can help and nothing is charged
            # to the host. The abort record stops the other nodes and the heartbeat watch.
            record(self.run_dir, "chip_unavailable", node=self.node, host=self.host, message=str(exc))
            abort(
                self.run_dir,
                {
                    "rank": None,
                    "node": self.node,
                    "kind": "chip_unavailable",
                    "type": type(exc).__name__,
                    "message": str(exc),
                    "time": time.time(),
                },
            )
            self.end("chip_unavailable")
            raise
        except PreflightError as exc:
            record(self.run_dir, "preflight_failed", node=self.node, host=self.host, message=str(exc))
            self.end("preflight_failed", failure=str(exc))
            raise

    def _marker_fields(self) -> dict:
        """What the try's marker says while it runs and after it ended: its host, Airflow's
        try number, the try within the run's retry budget and the tries the budget allows."""
        tries = int((self.plan.get("spec") or {}).get("retries", 0)) + 1
        return {"host": self.host, "try": self.try_number, "run_try": self.run_try, "tries": tries}

    def end(self, outcome: str, *, failure: str | None = None) -> None:
        """Mark the try ended; a ``failure`` is charged to this host (which may cordon it)."""
        write_json_atomic(
            self.marker,
            {**self._marker_fields(), "ended": outcome[:200], "began": self.started, "ended_at": time.time()},
        )
        if failure is None:
            return
        before = self.hosts.cordoned(self.host)
        cordon = self.hosts.record_failure(
            self.host, reason=failure, run_key=self.run_key, node=self.node, policy=self.policy
        )
        if cordon is not None and before is None:
            log.warning("host %s is cordoned: %s", self.host, cordon.reason)
            record(self.run_dir, "host_cordoned", host=self.host, node=self.node, reason=cordon.reason)

    def agent_ended_by_signal(self, code: int) -> None:
        """Record (``agent_exited``) that this try's agent died of a signal it did not ask for
        (``code``: its negative exit status) — trainflow stops an agent through its node
        task, never alone — so the fault is on the run's books with its cause: the agent's
        workers die with it unobserved, and the exits the survivors see only follow from it."""
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        record(self.run_dir, "agent_exited", node=self.node, host=self.host, signal=name)

    def replacement_requested(self) -> str | None:
        """The heartbeat watch's request to replace this node, if one was made during this
        try (older ones are set aside); cordons this host when the request says so."""
        if not self.request.exists():
            return None
        handled = self.request.with_name(f"{self.request.name}.handled-try{self.try_number}")
        os.replace(self.request, handled)
        req = json.loads(handled.read_text())
        if req["time"] < self.started:
            log.info("ignoring a replacement request older than this try")
            return None
        if req.get("cordon"):
            self.hosts.cordon(self.host, reason=req["reason"])
            record(self.run_dir, "host_cordoned", host=self.host, node=self.node, reason=req["reason"])
        return f"restart requested by the heartbeat watch: {req['reason']}"
