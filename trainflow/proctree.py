"""Process-tree hygiene: no worker outlives the agent that started it."""

from __future__ import annotations

import ctypes
import os
import signal
import sys

_PR_SET_PDEATHSIG = 1


def signal_tree(pid: int, sig: int = signal.SIGKILL) -> list[int]:
    """Send ``sig`` to ``pid`` and all its descendants (children first collected, then
    signalled parent-first so nobody respawns); returns the pids signalled."""
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []
    hit = []
    for p in procs:
        try:
            p.send_signal(sig)
            hit.append(p.pid)
        except psutil.NoSuchProcess:
            continue
    return hit


def die_with_parent(expected_parent: int = 0) -> None:
    """Ask the kernel to SIGKILL this process when its parent dies (Linux).

    If the parent is already gone (it died before this call), exit at once.
    """
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if expected_parent and os.getppid() != expected_parent:
        os._exit(70)
