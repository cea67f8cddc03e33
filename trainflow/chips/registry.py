"""The registry of chip families: plain data plus pure functions.

Facts come from ``shared/reference/accelerators.md`` (its confidence marks are kept in
``ChipFamily.unconfirmed``); every string field can be overridden per cluster with a
``TRAINFLOW_CHIP_<FAMILY>_<FIELD>`` environment variable (see ``get_family``), so an
unconfirmed fact that proves wrong on real hardware is fixed by configuration, not a
release. Nothing here imports torch or touches a device.
"""

from __future__ import annotations

import os
import shlex
from dataclasses import dataclass, fields, replace
from typing import Mapping


@dataclass(frozen=True, kw_only=True)
class ChipFamily:
    """How one accelerator family is driven from PyTorch, its hosts and Kubernetes.

    Attributes:
        name: registry key and queue prefix (``nvidia``, ``ascend`` ...).
        title: human name.
        package: what to install on a worker that serves the family.
        extension: module to import before torch can see the device (``None``: stock torch).
        device_type: ``torch.device`` type string.
        backend: ``torch.distributed`` backend for device tensors.
        visible_envs: in-process visibility variables (re-index devices to 0..n-1); the
            worker sets every one of them, the first is the one read back.
        container_env: container-runtime visibility variable (decides which device nodes
            a container gets; not the same thing as ``visible_envs``).
        k8s_resource: extended resource of the vendor's device plugin (whole cards).
        k8s_alt_resources: virtualised or shared alternatives (HAMi, vNPU, DRS ...).
        default_model: model used in the default queue name.
        inventory_cmd: vendor CLI listing the host's devices (parsed by
            ``trainflow.chips.parsers``); ``None``: no chip.
        health_cmd: vendor CLI that exits 0 when the chips are usable (a parser may also
            read per-device health from its output); ``None``: nothing to check.
        pci_vendor_ids: PCI vendor IDs of the family's cards (sysfs, no driver needed).
        dev_globs: device nodes under ``/dev`` that the driver creates.
        env_prefixes: environment prefixes propagated to every node of a gang.
        bf16: the bf16 rule: ``yes``, ``no``, ``runtime`` (ask the device module),
            ``capability>=M.m`` (device capability) or ``name:P1|P2`` (device name prefix).
        default_env: environment every worker of the family gets unless already set.
        image: container image for the Kubernetes launch path (must hold trainflow).
        presents_as_cuda: torch reports the family as ``cuda`` (told apart by detection).
        unconfirmed: fields marked [U] in the reference; verify on hardware.
    """

    name: str
    title: str
    package: str
    extension: str | None
    device_type: str
    backend: str
    visible_envs: tuple[str, ...]
    container_env: str | None
    k8s_resource: str | None
    k8s_alt_resources: tuple[str, ...] = ()
    default_model: str
    inventory_cmd: tuple[str, ...] | None = None
    health_cmd: tuple[str, ...] | None = None
    pci_vendor_ids: tuple[str, ...] = ()
    dev_globs: tuple[str, ...] = ()
    env_prefixes: tuple[str, ...] = ()
    bf16: str = "runtime"
    default_env: Mapping[str, str] = ()  # type: ignore[assignment]  # normalised to a dict
    image: str = ""
    presents_as_cuda: bool = False
    unconfirmed: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "default_env", dict(self.default_env or {}))
        if not self.image:
            object.__setattr__(self, "image", f"trainflow/worker-{self.name}:0.1.0")

    @property
    def visible_env(self) -> str | None:
        """The visibility variable read back (the first of ``visible_envs``)."""
        return self.visible_envs[0] if self.visible_envs else None

    @property
    def composite_backend(self) -> str:
        """``<dev>:<backend>,cpu:gloo`` so CPU-tensor collectives also have a group."""
        if self.device_type == "cpu":
            return "gloo"
        return f"{self.device_type}:{self.backend},cpu:gloo"

    @property
    def has_devices(self) -> bool:
        return self.device_type != "cpu"


