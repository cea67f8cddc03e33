"""Per-tenant OS users: a tenant's workload cannot open another tenant's files on a shared host.

Two tenants' workers on one host would otherwise run as the same OS user, so a workload that
knows another run's workspace path could read its checkpoints and heartbeats. With
``TRAINFLOW_TENANT_USERS`` (``tenant=user`` words, the user a name or a numeric uid; e.g.
``vision=tf-vision nlp=52002``) the node agent, running as root, gives the run's workspace to
the tenant's user with mode 0700, and every process that runs the tenant's code — the
training workers and the evaluation — drops to that user before it imports the workload (as
YARN's LinuxContainerExecutor runs containers as the submitting user). The Airflow task and the
agent stay root: they read the workspace to report, sync and clean it. A tenant not in the
map runs as today, as the worker's user.

The agent passes the identity to its workers as ``TRAINFLOW_RUN_AS=uid:gid`` (the trimmed
environment keeps ``TRAINFLOW_*``); ``drop_privileges`` applies it.
"""

from __future__ import annotations

import os
from pathlib import Path

from trainflow.errors import SpecError

VAR = "TRAINFLOW_TENANT_USERS"
RUN_AS = "TRAINFLOW_RUN_AS"


def tenant_users(env=None) -> dict[str, tuple[int, int]]:
    """``TRAINFLOW_TENANT_USERS`` as tenant → (uid, gid); a name's gid is its primary group,
    a bare uid's gid is the uid.

    Raises:
        SpecError: a malformed word, an unknown user name, or uid 0 (naming the word).
    """
    import pwd

    env = os.environ if env is None else env
    out: dict[str, tuple[int, int]] = {}
    for word in (env.get(VAR) or "").replace(",", " ").split():
        tenant, sep, user = word.partition("=")
        if not sep or not tenant or not user:
            raise SpecError(VAR, word, "use tenant=user words, e.g. vision=tf-vision nlp=52002")
        if user.isdigit():
            ids = (int(user), int(user))
        else:
            try:
                entry = pwd.getpwnam(user)
            except KeyError:
                raise SpecError(VAR, word, f"no user {user!r} on this host: create it, or give a uid") from None
            ids = (entry.pw_uid, entry.pw_gid)
        if ids[0] == 0:
            raise SpecError(VAR, word, "a tenant's user must not be root")
        out[tenant] = ids
    return out


def for_tenant(tenant: str, env=None) -> tuple[int, int] | None:
    """The (uid, gid) the tenant's workloads run as here, or None (the worker's own user).

    Raises:
        SpecError: the map is malformed, or it names this tenant while this process cannot
            switch users (not root): running the workload as root's peer would be silent.
    """
    ids = tenant_users(env).get(tenant)
    if ids is not None and os.geteuid() != 0:
        raise SpecError(
            VAR,
            f"{tenant}={ids[0]}",
            f"maps tenant {tenant!r} to another user, but this process runs as uid "
            f"{os.geteuid()}: run the Celery worker as root, or unset {VAR}",
        )
    return ids


def give_workspace(run_dir: Path, ids: tuple[int, int]) -> None:
    """Make the run's workspace the tenant user's, readable by it alone (0700 at the top:
    nothing under it can be reached by another non-root user)."""
    uid, gid = ids
    run_dir = Path(run_dir)
    for dirpath, dirnames, filenames in os.walk(run_dir):
        for name in [*dirnames, *filenames]:
            os.chown(os.path.join(dirpath, name), uid, gid, follow_symlinks=False)
    os.chown(run_dir, uid, gid)
    os.chmod(run_dir, 0o700)
    (run_dir / "home").mkdir(exist_ok=True)  # the workload's $HOME: caches, configs
    os.chown(run_dir / "home", uid, gid)


def env_for(run_dir: Path, ids: tuple[int, int]) -> dict[str, str]:
    """What a process that drops to ``ids`` needs in its environment."""
    uid, gid = ids
    return {
        RUN_AS: f"{uid}:{gid}",
        "HOME": str(Path(run_dir) / "home"),
        "USER": f"tenant-{uid}",
        "LOGNAME": f"tenant-{uid}",
    }


def hand_over(run_dir: Path, tenant: str) -> dict[str, str]:
    """Before starting a process that runs ``tenant``'s code on ``run_dir``: when the tenant
    is mapped, give it the workspace (again: files root processes added since are included)
    and return what that process's environment needs to drop to its user; else ``{}``."""
    ids = for_tenant(tenant)
    if ids is None:
        return {}
    give_workspace(Path(run_dir), ids)
    return env_for(Path(run_dir), ids)


def drop_privileges() -> tuple[int, int] | None:
    """In a process about to run a tenant's code: become ``TRAINFLOW_RUN_AS`` (no-op when it
    is unset). Torch elastic's per-worker error file lives in a folder the root agent made:
    it is handed over first, so the worker can still report its failure there.

    Raises:
        PermissionError: the identity is set but this process is not root (it never runs the
            workload as a different user than asked).
    """
    spec = os.environ.get(RUN_AS)
    if not spec:
        return None
    uid, gid = (int(x) for x in spec.split(":"))
    if os.geteuid() == uid:
        return uid, gid
    if os.geteuid() != 0:
        raise PermissionError(f"{RUN_AS}={spec} but this process runs as uid {os.geteuid()}, not root")
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if error_file:  # <agent's mkdtemp torchelastic_*>/<run>/attempt_<n>/<rank>/error.json
        folder = Path(error_file).parent
        folder.mkdir(parents=True, exist_ok=True)
        chain = [folder, *folder.parents]
        top = next((i for i, p in enumerate(chain) if p.name.startswith("torchelastic_")), 0)
        for path in chain[: top + 1]:  # the agent's folder serves this run alone
            os.chown(path, uid, gid)
    os.setgroups([gid])
    os.setgid(gid)
    os.setuid(uid)
    return uid, gid
