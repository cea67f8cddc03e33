"""``build_plan``: the pure description of how a run is laid out over nodes.

No I/O and no clock: the port and host of the rendezvous are parameters, so a plan can
be built (and dry-run, and tested) anywhere.
"""

from __future__ import annotations

import hashlib
from typing import Any

from trainflow.errors import SpecError
from trainflow.spec import TrainingSpec


def rendezvous_id(tenant: str, dag_id: str, run_id: str, attempt: int = 0) -> str:
    digest = hashlib.sha256(f"{tenant}/{dag_id}/{run_id}".encode()).hexdigest()[:16]
    return f"tf-{digest}-{attempt}"


def rendezvous_poll_interval(nodes: int) -> float:
    """Seconds between an agent's reads of the shared rendezvous state (pure).

    Short polls make a restarted gang re-form quickly (torch elastic's own 1 s costs about
    2 s per worker restart, see ``launch.agent.fast_rendezvous_polling``), but every agent
    reads once per poll while it waits or monitors its workers, so the store serves
    ``nodes / poll`` reads a second: 0.1 s up to 10 nodes, then as long as keeps that at
    100 reads a second, and never longer than torch's own 1 s.
    """
    return min(1.0, max(0.1, nodes / 100))


def check_devices(spec: TrainingSpec, inventory: list[dict]) -> list[dict]:
    """The registered hosts of the spec's queue that can hold one node (``nproc_per_node``
    devices); refuses the run when hosts are registered and none can (pure).

    ``inventory`` is ``HostRegistry.inventory(spec.queue)`` (``trainflow doctor --register``);
    with no host registered the node's own preflight counts the devices instead.

    Raises:
        SpecError: on ``nproc_per_node``, naming the largest host and the fix.
    """
    from trainflow.chips.registry import get_family

    if not get_family(spec.chip).has_devices or not inventory:
        return list(inventory)
    fit = [h for h in inventory if h["devices"] >= spec.nproc_per_node]
    if not fit:
        best = max(inventory, key=lambda h: h["devices"])
        raise SpecError(
            "nproc_per_node",
            spec.nproc_per_node,
            f"no host of queue {spec.queue!r} has that many devices (the largest, "
            f"{best['host']}, has {best['devices']}); use at most {best['devices']}, "
            f"or more nodes with fewer ranks each",
        )
    return fit


KEEP_ALIVE_S = 1
KEEP_ALIVE_MISSES = 3


def build_plan(
    spec: TrainingSpec,
    *,
    dag_id: str,
    run_id: str,
    run_dir: str,
    rdzv_endpoint: str,
    rdzv_backend: str = "trainflow-db",
    env: dict[str, str] | None = None,
    max_restarts: int | None = None,
) -> dict[str, Any]:
    """Lay ``spec`` out over its nodes.

    Args:
        spec: the validated training spec.
        dag_id, run_id: the Airflow run this plan belongs to.
        run_dir: the run's workspace directory.
        rdzv_endpoint, rdzv_backend: the gang's rendezvous: ``trainflow-db`` (default) on a
            database no node hosts (``sqlite:////path.db``; it survives any node's loss),
            or torch's ``c10d`` on ``host:port`` (lost with the node that hosts it).
        env: extra environment for the node agents and workers (e.g. GLOO_SOCKET_IFNAME).
        max_restarts: in-node worker restarts the agent may do before it fails (default:
            two more than the crash-loop limit, so the crash-loop check decides first).

    Returns:
        A JSON-serialisable plan; ``plan["nodes"][i]`` describes node i.
    """
    queue = spec.queue
    k = spec.nproc_per_node
    return {
        "dag_id": dag_id,
        "run_id": run_id,
        "tenant": spec.tenant,
        "run_dir": run_dir,
        "spec": spec.to_dict(),
        "world_size": spec.world_size,
        "queue": queue,
        "max_restarts": spec.crash_loop_limit + 2 if max_restarts is None else max_restarts,
        "env": dict(env or {}),
        "rendezvous": {
            "backend": rdzv_backend,
            "endpoint": rdzv_endpoint,
            "id": rendezvous_id(spec.tenant, dag_id, run_id),
            "timeout": int(spec.startup_timeout),
            "poll_interval": rendezvous_poll_interval(spec.max_nodes + spec.spares),
            # The gang forms with min_nodes..max_nodes agents; an elastic gang short of
            # max_nodes waits this long for more before it trains with fewer.
            "min_nodes": spec.min_nodes,
            "max_nodes": spec.max_nodes,
            "last_call_timeout": spec.shrink_grace if spec.elastic else 1,
            # A lost node leaves the rendezvous after keep_alive × max_attempt seconds
            # (torch's default 5 × 3 made the survivors wait 15 s for a replacement).
            "keep_alive_interval": KEEP_ALIVE_S,
            "keep_alive_max_attempt": KEEP_ALIVE_MISSES,
        },
        # One slot per node of the full gang, then one per hot spare. Ranks are the ones a
        # slot gets in a gang of its first max_nodes slots; torch elastic assigns the real
        # ones as agents join (a spare that steps in takes the lost node's).
        "spares": spec.spares,
        "nodes": [
            {
                "node": i,
                "queue": queue,
                "role": "member" if i < spec.max_nodes else "spare",
                "ranks": list(range(i * k, (i + 1) * k)) if i < spec.max_nodes else [],
            }
            for i in range(spec.max_nodes + spec.spares)
        ],
    }
