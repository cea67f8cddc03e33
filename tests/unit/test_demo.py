from __future__ import annotations

from trainflow.demo import describe, progress_line


def test_progress_line_summarises_the_gang():
    beats = {
        0: {
            "node": 0,
            "step": 120,
            "total": 300,
            "loss": 0.5,
            "state": "training",
            "samples_per_s": 100.0,
            "checkpoint_step": 100,
        },
        1: {
            "node": 1,
            "step": 119,
            "total": 300,
            "loss": 0.3,
            "state": "training",
            "samples_per_s": 50.0,
            "checkpoint_step": 100,
        },
    }
    line = progress_line(beats, 2)
    assert line.startswith("step 119/300  loss 0.4000  150 samples/s  ranks 2/2 on 2 nodes (training)")
    assert line.endswith("last checkpoint 100")
    assert progress_line({}, 2) == "waiting for the first heartbeats"


def test_describe_timeline_events():
    assert (
        describe({"event": "fault_injected", "kind": "kill_rank", "rank": 1, "step": 120})
        == "FAULT     kill_rank on rank 1 at step 120"
    )
    assert "from verified checkpoint step 100" in describe({"event": "resumed", "step": 100})
    assert describe({"event": "checkpoint_stall", "step": 50, "stall_ms": 1.0}) is None