_F = ChipFamily
FAMILIES: dict[str, ChipFamily] = {
    f.name: f
    for f in (
        _F(
            name="cpu",
            title="CPU",
            package="torch",
            extension=None,
            device_type="cpu",
            backend="gloo",
            visible_envs=(),
            container_env=None,
            k8s_resource=None,
            default_model="x86",
            env_prefixes=("GLOO",),
            bf16="yes",
        ),
        _F(
            name="nvidia",
            title="NVIDIA CUDA",
            package="torch (CUDA build)",
            extension=None,
            device_type="cuda",
            backend="nccl",
            visible_envs=("CUDA_VISIBLE_DEVICES",),
            container_env="NVIDIA_VISIBLE_DEVICES",
            k8s_resource="nvidia.com/gpu",
            k8s_alt_resources=("nvidia.com/gpumem", "nvidia.com/gpucores"),
            default_model="gpu",
            inventory_cmd=(
                "nvidia-smi",
                "--query-gpu=index,uuid,name,memory.total,compute_cap",
                "--format=csv,noheader",
            ),
            health_cmd=("nvidia-smi", "--query-gpu=index,uuid,name,memory.total,compute_cap", "--format=csv,noheader"),
            pci_vendor_ids=("0x10de",),
            dev_globs=("nvidia[0-9]*",),
            env_prefixes=("NCCL", "CUDA"),
            bf16="capability>=8.0",
            default_env={"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"},
            presents_as_cuda=True,
            unconfirmed=("container_env",),
        ),
        _F(
            name="amd",
            title="AMD ROCm",
            package="torch (ROCm build)",
            extension=None,
            device_type="cuda",
            backend="nccl",
            visible_envs=("HIP_VISIBLE_DEVICES",),
            container_env="AMD_VISIBLE_DEVICES",
            k8s_resource="amd.com/gpu",
            k8s_alt_resources=("amd.com/gpumem", "amd.com/gpucores"),
            default_model="gpu",
            inventory_cmd=("amd-smi", "list"),
            health_cmd=("amd-smi", "list"),
            pci_vendor_ids=("0x1002",),
            dev_globs=("kfd", "dri/renderD*"),
            env_prefixes=("NCCL", "RCCL", "HIP", "HSA", "ROCR"),
            bf16="runtime",
            presents_as_cuda=True,
            unconfirmed=("container_env", "bf16"),
        ),
        _F(
            name="ascend",
            title="Huawei Ascend",
            package="torch-npu",
            extension="torch_npu",
            device_type="npu",
            backend="hccl",
            visible_envs=("ASCEND_RT_VISIBLE_DEVICES",),
            container_env="ASCEND_VISIBLE_DEVICES",
            k8s_resource="huawei.com/Ascend910",
            k8s_alt_resources=(
                "huawei.com/Ascend910B3",
                "huawei.com/Ascend910C",
                "huawei.com/Ascend310P",
                "huawei.com/Ascend910-4c",
            ),
            default_model="910b",
            inventory_cmd=("npu-smi", "info"),
            health_cmd=("npu-smi", "info"),
            pci_vendor_ids=("0x19e5",),
            dev_globs=("davinci[0-9]*",),
            env_prefixes=("ASCEND", "HCCL"),
            bf16="name:Ascend910B|Ascend910_93|Ascend910C",
            # HCCL's own timeouts must outlast the slowest peer (a checkpoint save, a restart).
            default_env={"HCCL_CONNECT_TIMEOUT": "600", "HCCL_EXEC_TIMEOUT": "1836"},
            unconfirmed=("k8s_resource",),
        ),
        _F(
            name="cambricon",
            title="Cambricon MLU",
            package="torch_mlu (vendor wheel)",
            extension="torch_mlu",
            device_type="mlu",
            backend="cncl",
            visible_envs=("MLU_VISIBLE_DEVICES",),
            container_env="CAMBRICON_VISIBLE_DEVICES",
            k8s_resource="cambricon.com/mlu",
            k8s_alt_resources=("cambricon.com/vmlu", "cambricon.com/mlu.smlu.vmemory"),
            default_model="mlu",
            inventory_cmd=("cnmon",),
            health_cmd=("cnmon",),
            pci_vendor_ids=("0xcabc",),
            dev_globs=("cambricon_dev*",),
            env_prefixes=("NEUWARE_HOME", "CNCL", "CNRT"),
            bf16="capability>=5.0",
            default_env={"PYTORCH_CNDEV_BASED_MLU_CHECK": "1"},
            unconfirmed=("inventory_cmd", "health_cmd"),
        ),
        _F(
            name="hygon",
            title="Hygon DCU",
            package="torch (DTK build)",
            extension=None,
            device_type="cuda",
            backend="nccl",
            visible_envs=("HIP_VISIBLE_DEVICES",),
            container_env="HYGON_VISIBLE_DEVICES",
            k8s_resource="hygon.com/dcu",
            k8s_alt_resources=("hygon.com/dcunum", "hygon.com/dcumem", "hygon.com/dcucores"),
            default_model="dcu",
            inventory_cmd=("hy-smi",),
            health_cmd=("hy-smi",),
            pci_vendor_ids=("0x1d94",),
            dev_globs=("kfd", "dri/renderD*"),
            env_prefixes=("NCCL", "RCCL", "HIP", "HSA"),
            bf16="runtime",
            presents_as_cuda=True,
            unconfirmed=("k8s_resource", "inventory_cmd", "bf16"),
        ),
        _F(
            name="kunlunxin",
            title="Kunlunxin XPU",
            package="xpytorch (vendor wheel)",
            extension="torch_xmlir",
            device_type="cuda",
            backend="nccl",
            visible_envs=("XPU_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES"),
            container_env=None,
            k8s_resource="kunlunxin.com/xpu",
            k8s_alt_resources=("kunlunxin.com/vxpu", "kunlunxin.com/vxpu-memory"),
            default_model="p800",
            inventory_cmd=("xpu-smi",),
            health_cmd=("xpu-smi",),
            dev_globs=("xpu[0-9]*", "xpuctrl"),
            env_prefixes=("XPU", "BKCL", "XCCL", "XMLIR"),
            bf16="yes",
            presents_as_cuda=True,
            unconfirmed=("k8s_resource", "inventory_cmd", "visible_envs"),
        ),
        _F(
            name="mthreads",
            title="Moore Threads MUSA",
            package="torch_musa (vendor wheel)",
            extension="torch_musa",
            device_type="musa",
            backend="mccl",
            visible_envs=("MUSA_VISIBLE_DEVICES",),
            container_env="MTHREADS_VISIBLE_DEVICES",
            k8s_resource="mthreads.com/gpu",
            k8s_alt_resources=("mthreads.com/vgpu", "mthreads.com/sgpu-memory"),
            default_model="gpu",
            inventory_cmd=("mthreads-gmi",),
            health_cmd=("mthreads-gmi",),
            pci_vendor_ids=("0x1ed5",),
            dev_globs=("mtgpu*",),
            env_prefixes=("MUSA", "MCCL"),
            bf16="capability>=2.2",
            unconfirmed=("k8s_resource", "inventory_cmd", "dev_globs"),
        ),
        _F(
            name="metax",
            title="MetaX MACA",
            package="torch (mcPytorch build)",
            extension=None,
            device_type="cuda",
            backend="nccl",
            visible_envs=("CUDA_VISIBLE_DEVICES", "MACA_VISIBLE_DEVICES"),
            container_env="CUDA_VISIBLE_DEVICES",
            k8s_resource="metax-tech.com/gpu",
            k8s_alt_resources=("metax-tech.com/sgpu", "metax-tech.com/vmemory"),
            default_model="gpu",
            inventory_cmd=("mx-smi",),
            health_cmd=("mx-smi",),
            pci_vendor_ids=("0x9999",),
            dev_globs=("mxcd", "dri/renderD*"),
            env_prefixes=("NCCL", "MCCL", "MACA"),
            bf16="runtime",
            presents_as_cuda=True,
            unconfirmed=("container_env", "k8s_resource", "bf16", "dev_globs"),
        ),
        _F(
            name="iluvatar",
            title="Iluvatar CoreX",
            package="torch (CoreX build)",
            extension=None,
            device_type="cuda",
            backend="nccl",
            visible_envs=("CUDA_VISIBLE_DEVICES",),
            container_env="IX_VISIBLE_DEVICES",
            k8s_resource="iluvatar.com/gpu",
            k8s_alt_resources=("iluvatar.ai/BI-V150-vgpu",),
            default_model="gpu",
            inventory_cmd=("ixsmi",),
            health_cmd=("ixsmi",),
            pci_vendor_ids=("0x1e3e",),
            dev_globs=("iluvatar*",),
            env_prefixes=("NCCL", "IXCCL", "COREX"),
            bf16="runtime",
            presents_as_cuda=True,
            unconfirmed=("visible_envs", "backend", "bf16"),
        ),
        _F(
            name="enflame",
            title="Enflame GCU",
            package="torch_gcu (vendor wheel)",
            extension="torch_gcu",
            device_type="gcu",
            backend="eccl",
            visible_envs=("TOPS_VISIBLE_DEVICES",),
            container_env="ENFLAME_VISIBLE_DEVICES",
            k8s_resource="enflame.com/gcu",
            k8s_alt_resources=("enflame.com/drs-gcu", "enflame.com/shared-gcu"),
            default_model="gcu",
            inventory_cmd=("efsmi",),
            health_cmd=("efsmi",),
            dev_globs=("gcu[0-9]*",),
            env_prefixes=("TOPS", "ECCL", "ENFLAME"),
            bf16="runtime",
            unconfirmed=("bf16", "env_prefixes", "dev_globs", "pci_vendor_ids"),
        ),
        _F(
            name="biren",
            title="Biren SUPA",
            package="torch_supa (vendor wheel)",
            extension="torch_supa",
            device_type="supa",
            backend="bccl",
            visible_envs=("SUPA_VISIBLE_DEVICES",),
            container_env=None,
            k8s_resource="birentech.com/gpu",
            default_model="gpu",
            inventory_cmd=("brsmi", "gpu", "list"),
            health_cmd=("brsmi", "gpu", "list"),
            dev_globs=("biren/card_*",),
            env_prefixes=("BCCL", "BIREN", "SUPA"),
            bf16="yes",
            unconfirmed=("container_env", "health_cmd", "pci_vendor_ids"),
        ),
        _F(
            name="gaudi",
            title="Intel Gaudi",
            package="habana-torch-plugin",
            extension="habana_frameworks.torch",
            device_type="hpu",
            backend="hccl",
            visible_envs=("HABANA_VISIBLE_MODULES",),
            container_env="HABANA_VISIBLE_DEVICES",
            k8s_resource="habana.ai/gaudi",
            default_model="gaudi2",
            inventory_cmd=("hl-smi", "-Q", "index,module_id,bus_id,name", "-f", "csv"),
            health_cmd=("hl-smi", "-Q", "index,module_id,bus_id,name", "-f", "csv"),
            pci_vendor_ids=("0x1da3",),
            dev_globs=("accel/accel[0-9]*", "hl[0-9]*"),
            env_prefixes=("HABANA", "HCCL", "PT_HPU"),
            bf16="yes",
            unconfirmed=("dev_globs", "pci_vendor_ids"),
        ),
        _F(
            name="intel-xpu",
            title="Intel XPU",
            package="torch (XPU build)",
            extension=None,
            device_type="xpu",
            backend="xccl",
            visible_envs=("ZE_AFFINITY_MASK",),
            container_env=None,
            k8s_resource="gpu.intel.com/xe",
            k8s_alt_resources=("gpu.intel.com/i915",),
            default_model="gpu",
            inventory_cmd=("xpu-smi", "discovery", "-j"),
            health_cmd=("xpu-smi", "discovery", "-j"),
            pci_vendor_ids=("0x8086",),
            dev_globs=("dri/renderD*",),
            env_prefixes=("ZE", "ONEAPI", "CCL", "I_MPI"),
            bf16="yes",
        ),
    )
}

