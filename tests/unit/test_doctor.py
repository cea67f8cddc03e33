"""``trainflow doctor`` end to end (a real subprocess with fake vendor CLIs on PATH that
print recorded outputs), the preflight's device checks, chip routing and the
provision-time device fit."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from trainflow import preflight
from trainflow.chips.registry import get_family
from trainflow.cluster.hosts import CordonPolicy, HostRegistry
from trainflow.errors import PreflightError, SpecError
from trainflow.launch.local import free_port
from trainflow.plan import check_devices
from trainflow.routing import node_queue
from trainflow.spec import TrainingSpec

DATA = Path(__file__).parent / "data" / "chips"


def _fake_cli(bin_dir: Path, name: str, sample: str | None, rc: int = 0) -> None:
    bin_dir.mkdir(exist_ok=True)
    body = f"cat {DATA / sample}\n" if sample else ""
    path = bin_dir / name
    path.write_text(f"#!/bin/sh\n{body}exit {rc}\n")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


def _doctor(tmp_path, *args, extra_env=None):
    env = {
        "PATH": f"{tmp_path / 'bin'}:/usr/bin:/bin",
        "HOME": str(tmp_path),
        "TRAINFLOW_HOME": str(tmp_path / "home"),
        "TRAINFLOW_HOST": "host-a",
        **(extra_env or {}),
    }
    return subprocess.run(
        [sys.executable, "-m", "trainflow.cli", "doctor", *args], capture_output=True, text=True, env=env, timeout=120
    )


def test_doctor_on_a_healthy_ascend_host(tmp_path):
    _fake_cli(tmp_path / "bin", "npu-smi", "npu-smi-info.txt")
    done = _doctor(tmp_path, "--chip", "ascend", "--model", "910b4")
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "chip family : ascend (Huawei Ascend), detected by spec" in out
    assert "devices     : 8" in out and "[2] 910B4 0000:81:00.0 Health OK" in out
    assert "queue       : ascend-910b4" in out
    assert "serve it    : trainflow worker --queues ascend-910b4 --concurrency 1" in out
    assert "backend npu:hccl,cpu:gloo, extension torch_npu (pip torch-npu)" in out
    assert out.rstrip().endswith("verdict     : HEALTHY")


def test_doctor_exits_1_on_an_unhealthy_device_and_names_it(tmp_path):
    _fake_cli(tmp_path / "bin", "npu-smi", "npu-smi-info-warning.txt")
    done = _doctor(tmp_path, "--queue", "ascend-910b", "--json")
    assert done.returncode == 1
    report = json.loads(done.stdout)
    assert report["healthy"] is False and report["queue"] == "ascend-910b"
    assert report["health"]["detail"] == "unhealthy devices 3 (Health Warning)"


def test_doctor_exits_1_when_the_vendor_cli_fails_or_is_missing(tmp_path):
    _fake_cli(tmp_path / "bin", "cnmon", None, rc=3)
    failed = _doctor(tmp_path, "--chip", "cambricon")
    assert failed.returncode == 1 and "cnmon: exited 3" in failed.stdout and "UNHEALTHY" in failed.stdout
    missing = _doctor(tmp_path, "--chip", "mthreads")
    assert missing.returncode == 1
    assert (
        "'mthreads-gmi' not found; install the vendor tools or set TRAINFLOW_CHIP_MTHREADS_INVENTORY_CMD"
        in missing.stdout
    )


def test_doctor_detects_from_the_environment_and_registers_the_host(tmp_path):
    _fake_cli(tmp_path / "bin", "hy-smi", "hy-smi.txt")
    done = _doctor(tmp_path, "--register", "--json", extra_env={"TRAINFLOW_CHIP": "hygon"})
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert (report["family"], report["detected_by"], report["devices"]) == ("hygon", "env", 4)
    assert report["registered"] == "host-a"
    (row,) = HostRegistry(tmp_path / "home" / "state.db").inventory("hygon-dcu")
    assert (row["host"], row["family"], row["devices"]) == ("host-a", "hygon", 4)


def test_doctor_bad_input_exits_2(tmp_path):
    done = _doctor(tmp_path, "--chip", "tpu")
    assert done.returncode == 2 and "unknown chip family 'tpu'; known families:" in done.stderr


@pytest.mark.integration  # real worker processes
def test_doctor_on_this_cpu_host(tmp_path):
    done = _doctor(tmp_path)
    assert done.returncode == 0
    assert "chip family : cpu" in done.stdout and "queue       : cpu" in done.stdout


# -- preflight device checks -------------------------------------------------------------
def _plan(tmp_path, chip="metax", nproc=1):
    return {
        "spec": {"chip": chip, "nproc_per_node": nproc},
        "run_dir": str(tmp_path / "run"),
        "rendezvous": {"endpoint": f"127.0.0.1:{free_port()}"},
    }


def test_preflight_counts_devices_and_reads_device_health(tmp_path, monkeypatch):
    registry = HostRegistry(tmp_path / "state.db")
    policy = CordonPolicy(failures=3, window_s=60)
    monkeypatch.setenv("TRAINFLOW_CHIP_METAX_HEALTH_CMD", f"cat {DATA / 'mx-smi.txt'}")
    checks = preflight.run(_plan(tmp_path), 0, host="h", registry=registry, policy=policy)
    assert [c.name for c in checks][:2] == ["chip_health", "devices"] and all(c.ok for c in checks)
    with pytest.raises(PreflightError, match=r"devices: 1 cuda device\(s\) listed, nproc_per_node=2; lower"):
        preflight.run(_plan(tmp_path, nproc=2), 0, host="h", registry=registry, policy=policy)
    assert registry.cordoned("h") is None  # too small is not sick
    sick = tmp_path / "sick.txt"
    sick.write_text((DATA / "mx-smi.txt").read_text().replace("Available    ", "Unavailable  "))
    monkeypatch.setenv("TRAINFLOW_CHIP_METAX_HEALTH_CMD", f"cat {sick}")
    with pytest.raises(PreflightError, match=r"unhealthy devices 0 \(GPU-State Unavailable\)"):
        preflight.run(_plan(tmp_path), 0, host="h", registry=registry, policy=policy)
    assert "chip health check failed" in registry.cordoned("h").reason


# -- routing and provision ---------------------------------------------------------------
@pytest.mark.parametrize(
    "conf, current, queue",
    [
        ({"chip": "ascend"}, "cpu", "ascend-910b"),
        ({"chip": "ascend", "chip_model": "910c"}, "cpu", "ascend-910c"),
        ({"chip_model": "h100"}, "nvidia-gpu", "nvidia-h100"),
        ({"chip": "nvidia"}, "nvidia-h100", "nvidia-h100"),  # the DAG's model of the same family
        ({"chip": "amd"}, "nvidia-h100", "amd-gpu"),
        ({"chip_model": "Bad Model"}, "nvidia-gpu", None),
        ({"steps": 5}, "nvidia-gpu", None),
    ],
)
def test_node_queue_with_models(conf, current, queue):
    assert node_queue("shard_train", conf, current) == queue


def test_spec_queue_and_mixed_families_refused():
    assert TrainingSpec.from_mapping({"chip": "ascend", "chip_model": "910c"}).queue == "ascend-910c"
    assert TrainingSpec.from_mapping({}).queue == "cpu"
    for mixed in (["nvidia", "ascend"], "nvidia,ascend"):
        with pytest.raises(SpecError, match="a gang is one chip family") as err:
            TrainingSpec.from_mapping({"chip": mixed})
        assert err.value.field == "chip"
    with pytest.raises(SpecError, match="must be one of amd, ascend"):
        TrainingSpec.from_mapping({"chip": "tpu"})
    with pytest.raises(SpecError) as err:
        TrainingSpec.from_mapping({"chip_model": "H100!"})
    assert err.value.field == "chip_model"


def test_precision_enters_the_training_hash_only_when_not_fp32():
    base = TrainingSpec.from_mapping({})
    assert TrainingSpec.from_mapping({"precision": "fp32"}).training_hash() == base.training_hash()
    assert TrainingSpec.from_mapping({"precision": "bf16"}).training_hash() != base.training_hash()


def test_provision_refuses_nproc_beyond_every_registered_host():
    spec = TrainingSpec.from_mapping({"chip": "ascend", "nproc_per_node": 16})
    hosts = [{"host": "a", "devices": 8}, {"host": "b", "devices": 4}]
    with pytest.raises(
        SpecError,
        match=r"no host of queue 'ascend-910b' has that many devices \(the "
        r"largest, a, has 8\); use at most 8",
    ) as err:
        check_devices(spec, hosts)
    assert err.value.field == "nproc_per_node"
    ok = TrainingSpec.from_mapping({"chip": "ascend", "nproc_per_node": 8})
    assert [h["host"] for h in check_devices(ok, hosts)] == ["a"]
    assert check_devices(ok, []) == []  # nothing registered: the node's preflight counts
    cpu = TrainingSpec.from_mapping({"nproc_per_node": 16})
    assert check_devices(cpu, hosts) == hosts  # CPU ranks are processes, not devices


def test_a_missing_extension_names_the_package_and_the_queue():
    from trainflow.errors import ChipUnavailableError

    with pytest.raises(ChipUnavailableError, match=r"needs the 'torch_npu' extension.*serve queue 'ascend-910b'"):
        preflight.chip_extension(get_family("ascend", env={}))
    assert os.environ.get("TRAINFLOW_CHIP") is None


def test_gpu_check_skips_with_the_reason_where_there_is_no_gpu(tmp_path):
    """bench/gpu_check exits 77 (skipped) and says why on a host without an NVIDIA GPU; on a
    GPU host it trains (run by hand, results in bench/results/gpu_check.json)."""
    import shutil

    if shutil.which("nvidia-smi", path="/usr/bin:/bin"):
        pytest.skip("an NVIDIA host: run bench/gpu_check.py itself")
    repo = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [sys.executable, str(repo / "bench" / "gpu_check.py"), "--out", str(tmp_path / "r.json")],
        capture_output=True,
        text=True,
        timeout=120,
        env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)},
    )
    assert done.returncode == 77, done.stderr
    assert "gpu_check: skipped, no healthy NVIDIA GPU here: 'nvidia-smi' not found" in done.stderr
    assert not (tmp_path / "r.json").exists()


@pytest.mark.integration  # real worker processes
def test_worker_registers_the_host_in_its_pool_with_labels_then_runs_celery(tmp_path):
    """`trainflow worker` (what the images and compose run): the doctor's registration
    with a pool and labels, then the Celery worker command for the queues."""
    _fake_cli(tmp_path / "bin", "hy-smi", "hy-smi.txt")
    env = {
        "PATH": f"{tmp_path / 'bin'}:/usr/bin:/bin",
        "HOME": str(tmp_path),
        "TRAINFLOW_HOME": str(tmp_path / "home"),
        "TRAINFLOW_HOST": "host-b",
    }
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "trainflow.cli",
            "worker",
            "--queues",
            "default,hygon-dcu",
            "--pool",
            "dcu",
            "--label",
            "rack=r7",
            "--dry-run",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    first, command = done.stdout.strip().splitlines()
    assert json.loads(first) == {
        "queue": "hygon-dcu",
        "devices": 4,
        "healthy": True,
        "registered": "host-b",
        "pool": "dcu",
        "labels": {"rack": "r7"},
    }
    # its chip queue, and its own queue of it: where trainflow places node tasks on this host
    assert command.endswith("airflow celery worker --queues default,hygon-dcu,hygon-dcu@host-b --concurrency 1")
    (row,) = HostRegistry(tmp_path / "home" / "state.db").inventory(pool="dcu")
    assert (row["host"], row["queue"], row["devices"], row["labels"], row["cordoned"]) == (
        "host-b",
        "hygon-dcu",
        4,
        {"rack": "r7"},
        None,
    )
    bad = subprocess.run(
        [sys.executable, "-m", "trainflow.cli", "doctor", "--register", "--label", "rack"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert bad.returncode == 2 and "invalid --label='rack': name=value" in bad.stderr
