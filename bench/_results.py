"""Shared by the side-by-side benchmarks: medians, the ratio, the result file."""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import time
from pathlib import Path


def side_by_side(
    bench: str, out: Path, baseline: tuple[str, list[float]], subject: tuple[str, list[float]], **extra
) -> dict:
    """Write ``out`` with both series, their medians and subject/baseline; print a summary."""
    (b_name, b), (s_name, s) = baseline, subject
    result = {
        "bench": bench,
        **extra,
        f"{b_name}_s": b,
        f"{s_name}_s": s,
        f"{b_name}_median_s": statistics.median(b),
        f"{s_name}_median_s": statistics.median(s),
        "ratio": statistics.median(s) / statistics.median(b),
        "machine": {"cpus": os.cpu_count()},
        "time": time.time(),
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(json.dumps({k: result[k] for k in (f"{b_name}_median_s", f"{s_name}_median_s", "ratio")}))
    return result


def gang_env(**extra: str) -> dict[str, str]:
    """The environment of a benchmark's 2-rank gang: gloo on loopback, one thread per rank."""
    return {
        **os.environ,
        "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo"),
        "OMP_NUM_THREADS": "1",
        **extra,
    }


def torchrun(*options: str, nproc: int = 2) -> list[str]:
    """Raw ``torchrun`` on this machine, as a user would start the baseline."""
    import sys

    return [str(Path(sys.executable).parent / "torchrun"), "--standalone", f"--nproc-per-node={nproc}", *options]


def drop_from_page_cache(files) -> None:
    """Write ``files`` back and drop them from the page cache, so the next read of each
    comes from the disk (fair cold reads on both sides of a comparison)."""
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


@contextlib.contextmanager
def embedded_stack(prefix: str, **options):
    """A real embedded stack (``EmbeddedStack(**options)``) in a temporary folder for one
    benchmark: up and healthy inside the block, stopped and removed after it."""
    import shutil
    import tempfile

    from trainflow.launch.local import free_port
    from trainflow.stack import EmbeddedStack

    work = Path(tempfile.mkdtemp(prefix=prefix))
    stack = EmbeddedStack(home=work / "airflow", trainflow_home=work / "trainflow", port=free_port(), **options)
    try:
        stack.up(timeout=300)
        yield stack
    finally:
        stack.stop()
        shutil.rmtree(work, ignore_errors=True)