# Fields a cluster can override with TRAINFLOW_CHIP_<FAMILY>_<FIELD> (tuples: shell words;
# default_env: KEY=VALUE words; an empty value clears an optional field).
_SCALARS = (
    "package",
    "extension",
    "device_type",
    "backend",
    "container_env",
    "k8s_resource",
    "default_model",
    "bf16",
    "image",
)
_TUPLES = (
    "visible_envs",
    "k8s_alt_resources",
    "inventory_cmd",
    "health_cmd",
    "pci_vendor_ids",
    "dev_globs",
    "env_prefixes",
)
_OPTIONAL = ("extension", "container_env", "k8s_resource", "inventory_cmd", "health_cmd")


def env_key(family: str, field: str) -> str:
    """``TRAINFLOW_CHIP_<FAMILY>_<FIELD>``: the variable overriding one field of a family."""
    return f"TRAINFLOW_CHIP_{family.upper().replace('-', '_')}_{field.upper()}"


def get_family(name: str, env: Mapping[str, str] | None = None) -> ChipFamily:
    """Return the family called ``name``, with environment overrides applied.

    Args:
        name: family name, e.g. ``"ascend"``.
        env: environment to read ``TRAINFLOW_CHIP_<NAME>_<FIELD>`` overrides from
            (default ``os.environ``).

    Raises:
        ValueError: unknown family (the message lists the known ones), or an override
            that does not parse (naming the variable).
    """
    try:
        family = FAMILIES[name]
    except KeyError:
        raise ValueError(f"unknown chip family {name!r}; known families: {', '.join(sorted(FAMILIES))}") from None
    env = os.environ if env is None else env
    overrides: dict = {}
    for f in _SCALARS + _TUPLES + ("default_env", "presents_as_cuda"):
        key = env_key(name, f)
        if key not in env:
            continue
        raw = env[key].strip()
        if f in _TUPLES:
            value = tuple(shlex.split(raw))
            overrides[f] = value or (None if f in _OPTIONAL else ())
        elif f == "default_env":
            pairs = [w.partition("=") for w in shlex.split(raw)]
            if any(not k or not sep for k, sep, _ in pairs):
                raise ValueError(f"{key}={raw!r}: write KEY=VALUE words, e.g. 'HCCL_CONNECT_TIMEOUT=900'")
            overrides[f] = {k: v for k, _, v in pairs}
        elif f == "presents_as_cuda":
            overrides[f] = raw.lower() in ("1", "true", "yes")
        else:
            overrides[f] = raw or (None if f in _OPTIONAL else raw)
    if "bf16" in overrides:
        bf16_rule(overrides["bf16"])  # refuse a malformed rule here, not in a worker
    return replace(family, **overrides) if overrides else family


