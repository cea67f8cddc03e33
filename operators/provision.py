"""``provision``: validate the spec, admit the gang, create the workspace, plan the run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from airflow.sdk import BaseOperator

from operators._common import load_plan, translate


class ProvisionOperator(BaseOperator):
    """Validate the run's spec (from the DAG params) and admit its nodes all-or-nothing.

    Bad input fails the task at once (no retry) with the field, the value and the fix,
    before anything is allocated or written. Returns one kwargs dict per slot (the full
    gang's nodes, then the hot spares; slots beyond the admitted ones wait for capacity) for the
    mapped ``shard_train`` task; pushes ``plan``, ``run_dir`` and ``resume_from``.

    :param node_pool: trainflow allocator pool to admit the gang from (not an Airflow pool).
    :param lease_ttl: seconds a lease lives before it expires (backstop for crashed runs).
    """

    def __init__(self, *, node_pool: str = "embedded", lease_ttl: float = 24 * 3600, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.node_pool = node_pool
        self.lease_ttl = lease_ttl

    def execute(self, context) -> list[dict[str, Any]]:
        from trainflow.checkpoint.manifest import newest_verified
        from trainflow.cluster.allocator import Allocator, embedded_capacity
        from trainflow.cluster.hosts import HostRegistry
        from trainflow.cluster.slots import SlotLeases
        from trainflow.errors import SpecError, TrainingError
        from trainflow.launch.local import prepare
        from trainflow.plan import check_devices
        from trainflow.spec import TrainingSpec
        from trainflow.workspace import Workspace, default_root

        dag_id, run_id = self.dag_id, context["run_id"]
        try:
            spec = TrainingSpec.from_mapping(dict(context["params"]))
            ws = Workspace(default_root(), spec.tenant, dag_id, run_id)
            check_devices(spec, HostRegistry().inventory(spec.queue))
        except SpecError as exc:
            raise translate(exc) from exc
        self.log.info("spec: %s", spec.to_json())
        allocator = Allocator()
        if self.node_pool == "embedded":
            allocator.set_pool("embedded", embedded_capacity())
        run_key = f"{spec.tenant}/{dag_id}/{run_id}"
        slots = spec.max_nodes + spec.spares
        try:
            # The gang needs min_nodes (and its spares) now; an elastic one takes what more
            # is free up to its full size, and its other slots wait for capacity.
            lease = allocator.admit(run_key, tenant=spec.tenant, pool=self.node_pool,
                                    nodes=spec.min_nodes + spec.spares, up_to=slots, ttl=self.lease_ttl)
        except (SpecError, TrainingError) as exc:
            raise translate(exc) from exc
        self.log.info("admitted %d of %d nodes of pool %r until %.0f", lease.nodes, slots, lease.pool,
                      lease.expires)
        ws.create()
        plan_path = prepare(spec, ws.dir, dag_id=dag_id, run_id=run_id)
        SlotLeases.create(ws.dir, run_key, self.node_pool, lease.nodes, allocator)
        resume = newest_verified(ws.checkpoints, training_hash=spec.training_hash(),
                                 world_size=None if spec.elastic else spec.world_size)
        ti = context["ti"]
        plan = load_plan(ws.dir)
        ti.xcom_push(key="plan", value=plan)
        ti.xcom_push(key="run_dir", value=str(ws.dir))
        ti.xcom_push(key="resume_from", value=resume.to_dict() if resume else None)
        self.log.info("workspace %s; %s nodes (+%d spares) × %d ranks on queue %s; resume from %s",
                      ws.dir, spec.nodes, spec.spares, spec.nproc_per_node, plan["queue"],
                      f"step {resume.step}" if resume else "scratch")
        return [{"node": i, "plan_path": str(Path(plan_path))} for i in range(slots)]
