from __future__ import annotations

import json

from trainflow.worker.train import crash_restarts, membership_change


def _start(t, nodes, world):
    return {"event": "gang_start", "time": t, "step": 0, "nodes": nodes, "world": world}


def test_membership_changes_are_named(tmp_path):
    (tmp_path / "nodes").mkdir()
    (tmp_path / "nodes" / "node-0002.json").write_text(json.dumps({"started": 5.0}))  # up before t=10
    (tmp_path / "nodes" / "node-0003.json").write_text(json.dumps({"started": 50.0}))
    first = [_start(10, [0, 1], 2)]
    assert membership_change([], [0, 1], 2, run_dir=tmp_path) is None
    assert membership_change(first, [0, 1], 2, run_dir=tmp_path) is None
    spare = membership_change(first, [0, 2], 2, run_dir=tmp_path)
    assert (spare["change"], spare["left"], spare["joined"], spare["spares_used"]) == ("spare_used", [1], [2], [2])
    assert membership_change(first, [0, 3], 2, run_dir=tmp_path)["change"] == "replaced"
    shrink = membership_change([_start(10, [0, 1, 2], 3)], [0, 1], 2, run_dir=tmp_path)
    assert (shrink["change"], shrink["world_from"], shrink["world_to"]) == ("shrink", 3, 2)
    grow = membership_change(first, [0, 1, 3], 3, run_dir=tmp_path)
    assert (grow["change"], grow["joined"]) == ("grow", [3])


def test_a_grow_restart_is_not_a_crash_restart():
    events = [
        {"event": "gang_start", "step": 0},
        {"event": "gang_start", "step": 100},  # resumed after a crash: counts
        {"event": "grow_window", "step": 200},
        {"event": "gang_start", "step": 200},  # the planned grow restart: does not
    ]
    assert crash_restarts(events, 100) == 1
    assert crash_restarts(events, 200) == 0
    events += [{"event": "gang_start", "step": 200}, {"event": "gang_start", "step": 200}]
    assert crash_restarts(events, 200) == 2  # crashes after the grow count again
    assert crash_restarts(events, 300) == 0