def overridable_fields() -> tuple[str, ...]:
    return tuple(
        f.name for f in fields(ChipFamily) if f.name in _SCALARS + _TUPLES + ("default_env", "presents_as_cuda")
    )


def queue_for(chip: str, model: str | None = None) -> str:
    """Airflow queue serving ``chip`` (``cpu``, ``nvidia-gpu``, ``ascend-910b`` ...)."""
    family = get_family(chip)
    if family.name == "cpu" and model is None:
        return "cpu"
    return f"{family.name}-{(model or family.default_model).lower()}"


def family_of_queue(queue: str) -> str | None:
    """The family a queue serves (``ascend-910b`` → ``ascend``), or None."""
    if queue == "cpu":
        return "cpu"
    for name in sorted(FAMILIES, key=len, reverse=True):  # intel-xpu before a shorter prefix
        if queue.startswith(name + "-"):
            return name
    return None


# -- bf16 -------------------------------------------------------------------------------
def bf16_rule(rule: str) -> tuple[str, object]:
    """Parse a bf16 rule into (kind, argument).

    Raises:
        ValueError: naming the rule and the accepted forms.
    """
    if rule in ("yes", "no", "runtime"):
        return rule, None
    if rule.startswith("capability>="):
        try:
            major, _, minor = rule.removeprefix("capability>=").partition(".")
            return "capability", (int(major), int(minor or 0))
        except ValueError:
            pass
    if rule.startswith("name:") and rule.removeprefix("name:"):
        return "name", tuple(rule.removeprefix("name:").split("|"))
    raise ValueError(f"bf16 rule {rule!r}: use yes, no, runtime, capability>=M.m or name:PREFIX|PREFIX")


