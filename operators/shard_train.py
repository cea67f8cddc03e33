"""``shard_train``: one node of the gang (mapped, one task instance per node)."""

from __future__ import annotations

from typing import Any

from airflow.sdk import BaseOperator

from operators._common import Subprocess, abort_message, load_plan, python


class ShardTrainOperator(BaseOperator):
    """Run node ``node``'s agent, which launches its torch.distributed workers.

    The agent runs in its own process session; its output (and its workers') streams into
    this task's log; ``on_kill`` tears the whole process tree down. The newest checkpoint
    this node saw is kept in ``task_state_store`` (it survives retries) and pushed as XCom
    ``checkpoint``. Before the agent starts, the node passes its preflight
    (``trainflow.preflight``: cordon, chip health, free disk, rendezvous); infrastructure
    failures of the node are recorded against its host, which is cordoned after too many.

    :param node: node index in the gang (templated).
    :param plan_path: the run's plan.json written by provision (templated).
    """

    template_fields = ("node", "plan_path")

    def __init__(self, *, node: int, plan_path: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.node = node
        self.plan_path = plan_path
        self._agent: Subprocess | None = None

    def execute(self, context) -> dict[str, Any]:
        import json
        import os
        import time
        from pathlib import Path

        from airflow.sdk.exceptions import AirflowException, AirflowFailException

        from trainflow import preflight
        from trainflow.checkpoint.manifest import newest_verified
        from trainflow.cluster.hosts import CordonPolicy, HostRegistry, host_name
        from trainflow.errors import PreflightError
        from trainflow.heartbeat import read_all
        from trainflow.remediation import aborted as read_abort
        from trainflow.timeline import record
        from trainflow.workspace import write_json_atomic

        run_dir = Path(self.plan_path).parent
        plan = load_plan(run_dir)
        node, spec = int(self.node), plan["spec"]
        store = context.get("task_state_store")
        try_number = context["ti"].try_number
        if try_number > spec["retries"] + 1:
            raise AirflowFailException(f"node {node}: retry budget of the run spent "
                                       f"(retries={spec['retries']}, this is try {try_number})")
        if store is not None and (prev := store.get("checkpoint")):
            self.log.info("an earlier try of node %d reached checkpoint step %s", node, prev.get("step"))
        if (abort := read_abort(run_dir)) is not None:
            raise AirflowFailException(abort_message(abort))
        host, hosts, policy = host_name(), HostRegistry(), CordonPolicy.from_env()
        run_key = f"{plan['tenant']}/{plan['dag_id']}/{plan['run_id']}"

        def host_failed(reason: str) -> None:
            cordon = hosts.record_failure(host, reason=reason, run_key=run_key, node=node, policy=policy)
            if cordon is not None:
                self.log.warning("host %s is cordoned: %s", host, cordon.reason)
                record(run_dir, "host_cordoned", host=host, node=node, reason=cordon.reason)

        marker = run_dir / "nodes" / f"task-{node:04d}.json"
        if marker.exists() and "ended" not in (last := json.loads(marker.read_text())):
            # The previous try died without a word (SIGKILL, its host lost): its host failed.
            hosts.record_failure(last["host"], reason=f"node {node} task of try {last['try']} died",
                                 run_key=run_key, node=node, policy=policy)
        marker.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(marker, {"host": host, "try": try_number, "pid": os.getpid()})
        try:
            for check in preflight.run(plan, node, host=host, registry=hosts, policy=policy):
                self.log.info("preflight %s: %s", check.name, check.detail)
        except PreflightError as exc:
            record(run_dir, "preflight_failed", node=node, host=host, message=str(exc))
            host_failed(str(exc))
            write_json_atomic(marker, {"host": host, "try": try_number, "ended": "preflight_failed"})
            raise AirflowException(str(exc)) from exc
        request = run_dir / "control" / f"restart-node-{node:04d}.json"
        started = time.time()

        def poll() -> str | None:
            if read_abort(run_dir) is not None:
                return "abort"
            if request.exists():
                handled = request.with_name(f"{request.name}.handled-try{try_number}")
                os.replace(request, handled)
                if json.loads(handled.read_text())["time"] >= started:
                    return f"restart requested by the heartbeat watch: {handled.read_text()}"
                self.log.info("ignoring a replacement request older than this try")
            return None

        self._agent = Subprocess([python(), "-u", "-m", "trainflow.launch.agent",
                                  "--plan", self.plan_path, "--node", str(node)], log=self.log,
                                 env={"TRAINFLOW_NODE_TASK_PID": str(os.getpid())})
        rc = self._agent.run(poll=poll)
        write_json_atomic(marker, {"host": host, "try": try_number, "ended": str(rc)[:200]})
        ckpt = newest_verified(run_dir / "checkpoints")
        if ckpt is not None:
            pointer = {"step": ckpt.step, "path": ckpt.path, "manifest_sha256": ckpt.manifest_sha256}
            if store is not None:
                store.set("checkpoint", pointer)
            context["ti"].xcom_push(key="checkpoint", value=pointer)
        if (abort := read_abort(run_dir)) is not None:
            raise AirflowFailException(abort_message(abort))
        if isinstance(rc, str):
            host_failed(f"node {node} replaced: {rc}")
            raise AirflowException(f"node {node} killed for replacement: {rc}")
        if rc != 0:
            host_failed(f"node {node} agent exited with code {rc}")
            raise AirflowException(f"node {node} agent exited with code {rc}")
        mine = {r: b for r, b in read_all(run_dir / "heartbeats").items() if b.get("node") == node}
        return {
            "node": node,
            "host": host,
            "ranks": sorted(mine),
            "step": min((b["step"] for b in mine.values()), default=0),
            "loss": {str(r): b.get("loss") for r, b in sorted(mine.items())},
            "samples_per_s": sum(b.get("samples_per_s", 0.0) for b in mine.values()),
        }

    def on_kill(self) -> None:
        if self._agent is not None:
            self._agent.kill()
