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
