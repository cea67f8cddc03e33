"""The preflight a node passes before it joins its gang.

Checks, in order: this worker can serve the chip family at all (its torch extension is
installed — found without importing it, so no device runtime starts in the task process);
the host is not cordoned (or, if it is, passes its chip health check, which lifts the
cordon); the chip family's health command succeeds; the checkpoint
filesystem has room for the next checkpoint; the rendezvous endpoint is reachable. A
failing node never starts its agent, so it never joins the gang; its task fails as an
infrastructure error and Airflow's retry places it again.
"""

from __future__ import annotations

import os
import shutil
import socket
import time
from dataclasses import dataclass
from pathlib import Path

from trainflow import statedb
from trainflow.cluster.hosts import CordonPolicy, HostRegistry
from trainflow.errors import ChipUnavailableError, PreflightError

# Ends the detail of a health check whose command is missing: a host setup error, not a
# chip fault, so it does not cordon the host.
_NOT_INSTALLED = " (not installed on this host)"

# Floor of free space on the checkpoint filesystem: TRAINFLOW_PREFLIGHT_MIN_FREE_MB.
MIN_FREE_MB = 256


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    detail: str
    devices: int | None = None  # chip_health: devices the vendor CLI listed


def chip_extension(family) -> None:
    """Raise if this worker lacks the family's torch extension (a misrouted or misbuilt
    worker: deterministic, so the run stops at once and no host is charged for it)."""
    import importlib.util

    from trainflow.chips.registry import queue_for

    if family.extension and importlib.util.find_spec(family.extension) is None:
        raise ChipUnavailableError(
            f"chip family {family.name!r} needs the {family.extension!r} extension (pip package "
            f"{family.package!r}), which is not installed on this worker; install it, or serve "
            f"queue {queue_for(family.name)!r} "
            f"only from workers that have it"
        )


def chip_health(family, *, timeout: float = 30.0) -> Check:
    """Run the family's health command in a subprocess (``doctor.run_cli``: exit 0 and,
    where its output parses, no unhealthy device listed)."""
    from trainflow.chips.doctor import run_cli

    probe = run_cli(family, family.health_cmd, timeout=timeout, field_name="health_cmd")
    where = f"{family.name}: {probe.command}: " if probe.command else f"{family.name}: "
    return Check(
        "chip_health",
        probe.ok,
        where + probe.detail + (_NOT_INSTALLED if probe.missing else ""),
        devices=len(probe.devices) if probe.parsed else None,
    )


def device_count(family, devices: int | None, nproc: int) -> Check | None:
    """Enough devices on this host for the node's ranks (None: the count is unknown)."""
    if not family.has_devices or devices is None:
        return None
    ok = devices >= nproc
    return Check(
        "devices",
        ok,
        f"{devices} {family.device_type} device(s) listed, nproc_per_node={nproc}"
        + ("" if ok else "; lower nproc_per_node or route the run to bigger hosts"),
    )


def free_disk(checkpoint_root: Path, *, newest_bytes: int, min_free_mb: float) -> Check:
    """Room for two more checkpoints of the newest one's size, and never under the floor."""
    root = Path(checkpoint_root)
    while not root.exists():
        root = root.parent
    free = shutil.disk_usage(root).free
    need = max(int(min_free_mb * 2**20), 2 * newest_bytes)
    ok = free >= need
    return Check(
        "free_disk",
        ok,
        f"{free / 2**20:.0f} MiB free on {root}, "
        f"{need / 2**20:.0f} MiB needed" + ("" if ok else "; free space or lower keep_last"),
    )


def rendezvous_reachable(endpoint: str, *, timeout: float = 5.0, backend: str = "c10d") -> Check:
    """The rendezvous answers: its database (``trainflow-db``), or its host on the network.

    A refused connection counts as reachable: the host answered, and the store is not up
    until the first agent starts it. A timeout or an unreachable network fails.
    """
    if backend == "trainflow-db":
        from trainflow.launch import rdzv_db

        try:
            return Check("rendezvous", True, rdzv_db.reachable(endpoint, timeout=timeout))
        except (ValueError, OSError, *statedb.errors()) as exc:
            return Check("rendezvous", False, f"{endpoint} unusable from this host: {exc}")
    host, _, port = endpoint.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout):
            return Check("rendezvous", True, f"{endpoint} answers")
    except ConnectionRefusedError:
        return Check("rendezvous", True, f"{host} answers; the store on port {port} is not up yet")
    except OSError as exc:
        return Check("rendezvous", False, f"{endpoint} unreachable from this host: {exc}")


def run(
    plan: dict,
    node: int,
    *,
    host: str,
    registry: HostRegistry | None = None,
    policy: CordonPolicy | None = None,
    now: float | None = None,
) -> list[Check]:
    """Every check for ``node`` of ``plan`` on ``host``; raises if any fails.

    Raises:
        ChipUnavailableError: this worker lacks the family's extension (checked first).
        PreflightError: naming the failed checks (the host is cordoned when its chip
            health check fails; a health command that is not installed is a setup
            error of the host, reported but not charged as a chip fault).
    """
    from trainflow.checkpoint.manifest import committed_bytes, list_checkpoints
    from trainflow.chips.registry import get_family

    now = time.time() if now is None else now
    registry = registry or HostRegistry()
    policy = policy or CordonPolicy.from_env()
    family = get_family(plan["spec"]["chip"])
    chip_extension(family)
    health = chip_health(family)
    checks = []
    cordon = registry.cordoned(host)
    if cordon is not None:
        healed = health.ok
        if healed:
            registry.uncordon(host)
        checks.append(
            Check(
                "cordon",
                healed,
                f"host {host} cordoned since {cordon.since:.0f} "
                f"({cordon.reason}); health check "
                f"{'passed: cordon lifted' if healed else 'failed'}",
            )
        )
    elif not health.ok and not health.detail.endswith(_NOT_INSTALLED):
        registry.cordon(host, reason=f"chip health check failed: {health.detail}", now=now)
    checks.append(health)
    if (count := device_count(family, health.devices, int(plan["spec"].get("nproc_per_node", 1)))) is not None:
        checks.append(count)
    ckpt_root = Path(plan["run_dir"]) / "checkpoints"
    # The newest checkpoint's size from its manifest: hashing it (verify) is the resume's
    # job, not worth a full read of the checkpoint at every node start.
    newest = next(iter(list_checkpoints(ckpt_root)), None)
    floor = float(os.environ.get("TRAINFLOW_PREFLIGHT_MIN_FREE_MB", MIN_FREE_MB))
    checks.append(free_disk(ckpt_root, newest_bytes=committed_bytes(newest[1]) if newest else 0, min_free_mb=floor))
    checks.append(
        rendezvous_reachable(plan["rendezvous"]["endpoint"], backend=plan["rendezvous"].get("backend", "c10d"))
    )
    failed = [c for c in checks if not c.ok]
    if failed:
        raise PreflightError(
            f"node {node} on host {host} failed preflight: " + "; ".join(f"{c.name}: {c.detail}" for c in failed)
        )
    return checks
