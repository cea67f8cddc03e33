"""The environment a node agent and its workers run with: only what training needs.

A node agent is started by an Airflow task (``shard_train``), whose environment carries the
deployment's secrets: Airflow's configuration (``AIRFLOW__*``: the metadata database URL,
the API's JWT secret, the Fernet key), cloud credentials (``AWS_*``), and whatever else the
worker host exports. The workers run the user's workload; none of it is theirs to read.
``trimmed`` keeps an allowlist (the process basics, Python's own variables, trainflow's,
torch's and the collective libraries', and every chip family's runtime variables from the
adapter registry) and drops the rest. The agent applies it to itself before it starts the
zygote or any worker, so every worker process is created with the trimmed environment
(``/proc/<pid>/environ`` included).

More names: ``TRAINFLOW_WORKER_ENV_ALLOW`` (comma-separated; ``NAME`` or ``PREFIX*``), e.g.
a proxy a workload's data loader needs.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from functools import lru_cache

# Set by the deployment, read by the workload's process itself.
BASICS = frozenset(
    {
        "PATH",
        "HOME",
        "USER",
        "LOGNAME",
        "SHELL",
        "TERM",
        "LANG",
        "LANGUAGE",
        "TZ",
        "HOSTNAME",
        "TMPDIR",
        "TMP",
        "TEMP",
        "LD_LIBRARY_PATH",
        "SSL_CERT_FILE",
        "SSL_CERT_DIR",
        "REQUESTS_CA_BUNDLE",
        "CURL_CA_BUNDLE",
        "PYTHONPATH",
        "PYTHONHASHSEED",
        "PYTHONUNBUFFERED",
        "PYTHONDONTWRITEBYTECODE",
        "PYTHONWARNINGS",
        "VIRTUAL_ENV",
        "LOGLEVEL",
        "OMP_NUM_THREADS",
        "MKL_NUM_THREADS",
        "OPENBLAS_NUM_THREADS",
        "MASTER_ADDR",
        "MASTER_PORT",
    }
)
# trainflow's, torch's, the collectives', the thread libraries', and the chip runtimes'.
PREFIXES = (
    "LC_",
    "TRAINFLOW_",
    "TORCH",
    "PYTORCH_",
    "GLOO_",
    "NCCL_",
    "NVSHMEM_",
    "UCX_",
    "FI_",
    "OMPI_",
    "KMP_",
    "MKL_",
    "CUDA_",
    "NVIDIA_",
    "HIP_",
    "ROCR_",
    "HSA_",
    "ROCM_",
    "AMD_",
    "HYGON_",
    "DCU_",
    "ASCEND_",
    "HCCL_",
    "NPU_",
    "MLU_",
    "CNCL_",
    "CNRT_",
    "CAMBRICON_",
    "NEUWARE_",
    "XPU_",
    "BKCL_",
    "KUNLUN",
    "MUSA_",
    "MCCL_",
    "MTHREADS_",
    "MACA_",
    "METAX_",
)
EXTRA = "TRAINFLOW_WORKER_ENV_ALLOW"


@lru_cache(maxsize=1)
def _chip_names() -> frozenset[str]:
    """The visibility and container variables every chip adapter names."""
    from trainflow.chips.registry import FAMILIES

    names: set[str] = set()
    for family in FAMILIES.values():
        names.update(family.visible_envs)
        if family.container_env:
            names.add(family.container_env)
    return frozenset(names)


def allowed(name: str, extra: tuple[str, ...] = ()) -> bool:
    """Whether ``name`` may reach a worker (``extra``: more names, ``PREFIX*`` for prefixes)."""
    if name in BASICS or name.startswith(PREFIXES) or name in _chip_names():
        return True
    return any(name.startswith(e[:-1]) if e.endswith("*") else name == e for e in extra)


def trimmed(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """``env`` (default ``os.environ``) with only the allowed variables. Pure but for the default."""
    env = os.environ if env is None else env
    extra = tuple(e.strip() for e in env.get(EXTRA, "").split(",") if e.strip())
    return {k: v for k, v in env.items() if allowed(k, extra)}


def trim_this_process() -> list[str]:
    """Drop every variable ``trimmed`` would not keep from this process's environment (for
    its children to come); return the names dropped, sorted."""
    keep = trimmed()
    dropped = sorted(k for k in os.environ if k not in keep)
    for name in dropped:
        del os.environ[name]
    return dropped


__all__ = ["BASICS", "PREFIXES", "allowed", "trim_this_process", "trimmed"]
