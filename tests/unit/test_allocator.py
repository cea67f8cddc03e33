from __future__ import annotations

import pytest

from trainflow.cluster.allocator import Allocator
from trainflow.errors import AdmissionError, SpecError


@pytest.fixture
def alloc(tmp_path):
    a = Allocator(tmp_path / "state.db")
    a.set_pool("cpu", 4)
    return a


def test_gang_is_all_or_nothing(alloc):
    alloc.admit("r1", tenant="t", pool="cpu", nodes=3, ttl=60, now=0)
    with pytest.raises(AdmissionError, match="2 nodes asked, 1 of 4 free"):
        alloc.admit("r2", tenant="t", pool="cpu", nodes=2, ttl=60, now=1)
    assert [l.run_key for l in alloc.leases(now=1)] == ["r1"]
    assert alloc.release("r1") and not alloc.release("r1")
    alloc.admit("r2", tenant="t", pool="cpu", nodes=2, ttl=60, now=2)


def test_admission_is_idempotent_per_run(alloc):
    alloc.admit("r1", tenant="t", pool="cpu", nodes=4, ttl=60, now=0)
    lease = alloc.admit("r1", tenant="t", pool="cpu", nodes=4, ttl=60, now=30)
    assert lease.expires == 90


def test_leases_expire_as_a_backstop(alloc):
    alloc.admit("crashed", tenant="t", pool="cpu", nodes=4, ttl=10, now=0)
    alloc.admit("next", tenant="t", pool="cpu", nodes=4, ttl=10, now=11)


def test_requests_that_never_fit_are_refused_with_numbers(alloc):
    with pytest.raises(SpecError, match="only 4 nodes in total"):
        alloc.admit("big", tenant="t", pool="cpu", nodes=5, ttl=10)
    with pytest.raises(SpecError, match="unknown pool; known pools: cpu"):
        alloc.admit("x", tenant="t", pool="gpu", nodes=1, ttl=10)
