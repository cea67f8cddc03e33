"""Parsers of the vendor CLIs' device listings (pure: text in, devices out).

Each family's ``inventory_cmd`` prints one of these formats; the samples the tests read
(``tests/unit/data/chips/``, provenance in its SOURCES.md) are recorded outputs of real
hosts. Only ``npu-smi info`` (Health) and ``mx-smi`` (GPU-State) print a per-device
health field; for the others a listed device counts as present and the command's exit
status is its health.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass


class ParseError(ValueError):
    """The text is not the format the family's CLI prints."""


@dataclass(frozen=True)
class Device:
    index: int
    name: str | None = None
    bus_id: str | None = None
    uuid: str | None = None
    healthy: bool | None = None  # None: the CLI prints no health field
    detail: str = ""


# -- box tables (nvidia-smi style: "| 0  Name | Bus-Id | ... |" rows between separators) --
_SEPARATOR = re.compile(r"^\s*(\+[-=+]|\|[=-]{3})")
_INDEX_CELL = re.compile(r"^(\d+)(?:\s+(.*?))?$")


def _box_devices(text: str) -> list[list[list[str]]]:
    """Rows of each device block: a block starts after a separator with a row whose first
    cell is ``<index> <name>``; the process table that follows ends the parse."""
    blocks: list[list[list[str]]] = []
    current: list[list[str]] | None = None
    after_separator = False
    for line in text.splitlines():
        if "Process" in line:
            break
        if _SEPARATOR.match(line):
            after_separator, current = True, None
            continue
        if not line.strip().startswith("|"):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if after_separator and _INDEX_CELL.match(cells[0]) and (current is None):
            current = [cells]
            blocks.append(current)
        elif current is not None:
            current.append(cells)
        after_separator = False
    return blocks


def _bus(cell: str) -> str | None:
    m = re.search(r"[0-9A-Fa-f]{2,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}\.[0-9A-Fa-f]", cell)
    return m.group(0) if m else None


def _first(cell: str) -> tuple[int, str]:
    m = _INDEX_CELL.match(cell)
    if not m:
        raise ParseError(f"no device index in {cell!r}")
    return int(m.group(1)), (m.group(2) or "").strip()


def _table(text: str, what: str) -> list[list[list[str]]]:
    blocks = _box_devices(text)
    if not blocks and not re.search(r"\|.*\|", text):
        raise ParseError(f"not {what} output (no table)")
    return blocks


def npu_smi(text: str) -> list[Device]:
    """``npu-smi info`` (table with Health) or ``npu-smi info -l`` (``NPU ID : n`` lines)."""
    if "Total Count" in text or re.search(r"NPU ID\s*:", text):
        ids = [int(m) for m in re.findall(r"NPU ID\s*:\s*(\d+)", text)]
        names = re.findall(r"Product Name\s*:\s*(\S.*)", text)
        return [Device(i, name=names[k].strip() if k < len(names) else None) for k, i in enumerate(ids)]
    out = []
    for rows in _table(text, "npu-smi info"):
        index, name = _first(rows[0][0])
        health = rows[0][1] if len(rows[0]) > 1 else ""
        out.append(
            Device(
                index,
                name=name or None,
                bus_id=_bus(rows[1][1]) if len(rows) > 1 else None,
                healthy=health == "OK",
                detail=f"Health {health}",
            )
        )
    return out


def cnmon(text: str) -> list[Device]:
    """Cambricon ``cnmon``: ``| <card>  <VF>  <name>  <firmware> | <bus> | ...``."""
    out = []
    for rows in _table(text, "cnmon"):
        index, rest = _first(rows[0][0])
        words = [w for w in rest.split() if w != "/"]
        name = words[0] if words else None
        out.append(Device(index, name=name, bus_id=_bus(rows[0][1]) if len(rows[0]) > 1 else None))
    return out


def nv_like(text: str, what: str) -> list[Device]:
    """nvidia-smi-like tables (Kunlunxin ``xpu-smi``, Iluvatar ``ixsmi``, Enflame ``efsmi``,
    MetaX ``mx-smi``): index and name in the first cell, the bus in the row; MetaX's
    second row ends with its GPU-State."""
    out = []
    for rows in _table(text, what):
        index, name = _first(rows[0][0])
        name = re.sub(r"\s+N/A$", "", name).strip() or None
        bus = next((b for c in rows[0][1:] if (b := _bus(c))), None)
        healthy, detail = None, ""
        if what == "mx-smi" and len(rows) > 1 and len(rows[1]) > 2:
            state = rows[1][2]
            healthy, detail = state == "Available", f"GPU-State {state}"
        out.append(Device(index, name=name, bus_id=bus, healthy=healthy, detail=detail))
    return out


def mthreads_gmi(text: str) -> list[Device]:
    """Moore Threads ``mthreads-gmi``: ``<idx>  <name>  |<bus>  |<util> <mem>`` lines."""
    if "mthreads-gmi" not in text and "MTT" not in text:
        raise ParseError("not mthreads-gmi output")
    out = []
    for line in text.splitlines():
        if line.startswith("Processes"):
            break
        m = re.match(r"^(\d+)\s+(\S.*?)\s*\|(.*)$", line)
        if m:
            out.append(Device(int(m.group(1)), name=m.group(2), bus_id=_bus(m.group(3))))
    return out


