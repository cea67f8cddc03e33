"""The chip adapter layer: registry, vendor CLI parsers (recorded outputs), detection order
(fake extension modules, fake sysfs and /dev trees), worker environment, bf16 rule."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from trainflow.chips import parsers
from trainflow.chips.detect import by_torch, detect
from trainflow.chips.registry import (
    FAMILIES,
    amp_dtype,
    bf16_rule,
    family_of_queue,
    get_family,
    parse_visible,
    propagated_env,
    queue_for,
    rank_devices,
    worker_env,
)

DATA = Path(__file__).parent / "data" / "chips"
REQUIRED = (
    "nvidia",
    "amd",
    "ascend",
    "cambricon",
    "hygon",
    "kunlunxin",
    "mthreads",
    "metax",
    "iluvatar",
    "enflame",
    "biren",
    "gaudi",
    "intel-xpu",
    "cpu",
)


# -- registry ---------------------------------------------------------------------------
def test_every_family_the_issue_names_is_registered_with_its_facts():
    assert set(REQUIRED) == set(FAMILIES)
    for f in FAMILIES.values():
        assert f.device_type and f.backend and f.package and f.default_model and f.image
        bf16_rule(f.bf16)  # parses
        if f.name == "cpu":
            assert f.composite_backend == "gloo" and not f.has_devices and f.k8s_resource is None
            continue
        assert f.composite_backend == f"{f.device_type}:{f.backend},cpu:gloo"
        assert f.visible_envs and all(v.isupper() for v in f.visible_envs)
        assert f.k8s_resource and "/" in f.k8s_resource
        assert f.inventory_cmd and f.health_cmd and f.env_prefixes
        assert f.name in parsers.PARSERS
        assert f.pci_vendor_ids or f.dev_globs
        assert all(v.startswith("0x") and len(v) == 6 for v in f.pci_vendor_ids)


@pytest.mark.parametrize(
    "name, device, backend, visible, resource",
    [
        ("nvidia", "cuda", "nccl", "CUDA_VISIBLE_DEVICES", "nvidia.com/gpu"),
        ("amd", "cuda", "nccl", "HIP_VISIBLE_DEVICES", "amd.com/gpu"),
        ("ascend", "npu", "hccl", "ASCEND_RT_VISIBLE_DEVICES", "huawei.com/Ascend910"),
        ("cambricon", "mlu", "cncl", "MLU_VISIBLE_DEVICES", "cambricon.com/mlu"),
        ("hygon", "cuda", "nccl", "HIP_VISIBLE_DEVICES", "hygon.com/dcu"),
        ("kunlunxin", "cuda", "nccl", "XPU_VISIBLE_DEVICES", "kunlunxin.com/xpu"),
        ("mthreads", "musa", "mccl", "MUSA_VISIBLE_DEVICES", "mthreads.com/gpu"),
        ("metax", "cuda", "nccl", "CUDA_VISIBLE_DEVICES", "metax-tech.com/gpu"),
        ("iluvatar", "cuda", "nccl", "CUDA_VISIBLE_DEVICES", "iluvatar.com/gpu"),
        ("enflame", "gcu", "eccl", "TOPS_VISIBLE_DEVICES", "enflame.com/gcu"),
        ("biren", "supa", "bccl", "SUPA_VISIBLE_DEVICES", "birentech.com/gpu"),
        ("gaudi", "hpu", "hccl", "HABANA_VISIBLE_MODULES", "habana.ai/gaudi"),
        ("intel-xpu", "xpu", "xccl", "ZE_AFFINITY_MASK", "gpu.intel.com/xe"),
    ],
)
def test_family_facts(name, device, backend, visible, resource):
    f = get_family(name, env={})
    assert (f.device_type, f.backend, f.visible_env, f.k8s_resource) == (device, backend, visible, resource)
    assert f.presents_as_cuda == (device == "cuda")


def test_unknown_family_lists_the_known_ones():
    with pytest.raises(ValueError, match=r"unknown chip family 'tpu'; known families: amd, ascend, biren"):
        get_family("tpu")


def test_unconfirmed_facts_are_overridable_by_configuration():
    env = {
        "TRAINFLOW_CHIP_HYGON_K8S_RESOURCE": "hygon.com/dcunum",
        "TRAINFLOW_CHIP_KUNLUNXIN_VISIBLE_ENVS": "XPU_VISIBLE_DEVICES",
        "TRAINFLOW_CHIP_ASCEND_DEFAULT_ENV": "HCCL_CONNECT_TIMEOUT=900 HCCL_BUFFSIZE=200",
        "TRAINFLOW_CHIP_INTEL_XPU_BF16": "no",
        "TRAINFLOW_CHIP_NVIDIA_INVENTORY_CMD": "",
        "TRAINFLOW_CHIP_BIREN_IMAGE": "registry.local/biren:1",
    }
    assert get_family("hygon", env).k8s_resource == "hygon.com/dcunum"
    assert get_family("kunlunxin", env).visible_envs == ("XPU_VISIBLE_DEVICES",)
    assert get_family("ascend", env).default_env == {"HCCL_CONNECT_TIMEOUT": "900", "HCCL_BUFFSIZE": "200"}
    assert get_family("intel-xpu", env).bf16 == "no"
    assert get_family("nvidia", env).inventory_cmd is None
    assert get_family("biren", env).image == "registry.local/biren:1"
    assert get_family("hygon", {}).k8s_resource == "hygon.com/dcu"  # the registry itself is untouched
    with pytest.raises(ValueError, match="TRAINFLOW_CHIP_ASCEND_DEFAULT_ENV='oops': write KEY=VALUE"):
        get_family("ascend", {"TRAINFLOW_CHIP_ASCEND_DEFAULT_ENV": "oops"})
    with pytest.raises(ValueError, match="bf16 rule 'maybe'"):
        get_family("cpu", {"TRAINFLOW_CHIP_CPU_BF16": "maybe"})


def test_queues_per_family_and_model():
    assert queue_for("cpu") == "cpu"
    assert queue_for("ascend") == "ascend-910b" and queue_for("nvidia", "H100") == "nvidia-h100"
    for name in FAMILIES:
        assert family_of_queue(queue_for(name)) == name
        assert family_of_queue(queue_for(name, "x1")) == name
    assert family_of_queue("intel-xpu-max1100") == "intel-xpu"
    assert family_of_queue("default") is None


# -- bf16 rule --------------------------------------------------------------------------
@pytest.mark.parametrize(
    "name, probe, dtype",
    [
        ("nvidia", {"capability": (9, 0)}, "bfloat16"),
        ("nvidia", {"capability": (7, 5)}, "float16"),
        ("ascend", {"device_name": "Ascend910B3"}, "bfloat16"),
        ("ascend", {"device_name": "Ascend310P3"}, "float16"),
        ("cambricon", {"capability": (5, 0)}, "bfloat16"),
        ("cambricon", {"capability": (3, 0)}, "float16"),
        ("mthreads", {"capability": (2, 2)}, "bfloat16"),
        ("mthreads", {"capability": (2, 1)}, "float16"),
        ("amd", {"runtime_bf16": True}, "bfloat16"),
        ("amd", {}, "float16"),
        ("gaudi", {}, "bfloat16"),
        ("cpu", {}, "bfloat16"),
        ("intel-xpu", {"runtime_bf16": False}, "float16"),  # the device's own answer vetoes
    ],
)
def test_amp_dtype_follows_the_bf16_rule(name, probe, dtype):
    assert amp_dtype(get_family(name, env={}), **probe) == dtype


# -- visibility -------------------------------------------------------------------------
def test_parse_visible():
    assert parse_visible(None) is None
    assert parse_visible("") == [] and parse_visible("NoDevFiles") == []
    assert parse_visible("4, 5,6") == ["4", "5", "6"]


def test_rank_devices_split_evenly_and_refuse_too_few():
    assert rank_devices(["0", "1", "2", "3"], local_rank=1, local_world=2) == ["2", "3"]
    assert rank_devices(["5", "7"], local_rank=1, local_world=2) == ["7"]
    with pytest.raises(ValueError, match="2 visible devices .* among 4 local ranks"):
        rank_devices(["0", "1"], local_rank=0, local_world=4)
    with pytest.raises(ValueError, match="3 visible devices"):
        rank_devices(["0", "1", "2"], local_rank=0, local_world=2)


@pytest.mark.parametrize("name", sorted(set(FAMILIES) - {"cpu"}))
def test_worker_env_of_every_family(name):
    f = get_family(name, env={})
    # The node was given devices 2,3,6,7 (by the container runtime or an operator).
    env = {f.visible_env: "2,3,6,7"}
    out = worker_env(f, env, local_rank=1, local_world=2)
    assert {v: out[v] for v in f.visible_envs} == {v: "6,7" for v in f.visible_envs}
    for key, value in f.default_env.items():
        assert out[key] == value
    # Nothing set: one device per local rank, or the node's count from the pod.
    assert worker_env(f, {}, local_rank=3, local_world=4)[f.visible_env] == "3"
    assert worker_env(f, {}, local_rank=1, local_world=2, node_devices=8)[f.visible_env] == "4,5,6,7"


def test_worker_env_keeps_what_the_operator_set_and_cpu_needs_nothing():
    ascend = get_family("ascend", env={})
    out = worker_env(ascend, {"HCCL_CONNECT_TIMEOUT": "1200"}, local_rank=0, local_world=1)
    assert "HCCL_CONNECT_TIMEOUT" not in out and out["HCCL_EXEC_TIMEOUT"] == "1836"
    assert worker_env(get_family("cpu", env={}), {}, local_rank=0, local_world=2) == {}


def test_apply_visibility_sets_the_rank_share_before_torch(tmp_path):
    from trainflow.errors import ChipUnavailableError
    from trainflow.worker.train import apply_visibility

    (tmp_path / "spec.json").write_text('{"chip": "ascend"}')
    env = {"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "ASCEND_RT_VISIBLE_DEVICES": "0,1,2,3"}
    apply_visibility(tmp_path, env)
    assert env["ASCEND_RT_VISIBLE_DEVICES"] == "2,3" and env["HCCL_CONNECT_TIMEOUT"] == "600"
    env = {"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "4", "ASCEND_RT_VISIBLE_DEVICES": "0,1"}
    with pytest.raises(ChipUnavailableError, match="2 visible devices"):
        apply_visibility(tmp_path, env)


def test_propagated_env_takes_the_family_prefixes():
    env = {"NCCL_SOCKET_IFNAME": "eth0", "HCCL_IF_IP": "10.0.0.1", "HOME": "/root", "PATH": "/bin"}
    assert propagated_env(get_family("nvidia", env={}), env) == {"NCCL_SOCKET_IFNAME": "eth0"}
    assert propagated_env(get_family("ascend", env={}), env) == {"HCCL_IF_IP": "10.0.0.1"}


# -- parsers: recorded outputs of each vendor CLI (provenance: data/chips/SOURCES.md) ---
@pytest.mark.parametrize(
    "family, sample, indices, name, healthy",
    [
        ("nvidia", "nvidia-smi.csv", [0], "Tesla P100-PCIE-16GB", [None]),
        ("amd", "amd-smi-list.txt", [0, 1], None, [None] * 2),
        ("ascend", "npu-smi-info.txt", list(range(8)), "910B4", [True] * 8),
        ("ascend", "npu-smi-info-warning.txt", [0, 1, 2, 3], "xxx", [True, True, True, False]),
        ("ascend", "npu-smi-info-l.txt", list(range(8)), None, [None] * 8),
        ("cambricon", "cnmon.txt", [0, 1], "MLU370-X4", [None] * 2),
        ("hygon", "hy-smi.txt", [0, 1, 2, 3], None, [None] * 4),
        ("kunlunxin", "xpu-smi-kunlunxin.txt", [0, 1, 2, 3], "P800 OAM", [None] * 4),
        ("mthreads", "mthreads-gmi.txt", [0, 1, 2, 3], "MTT S5000", [None] * 4),
        ("metax", "mx-smi.txt", [0], "MetaX C500", [True]),
        ("iluvatar", "ixsmi.txt", [0, 1, 2, 3], "Iluvatar BI-V100", [None] * 4),
        ("enflame", "efsmi.txt", [0, 1], "Enflame S60G", [None] * 2),
        ("biren", "brsmi-gpu-list.txt", [0, 1], "BIREN 106C", [None] * 2),
        ("gaudi", "hl-smi-Q.csv", list(range(8)), None, [None] * 8),
        ("intel-xpu", "xpu-smi-discovery.json", [0, 1], "Intel(R) Data Center GPU Max 1100", [None] * 2),
    ],
)
def test_parsers_read_recorded_vendor_output(family, sample, indices, name, healthy):
    devices = parsers.parse(family, (DATA / sample).read_text())
    assert [d.index for d in devices] == indices
    assert devices[0].name == name
    assert [d.healthy for d in devices] == healthy


def test_parsers_keep_bus_ids_and_vendor_details():
    npu = parsers.parse("ascend", (DATA / "npu-smi-info.txt").read_text())
    assert npu[2].bus_id == "0000:81:00.0" and npu[0].detail == "Health OK"
    warn = parsers.parse("ascend", (DATA / "npu-smi-info-warning.txt").read_text())
    assert warn[3].detail == "Health Warning"  # the process table after it is not a device
    gaudi = parsers.parse("gaudi", (DATA / "hl-smi-Q.csv").read_text())
    assert gaudi[0].detail == "module_id 2"
    assert parsers.parse("nvidia", (DATA / "nvidia-smi.csv").read_text())[0].detail == "compute capability 6.0"
    assert parsers.parse("metax", (DATA / "mx-smi.txt").read_text())[0].detail == "GPU-State Available"
    assert parsers.parse("mthreads", (DATA / "mthreads-gmi.txt").read_text())[3].bus_id == "00000000:5c:00.0"


@pytest.mark.parametrize("family", sorted(parsers.PARSERS))
def test_parsers_refuse_other_output(family):
    with pytest.raises(parsers.ParseError):
        parsers.parse(family, "command not found: something else entirely\n")


def test_the_mx_smi_state_decides_health():
    text = (DATA / "mx-smi.txt").read_text().replace("Available    ", "Unavailable  ")
    (dev,) = parsers.parse("metax", text)
    assert dev.healthy is False and dev.detail == "GPU-State Unavailable"


# -- detection order --------------------------------------------------------------------
def _sysfs(root: Path, devices: list[tuple[str, str]]) -> Path:
    """A fake /sys with PCI functions of (vendor, class)."""
    for i, (vendor, klass) in enumerate(devices):
        d = root / "sys" / "bus" / "pci" / "devices" / f"0000:{i + 1:02x}:00.0"
        d.mkdir(parents=True)
        (d / "vendor").write_text(vendor + "\n")
        (d / "class").write_text(klass + "\n")
    (root / "sys" / "bus" / "pci" / "devices").mkdir(parents=True, exist_ok=True)
    return root / "sys"


def _fake_extension(root: Path, module: str, monkeypatch) -> None:
    pkg = root / "site" / module.split(".")[0]
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("raise RuntimeError('detection must not import vendor extensions')\n")
    monkeypatch.syspath_prepend(str(root / "site"))


def _no_torch():
    raise AssertionError("torch must not be probed when an earlier source answered")


@pytest.fixture
def empty(tmp_path):
    (tmp_path / "dev").mkdir()
    return {"sysfs": _sysfs(tmp_path, []), "dev": tmp_path / "dev"}


def test_explicit_spec_and_queue_win(tmp_path, empty):
    assert detect(explicit="ascend", env={}, torch_probe=_no_torch, **empty).source == "spec"
    d = detect(queue="cambricon-mlu590", env={"TRAINFLOW_CHIP": "ascend"}, torch_probe=_no_torch, **empty)
    assert (d.family, d.source) == ("cambricon", "spec")
    with pytest.raises(ValueError, match="queue 'gpu-a100' names no chip family"):
        detect(queue="gpu-a100", env={}, **empty)


def test_environment_override_beats_hardware(tmp_path, monkeypatch):
    sysfs = _sysfs(tmp_path, [("0x10de", "0x030200")])
    d = detect(env={"TRAINFLOW_CHIP": "metax"}, sysfs=sysfs, dev=tmp_path, torch_probe=_no_torch)
    assert (d.family, d.source) == ("metax", "env")
    with pytest.raises(ValueError, match="unknown chip family 'gpu'"):
        detect(env={"TRAINFLOW_CHIP": "gpu"}, sysfs=sysfs, dev=tmp_path)


@pytest.mark.parametrize(
    "module, family",
    [
        ("torch_npu", "ascend"),
        ("torch_mlu", "cambricon"),
        ("torch_musa", "mthreads"),
        ("torch_gcu", "enflame"),
        ("torch_supa", "biren"),
        ("habana_frameworks.torch", "gaudi"),
        ("torch_xmlir", "kunlunxin"),
    ],
)
def test_an_installed_extension_is_found_without_importing_it(tmp_path, monkeypatch, module, family, empty):
    _fake_extension(tmp_path, module, monkeypatch)
    d = detect(env={}, torch_probe=_no_torch, **empty)
    assert (d.family, d.source) == (family, "extension")
    assert module.split(".")[0] not in sys.modules


def test_extension_beats_pci_and_two_stacks_prefer_the_present_hardware(tmp_path, monkeypatch):
    _fake_extension(tmp_path, "torch_npu", monkeypatch)
    _fake_extension(tmp_path / "b", "torch_mlu", monkeypatch)
    sysfs = _sysfs(tmp_path, [("0xcabc", "0x120000"), ("0xcabc", "0x120000")])
    d = detect(env={}, sysfs=sysfs, dev=tmp_path, torch_probe=_no_torch)
    assert (d.family, d.source, d.devices) == ("cambricon", "extension", 2)
    assert "also installed: ascend" in d.evidence


@pytest.mark.parametrize(
    "vendor, family",
    [
        ("0x10de", "nvidia"),
        ("0x1002", "amd"),
        ("0x1d94", "hygon"),
        ("0x9999", "metax"),
        ("0x1e3e", "iluvatar"),
        ("0x19e5", "ascend"),
        ("0xcabc", "cambricon"),
        ("0x1ed5", "mthreads"),
        ("0x1da3", "gaudi"),
    ],
)
def test_pci_vendor_ids_tell_the_cuda_presenters_apart(tmp_path, vendor, family):
    (tmp_path / "dev").mkdir()
    # Two compute functions of the vendor, plus its audio function and an Intel NIC and
    # host bridge, which are not accelerators.
    sysfs = _sysfs(
        tmp_path,
        [
            (vendor, "0x030200"),
            (vendor, "0x120000"),
            (vendor, "0x040300"),
            ("0x8086", "0x020000"),
            ("0x8086", "0x060000"),
        ],
    )
    d = detect(env={}, sysfs=sysfs, dev=tmp_path / "dev", torch_probe=_no_torch)
    assert (d.family, d.source, d.devices) == (family, "pci", 2)


@pytest.mark.parametrize(
    "nodes, family",
    [
        (["davinci0", "davinci1", "davinci_manager"], "ascend"),
        (["xpu0", "xpu1", "xpu2", "xpuctrl"], "kunlunxin"),
        (["nvidia0", "nvidiactl"], "nvidia"),
        (["cambricon_dev0"], "cambricon"),
    ],
)
def test_device_nodes_when_sysfs_shows_nothing(tmp_path, nodes, family, empty):
    for n in nodes:
        (empty["dev"] / n).write_text("")
    d = detect(env={}, torch_probe=_no_torch, **empty)
    assert (d.family, d.source) == (family, "devnodes")
    assert d.devices == sum(1 for n in nodes if n[-1].isdigit())


@pytest.mark.parametrize(
    "probe, family",
    [
        ({"cuda": 8, "hip": None}, "nvidia"),
        ({"cuda": 8, "hip": "6.3.1"}, "amd"),
        ({"cuda": 8, "hip": "5.7", "hcu": True}, "hygon"),
        ({"cuda": 4, "corex": True}, "iluvatar"),
        ({"cuda": 0, "xpu": 2}, "intel-xpu"),
        ({"cuda": 0, "xpu": 0}, None),
    ],
)
def test_torch_probe_last(probe, family, empty):
    assert by_torch(probe) == family
    d = detect(env={}, torch_probe=lambda: probe, **empty)
    assert d.family == (family or "cpu") and d.source == ("torch" if family else "none")


@pytest.mark.integration  # real worker processes
def test_the_real_torch_probe_runs_in_a_subprocess_and_sees_no_accelerator_here():
    from trainflow.chips.detect import probe_torch

    probe = probe_torch()
    assert probe.get("cuda") == 0 and by_torch(probe) is None
    assert "torch.cuda" not in sys.modules or not __import__("torch").cuda.is_initialized()


def test_the_worker_picks_device_and_amp_dtype_generically_on_cpu():
    import torch

    from trainflow.worker.train import amp_precision, pick_device

    cpu = get_family("cpu", env={})
    device = pick_device(torch, cpu)
    assert device == torch.device("cpu")
    assert amp_precision(torch, cpu, "fp32", device) is torch.float32
    assert amp_precision(torch, cpu, "fp16", device) is torch.float16
    assert amp_precision(torch, cpu, "auto", device) is torch.bfloat16  # the CPU's rule: yes
    no_bf16 = get_family("cpu", env={"TRAINFLOW_CHIP_CPU_BF16": "no"})
    assert amp_precision(torch, no_bf16, "auto", device) is torch.float16
