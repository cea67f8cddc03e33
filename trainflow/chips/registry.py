"""The registry of chip families: plain data plus pure functions.

Facts come from ``shared/reference/accelerators.md``; the ones marked unconfirmed there
can be overridden with ``TRAINFLOW_CHIP_<FAMILY>_<FIELD>`` environment variables (see
``get_family``). Nothing here imports torch or touches a device.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace


@dataclass(frozen=True, kw_only=True)
class ChipFamily:
    """How one accelerator family is driven from PyTorch.

    Attributes:
        name: registry key and queue prefix (``nvidia``, ``ascend`` ...).
        title: human name.
        extension: module to import before torch can see the device (``None``: stock torch).
        device_type: ``torch.device`` type string.
        backend: ``torch.distributed`` backend for device tensors.
        visible_env: in-process visibility variable (re-indexes devices to 0..n-1).
        container_env: container-runtime visibility variable.
        k8s_resource: Kubernetes extended resource of the vendor device plugin.
        default_model: model used in the default queue name.
        health_cmd: vendor CLI that exits 0 when the node's chips are usable (run by the
            node preflight in a subprocess, never by initialising a device runtime);
            ``None`` where there is no chip to check. Override with
            ``TRAINFLOW_CHIP_<FAMILY>_HEALTH_CMD`` (a shell-quoted command; empty: none).
    """

    name: str
    title: str
    extension: str | None
    device_type: str
    backend: str
    visible_env: str | None
    container_env: str | None
    k8s_resource: str | None
    default_model: str
    health_cmd: tuple[str, ...] | None = None

    @property
    def composite_backend(self) -> str:
        """``<dev>:<backend>,cpu:gloo`` so CPU-tensor collectives also have a group."""
        if self.device_type == "cpu":
            return "gloo"
        return f"{self.device_type}:{self.backend},cpu:gloo"


_F = ChipFamily
FAMILIES: dict[str, ChipFamily] = {
    f.name: f
    for f in (
        _F(name="cpu", title="CPU", extension=None, device_type="cpu", backend="gloo",
           visible_env=None, container_env=None, k8s_resource=None, default_model="x86"),
        _F(name="nvidia", title="NVIDIA CUDA", extension=None, device_type="cuda", backend="nccl",
           visible_env="CUDA_VISIBLE_DEVICES", container_env="NVIDIA_VISIBLE_DEVICES",
           k8s_resource="nvidia.com/gpu", default_model="gpu",
           health_cmd=("nvidia-smi", "--query-gpu=index,uuid,name", "--format=csv,noheader")),
        _F(name="amd", title="AMD ROCm", extension=None, device_type="cuda", backend="nccl",
           visible_env="HIP_VISIBLE_DEVICES", container_env="AMD_VISIBLE_DEVICES",
           k8s_resource="amd.com/gpu", default_model="gpu", health_cmd=("amd-smi", "list")),
        _F(name="ascend", title="Huawei Ascend", extension="torch_npu", device_type="npu",
           backend="hccl", visible_env="ASCEND_RT_VISIBLE_DEVICES",
           container_env="ASCEND_VISIBLE_DEVICES", k8s_resource="huawei.com/Ascend910",
           default_model="910b", health_cmd=("npu-smi", "info", "-l")),
        _F(name="cambricon", title="Cambricon MLU", extension="torch_mlu", device_type="mlu",
           backend="cncl", visible_env="MLU_VISIBLE_DEVICES",
           container_env="CAMBRICON_VISIBLE_DEVICES", k8s_resource="cambricon.com/mlu",
           default_model="mlu", health_cmd=("cnmon", "info")),
        _F(name="hygon", title="Hygon DCU", extension=None, device_type="cuda", backend="nccl",
           visible_env="HIP_VISIBLE_DEVICES", container_env="HYGON_VISIBLE_DEVICES",
           k8s_resource="hygon.com/dcu", default_model="dcu", health_cmd=("hy-smi",)),
        _F(name="kunlunxin", title="Kunlunxin XPU", extension="torch_xmlir", device_type="cuda",
           backend="nccl", visible_env="XPU_VISIBLE_DEVICES", container_env=None,
           k8s_resource="kunlunxin.com/xpu", default_model="p800", health_cmd=("xpu-smi",)),
        _F(name="mthreads", title="Moore Threads MUSA", extension="torch_musa", device_type="musa",
           backend="mccl", visible_env="MUSA_VISIBLE_DEVICES",
           container_env="MTHREADS_VISIBLE_DEVICES", k8s_resource="mthreads.com/gpu",
           default_model="gpu", health_cmd=("mthreads-gmi",)),
        _F(name="metax", title="MetaX MACA", extension=None, device_type="cuda", backend="nccl",
           visible_env="CUDA_VISIBLE_DEVICES", container_env="CUDA_VISIBLE_DEVICES",
           k8s_resource="metax-tech.com/gpu", default_model="gpu", health_cmd=("mx-smi",)),
        _F(name="iluvatar", title="Iluvatar CoreX", extension=None, device_type="cuda",
           backend="nccl", visible_env="CUDA_VISIBLE_DEVICES", container_env="IX_VISIBLE_DEVICES",
           k8s_resource="iluvatar.com/gpu", default_model="gpu", health_cmd=("ixsmi", "-L")),
        _F(name="enflame", title="Enflame GCU", extension="torch_gcu", device_type="gcu",
           backend="eccl", visible_env="TOPS_VISIBLE_DEVICES",
           container_env="ENFLAME_VISIBLE_DEVICES", k8s_resource="enflame.com/gcu",
           default_model="gcu", health_cmd=("efsmi", "-L")),
        _F(name="biren", title="Biren SUPA", extension="torch_supa", device_type="supa",
           backend="bccl", visible_env="SUPA_VISIBLE_DEVICES", container_env=None,
           k8s_resource="birentech.com/gpu", default_model="gpu",
           health_cmd=("brsmi", "gpu", "list")),
        _F(name="gaudi", title="Intel Gaudi", extension="habana_frameworks.torch",
           device_type="hpu", backend="hccl", visible_env="HABANA_VISIBLE_MODULES",
           container_env="HABANA_VISIBLE_DEVICES", k8s_resource="habana.ai/gaudi",
           default_model="gaudi",
           health_cmd=("hl-smi", "-Q", "index,module_id", "-f", "csv")),
        _F(name="intel-xpu", title="Intel XPU", extension=None, device_type="xpu", backend="xccl",
           visible_env="ZE_AFFINITY_MASK", container_env=None, k8s_resource="gpu.intel.com/xe",
           default_model="gpu", health_cmd=("xpu-smi", "discovery", "-j")),
    )
}

_OVERRIDABLE = ("extension", "device_type", "backend", "visible_env", "container_env", "k8s_resource")


def get_family(name: str, env: dict[str, str] | None = None) -> ChipFamily:
    """Return the family called ``name``, with environment overrides applied.

    Args:
        name: family name, e.g. ``"ascend"``.
        env: environment to read ``TRAINFLOW_CHIP_<NAME>_<FIELD>`` overrides from
            (default ``os.environ``).

    Raises:
        ValueError: unknown family; the message lists the known ones.
    """
    try:
        family = FAMILIES[name]
    except KeyError:
        raise ValueError(
            f"unknown chip family {name!r}; known families: {', '.join(sorted(FAMILIES))}"
        ) from None
    env = os.environ if env is None else env
    prefix = f"TRAINFLOW_CHIP_{name.upper().replace('-', '_')}_"
    overrides: dict = {f: env[prefix + f.upper()] for f in _OVERRIDABLE if prefix + f.upper() in env}
    if prefix + "HEALTH_CMD" in env:
        import shlex

        overrides["health_cmd"] = tuple(shlex.split(env[prefix + "HEALTH_CMD"])) or None
    return replace(family, **overrides) if overrides else family


def queue_for(chip: str, model: str | None = None) -> str:
    """Airflow queue serving ``chip`` (``cpu``, ``nvidia-gpu``, ``ascend-910b`` ...)."""
    family = get_family(chip)
    if family.name == "cpu" and model is None:
        return "cpu"
    return f"{family.name}-{model or family.default_model}"