def hy_smi(text: str) -> list[Device]:
    """Hygon ``hy-smi``: a ``DCU  Temp ... Mode`` header, then one row per DCU."""
    lines = text.splitlines()
    try:
        start = next(i for i, line in enumerate(lines) if line.split()[:1] == ["DCU"])
    except StopIteration:
        raise ParseError("not hy-smi output (no 'DCU' header)") from None
    header = lines[start].split()
    out = []
    for line in lines[start + 1 :]:
        words = line.split()
        if not words or not words[0].isdigit():
            break
        row = dict(zip(header, words))
        out.append(Device(int(words[0]), detail=f"Mode {row['Mode']}" if "Mode" in row else ""))
    return out


def nvidia_csv(text: str) -> list[Device]:
    """``nvidia-smi --query-gpu=index,uuid,name[,...] --format=csv,noheader``."""
    out = []
    for line in text.splitlines():
        if not line.strip():
            continue
        cells = [c.strip() for c in line.split(",")]
        if not cells[0].isdigit() or len(cells) < 3:
            raise ParseError(f"not nvidia-smi csv output: {line!r}")
        detail = f"compute capability {cells[4]}" if len(cells) > 4 else ""
        out.append(Device(int(cells[0]), uuid=cells[1], name=cells[2], detail=detail))
    return out


def amd_smi(text: str) -> list[Device]:
    """``amd-smi list``: ``GPU: n`` blocks of ``KEY: value`` lines."""
    out = []
    for block in re.split(r"(?m)^(?=GPU:\s*\d+)", text):
        m = re.match(r"GPU:\s*(\d+)", block)
        if not m:
            continue
        fields = dict(re.findall(r"(?m)^\s+([A-Z_]+):\s*(\S+)", block))
        out.append(Device(int(m.group(1)), bus_id=fields.get("BDF"), uuid=fields.get("UUID")))
    if not out and text.strip():
        raise ParseError("not amd-smi list output")
    return out


def hl_smi_csv(text: str) -> list[Device]:
    """Gaudi ``hl-smi -Q index,module_id,... -f csv``: a header, then a row per device.
    The module id (what HABANA_VISIBLE_MODULES takes) goes in ``detail``."""
    lines = [line for line in text.splitlines() if line.strip()]
    if not lines or "index" not in lines[0]:
        raise ParseError("not hl-smi csv output (no header)")
    header = [h.strip() for h in lines[0].split(",")]
    out = []
    for line in lines[1:]:
        row = dict(zip(header, (c.strip() for c in line.split(","))))
        out.append(
            Device(
                int(row["index"]),
                name=row.get("name"),
                bus_id=row.get("bus_id"),
                detail=f"module_id {row['module_id']}" if "module_id" in row else "",
            )
        )
    return out


def xpu_smi_json(text: str) -> list[Device]:
    """Intel ``xpu-smi discovery -j``: physical devices of ``device_list``."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ParseError(f"not xpu-smi discovery -j output: {exc}") from None
    return [
        Device(int(d["device_id"]), name=d.get("device_name"), bus_id=d.get("pci_bdf_address"), uuid=d.get("uuid"))
        for d in data.get("device_list", [])
        if d.get("device_function_type", "physical") == "physical"
    ]


def brsmi(text: str) -> list[Device]:
    """Biren ``brsmi gpu list`` (format reconstructed, not seen on hardware):
    ``GPU <n>: <name> (UUID: <uuid>, Bus-id: <bus>)``."""
    out = []
    for m in re.finditer(r"(?m)^GPU (\d+): (.+?) \(UUID: ([^,)]+)(?:, Bus-id: ([^)]+))?\)", text):
        out.append(Device(int(m.group(1)), name=m.group(2), uuid=m.group(3), bus_id=m.group(4)))
    if not out and text.strip():
        raise ParseError("not brsmi gpu list output")
    return out


PARSERS = {
    "nvidia": nvidia_csv,
    "amd": amd_smi,
    "ascend": npu_smi,
    "cambricon": cnmon,
    "hygon": hy_smi,
    "kunlunxin": lambda t: nv_like(t, "xpu-smi"),
    "mthreads": mthreads_gmi,
    "metax": lambda t: nv_like(t, "mx-smi"),
    "iluvatar": lambda t: nv_like(t, "ixsmi"),
    "enflame": lambda t: nv_like(t, "efsmi"),
    "biren": brsmi,
    "gaudi": hl_smi_csv,
    "intel-xpu": xpu_smi_json,
}


def parse(family: str, text: str) -> list[Device]:
    """The devices in ``family``'s inventory output.

    Raises:
        ParseError: the text is not in the family's format (an overridden command, a
            changed CLI); callers fall back on the command's exit status.
        KeyError: the family has no inventory parser (``cpu``).
    """
    return PARSERS[family](text)
