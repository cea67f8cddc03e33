from __future__ import annotations

import pytest

from trainflow.faults import FaultKind, parse_faults
from trainflow.errors import SpecError
from trainflow.goodput import fault_records, summarize
from trainflow.timeline import record


def test_fault_detection_and_recovery_are_paired():
    events = [
        {"event": "fault_injected", "kind": "stop_rank", "step": 120, "time": 100.0},
        {"event": "stall_detected", "time": 105.0},
        {"event": "resumed", "step": 100, "time": 113.0},
    ]
    (rec,) = fault_records(events)
    assert rec["detection_s"] == 5.0 and rec["recovery_s"] == 13.0
    assert rec["steps_lost"] == 19 and rec["resumed_from_step"] == 100


def test_summary_goodput(tmp_path):
    record(tmp_path, "fault_injected", kind="kill_rank", step=51, rank=1)
    record(tmp_path, "resumed", step=50)
    s = summarize(tmp_path, started=0.0, ended=1e12, steps=100)
    assert s["steps_lost"] == 0 and 0.99 < s["goodput"] <= 1.0
    assert summarize(tmp_path / "none", started=0, ended=10, steps=10)["goodput"] == 1.0


def test_parse_faults():
    (f,) = parse_faults([{"kind": "stop_rank", "step": 3, "rank": 1}], world_size=2, steps=10)
    assert f.kind == FaultKind.STOP_RANK and f.to_dict() == {"kind": "stop_rank", "step": 3, "rank": 1}
    with pytest.raises(SpecError, match=r"faults\[0\]"):
        parse_faults([{"kind": "kill_rank", "step": 3, "extra": 1}], world_size=2, steps=10)
