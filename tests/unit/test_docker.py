"""docker/: static validation with real tools (no Docker engine here): hadolint on the
Dockerfiles, the Compose binary's own `config` on the compose file, and the references
between them, the repository and the chip queues."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from trainflow.chips.registry import family_of_queue

REPO = Path(__file__).resolve().parents[2]
DOCKER = REPO / "docker"
SECRETS = {"MINIO_ROOT_PASSWORD": "x" * 12, "TRAINFLOW_JWT_SECRET": "y" * 32, "TRAINFLOW_API_SECRET_KEY": "z" * 32}


def _tool(name: str) -> str:
    found = shutil.which(name) or str(Path(sys.executable).with_name(name))
    assert os.access(found, os.X_OK), f"{name} is a test dependency (pyproject [test])"
    return found


def _compose(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [_tool("docker-compose"), "-f", str(DOCKER / "docker-compose.yaml"), *args],
        capture_output=True,
        text=True,
        env={"PATH": os.environ["PATH"], "HOME": "/tmp", **(env or {})},
        timeout=120,
    )


@pytest.mark.parametrize("dockerfile", sorted(p.name for p in DOCKER.glob("Dockerfile.*")))
def test_hadolint_passes(dockerfile):
    done = subprocess.run(
        [_tool("hadolint"), "--no-color", str(DOCKER / dockerfile)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.parametrize("dockerfile", sorted(p.name for p in DOCKER.glob("Dockerfile.*")))
def test_every_copied_path_exists_and_the_base_is_pinned(dockerfile):
    text = (DOCKER / dockerfile).read_text()
    for line in text.splitlines():
        if line.startswith("COPY "):
            sources = [w for w in line.split()[1:-1] if not w.startswith("--")]
            for src in sources:
                assert (REPO / src).exists(), f"{dockerfile}: COPY {src} does not exist"
    bases = re.findall(r"^(?:ARG BASE_IMAGE=|FROM )(\S+)", text, flags=re.M)
    for base in bases:
        if base.startswith("$"):
            continue
        assert re.search(r":[0-9][^:]*$", base), f"{dockerfile}: base image {base} is not pinned to a version"


@pytest.mark.parametrize("profiles", [(), ("gpu",), ("npu",), ("gpu", "npu")])
def test_compose_config_is_valid(profiles):
    args = [a for p in profiles for a in ("--profile", p)]
    done = _compose(*args, "config", "-q", env=SECRETS)
    assert done.returncode == 0, done.stderr
    services = _compose(*args, "config", "--services", env=SECRETS).stdout.split()
    assert {"postgres", "redis", "minio", "api-server", "scheduler", "dag-processor", "triggerer", "worker-cpu"} <= set(
        services
    )
    assert ("worker-nvidia" in services) == ("gpu" in profiles)
    assert ("worker-ascend" in services) == ("npu" in profiles)


def test_compose_refuses_to_run_without_its_secrets():
    done = _compose("config", "-q", env={k: v for k, v in SECRETS.items() if k != "MINIO_ROOT_PASSWORD"})
    assert done.returncode != 0 and "set MINIO_ROOT_PASSWORD" in done.stderr


def test_compose_references_queues_files_and_pinned_images():
    config = yaml.safe_load(_compose("--profile", "gpu", "--profile", "npu", "config", env=SECRETS).stdout)
    queues = set()
    for name, svc in config["services"].items():
        image = svc.get("image", "")
        assert image and ":" in image and not image.endswith(":latest"), f"{name}: unpinned image {image!r}"
        if "build" in svc:
            assert (Path(svc["build"]["context"]) / svc["build"]["dockerfile"]).is_file(), name
        command = svc.get("command") or []
        assert command[:3] != ["airflow", "celery", "worker"], f"{name}: workers register first (trainflow worker)"
        if command[:2] == ["trainflow", "worker"]:
            queues |= set(command[command.index("--queues") + 1].split(","))
        for vol in svc.get("volumes", []):
            if vol.get("type") == "bind" and str(vol["source"]).startswith(str(REPO)):
                assert Path(vol["source"]).exists(), f"{name}: {vol['source']} does not exist"
        env = svc.get("environment") or {}
        if "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN" in env:
            assert env["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"].startswith("postgresql+psycopg2://")
            assert env["AIRFLOW__CELERY__RESULT_BACKEND"].startswith("db+postgresql+psycopg2://")
            assert int(env["AIRFLOW__CELERY_BROKER_TRANSPORT_OPTIONS__VISIBILITY_TIMEOUT"]) >= 24 * 3600
    assert queues == {"default", "cpu", "nvidia-gpu", "ascend-910b"}
    assert all(q == "default" or family_of_queue(q) for q in queues)
