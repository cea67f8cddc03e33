"""Size bounds on what a run writes for others to read.

Text that comes from the workload (exception messages, metric names and values) ends up in
the workspace (timeline, error records, ``metrics.json``), Airflow's XComs (the metadata
database), the run report and the training page's API. Each is bounded here, so a workload
cannot flood the database, the page or a reader's memory: messages are clipped (saying how
much was cut), metrics must be a small mapping of names to numbers or short strings
(``WorkloadOutputError`` naming the metric otherwise), lists in a report keep their newest items.
"""

from __future__ import annotations

from numbers import Real
from typing import Any

from trainflow.errors import WorkloadOutputError

# Characters kept of one message (an exception's text, a fault's message).
MAX_MESSAGE = 2000
# Metrics: at most this many, names this long, string values this long.
MAX_METRICS = 64
MAX_METRIC_NAME = 64
MAX_METRIC_TEXT = 256
# Items kept of one list in the run report (faults, stragglers, membership changes, errors).
MAX_REPORT_ITEMS = 500


def clip(text: Any, limit: int = MAX_MESSAGE) -> str:
    """``text`` as a string of at most about ``limit`` characters; a clipped one ends with
    how many characters were cut."""
    text = str(text)
    if len(text) <= limit:
        return text
    return f"{text[:limit]}… [{len(text) - limit} more characters]"


def clip_fields(fields: dict, limit: int = MAX_MESSAGE) -> dict:
    """``fields`` with every string value clipped to ``limit`` (one level deep)."""
    return {k: clip(v, limit) if isinstance(v, str) else v for k, v in fields.items()}


def check_metrics(metrics: Any) -> dict[str, Any]:
    """The workload's metrics, checked: a mapping of at most ``MAX_METRICS`` names (strings
    of at most ``MAX_METRIC_NAME`` characters) to numbers, booleans or strings
    of at most ``MAX_METRIC_TEXT`` characters. Raises ``WorkloadOutputError`` naming the first
    offending metric, its value's type and the fix."""
    if not isinstance(metrics, dict):
        raise WorkloadOutputError(
            f"workload.evaluate returned {type(metrics).__name__}; fix: return a dict of metric name → number"
        )
    if len(metrics) > MAX_METRICS:
        raise WorkloadOutputError(
            f"workload.evaluate returned {len(metrics)} metrics; fix: return at most {MAX_METRICS}"
        )
    out: dict[str, Any] = {}
    for name, value in metrics.items():
        if not isinstance(name, str) or not name or len(name) > MAX_METRIC_NAME:
            raise WorkloadOutputError(
                f"metric name {clip(repr(name), 80)}: fix: a non-empty string of at most {MAX_METRIC_NAME} characters"
            )
        if isinstance(value, bool) or isinstance(value, str) and len(value) <= MAX_METRIC_TEXT:
            out[name] = value
        elif isinstance(value, Real):  # numpy and torch scalars too: as plain numbers
            out[name] = int(value) if isinstance(value, int) else float(value)
        else:
            kind = f"str of {len(value)} characters" if isinstance(value, str) else type(value).__name__
            raise WorkloadOutputError(
                f"metric {name!r}: value of type {kind}; fix: a number, a boolean "
                f"or a string of at most {MAX_METRIC_TEXT} characters"
            )
    return out


def newest(items: list, limit: int = MAX_REPORT_ITEMS) -> list:
    """The last ``limit`` items (lists in a report are in time order: the newest kept)."""
    return items[-limit:] if len(items) > limit else items


__all__ = ["MAX_MESSAGE", "MAX_METRICS", "MAX_REPORT_ITEMS", "check_metrics", "clip", "clip_fields", "newest"]
