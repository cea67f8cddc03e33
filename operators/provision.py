"""``provision``: validate the spec, admit the gang, create the workspace, plan the run."""

from __future__ import annotations

from pathlib import Path
from typing import Any, AsyncIterator, Sequence

from airflow.sdk import BaseOperator
from airflow.triggers.base import BaseTrigger, TriggerEvent

from operators._common import airflow_run_state, load_plan, translate


def history_scope(dag_id: str, spec) -> str:
    """Which completed runs a run's runtime estimate is learnt from: the same DAG, workload
    and gang size (the release teardown records each completed run under it)."""
    return f"{dag_id}|{spec.workload}|{spec.max_nodes}x{spec.nproc_per_node}"


class ProvisionOperator(BaseOperator):
    """Validate the run's spec (from the DAG params) and admit its nodes all-or-nothing.

    Bad input fails the task at once (no retry) with the field, the value and the fix,
    before anything is allocated or written. Returns one kwargs dict per slot (the full
    gang's nodes, then the hot spares; slots beyond the admitted ones wait for capacity) for the
    mapped ``shard_train`` task; pushes ``plan``, ``run_dir`` and ``resume_from``.

    :param node_pool: trainflow allocator pool to admit the gang from (not an Airflow pool).
    :param lease_ttl: seconds a lease lives before it expires (backstop for crashed runs).
    :param tenants: the tenants the DAG runs for (None: any); another is refused, naming them.
    :param allow_faults: the DAG accepts a fault schedule in its conf (a rehearsal DAG);
        otherwise only a deployment with ``TRAINFLOW_ALLOW_FAULTS=1`` does.
    """

    def __init__(
        self,
        *,
        node_pool: str = "embedded",
        lease_ttl: float = 24 * 3600,
        tenants: Sequence[str] | None = None,
        allow_faults: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.node_pool = node_pool
        self.lease_ttl = lease_ttl
        self.tenants = list(tenants) if tenants is not None else None
        self.allow_faults = allow_faults

    def execute(self, context) -> list[dict[str, Any]]:
        from datetime import timedelta

        from trainflow.cluster.allocator import Waiting

        spec, ws, run_key = self._validate(context)
        self.log.info("spec: %s", spec.to_json())
        admission = self._request(spec, run_key)
        if isinstance(admission, Waiting):  # hand the wait to the triggerer
            self.log.info("waiting for capacity, position %d in the queue: %s", admission.position, admission.reason)
            context["ti"].xcom_push(key="admission", value=admission.to_dict())
            self.defer(
                trigger=AdmissionTrigger(request=self._request_kwargs(spec, run_key)),
                method_name="admitted",
                timeout=timedelta(seconds=float(spec.admission_timeout)),
            )
        return self._plan(context, spec, ws, run_key, admission)

    def admitted(self, context, event: dict[str, Any]) -> list[dict[str, Any]]:
        """Resume after the trigger saw the gang admitted (or the request refused)."""
        from airflow.sdk.exceptions import AirflowFailException

        from trainflow.cluster.allocator import Waiting

        if event.get("status") != "admitted":
            raise AirflowFailException(f"admission: {event.get('message')}")
        spec, ws, run_key = self._validate(context)
        lease = self._request(spec, run_key)  # the granted lease, renewed
        if isinstance(lease, Waiting):
            raise AirflowFailException(f"admission: the lease granted to {run_key} was lost: {lease.reason}")
        self.log.info("admitted after waiting %.0f s", event.get("waited_s", 0.0))
        return self._plan(context, spec, ws, run_key, lease)

    def _validate(self, context):
        from trainflow.cluster.hosts import HostRegistry
        from trainflow.errors import SpecError
        from trainflow.faults import check_allowed
        from trainflow.plan import check_devices
        from trainflow.spec import TrainingSpec, check_tenant
        from trainflow.workspace import Workspace, default_root

        try:
            spec = TrainingSpec.from_mapping(dict(context["params"]))
            check_tenant(spec.tenant, self.tenants)
            check_allowed(spec.faults, dag_allows=self.allow_faults)
            if spec.program:  # the program exists and comes from an allowed place, before any lease
                from trainflow.program import check_place

                check_place(spec.program, spec.working_dir)
            ws = Workspace(default_root(), spec.tenant, self.dag_id, context["run_id"])
            check_devices(spec, HostRegistry().inventory(spec.queue))
        except SpecError as exc:
            raise translate(exc) from exc
        return spec, ws, f"{spec.tenant}/{self.dag_id}/{context['run_id']}"

    def _request_kwargs(self, spec, run_key: str) -> dict[str, Any]:
        # The gang needs min_nodes (and its spares) now; an elastic one takes what more is
        # free up to its full size, and its other slots wait for capacity. The runtime
        # estimate (for a backfilling pool) is the spec's, else the DAG's history.
        # Computed once per task attempt: the request, the deferral and the slot leases all
        # use it, and the estimate reads the run history.
        from trainflow.cluster.allocator import Allocator

        memo = getattr(self, "_request_memo", None)
        if memo is not None and memo["run_key"] == run_key:
            return dict(memo)
        estimate = spec.runtime_estimate or Allocator().estimate(history_scope(self.dag_id, spec), spec.steps)
        self._request_memo = {
            "run_key": run_key,
            "tenant": spec.tenant,
            "pool": self.node_pool,
            "nodes": spec.min_nodes + spec.spares,
            "up_to": spec.max_nodes + spec.spares,
            "ttl": self.lease_ttl,
            "priority": spec.priority,
            "preemptible": spec.preemptible,
            "estimate": estimate,
            # a pool of registered hosts places each node on a host of this many chips
            "chips": spec.nproc_per_node,
        }
        return dict(self._request_memo)

    def _request(self, spec, run_key: str):
        from trainflow.cluster.allocator import Allocator, embedded_capacity
        from trainflow.errors import SpecError, TrainingError

        allocator = Allocator()
        if self.node_pool == "embedded":
            allocator.set_pool("embedded", embedded_capacity())
        allocator.release_gone(airflow_run_state)  # nodes of deleted runs come back first
        try:
            return allocator.request(**self._request_kwargs(spec, run_key))
        except (SpecError, TrainingError) as exc:
            raise translate(exc) from exc

    def _plan(self, context, spec, ws, run_key: str, lease) -> list[dict[str, Any]]:
        import time

        from trainflow.checkpoint.manifest import newest_verified
        from trainflow.cluster.allocator import Allocator
        from trainflow.cluster.slots import SlotLeases
        from trainflow.launch.local import prepare
        from trainflow.remediation import plan_epoch, provisioned

        dag_id, run_id = self.dag_id, context["run_id"]
        slots = spec.max_nodes + spec.spares
        self.log.info(
            "admitted %d of %d nodes of pool %r until %.0f%s",
            lease.nodes,
            slots,
            lease.pool,
            lease.expires,
            f" on hosts {', '.join(lease.hosts)}" if lease.hosts else "",
        )
        ws.create()
        previous = plan_epoch(ws.dir)  # > 0: the run was cleared and is provisioned again
        plan_path = prepare(spec, ws.dir, dag_id=dag_id, run_id=run_id)
        epoch = provisioned(ws.dir, plan_path, previous, now=time.time())
        SlotLeases.create(
            ws.dir, run_key, self.node_pool, lease.nodes, Allocator(), request=self._request_kwargs(spec, run_key)
        )
        resume = newest_verified(
            ws.checkpoints, training_hash=spec.training_hash(), world_size=None if spec.elastic else spec.world_size
        )
        ti = context["ti"]
        plan = load_plan(ws.dir)
        ti.xcom_push(key="plan", value=plan)
        ti.xcom_push(key="run_dir", value=str(ws.dir))
        ti.xcom_push(key="resume_from", value=resume.to_dict() if resume else None)
        # hosts: node slot i runs on hosts[i] (a pool of registered hosts; the executor routes
        # each node task's try there, executors/placement.py)
        ti.xcom_push(
            key="admission",
            value={"state": "admitted", "pool": lease.pool, "nodes": lease.nodes, "hosts": list(lease.hosts)},
        )
        self.log.info(
            "workspace %s; %s nodes (+%d spares) × %d ranks on queue %s; resume from %s%s",
            ws.dir,
            spec.nodes,
            spec.spares,
            spec.nproc_per_node,
            plan["queue"],
            f"step {resume.step}" if resume else "scratch",
            f" (provisioned again: epoch {epoch})" if epoch > 1 else "",
        )
        return [{"node": i, "plan_path": str(Path(plan_path))} for i in range(slots)]


class AdmissionTrigger(BaseTrigger):
    """Renew a waiting admission request every ``poll_interval`` seconds until the gang is
    admitted (event ``admitted``) or the request is refused (``refused``); its queue
    position changes are logged. The triggerer holds the wait: no worker slot sleeps.

    :param request: ``Allocator.request`` keyword arguments.
    :param poll_interval: seconds between renewals.
    """

    def __init__(self, *, request: dict[str, Any], poll_interval: float = 2.0, started: float | None = None) -> None:
        import time

        super().__init__()
        self.request = request
        self.poll_interval = poll_interval
        self.started = time.time() if started is None else started

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (
            f"{type(self).__module__}.{type(self).__qualname__}",
            {"request": self.request, "poll_interval": self.poll_interval, "started": self.started},
        )

    async def run(self) -> AsyncIterator[TriggerEvent]:
        import asyncio
        import time

        from trainflow.cluster.allocator import Allocator, Waiting
        from trainflow.errors import SpecError

        said = None
        while True:
            try:
                answer = await asyncio.to_thread(Allocator().request, **self.request)
            except SpecError as exc:
                yield TriggerEvent({"status": "refused", "message": str(exc)})
                return
            if not isinstance(answer, Waiting):
                yield TriggerEvent(
                    {"status": "admitted", "nodes": answer.nodes, "waited_s": time.time() - self.started}
                )
                return
            if (answer.position, answer.reason) != said:
                self.log.info(
                    "%s waits, position %d in the queue: %s", self.request["run_key"], answer.position, answer.reason
                )
                said = (answer.position, answer.reason)
            await asyncio.sleep(self.poll_interval)
