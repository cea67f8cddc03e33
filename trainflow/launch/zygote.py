"""Warm worker starts: a per-node process that has imported torch forks each new worker.

A worker restart is dominated by starting Python and importing torch and the training
stack (measured here: ~3.5 of the ~4 s from a rank's death to the gang training again).
The node agent therefore starts one *zygote* per node: it imports all of that once, then
waits on a Unix socket. torch elastic still starts every worker as a process of its own
— ``python -m trainflow.launch.zygote run trainflow.worker.train ...``, which imports
nothing heavy — and that
small process hands its argv, environment, working directory and stdin/stdout/stderr to
the zygote, which forks a child that runs ``trainflow.worker.train`` in their place.

The small process stands in for the child towards torch elastic: it forwards SIGTERM,
SIGINT and SIGHUP to the child, and exits as the child exited (the same code, or killed by
the same signal). When it is killed outright (SIGKILL, as torch elastic does to stragglers
of a failed group), the child sees its connection close and exits at once. The child dies
with the zygote, the zygote with its agent, so no worker outlives the node.

Safety: the zygote never starts a thread and never touches a device (no CUDA or vendor
runtime, which must not be initialised before a fork); families whose torch extension must
be imported with visibility variables already set are started the plain way. If the zygote
is not there, the small process simply becomes the plain worker (``os.execv``).
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import socket
import struct
import sys
import time

# How long a worker start waits for a zygote that is still importing (it was started
# first, so it is normally ready before torch elastic starts the first workers).
READY_WAIT_S = 60.0
_FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def socket_path(run_dir: str, node: int) -> str:
    """Where node ``node``'s zygote listens (short enough for AF_UNIX's 108 bytes)."""
    import hashlib

    key = hashlib.sha256(f"{os.path.abspath(run_dir)}/{node}".encode()).hexdigest()[:16]
    return os.path.join(os.environ.get("TMPDIR", "/tmp"), f"trainflow-zygote-{key}.sock")


def usable(chip: str) -> bool:
    """Warm starts are safe for families whose runtime starts lazily after the fork."""
    from trainflow.chips.registry import get_family

    return get_family(chip).extension is None


# -- framing ----------------------------------------------------------------------------
def _send(conn: socket.socket, obj: dict, fds: list[int] | None = None) -> None:
    data = json.dumps(obj).encode()
    frame = struct.pack("!I", len(data)) + data
    if fds:
        socket.send_fds(conn, [frame], fds)
    else:
        conn.sendall(frame)


def _recv(conn: socket.socket, nfds: int = 0) -> tuple[dict | None, list[int]]:
    """One message (None at end of stream) and any file descriptors sent with it."""
    head, fds = b"", []
    while len(head) < 4:
        if nfds and not fds:
            chunk, fds, _, _ = socket.recv_fds(conn, 4 - len(head), nfds)
        else:
            chunk = conn.recv(4 - len(head))
        if not chunk:
            return None, fds
        head += chunk
    (size,) = struct.unpack("!I", head)
    body = b""
    while len(body) < size:
        chunk = conn.recv(size - len(body))
        if not chunk:
            return None, fds
        body += chunk
    return json.loads(body), fds


# What the zygote imports before it forks: the training stack and the built-in workloads'
# dependencies (optional ones are skipped when not installed).
PRELOAD = (
    "torch",
    "torch.distributed",
    "torch.distributed.checkpoint",
    "torch.distributed.checkpoint.state_dict",
    "torch.distributed.fsdp",
    "torch.nn.parallel",
    "numpy",
    "sklearn.datasets",
    "trainflow.worker.train",
    "trainflow.checkpoint.dcp",
    "trainflow.checkpoint.manifest",
    "trainflow.data",
    "trainflow.faults",
    "trainflow.heartbeat",
    "trainflow.chips.registry",
    "trainflow.workloads.digits",
    "trainflow.workloads.tinylm",
)


def preload() -> list[str]:
    """Import ``PRELOAD``; returns the modules that are not installed."""
    import importlib

    missing = []
    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except ImportError:
            missing.append(name)
    return missing


# -- the zygote -------------------------------------------------------------------------
def serve(path: str, agent_pid: int) -> int:
    """Import the training stack, then fork a worker for every request until the agent dies."""
    from trainflow.proctree import die_with_parent

    die_with_parent(agent_pid)
    preload()
    threads = len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else 1
    if threads != 1:  # a fork would copy one thread of several: refuse, workers start plain
        print(f"trainflow zygote: {threads} threads after the imports; not forking", file=sys.stderr)
        return 1
    if os.path.exists(path):
        os.unlink(path)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    tmp = f"{path}.{os.getpid()}"
    listener.bind(tmp)
    listener.listen(64)
    os.replace(tmp, path)  # appears only once the zygote is ready
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ)
    children: dict[int, socket.socket] = {}
    try:
        while True:
            for key, _ in sel.select(timeout=0.02):
                conn, _ = listener.accept()
                request, fds = _recv(conn, nfds=3)
                if request is None or len(fds) != 3:
                    for fd in fds:
                        os.close(fd)
                    conn.close()
                    continue
                pid = os.fork()
                if pid == 0:
                    sel.close()
                    listener.close()
                    for other in children.values():
                        other.close()
                    _child(conn, request, fds)  # never returns
                for fd in fds:
                    os.close(fd)
                children[pid] = conn
                _send(conn, {"pid": pid})
            while children:  # reap finished workers and tell their stand-ins how they ended
                try:
                    pid, status = os.waitpid(-1, os.WNOHANG)
                except ChildProcessError:
                    break
                if pid == 0:
                    break
                conn = children.pop(pid, None)
                if conn is not None:
                    code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
                    try:
                        _send(conn, {"exit": code})
                    except OSError:
                        pass  # the stand-in is gone already
                    conn.close()
    finally:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def _child(conn: socket.socket, request: dict, fds: list[int]) -> None:
    """In the forked worker: become the stand-in's process, then run the training worker."""
    code = 1
    try:
        import threading

        from trainflow.proctree import die_with_parent

        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGCHLD):
            signal.signal(sig, signal.SIG_DFL)
        zygote = os.getppid()
        die_with_parent(zygote)
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        os.environ.clear()
        os.environ.update(request["env"])
        os.environ["TRAINFLOW_ZYGOTE_CHILD"] = "1"
        os.chdir(request["cwd"])
        sys.argv = [request["module"], *request["argv"]]

        def orphaned() -> None:  # the stand-in was killed: torch elastic is done with us
            while True:
                try:
                    if not conn.recv(64):
                        break
                except InterruptedError:
                    continue
                except OSError:
                    break
            os._exit(137)

        threading.Thread(target=orphaned, name="zygote-standin", daemon=True).start()
        import runpy

        runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:  # noqa: BLE001 - report, then exit as a failed worker would
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code if isinstance(code, int) else 1)


