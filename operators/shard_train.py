"""``shard_train``: one node of the gang (mapped, one task instance per node)."""

from __future__ import annotations

from typing import Any

from airflow.sdk import BaseOperator

from operators._common import Subprocess, abort_message, durable_store, load_plan, python


class ShardTrainOperator(BaseOperator):
    """Run node ``node``'s agent, which launches its torch.distributed workers.

    The agent runs in its own process session; its output (and its workers') streams into
    this task's log; ``on_kill`` tears the whole process tree down. The newest checkpoint
    this node saw is kept in ``task_state_store`` (it survives retries) and pushed as XCom
    ``checkpoint``. Before the agent starts, the node passes its preflight
    (``trainflow.cluster.nodes.NodeTry``: cordon, chip health, free disk, rendezvous);
    infrastructure failures of the node are charged to its host, which is cordoned after
    too many. Failures raise trainflow's own errors, which the DAG's retry policy sorts:
    ``RunAbortedError`` fails at once, other ``TrainingError``\ s retry after 1 s.

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
        import os
        from pathlib import Path

        from airflow.sdk.exceptions import AirflowFailException

        from trainflow.checkpoint.manifest import newest_verified
        from trainflow.cluster.nodes import NodeTry
        from trainflow.errors import HeartbeatTimeoutError, LaunchError, RunAbortedError
        from trainflow.heartbeat import read_all
        from trainflow.remediation import aborted as read_abort

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
            raise RunAbortedError(abort_message(abort))
        if not self._capacity(run_dir, node):
            return {"node": node, "released": True, "ranks": [], "step": None}
        if spec.get("launcher") == "kubernetes":
            return self._run_pod(context, plan, node, try_number)
        attempt = NodeTry(plan, node, try_number)
        for check in attempt.begin():
            self.log.info("preflight %s: %s", check.name, check.detail)
        durable = durable_store(plan)  # one client for the fetch and the uploads
        self._hydrate(run_dir, plan, durable)
        uploader = self._uploader(run_dir, plan, node, durable)

        def poll() -> str | None:
            if uploader is not None:
                uploader.poll()
            return "abort" if read_abort(run_dir) is not None else attempt.replacement_requested()

        self._agent = Subprocess([python(), "-u", "-m", "trainflow.launch.agent",
                                  "--plan", self.plan_path, "--node", str(node)], log=self.log,
                                 env={"TRAINFLOW_NODE_TASK_PID": str(os.getpid())})
        rc = self._agent.run(poll=poll)
        if uploader is not None:
            uploader.close()
        ckpt = newest_verified(run_dir / "checkpoints")
        if ckpt is not None:
            pointer = {"step": ckpt.step, "path": ckpt.path, "manifest_sha256": ckpt.manifest_sha256}
            if store is not None:
                store.set("checkpoint", pointer)
            context["ti"].xcom_push(key="checkpoint", value=pointer)
        if (abort := read_abort(run_dir)) is not None:
            attempt.end("aborted")
            raise RunAbortedError(abort_message(abort))
        if isinstance(rc, str):
            attempt.end("replaced", failure=f"node {node} replaced: {rc}")
            raise HeartbeatTimeoutError(f"node {node} killed for replacement: {rc}")
        if rc != 0:
            attempt.end(f"exit {rc}", failure=f"node {node} agent exited with code {rc}")
            raise LaunchError(f"node {node} agent exited with code {rc}")
        attempt.end("succeeded")
        mine = {r: b for r, b in read_all(run_dir / "heartbeats").items() if b.get("node") == node}
        return {
            "node": node,
            "host": attempt.host,
            "ranks": sorted(mine),
            "step": min((b["step"] for b in mine.values()), default=0),
            "loss": {str(r): b.get("loss") for r, b in sorted(mine.items())},
            "samples_per_s": sum(b.get("samples_per_s", 0.0) for b in mine.values()),
        }

    def _run_pod(self, context, plan: dict, node: int, try_number: int) -> dict[str, Any]:
        """Run the node as a pod; its agent does the preflight on the chip host."""
        from operators._k8s import pod_operator
        from trainflow.cluster.hosts import CordonPolicy, HostRegistry
        from trainflow.launch.k8s import build_pod

        cordoned = [h["host"] for h in HostRegistry().hosts(policy=CordonPolicy.from_env()) if h["cordoned"]]
        pod = build_pod(plan, node, try_number=try_number, cordoned=cordoned, plan_path=self.plan_path)
        self.log.info("node %d: pod %s/%s on %s (%s)", node, pod["metadata"]["namespace"],
                      pod["metadata"]["name"], plan["queue"], pod["spec"]["containers"][0]["image"])
        self._pod = pod_operator(pod, task_id=f"{self.task_id}_pod",
                                 startup_timeout_s=int(plan["spec"]["startup_timeout"]))
        self._pod.execute(context)
        return {"node": node, "pod": pod["metadata"]["name"], "ranks": [], "step": None}

    def _hydrate(self, run_dir, plan: dict, store) -> None:
        """Resume from the newest verified copy wherever it is: fetch the durable store's
        newest checkpoint when this workspace lost it (or never had it)."""
        from trainflow.checkpoint.store import hydrate
        from trainflow.spec import TrainingSpec

        if store is None:
            return
        spec = TrainingSpec.from_mapping(plan["spec"])
        ref = hydrate(run_dir, store, training_hash=spec.training_hash(),
                      world_size=None if spec.elastic else spec.world_size)
        if ref is not None:
            self.log.info("resume point: verified checkpoint step %d (%s)", ref.step, ref.path)

    def _uploader(self, run_dir, plan: dict, node: int, store):
        """Node 0 uploads each new verified checkpoint to the durable store while the gang
        trains, so a run that loses the hosts holding its local copy resumes from a recent
        durable one (checkpoint_sync still publishes the final checkpoint)."""
        from trainflow.checkpoint.store import BackgroundPublisher
        from trainflow.spec import TrainingSpec

        if node != 0 or store is None:
            return None
        spec = TrainingSpec.from_mapping(plan["spec"])
        return BackgroundPublisher(run_dir, store, training_hash=spec.training_hash(),
                                   world_size=None if spec.elastic else spec.world_size,
                                   keep_last=spec.keep_last, log=self.log)

    def _capacity(self, run_dir, node: int) -> bool:
        """Hold a node of the pool for this slot: True once it does, False if the run
        completed first (a slot of an elastic gang that never got capacity, or whose lost
        node never came back). A lost node is given back first (``SlotLeases``)."""
        import time

        from trainflow.cluster.slots import SlotLeases
        from trainflow.errors import RunAbortedError
        from trainflow.remediation import aborted as read_abort
        from trainflow.workspace import completed

        leases = SlotLeases.open(run_dir)
        if leases is None:
            return True
        if (lost := leases.settle_loss(node)) is not None:
            self.log.warning("node %d: its node was lost (%s); waiting for capacity", node, lost.get("reason"))
        said = False
        while not leases.acquire(node):
            if completed(run_dir):
                self.log.info("node %d: the run completed before capacity for this node freed", node)
                return False
            if (abort := read_abort(run_dir)) is not None:
                raise RunAbortedError(abort_message(abort))
            if not said:
                self.log.info("node %d: no free node in the pool; waiting for capacity", node)
                said = True
            time.sleep(1.0)
        return True

    def on_kill(self) -> None:
        if self._agent is not None:
            self._agent.kill()
        if getattr(self, "_pod", None) is not None:
            self._pod.on_kill()  # deletes the pod
