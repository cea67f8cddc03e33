"""Tenants on one host as OS users of their own (``TRAINFLOW_TENANT_USERS``): each tenant's
workers and evaluation run as its user, its workspace is that user's alone (0700), and
another tenant's code cannot open it — checked with real gangs and real user switches."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import pytest

from trainflow.checkpoint import manifest
from trainflow.errors import SpecError
from trainflow.launch import envtrim, runas
from trainflow.launch.local import run_local
from trainflow.spec import TrainingSpec
from trainflow.worker.evaluate import evaluate
from trainflow.workspace import Workspace

UIDS = {"alpha": 52001, "beta": 52002}
BASE = dict(workload="digits", nodes=2, steps=60, batch_size=16, checkpoint_interval=20, seed=9)
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="switching users needs root (CI runs as root)")


def test_the_map_names_the_bad_word_and_refuses_root_and_unknown_users(monkeypatch):
    assert runas.tenant_users({"TRAINFLOW_TENANT_USERS": "alpha=52001, beta=52002"}) == {
        "alpha": (52001, 52001),
        "beta": (52002, 52002),
    }
    assert runas.tenant_users({}) == {}
    for value, fix in (
        ("alpha", "tenant=user words"),
        ("alpha=", "tenant=user words"),
        ("alpha=0", "must not be root"),
        ("alpha=no-such-user-xyz", "no user 'no-such-user-xyz'"),
    ):
        with pytest.raises(SpecError, match=fix) as info:
            runas.tenant_users({"TRAINFLOW_TENANT_USERS": value})
        assert info.value.field == "TRAINFLOW_TENANT_USERS"
    monkeypatch.setenv("TRAINFLOW_TENANT_USERS", "alpha=52001")
    monkeypatch.setattr(os, "geteuid", lambda: 1000)  # a worker that cannot switch users
    with pytest.raises(SpecError, match="runs as uid 1000: run the Celery worker as root"):
        runas.for_tenant("alpha")
    assert runas.for_tenant("gamma") is None  # an unmapped tenant runs as the worker's user


@pytest.fixture
def python_reachable():
    """The tenant users must be able to run this Python, as they would a system one. Here it
    lives under /root (pyenv), which others cannot traverse: grant traverse (o+x, no listing)
    on such folders for the test, and take it back after."""
    changed = []
    for top in {Path(sys.base_prefix), Path(sys.prefix), Path(__file__).resolve().parents[2]}:
        for folder in [top, *top.parents]:
            mode = stat.S_IMODE(folder.stat().st_mode)
            if not mode & 0o001:
                os.chmod(folder, mode | 0o001)
                changed.append((folder, mode))
    yield
    for folder, mode in reversed(changed):
        os.chmod(folder, mode)


@pytest.fixture
def root(python_reachable):
    d = Path(tempfile.mkdtemp(prefix="tf-tenants-", dir="/tmp"))  # reachable by other users
    os.chmod(d, 0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _as_user(uid: int, what: str, path: Path) -> str:
    """Open or list ``path`` as ``uid`` (a forked child that switched users): "ok" or the error."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        os.close(r)
        try:
            os.setgroups([uid])
            os.setgid(uid)
            os.setuid(uid)
            os.listdir(path) if what == "list" else open(path, "rb").read(16)
            out = "ok"
        except OSError as exc:
            out = type(exc).__name__
        os.write(w, out.encode())
        os._exit(0)
    os.close(w)
    out = os.read(r, 256).decode()
    os.close(r)
    os.waitpid(pid, 0)
    return out


@pytest.mark.integration  # real worker processes
@needs_root
def test_each_tenants_workers_run_as_its_user_and_cannot_open_the_others_run(root, monkeypatch):
    solo = root / "solo"  # an unmapped tenant: as before, the worker's own user
    assert run_local(TrainingSpec(**BASE, tenant="solo"), solo) == [0, 0]
    expected = evaluate(solo)["weights_sha256"]

    monkeypatch.setenv("TRAINFLOW_TENANT_USERS", " ".join(f"{t}={u}" for t, u in UIDS.items()))
    runs = {t: Workspace(root / "runs", t, "train_digits", "same-run").create().dir for t in UIDS}
    codes: dict[str, list[int]] = {}
    threads = [
        threading.Thread(target=lambda t=t: codes.__setitem__(t, run_local(TrainingSpec(**BASE, tenant=t), runs[t])))
        for t in UIDS
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=900)
    assert codes == {"alpha": [0, 0], "beta": [0, 0]}, [
        p.read_text()[-3000:] for d in runs.values() for p in (d / "logs").glob("agent-*.log")
    ]

    newest = {}
    for tenant, run_dir in runs.items():
        uid = UIDS[tenant]
        st = run_dir.stat()
        assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (uid, 0o700)
        beats = sorted((run_dir / "heartbeats").glob("rank-*.json"))
        assert len(beats) == 2 and {b.stat().st_uid for b in beats} == {uid}  # written by its workers
        newest[tenant] = manifest.newest_verified(run_dir / "checkpoints")
        shards = [p for p in Path(newest[tenant].path).iterdir()]
        assert shards and {p.stat().st_uid for p in shards} == {uid}
        assert evaluate(run_dir)["weights_sha256"] == expected  # trained exactly as alone

    alpha, beta = UIDS["alpha"], UIDS["beta"]
    beta_manifest = Path(newest["beta"].path) / "manifest.json"
    assert _as_user(alpha, "open", beta_manifest) == "PermissionError"
    assert _as_user(alpha, "open", runs["beta"] / "heartbeats" / "rank-00000.json") == "PermissionError"
    assert _as_user(alpha, "list", runs["beta"]) == "PermissionError"
    assert _as_user(beta, "open", beta_manifest) == "ok"  # its own
    assert _as_user(alpha, "open", Path(newest["alpha"].path) / "manifest.json") == "ok"

    # The evaluation (the operator runs it so: trimmed environment, the tenant's user).
    env = {**envtrim.trimmed(), **runas.hand_over(runs["alpha"], "alpha")}
    (runs["alpha"] / "metrics.json").unlink(missing_ok=True)
    done = subprocess.run(
        [sys.executable, "-m", "trainflow.worker.evaluate", "--run-dir", str(runs["alpha"])],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert (runs["alpha"] / "metrics.json").stat().st_uid == alpha
    assert json.loads(done.stdout.splitlines()[-1])["weights_sha256"] == expected