# -- the stand-in torch elastic starts --------------------------------------------------
def run(module: str, argv: list[str]) -> int:
    """Have the node's zygote fork ``python -m module argv...``; stand in for it until it
    ends (without a zygote, become that process)."""
    path = os.environ.get("TRAINFLOW_ZYGOTE_SOCKET")
    zygote_pid = int(os.environ.get("TRAINFLOW_ZYGOTE_PID", "0"))
    conn = _connect(path, zygote_pid) if path else None
    plain = [sys.executable, "-u", "-m", module, *argv]
    if conn is None:  # no zygote: be the plain worker
        os.execv(sys.executable, plain)
    _send(conn, {"module": module, "argv": argv, "env": dict(os.environ), "cwd": os.getcwd()}, fds=[0, 1, 2])
    reply, _ = _recv(conn)
    if reply is None or "pid" not in reply:
        print("trainflow zygote dropped the worker start; starting it the plain way", file=sys.stderr)
        os.execv(sys.executable, plain)
    child = reply["pid"]

    def forward(sig, _frame) -> None:
        try:
            os.kill(child, sig)
        except ProcessLookupError:
            pass

    for sig in _FORWARDED:
        signal.signal(sig, forward)
    while True:
        try:
            done, _ = _recv(conn)
            break
        except InterruptedError:
            continue
    code = 1 if done is None else int(done["exit"])
    if code < 0:  # killed by a signal: end the same way, so torch elastic reports it
        sys.stdout.flush()
        if -code in _FORWARDED:
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
        time.sleep(1)
        return 128 - code
    return code


def _connect(path: str, zygote_pid: int) -> socket.socket | None:
    deadline = time.monotonic() + READY_WAIT_S
    while True:
        try:
            conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            conn.connect(path)
            return conn
        except (FileNotFoundError, ConnectionRefusedError):
            conn.close()
            if not _alive(zygote_pid) or time.monotonic() > deadline:
                return None
            time.sleep(0.01)


def wait_ready(path: str, zygote_pid: int, timeout: float = READY_WAIT_S) -> bool:
    """Block until the zygote at ``path`` serves (its socket appears once it has imported
    the training stack); False if it died or ``timeout`` passed first."""
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if not _alive(zygote_pid) or time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["serve"]:
        return serve(argv[1], int(argv[2]))
    if argv[:1] == ["run"] and len(argv) >= 2:
        return run(argv[1], argv[2:])
    print("usage: python -m trainflow.launch.zygote serve SOCKET AGENT_PID | run MODULE ARGS...", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
