"""Which chip family a host has, found without starting a device runtime in this process.

Order (first answer wins): the explicit spec or queue > ``TRAINFLOW_CHIP`` > a vendor
torch extension that is installed (found with ``importlib.util.find_spec``, not
imported) > the PCI vendor IDs of display/accelerator devices in sysfs, then the
driver's device nodes > ``torch`` itself, asked in a subprocess with NVML-based checks.
Airflow's executors fork their task processes: initialising CUDA (or any vendor
runtime) in the parent would break every later fork, so nothing here does.

Families that torch reports as ``cuda`` (AMD ROCm, Hygon, MetaX, Iluvatar, Kunlunxin) are
told apart by their extension (``torch_xmlir``), their PCI vendor ID or device nodes,
and, last, by torch's build (``torch.version.hip``, vendor attributes).
"""

from __future__ import annotations

import glob
import importlib.util
import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

from trainflow.chips.registry import FAMILIES, ChipFamily, family_of_queue, get_family

# PCI classes of devices that compute: display controllers (0x03xx) and processing
# accelerators (0x12xx). Filters out the same vendors' NICs, audio functions and bridges.
_COMPUTE_CLASSES = ("0x03", "0x12")

# Families whose extension decides when it is installed, in the order DeepSpeed and
# accelerate try them; a host has one vendor stack, so two hits are reported.
_EXTENSION_ORDER = ("ascend", "cambricon", "mthreads", "enflame", "biren", "gaudi", "kunlunxin")


@dataclass(frozen=True)
class Detection:
    """The answer: the family, how it was found, and what else was seen."""

    family: str
    source: str  # spec | env | extension | pci | devnodes | torch | none
    evidence: str
    devices: int | None = None  # devices counted on the way (PCI functions, device nodes)
    also_seen: tuple[str, ...] = field(default=())


def _extension_installed(module: str) -> bool:
    """Installed, without importing it (a submodule's parent package would be imported
    by ``find_spec``, so only the top-level package is looked up)."""
    try:
        return importlib.util.find_spec(module.split(".")[0]) is not None
    except (ImportError, ValueError):
        return False


def pci_devices(sysfs: str | Path = "/sys") -> list[tuple[str, str, str]]:
    """(address, vendor, class) of every compute-class PCI function under ``sysfs``."""
    out = []
    for dev in sorted(Path(sysfs, "bus", "pci", "devices").glob("*")):
        try:
            vendor = (dev / "vendor").read_text().strip().lower()
            klass = (dev / "class").read_text().strip().lower()
        except OSError:
            continue
        if klass.startswith(_COMPUTE_CLASSES):
            out.append((dev.name, vendor, klass))
    return out


def by_pci(sysfs: str | Path = "/sys") -> dict[str, int]:
    """Family → number of its compute devices on the PCI bus (no driver needed)."""
    vendors = {vid: f.name for f in FAMILIES.values() for vid in f.pci_vendor_ids}
    counts: dict[str, int] = {}
    for _, vendor, _ in pci_devices(sysfs):
        if vendor in vendors:
            counts[vendors[vendor]] = counts.get(vendors[vendor], 0) + 1
    return counts


def by_devnodes(dev: str | Path = "/dev") -> dict[str, int]:
    """Family → number of its device nodes (the first glob of a family counts devices;
    shared nodes such as AMD's ``/dev/kfd`` and DRM render nodes are not evidence alone)."""
    counts: dict[str, int] = {}
    for f in FAMILIES.values():
        if not f.dev_globs or f.dev_globs[0] in ("kfd", "dri/renderD*"):
            continue
        found = glob.glob(os.path.join(str(dev), f.dev_globs[0]))
        if found:
            counts[f.name] = len(found)
    return counts


_TORCH_PROBE = """
import json, torch
out = {"cuda": None, "hip": getattr(torch.version, "hip", None), "cuda_version": torch.version.cuda,
       "corex": hasattr(torch, "corex"), "hcu": hasattr(torch, "__hcu_version__"),
       "xpu": None}
try:
    out["cuda"] = torch.cuda.device_count()
except Exception:
    pass
try:
    out["xpu"] = torch.xpu.device_count() if hasattr(torch, "xpu") else None
except Exception:
    pass
print(json.dumps(out))
"""


