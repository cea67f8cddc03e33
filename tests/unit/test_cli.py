from __future__ import annotations

import json

from trainflow.cli import main


def test_validate_prints_the_spec_or_the_error(tmp_path, capsys):
    good = tmp_path / "good.json"
    good.write_text(json.dumps({"nodes": 1, "steps": 10, "checkpoint_interval": 5}))
    assert main(["validate", str(good)]) == 0
    assert json.loads(capsys.readouterr().out)["nodes"] == 1
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"nodes": 0}))
    assert main(["validate", str(bad)]) == 2
    assert "invalid nodes=0: use a number of nodes (1..64)" in capsys.readouterr().err


def test_chaos_refuses_unknown_ranks(tmp_path, capsys):
    (tmp_path / "heartbeats").mkdir()
    assert main(["chaos", str(tmp_path), "--kill-rank", "3"]) == 2
    assert "invalid rank=3: no heartbeat for this rank" in capsys.readouterr().err


def test_pool_shows_resizes_and_sets_the_admission_policy(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TRAINFLOW_STATE_DB", str(tmp_path / "state.db"))
    monkeypatch.setenv("TRAINFLOW_EMBEDDED_NODES", "4")
    assert main(["pool"]) == 0
    assert json.loads(capsys.readouterr().out) == {
        "pool": "embedded",
        "nodes": 4,
        "policy": "priority",
        "hosts": [],
        "quotas": {},
        "leases": [],
        "queue": [],
    }
    assert main(["pool", "--policy", "backfill"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["nodes"], out["policy"]) == (4, "backfill")
    assert main(["pool", "--pool", "gpu", "--nodes", "8"]) == 0
    assert json.loads(capsys.readouterr().out)["nodes"] == 8
    assert main(["pool", "--pool", "nope"]) == 2
    assert "invalid pool='nope': unknown pool; known pools: embedded, gpu" in capsys.readouterr().err


def test_quota_sets_lists_and_unsets_a_pools_shares(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TRAINFLOW_STATE_DB", str(tmp_path / "state.db"))
    assert main(["quota", "--set", "vision=3"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out == {"pool": "embedded", "policy": "fairshare", "quotas": {"vision": 3}, "queue": []}
    assert main(["quota", "--pool", "embedded", "--unset", "vision"]) == 0
    assert json.loads(capsys.readouterr().out)["policy"] == "priority"
    assert main(["quota", "--set", "vision"]) == 2
    assert "invalid --set='vision': TENANT=NODES" in capsys.readouterr().err
    assert main(["quota", "--set", "Bad Name=2"]) == 2
    assert "invalid tenant='Bad Name'" in capsys.readouterr().err
