"""Processes of a run, as a test finds them from outside: by what their command lines name."""

from __future__ import annotations


def processes_naming(path: str) -> list[int]:
    """Pids of the live processes whose command line names ``path`` (a run's agents, workers
    and output taps name its plan or workspace)."""
    import psutil

    found = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            if any(path in part for part in (p.info["cmdline"] or [])):
                found.append(p.pid)
        except psutil.Error:
            continue
    return found
