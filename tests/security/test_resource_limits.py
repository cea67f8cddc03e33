"""Per-run resource limits: a worker's data memory (RLIMIT_DATA) and open files
(RLIMIT_NOFILE) come from the spec; a workload that allocates without bound meets
MemoryError at its own limit and the run stops as a user error, naming the rank and the
type — the host is not exhausted."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from trainflow.errors import SpecError
from trainflow.spec import TrainingSpec
from trainflow.worker.train import apply_limits


class FakeResource:
    RLIMIT_DATA, RLIMIT_NOFILE, RLIM_INFINITY = 2, 7, -1

    def __init__(self, hard) -> None:
        self.hard, self.set = hard, {}

    def getrlimit(self, which):
        return (self.hard[which], self.hard[which])

    def setrlimit(self, which, limits):
        self.set[which] = limits


def test_limits_follow_the_spec_and_never_exceed_the_hosts_hard_limits():
    fake = FakeResource({2: -1, 7: 4096})
    done = apply_limits(TrainingSpec(memory_limit_mb=1024, open_files_limit=100000), resource=fake)
    assert done == {"memory_limit_mb": 1024 << 20, "open_files_limit": 4096}
    assert fake.set == {2: (1024 << 20, -1), 7: (4096, 4096)}
    assert apply_limits(TrainingSpec(), resource=fake) == {}  # 0: nothing set


def test_limits_below_what_a_worker_needs_are_refused_naming_the_field():
    with pytest.raises(SpecError, match="invalid memory_limit_mb=100: at least 512"):
        TrainingSpec(memory_limit_mb=100)
    with pytest.raises(SpecError, match="allocate needs memory_limit_mb > 0"):
        TrainingSpec(faults=[{"kind": "allocate", "rank": 0, "step": 5}])


@pytest.mark.integration  # real worker processes
def test_a_runaway_allocation_stops_at_the_limit_in_a_real_process():
    code = """
import sys
from trainflow.spec import TrainingSpec
from trainflow.worker.train import apply_limits
apply_limits(TrainingSpec(memory_limit_mb=768))
hoard = []
try:
    while True:
        hoard.append(bytearray(64 << 20))
except MemoryError:
    print(len(hoard) * 64)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert 0 < int(out.stdout) <= 768  # MiB it got before MemoryError


@pytest.mark.integration  # real worker processes
def test_an_allocating_workload_aborts_the_run_as_a_user_error(tmp_path):
    from trainflow.launch.local import run_local

    spec = TrainingSpec(
        workload="digits",
        nodes=2,
        steps=200,
        batch_size=16,
        checkpoint_interval=50,
        memory_limit_mb=2048,
        faults=[{"kind": "allocate", "rank": 1, "step": 20}],
    )
    t0 = time.time()
    codes = run_local(spec, tmp_path)
    assert time.time() - t0 < 120 and set(codes) <= {3} and codes
    abort = json.loads((tmp_path / "ABORT").read_text())
    assert abort["rank"] == 1 and abort["kind"] == "user" and abort["type"] == "MemoryError"