def amp_dtype(
    family: ChipFamily,
    *,
    capability: tuple[int, int] | None = None,
    device_name: str | None = None,
    runtime_bf16: bool | None = None,
) -> str:
    """``bfloat16`` or ``float16``: the AMP dtype the family's bf16 rule picks for a device.

    Args:
        capability: the device's (major, minor) capability, for ``capability>=`` rules.
        device_name: the device's name, for ``name:`` rules.
        runtime_bf16: the device module's own ``is_bf16_supported()``, where it has one;
            it decides ``runtime`` rules and, where known, vetoes a rule's yes.
    """
    kind, arg = bf16_rule(family.bf16)
    if kind == "yes":
        ok = True
    elif kind == "no":
        ok = False
    elif kind == "capability":
        ok = capability is not None and tuple(capability) >= arg  # type: ignore[operator]
    elif kind == "name":
        ok = device_name is not None and device_name.startswith(arg)  # type: ignore[arg-type]
    else:
        ok = bool(runtime_bf16)
    if runtime_bf16 is False:
        ok = False
    return "bfloat16" if ok else "float16"


# -- visibility -------------------------------------------------------------------------
def parse_visible(value: str | None) -> list[str] | None:
    """The device ids in a visibility variable's value (None: not restricted). Ray's
    ``NoDevFiles`` and an empty value mean no devices."""
    if value is None:
        return None
    value = value.strip()
    if value in ("", "NoDevFiles", "none", "void"):
        return []
    return [v.strip() for v in value.split(",") if v.strip()]


