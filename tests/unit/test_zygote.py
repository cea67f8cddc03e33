"""Warm worker starts: a real zygote forks real stand-ins' workers (no torch elastic).

The worker here is a small probe module, so each test runs in well under a second once
the zygote has imported the training stack (once per module).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from trainflow.launch import zygote

pytestmark = pytest.mark.integration  # real processes / a gloo world

PROBE = textwrap.dedent("""
    import os, sys, time
    what = sys.argv[1]
    print(f"probe {what} pid={os.getpid()} rank={os.environ.get('RANK')} cwd={os.getcwd()}", flush=True)
    if what == "exit":
        sys.exit(int(sys.argv[2]))
    if what == "raise":
        raise ValueError("probe failure")
    if what == "sleep":
        open(sys.argv[2], "w").write(str(os.getpid()))
        time.sleep(60)
""")


@pytest.fixture(scope="module")
def warm(tmp_path_factory):
    """A zygote serving this test process (as an agent), the probe on its path."""
    home = tmp_path_factory.mktemp("zygote")
    (home / "zygote_probe.py").write_text(PROBE)
    path = str(home / "z.sock")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(home), *sys.path]), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-u", "-m", "trainflow.launch.zygote", "serve", path, str(os.getpid())], env=env
    )
    deadline = time.time() + 120
    while not os.path.exists(path):
        assert proc.poll() is None and time.time() < deadline, "the zygote did not come up"
        time.sleep(0.05)
    yield {"socket": path, "pid": proc.pid, "env": env, "home": home}
    proc.kill()
    proc.wait()


def _standin(warm, *args, rank="3", zygote_on=True, **kw) -> subprocess.Popen:
    env = {**warm["env"], "RANK": rank}
    if zygote_on:
        env.update(TRAINFLOW_ZYGOTE_SOCKET=warm["socket"], TRAINFLOW_ZYGOTE_PID=str(warm["pid"]))
    return subprocess.Popen(
        [sys.executable, "-u", "-m", "trainflow.launch.zygote", "run", "zygote_probe", *args],
        env=env,
        cwd=warm["home"],
        stdout=subprocess.PIPE,
        text=True,
        **kw,
    )


def _gone(pid: int, timeout: float = 5) -> bool:
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


def test_the_forked_worker_gets_the_standins_argv_env_cwd_and_stdout_and_its_exit_code(warm):
    p = _standin(warm, "exit", "7")
    out, _ = p.communicate(timeout=30)
    assert p.returncode == 7
    assert "probe exit pid=" in out and "rank=3" in out and f"cwd={warm['home']}" in out
    pid = int(out.split("pid=")[1].split()[0])
    assert pid != p.pid  # forked by the zygote, not the stand-in itself


def test_an_exception_in_the_worker_fails_the_standin(warm):
    p = _standin(warm, "raise", stderr=subprocess.PIPE)
    _, err = p.communicate(timeout=30)
    assert p.returncode == 1 and "ValueError: probe failure" in err


def test_a_worker_killed_by_a_signal_ends_its_standin_by_the_same_signal(warm, tmp_path):
    pid_file = tmp_path / "pid"
    p = _standin(warm, "sleep", str(pid_file))
    while not pid_file.exists() or not pid_file.read_text():
        time.sleep(0.05)
    os.kill(int(pid_file.read_text()), signal.SIGKILL)
    assert p.wait(timeout=30) == -signal.SIGKILL


def test_sigterm_to_the_standin_reaches_the_worker(warm, tmp_path):
    pid_file = tmp_path / "pid"
    p = _standin(warm, "sleep", str(pid_file))
    while not pid_file.exists() or not pid_file.read_text():
        time.sleep(0.05)
    p.send_signal(signal.SIGTERM)
    assert p.wait(timeout=30) == -signal.SIGTERM
    assert _gone(int(pid_file.read_text()))


def test_a_killed_standin_takes_its_worker_with_it(warm, tmp_path):
    """torch elastic SIGKILLs the workers of a failed group: the forked one must not linger."""
    pid_file = tmp_path / "pid"
    p = _standin(warm, "sleep", str(pid_file))
    while not pid_file.exists() or not pid_file.read_text():
        time.sleep(0.05)
    p.kill()
    p.wait(timeout=30)
    assert _gone(int(pid_file.read_text()))


def test_without_a_zygote_the_standin_becomes_the_plain_worker(warm):
    p = _standin(warm, "exit", "5", zygote_on=False)
    out, _ = p.communicate(timeout=60)
    assert p.returncode == 5 and f"pid={p.pid} " in out  # exec'd: the same process


def test_a_dead_zygote_is_not_waited_for(warm):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    env = {
        **warm["env"],
        "TRAINFLOW_ZYGOTE_SOCKET": str(warm["home"] / "none.sock"),
        "TRAINFLOW_ZYGOTE_PID": str(dead.pid),
    }
    t = time.time()
    p = subprocess.Popen(
        [sys.executable, "-u", "-m", "trainflow.launch.zygote", "run", "zygote_probe", "exit", "4"],
        env=env,
        cwd=warm["home"],
        stdout=subprocess.PIPE,
        text=True,
    )
    out, _ = p.communicate(timeout=60)
    assert p.returncode == 4 and f"pid={p.pid} " in out
    assert time.time() - t < zygote.READY_WAIT_S / 2


def test_warm_starts_only_for_families_without_an_extension():
    assert zygote.usable("cpu") and zygote.usable("nvidia")
    assert not zygote.usable("ascend")  # torch_npu must see its environment at import


def test_socket_paths_are_short_and_per_node(tmp_path):
    a, b = zygote.socket_path(str(tmp_path / ("x" * 200)), 0), zygote.socket_path(str(tmp_path), 1)
    assert a != b and len(a.encode()) < 108
