"""``trainflow doctor``: what this host is, whether its chips are healthy, and how to
serve it from Airflow.

Detects the chip family (``detect``), lists the devices with the family's inventory
command (parsed by ``parsers``), runs its health command, and prints the queue this host
serves and the exact Celery worker command. Nothing here initialises a device runtime.
"""

from __future__ import annotations

import shlex
import subprocess
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Mapping

from trainflow.chips import parsers
from trainflow.chips.detect import Detection, detect
from trainflow.chips.registry import ChipFamily, env_key, get_family, queue_for


@dataclass
class Probe:
    """One vendor command's outcome."""

    command: str
    ok: bool
    detail: str
    devices: list[parsers.Device] = field(default_factory=list)
    parsed: bool = False
    missing: bool = False  # the command is not installed (a host setup error, not a chip fault)


def run_cli(
    family: ChipFamily,
    cmd: tuple[str, ...] | None,
    *,
    timeout: float = 30.0,
    runner: Callable[..., Any] = subprocess.run,
    field_name: str = "inventory_cmd",
) -> Probe:
    """Run a vendor command in a subprocess and parse its output with the family's parser:
    healthy when it exits 0 and, where its output parses, lists devices, none unhealthy.
    ``field_name`` names the registry field whose override the not-found message suggests."""
    if not cmd:
        return Probe("", True, "no command for this family (nothing to check)")
    text = " ".join(shlex.quote(c) for c in cmd)
    try:
        done = runner(list(cmd), capture_output=True, text=True, timeout=timeout)
    except FileNotFoundError:
        return Probe(
            text,
            False,
            f"{cmd[0]!r} not found; install the vendor tools or set {env_key(family.name, field_name)}",
            missing=True,
        )
    except subprocess.TimeoutExpired:
        return Probe(text, False, f"did not answer in {timeout:g}s")
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip()[-300:]
        return Probe(text, False, f"exited {done.returncode}: {tail}")
    try:
        devices = parsers.parse(family.name, done.stdout)
    except (parsers.ParseError, KeyError) as exc:
        return Probe(text, True, f"exit 0; output not parsed ({exc})")
    sick = [d for d in devices if d.healthy is False]
    if not devices:
        return Probe(text, False, "lists no devices", parsed=True)
    if sick:
        return Probe(
            text, False, "unhealthy devices " + ", ".join(f"{d.index} ({d.detail})" for d in sick), devices, parsed=True
        )
    return Probe(text, True, f"{len(devices)} device(s)", devices, parsed=True)


def worker_command(queues: list[str], *, concurrency: int = 1) -> str:
    """The command that registers this host and runs its Celery worker for ``queues`` (one
    node task at a time per host: a node task owns the host's chips); ``trainflow worker``
    execs ``airflow celery worker --queues … --concurrency …`` after registering."""
    return f"trainflow worker --queues {','.join(queues)} --concurrency {concurrency}"


def examine(
    *,
    explicit: str | None = None,
    queue: str | None = None,
    model: str | None = None,
    env: Mapping[str, str] | None = None,
    runner: Callable[..., Any] = subprocess.run,
    detector: Callable[..., Detection] = detect,
) -> dict[str, Any]:
    """The doctor's report (a dict) and whether the host is healthy (``report["healthy"]``)."""
    found = detector(explicit=explicit, queue=queue, env=env)
    family = get_family(found.family, env)
    if queue and model is None and "-" in queue:
        model = queue[len(family.name) + 1 :]
    inventory = run_cli(family, family.inventory_cmd, runner=runner)
    health = (
        inventory
        if family.health_cmd == family.inventory_cmd
        else run_cli(family, family.health_cmd, runner=runner, field_name="health_cmd")
    )
    count = len(inventory.devices) if inventory.parsed else found.devices
    q = queue_for(family.name, model)
    healthy = health.ok and inventory.ok and (not family.has_devices or bool(count))
    return {
        "family": family.name,
        "title": family.title,
        "detected_by": found.source,
        "evidence": found.evidence,
        "also_seen": list(found.also_seen),
        "devices": count,
        "device_list": [asdict(d) for d in inventory.devices],
        "inventory": asdict(inventory) | {"devices": len(inventory.devices)},
        "health": asdict(health) | {"devices": len(health.devices)},
        "healthy": healthy,
        "extension": family.extension,
        "package": family.package,
        "backend": family.composite_backend,
        "device_type": family.device_type,
        "visible_envs": list(family.visible_envs),
        "queue": q,
        "worker_command": worker_command([q]),
    }


def format_report(report: Mapping[str, Any]) -> str:
    lines = [
        f"chip family : {report['family']} ({report['title']}), detected by {report['detected_by']}: "
        f"{report['evidence']}",
        f"devices     : {report['devices'] if report['devices'] is not None else 'unknown'}"
        + "".join(
            f"\n  [{d['index']}] {d['name'] or ''} {d['bus_id'] or ''} {d['detail']}".rstrip()
            for d in report["device_list"]
        ),
        f"inventory   : {report['inventory']['command'] or '-'}: {report['inventory']['detail']}",
        f"health      : {report['health']['command'] or '-'}: {report['health']['detail']}",
        f"torch       : device {report['device_type']}, backend {report['backend']}"
        + (f", extension {report['extension']} (pip {report['package']})" if report["extension"] else ""),
        f"queue       : {report['queue']}",
        f"serve it    : {report['worker_command']}",
        f"verdict     : {'HEALTHY' if report['healthy'] else 'UNHEALTHY'}",
    ]
    if report["also_seen"] and report["also_seen"] != [report["family"]]:
        lines.insert(1, f"also seen   : {', '.join(report['also_seen'])}")
    return "\n".join(lines)