def rank_devices(devices: list[str], *, local_rank: int, local_world: int) -> list[str]:
    """The node's devices that local rank ``local_rank`` of ``local_world`` gets (an even,
    contiguous split, so neighbouring ranks share a switch).

    Raises:
        ValueError: fewer devices than local ranks, or an uneven split.
    """
    if local_world < 1 or not 0 <= local_rank < local_world:
        raise ValueError(f"local rank {local_rank} of {local_world}: out of range")
    if len(devices) < local_world or len(devices) % local_world:
        raise ValueError(
            f"{len(devices)} visible devices ({','.join(devices) or 'none'}) cannot be split "
            f"evenly among {local_world} local ranks; set nproc_per_node to a divisor of "
            f"the device count"
        )
    per = len(devices) // local_world
    return devices[local_rank * per : (local_rank + 1) * per]


def worker_env(
    family: ChipFamily, env: Mapping[str, str], *, local_rank: int, local_world: int, node_devices: int | None = None
) -> dict[str, str]:
    """The environment a worker process needs before torch is imported (pure).

    Restricts every visibility variable of the family to this rank's share of the node's
    devices (the node's set: the first visibility variable already in ``env``, else
    ``node_devices`` or one device per local rank), and adds the family's default
    environment where ``env`` does not set it.
    """
    out = {k: v for k, v in family.default_env.items() if k not in env}
    if not family.has_devices or not family.visible_envs:
        return out
    node = parse_visible(env.get(family.visible_envs[0]))
    if node is None:
        node = [str(i) for i in range(node_devices or local_world)]
    mine = ",".join(rank_devices(node, local_rank=local_rank, local_world=local_world))
    out.update({var: mine for var in family.visible_envs})
    return out


def propagated_env(family: ChipFamily, env: Mapping[str, str]) -> dict[str, str]:
    """The variables of ``env`` with one of the family's prefixes (sent to every node)."""
    return {k: v for k, v in env.items() if any(k.startswith(p) for p in family.env_prefixes)}
