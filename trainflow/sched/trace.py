"""Job traces (CSV) as gang requests for the simulator.

The ITP traces (``job_id,submission_time,duration,num_gpu``, seconds) carry no node shape,
tenant or estimate, so this module derives them, deterministically:

- shape: ``num_gpu`` ≤ chips per node → 1 node × ``num_gpu`` chips; more → ⌈num_gpu /
  chips⌉ whole nodes (a 12-GPU job holds 2 nodes × 8 chips);
- tenant: an optional ``tenant`` column, else ``tenant-<k>`` with k = CRC-32 of the job id
  mod ``tenants`` (the same job always lands on the same tenant);
- estimate: the actual duration × ``estimate_scale``, times a log-normal factor of
  σ = ``estimate_noise`` drawn from ``random.Random(seed)`` (exact by default);
- priority: an optional ``priority`` column, else 0.
"""

from __future__ import annotations

import csv
import math
import random
import zlib
from dataclasses import dataclass
from pathlib import Path

from trainflow.errors import SpecError
from trainflow.sched.model import Request

COLUMNS = ("job_id", "submission_time", "duration", "num_gpu")


class TraceError(SpecError):
    """A malformed trace: names the file, the line, the field, its value and the fix."""

    def __init__(self, path: str, line: int, field: str, value: object, fix: str) -> None:
        super().__init__(field, value, fix)
        self.path, self.line = path, line
        self.args = (path, line, field, value, fix)

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: invalid {self.field}={self.value!r}: {self.fix}"


@dataclass(frozen=True, kw_only=True)
class TraceJob:
    """One job of a trace: its request (shape, tenant, estimate) and its true run time."""

    request: Request
    duration: float
    """Seconds of work; the simulator runs it for exactly this long (plus work lost to preemption)."""
    gpus: int
    """Accelerators the trace asked for (the request may round up to whole nodes)."""


def shape(num_gpu: int, chips_per_node: int) -> tuple[int, int]:
    """``(nodes, chips_per_node)`` of a job asking for ``num_gpu`` accelerators."""
    if num_gpu <= chips_per_node:
        return 1, num_gpu
    return math.ceil(num_gpu / chips_per_node), chips_per_node


def tenant_of(job_id: str, tenants: int) -> str:
    return f"tenant-{zlib.crc32(job_id.encode()) % tenants}"


def load(
    path: Path | str,
    *,
    chips_per_node: int = 8,
    tenants: int = 4,
    limit: int | None = None,
    estimate_scale: float = 1.0,
    estimate_noise: float = 0.0,
    seed: int = 0,
) -> list[TraceJob]:
    """The first ``limit`` jobs of a CSV trace (all by default), in file order.

    Raises:
        TraceError: a missing column, or a row whose field is missing or out of range
            (file, line number, field, value).
        SpecError: a bad argument.
    """
    for name, value in (("chips_per_node", chips_per_node), ("tenants", tenants)):
        if not isinstance(value, int) or value < 1:
            raise SpecError(name, value, "a whole number, at least 1")
    if limit is not None and (not isinstance(limit, int) or limit < 1):
        raise SpecError("limit", limit, "a number of jobs, at least 1 (or none for all)")
    if not estimate_scale > 0 or not estimate_noise >= 0:
        raise SpecError(
            "estimate_scale" if not estimate_scale > 0 else "estimate_noise",
            estimate_scale if not estimate_scale > 0 else estimate_noise,
            "scale > 0, noise ≥ 0",
        )
    name = str(path)
    rng = random.Random(seed)
    jobs: list[TraceJob] = []
    seen: dict[str, int] = {}
    with open(path, newline="") as fh:
        reader = csv.reader(fh)
        header = next(reader, None)
        if header is None:
            raise TraceError(name, 1, "header", None, f"the file is empty; expected columns {','.join(COLUMNS)}")
        header = [h.strip() for h in header]
        missing = [c for c in COLUMNS if c not in header]
        if missing:
            raise TraceError(name, 1, "header", ",".join(header), f"missing column(s) {', '.join(missing)}")
        col = {c: header.index(c) for c in header}
        for row in reader:
            line = reader.line_num
            if not row or (len(row) == 1 and not row[0].strip()):
                continue
            if len(row) != len(header):
                raise TraceError(name, line, "row", ",".join(row), f"expected {len(header)} fields, got {len(row)}")

            def num(field: str, kind=float, low: float = 0.0, strict: bool = False):
                raw = row[col[field]].strip()
                try:
                    value = kind(raw)
                except ValueError:
                    value = None
                if value is None or not math.isfinite(value) or value < low or (strict and value == low):
                    want = "a whole number" if kind is int else "a number of seconds"
                    raise TraceError(name, line, field, raw, f"{want} {'>' if strict else '≥'} {low:g}")
                return value

            job_id = row[col["job_id"]].strip()
            if not job_id:
                raise TraceError(name, line, "job_id", job_id, "a non-empty id")
            if job_id in seen:
                raise TraceError(name, line, "job_id", job_id, f"duplicate of line {seen[job_id]}")
            seen[job_id] = line
            submitted = num("submission_time")
            duration = num("duration", strict=True)
            gpus = num("num_gpu", int, 1)
            priority = num("priority", int, -math.inf) if "priority" in col else 0
            tenant = row[col["tenant"]].strip() if "tenant" in col else tenant_of(job_id, tenants)
            noise = math.exp(rng.gauss(0.0, estimate_noise)) if estimate_noise else 1.0
            nodes, per_node = shape(gpus, chips_per_node)
            request = Request(
                id=job_id,
                nodes=nodes,
                chips_per_node=per_node,
                tenant=tenant or "default",
                priority=priority,
                submitted=submitted,
                estimate=duration * estimate_scale * noise,
            )
            jobs.append(TraceJob(request=request, duration=duration, gpus=gpus))
            if limit is not None and len(jobs) >= limit:
                break
    return jobs