def probe_torch(*, python: str = sys.executable, timeout: float = 60.0) -> dict:
    """Ask torch in a subprocess what it sees (NVML-based checks: no CUDA context)."""
    env = dict(os.environ, PYTORCH_NVML_BASED_CUDA_CHECK="1", TORCH_DEVICE_BACKEND_AUTOLOAD="0")
    done = subprocess.run([python, "-c", _TORCH_PROBE], capture_output=True, text=True, timeout=timeout, env=env)
    if done.returncode != 0:
        return {"error": (done.stderr or done.stdout).strip()[-300:]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def by_torch(probe: Mapping) -> str | None:
    """The family a torch probe's answer points at (its build tells CUDA presenters apart)."""
    if probe.get("corex"):
        return "iluvatar"
    if probe.get("hcu"):
        return "hygon"
    if probe.get("cuda"):
        return "amd" if probe.get("hip") else "nvidia"
    if probe.get("xpu"):
        return "intel-xpu"
    return None


def detect(
    *,
    explicit: str | None = None,
    queue: str | None = None,
    env: Mapping[str, str] | None = None,
    sysfs: str | Path = "/sys",
    dev: str | Path = "/dev",
    torch_probe=probe_torch,
) -> Detection:
    """Detect this host's chip family; see the module doc for the order.

    Args:
        explicit: the family a spec names (wins outright).
        queue: the Airflow queue this worker serves (``ascend-910b`` → ``ascend``).
        env: environment (``TRAINFLOW_CHIP``); default ``os.environ``.
        sysfs, dev: roots of the PCI tree and the device nodes (tests pass fakes).
        torch_probe: called last, with no arguments; returns ``probe_torch``'s dict
            (None skips it).

    Raises:
        ValueError: an explicit or environment family that is not in the registry.
    """
    env = os.environ if env is None else env
    if explicit:
        return Detection(get_family(explicit).name, "spec", f"the spec names {explicit!r}")
    if queue:
        name = family_of_queue(queue)
        if name is None:
            raise ValueError(
                f"queue {queue!r} names no chip family; queues are <family>-<model> "
                f"(families: {', '.join(sorted(FAMILIES))}) or cpu"
            )
        return Detection(name, "spec", f"this worker serves queue {queue!r}")
    if env.get("TRAINFLOW_CHIP"):
        name = get_family(env["TRAINFLOW_CHIP"]).name
        return Detection(name, "env", f"TRAINFLOW_CHIP={name}")
    pci = by_pci(sysfs)
    nodes = by_devnodes(dev)
    seen = tuple(sorted(set(pci) | set(nodes)))
    installed = [n for n in _EXTENSION_ORDER if _extension_installed(get_family(n, env).extension or "")]
    if installed:
        # Two stacks on one host is a misbuilt worker; the one whose hardware is present wins.
        present = [n for n in installed if n in pci or n in nodes]
        name = (present or installed)[0]
        fam = get_family(name, env)
        return Detection(
            name,
            "extension",
            f"{fam.extension} is installed"
            + (f" (also installed: {', '.join(n for n in installed if n != name)})" if len(installed) > 1 else ""),
            devices=pci.get(name) or nodes.get(name),
            also_seen=seen,
        )
    if pci:
        name = max(pci, key=lambda n: (pci[n], n))
        return Detection(
            name,
            "pci",
            f"{pci[name]} compute device(s) of PCI vendor {'/'.join(FAMILIES[name].pci_vendor_ids)}",
            devices=pci[name],
            also_seen=seen,
        )
    if nodes:
        name = max(nodes, key=lambda n: (nodes[n], n))
        return Detection(
            name,
            "devnodes",
            f"{nodes[name]} device node(s) /dev/{FAMILIES[name].dev_globs[0]}",
            devices=nodes[name],
            also_seen=seen,
        )
    if torch_probe is not None:
        probe = torch_probe()
        name = by_torch(probe)
        if name is not None:
            count = probe.get("xpu") if name == "intel-xpu" else probe.get("cuda")
            return Detection(
                name,
                "torch",
                f"torch sees {count} device(s)" + (f" (HIP {probe['hip']})" if probe.get("hip") else ""),
                devices=count,
            )
    return Detection(
        "cpu",
        "none",
        "no accelerator found: no vendor extension, no compute PCI device, no device node, torch sees none",
    )


def family(detection: Detection, env: Mapping[str, str] | None = None) -> ChipFamily:
    return get_family(detection.family, env)
