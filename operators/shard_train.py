"""``shard_train``: one node of the gang (mapped, one task instance per node)."""

from __future__ import annotations

from typing import Any

from airflow.sdk import BaseOperator

from operators._common import Subprocess, abort_message, durable_store, load_plan, python


class ShardTrainOperator(BaseOperator):
    r"""Run node ``node``'s agent, which launches its torch.distributed workers.

    The agent runs in its own process session; its output (and its workers') streams into
    this task's log; ``on_kill`` tears the whole process tree down. The newest checkpoint
    this node saw is kept in ``task_state_store`` (it survives retries) and pushed as XCom
    ``checkpoint``. Before the agent starts, the node passes its preflight
    (``trainflow.cluster.nodes.NodeTry``: cordon, chip health, free disk, rendezvous);
    infrastructure failures of the node are charged to its host, which is cordoned after
    too many. Failures raise trainflow's own errors, which the DAG's retry policy sorts:
    ``RunAbortedError`` fails at once, other ``TrainingError``\ s retry after 1 s. A
    preemptible run's node watches for the allocator's preemption order: the gang stops at a
    checkpoint, the task gives the nodes back, requeues the run and defers until it is
    admitted again, then trains on from that checkpoint in the same try
    (``trainflow.cluster.preemption``).

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
        from pathlib import Path

        from airflow.sdk.exceptions import AirflowFailException

        from trainflow.errors import RunAbortedError
        from trainflow.remediation import aborted as read_abort

        run_dir = Path(self.plan_path).parent
        plan = load_plan(run_dir)
        node, spec = int(self.node), plan["spec"]
        store = context.get("task_state_store")
        try_number = context["ti"].try_number
        tries = try_number - self._try_base(store, plan, try_number)
        if tries > spec["retries"] + 1:
            import time

            from trainflow.remediation import abort

            message = (
                f"node {node}: retry budget of the run spent (retries={spec['retries']}, this is "
                f"try {tries}" + (f", Airflow's {try_number}" if tries != try_number else "") + ")"
            )
            # The gang cannot be whole again: stop the other nodes and the watch now, instead
            # of leaving them waiting for this node until their own timeouts.
            abort(
                run_dir,
                {
                    "rank": None,
                    "node": node,
                    "kind": "retries_exhausted",
                    "type": "RetryBudgetSpent",
                    "message": message,
                    "time": time.time(),
                },
            )
            raise AirflowFailException(message)
        if store is not None and (prev := store.get("checkpoint")):
            self.log.info("an earlier try of node %d reached checkpoint step %s", node, prev.get("step"))
        if (abort := read_abort(run_dir)) is not None:
            raise RunAbortedError(abort_message(abort))
        if not self._capacity(run_dir, node):
            return {"node": node, "released": True, "ranks": [], "step": None}
        watch = self._preemption_watch(run_dir, plan, node)
        if watch is not None and not watch.holds_lease():
            # Preempted and requeued (a retry, or a wait that timed out): train only once
            # admitted again, never beside the run its nodes were given to.
            self.log.info("node %d: the run holds no lease (preempted and requeued); waiting for re-admission", node)
            self._defer_admission(plan, watch)
        if spec.get("launcher") == "kubernetes":
            return self._run_pod(context, plan, node, try_number)
        return self._train(context, run_dir, plan, node, try_number)

    def _train(self, context, run_dir, plan: dict, node: int, try_number: int) -> dict[str, Any]:
        """Preflight, then run the node's agent until the gang ends; a preempted gang's
        node task requeues the run and defers until it is admitted again (``readmitted``)."""
        import os

        from trainflow.checkpoint.manifest import newest_verified
        from trainflow.cluster.nodes import NodeTry
        from trainflow.errors import HeartbeatTimeoutError, LaunchError, RunAbortedError
        from trainflow.heartbeat import read_all
        from trainflow.remediation import aborted as read_abort
        from trainflow.workspace import completed

        store = context.get("task_state_store")
        run_try = try_number - self._try_base(store, plan, try_number)  # the retry budget's count
        attempt = NodeTry(plan, node, try_number, run_try=run_try)
        for check in attempt.begin():
            self.log.info("preflight %s: %s", check.name, check.detail)
        durable = durable_store(plan)  # one client for the fetch and the uploads
        self._hydrate(run_dir, plan, durable)
        uploader = self._uploader(run_dir, plan, node, durable)
        watch = self._preemption_watch(run_dir, plan, node)
        overdue: list[str] = []

        members = self._member_watch(context, plan, node, run_dir)

        def poll() -> str | None:
            if uploader is not None:
                uploader.poll()
            if read_abort(run_dir) is not None or members():
                return "abort"
            if watch is not None and (why := watch.poll()) is not None:
                overdue.append(why)
                return why
            return attempt.replacement_requested()

        self._agent = Subprocess(
            [python(), "-u", "-m", "trainflow.launch.agent", "--plan", self.plan_path, "--node", str(node)],
            log=self.log,
            env={"TRAINFLOW_NODE_TASK_PID": str(os.getpid())},
        )
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
        if watch is not None and (overdue or rc == 0) and not completed(run_dir) and watch.ordered():
            self._requeue(context, plan, node, attempt, watch, forced=overdue[0] if overdue else None)
        if isinstance(rc, str):
            attempt.end("replaced", failure=f"node {node} replaced: {rc}")
            raise HeartbeatTimeoutError(f"node {node} killed for replacement: {rc}")
        if rc != 0:
            if rc < 0:
                attempt.agent_ended_by_signal(rc)
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

    @staticmethod
    def _try_base(store, plan: dict, try_number: int) -> int:
        """Airflow's try number before this provision of the run: a cleared run counts its
        retry budget afresh (Airflow's try numbers go on counting across clears)."""
        epoch = plan.get("epoch", 1)
        if store is None:
            return 0
        if store.get("epoch") != epoch:
            store.set("epoch", epoch)
            store.set("try_base", try_number - 1)
        return int(store.get("try_base") or 0)

    def _member_watch(self, context, plan: dict, node: int, run_dir, every: float = 5.0):
        """A check, called on every poll, that ends the run when another node of a fixed
        gang ended for good (marked failed, tries spent): without it this node's agent
        would wait for that member in the rendezvous until its timeout, try after try.
        Asks Airflow for the gang's task states every ``every`` seconds."""
        import time

        from trainflow.remediation import end_for_member, ended_member, node_finished

        spec = plan["spec"]
        if isinstance(spec.get("nodes"), str) or spec.get("spares"):
            return lambda: False  # an elastic gang shrinks past a lost member; spares replace it
        ti, next_check = context["ti"], [0.0]

        def check() -> bool:
            if time.monotonic() < next_check[0]:
                return False
            next_check[0] = time.monotonic() + every
            try:
                found = ti.get_task_states(dag_id=self.dag_id, task_ids=[self.task_id], run_ids=[context["run_id"]])
            except Exception as exc:  # noqa: BLE001 - the API server restarting: ask again later
                self.log.debug("gang task states unavailable: %s", exc)
                return False
            prefix = f"{self.task_id}_"
            states = {
                int(k[len(prefix) :]): v
                for k, v in (found.get(context["run_id"]) or {}).items()
                if k.startswith(prefix) and k[len(prefix) :].isdigit()
            }
            ended = ended_member(states, me=node, finished=lambda n: node_finished(run_dir, n))
            if ended is None:
                return False
            self.log.error("%s", end_for_member(run_dir, *ended, now=time.time()))
            return True

        return check

    def _preemption_watch(self, run_dir, plan: dict, node: int):
        """The node's watch over preemption orders (None: the run is not preemptible)."""
        from trainflow.cluster.preemption import PreemptionWatch
        from trainflow.cluster.slots import SlotLeases

        leases = SlotLeases.open(run_dir)
        if not plan["spec"].get("preemptible") or leases is None or not leases.request:
            return None
        watch = PreemptionWatch(run_dir, leases.run_key, node)
        watch.request = leases.request  # what the run asks again with once requeued
        return watch

    def _requeue(self, context, plan: dict, node: int, attempt, watch, *, forced: str | None) -> None:
        """The gang stopped for a preemption (or was stopped, ``forced``): give the nodes
        back, requeue the run and wait deferred, holding no worker slot, until the pool
        admits it again; then ``readmitted`` starts the node again. Never returns."""
        step = watch.stopped_at()
        attempt.end("preempted")
        request = watch.request
        by = (watch.order or {}).get("by")
        if forced:
            self.log.warning("node %d: %s", node, forced)
        else:
            self.log.info("node %d: preempted for %r; the gang stopped at its checkpoint of step %s", node, by, step)
        if watch.requeue(nodes=request["nodes"]):
            self.log.info("gave the run's nodes back; it waits in pool %r's queue for re-admission", request["pool"])
        context["ti"].xcom_push(key="preempted", value={"by": by, "step": step, "forced": bool(forced)})
        self._defer_admission(plan, watch)

    def _defer_admission(self, plan: dict, watch) -> None:
        """Wait, deferred, until the pool admits the run again (``readmitted``)."""
        from datetime import timedelta

        from operators.provision import AdmissionTrigger

        self.defer(
            trigger=AdmissionTrigger(request=watch.request),
            method_name="readmitted",
            timeout=timedelta(seconds=float(plan["spec"]["admission_timeout"])),
        )

    def readmitted(self, context, event: dict[str, Any]) -> dict[str, Any]:
        """Resume after a preemption: the run was admitted again; train from the checkpoint
        the gang stopped at."""
        from pathlib import Path

        from airflow.sdk.exceptions import AirflowFailException

        from trainflow.errors import RunAbortedError
        from trainflow.remediation import aborted as read_abort

        if event.get("status") != "admitted":
            raise AirflowFailException(f"re-admission after a preemption: {event.get('message')}")
        run_dir = Path(self.plan_path).parent
        plan, node = load_plan(run_dir), int(self.node)
        watch = self._preemption_watch(run_dir, plan, node)
        watch.resumed(float(event.get("waited_s", 0.0)))
        self.log.info("node %d: admitted again after %.0f s in the queue; resuming", node, event.get("waited_s", 0.0))
        if (abort := read_abort(run_dir)) is not None:
            raise RunAbortedError(abort_message(abort))
        return self._train(context, run_dir, plan, node, context["ti"].try_number)

    def _run_pod(self, context, plan: dict, node: int, try_number: int) -> dict[str, Any]:
        """Run the node as a pod; its agent does the preflight on the chip host."""
        from operators._k8s import pod_operator
        from trainflow.cluster.hosts import CordonPolicy, HostRegistry
        from trainflow.launch.k8s import build_pod

        cordoned = [h["host"] for h in HostRegistry().hosts(policy=CordonPolicy.from_env()) if h["cordoned"]]
        pod = build_pod(plan, node, try_number=try_number, cordoned=cordoned, plan_path=self.plan_path)
        self.log.info(
            "node %d: pod %s/%s on %s (%s)",
            node,
            pod["metadata"]["namespace"],
            pod["metadata"]["name"],
            plan["queue"],
            pod["spec"]["containers"][0]["image"],
        )
        self._pod = pod_operator(
            pod, task_id=f"{self.task_id}_pod", startup_timeout_s=int(plan["spec"]["startup_timeout"])
        )
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
        ref = hydrate(
            run_dir, store, training_hash=spec.training_hash(), world_size=None if spec.elastic else spec.world_size
        )
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
        return BackgroundPublisher(
            run_dir,
            store,
            training_hash=spec.training_hash(),
            world_size=None if spec.elastic else spec.world_size,
            keep_last=spec.keep_last,
            log=self.log,
        )

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
