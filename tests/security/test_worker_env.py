"""Workers run the user's workload with only the environment training needs: the
deployment's secrets in the task's environment (Airflow's configuration, cloud credentials,
anything else the host exports) never reach them, and they live in a process session of
their own."""

from __future__ import annotations

import os
import threading
import time

import pytest

from trainflow.launch.envtrim import allowed, trimmed

SECRETS = {
    "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": "postgresql+psycopg2://airflow:hunter2@db/airflow",
    "AIRFLOW__API_AUTH__JWT_SECRET": "jwt-secret-value",
    "AIRFLOW__CORE__FERNET_KEY": "fernet-secret-value",
    "AWS_SECRET_ACCESS_KEY": "aws-secret-value",
    "AWS_ACCESS_KEY_ID": "aws-key-id-value",
    "GITHUB_TOKEN": "gh-token-value",
}


def test_the_allowlist_keeps_what_training_needs_and_nothing_else():
    needed = {
        "PATH": "/usr/bin",
        "HOME": "/root",
        "LC_ALL": "C.UTF-8",
        "PYTHONPATH": "/x",
        "TRAINFLOW_HOME": "/tf",
        "GLOO_SOCKET_IFNAME": "lo",
        "NCCL_IB_HCA": "mlx5",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
        "CUDA_VISIBLE_DEVICES": "0,1",
        "ASCEND_RT_VISIBLE_DEVICES": "0",
        "MLU_VISIBLE_DEVICES": "0",
        "XPU_VISIBLE_DEVICES": "0",
        "MUSA_VISIBLE_DEVICES": "0",
        "HIP_VISIBLE_DEVICES": "0",
        "HCCL_CONNECT_TIMEOUT": "600",
    }
    assert trimmed({**needed, **SECRETS}) == needed
    for name in SECRETS:
        assert not allowed(name), name


def test_more_names_are_allowed_by_configuration_only():
    env = {
        "TRAINFLOW_WORKER_ENV_ALLOW": "HTTPS_PROXY, DATA_*",
        "HTTPS_PROXY": "http://p:3128",
        "DATA_ROOT": "/data",
        "DATABASE_URL": "secret",
        "AWS_SECRET_ACCESS_KEY": "s",
    }
    assert trimmed(env) == {
        "TRAINFLOW_WORKER_ENV_ALLOW": "HTTPS_PROXY, DATA_*",
        "HTTPS_PROXY": "http://p:3128",
        "DATA_ROOT": "/data",
    }


def _environ(pid: int) -> dict[str, str]:
    raw = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
    return dict(item.decode(errors="replace").split("=", 1) for item in raw if b"=" in item)


@pytest.mark.integration  # real worker processes
def test_real_workers_see_no_secret_of_the_task_and_run_in_their_own_session(tmp_path, monkeypatch):
    """A real 2-node gang launched from a process whose environment holds secrets: each
    worker's environment as the kernel shows it (``/proc/<pid>/environ``) has none of them."""
    from trainflow.heartbeat import read_all
    from trainflow.launch.local import run_local
    from trainflow.spec import TrainingSpec

    for name, value in SECRETS.items():
        monkeypatch.setenv(name, value)
    spec = TrainingSpec(
        workload="digits", nodes=2, steps=1500, batch_size=16, checkpoint_interval=500, heartbeat_interval=0.2
    )
    result: dict = {}
    launcher = threading.Thread(target=lambda: result.update(codes=run_local(spec, tmp_path)), daemon=True)
    launcher.start()
    seen: dict[int, dict[str, str]] = {}
    deadline = time.monotonic() + 120
    while len(seen) < 2 and launcher.is_alive() and time.monotonic() < deadline:
        for rank, beat in read_all(tmp_path / "heartbeats").items():
            pid = beat.get("pid")
            if rank not in seen and pid and beat.get("step", 0) > 0:
                try:
                    seen[rank] = {**_environ(pid), "__sid": str(os.getsid(pid))}
                except (OSError, ProcessLookupError):
                    pass  # it ended between the beat and the read
        time.sleep(0.1)
    launcher.join(timeout=300)
    assert result.get("codes") and set(result["codes"]) == {0}, result
    assert sorted(seen) == [0, 1], "both workers were seen training"
    for rank, env in seen.items():
        leaked = {k for k, v in env.items() if k in SECRETS or v in SECRETS.values()}
        assert not leaked, f"rank {rank} sees {sorted(leaked)}"
        assert env["GLOO_SOCKET_IFNAME"] == "lo" and env.get("TRAINFLOW_NODE") in ("0", "1")
        assert int(env["__sid"]) != os.getsid(0)  # a session of its own, not the launcher's
