"""Unit tests for meshplan.cost.cluster: mesh strings, presets, TOML cluster files."""

from __future__ import annotations

import math
import textwrap
from pathlib import Path

import pytest

from meshplan.cost.cluster import (
    DEVICE_PRESETS,
    Cluster,
    DeviceSpec,
    LinkSpec,
    load_cluster_file,
    make_cluster,
    parse_mesh,
)
from meshplan.errors import ClusterError, MeshplanError

GIB = 1024**3


# --- parse_mesh ------------------------------------------------------------------------

@pytest.mark.parametrize(
    "text, expected",
    [("2x8", (2, 8)), ("1x4", (1, 4)), (" 1X4 ", (1, 4)), ("3 x 5", (3, 5)), ("16x1", (16, 1)), ("10x12", (10, 12))],
)
def test_parse_mesh_good(text, expected):
    assert parse_mesh(text) == expected


@pytest.mark.parametrize("text", ["2y2", "x4", "4x", "", "2x2x2", "-1x4", "1.5x2", "two x four", "2*8", "28"])
def test_parse_mesh_malformed(text):
    with pytest.raises(ValueError) as info:
        parse_mesh(text)
    assert repr(text) in str(info.value)
    assert "HxD" in str(info.value)


@pytest.mark.parametrize("text", ["0x4", "4x0", "0x0", "00x3"])
def test_parse_mesh_zero_sizes(text):
    with pytest.raises(ValueError) as info:
        parse_mesh(text)
    assert "positive" in str(info.value)
    assert repr(text) in str(info.value)


# --- presets and make_cluster ----------------------------------------------------------

def test_presets_are_sane():
    assert "h100-80g" in DEVICE_PRESETS and "cpu" in DEVICE_PRESETS
    for name, spec in DEVICE_PRESETS.items():
        assert spec.name == name
        assert spec.memory_bytes > GIB
        assert spec.peak_flops > 1e9
        assert spec.memory_bandwidth > 1e9
        assert 0 < spec.kernel_overhead < 1e-3
    # Known values (GiB / TFLOP/s / GB/s / µs) convert to SI units.
    h100 = DEVICE_PRESETS["h100-80g"]
    assert h100.memory_bytes == 80 * GIB
    assert h100.peak_flops == pytest.approx(67e12)            # FP32 (TF32 off), not the TF32 figure
    assert h100.peak("tf32") == pytest.approx(495e12)
    assert h100.memory_bandwidth == pytest.approx(3350e9)
    assert h100.kernel_overhead == pytest.approx(5e-6)
    # A bigger GPU is not slower than a CPU.
    assert DEVICE_PRESETS["cpu"].peak_flops < DEVICE_PRESETS["v100-32g"].peak_flops < DEVICE_PRESETS["h100-80g"].peak_flops


@pytest.mark.parametrize("device", sorted(DEVICE_PRESETS))
def test_make_cluster_each_preset(device):
    cluster = make_cluster((2, 4), device)
    assert cluster.mesh == (2, 4)
    assert cluster.num_devices == 8
    assert cluster.device == DEVICE_PRESETS[device]
    assert cluster.inter_host.bandwidth < cluster.intra_host.bandwidth
    assert cluster.inter_host.latency > cluster.intra_host.latency


def test_make_cluster_unknown_preset():
    with pytest.raises(ClusterError) as info:
        make_cluster((1, 2), "tpu-v9")
    assert "'tpu-v9'" in str(info.value)
    assert "h100-80g" in str(info.value)  # lists the known ones
    assert isinstance(info.value, MeshplanError)


def test_host_of_and_link_multi_host():
    cluster = make_cluster((3, 4), "a100-80g")
    assert [cluster.host_of(r) for r in range(12)] == [0] * 4 + [1] * 4 + [2] * 4
    for src in range(12):
        for dst in range(12):
            link = cluster.link(src, dst)
            expected = cluster.intra_host if src // 4 == dst // 4 else cluster.inter_host
            assert link == expected
    nbytes = 64 * 2**20
    assert cluster.link(0, 4).seconds(nbytes) > cluster.link(0, 3).seconds(nbytes)
    assert cluster.link(7, 8).seconds(nbytes) > cluster.link(8, 11).seconds(nbytes)
    # A tiny message is latency-bound and still slower across hosts.
    assert cluster.link(0, 4).seconds(1) > cluster.link(0, 1).seconds(1)


def test_single_host_uses_only_intra_links():
    cluster = make_cluster((1, 8))
    assert all(cluster.link(a, b) == cluster.intra_host for a in range(8) for b in range(8))


def test_link_seconds_formula():
    link = LinkSpec(bandwidth=2e9, latency=3e-6)
    assert link.seconds(0) == pytest.approx(3e-6)
    assert link.seconds(4e9) == pytest.approx(2.0 + 3e-6)


def test_cpu_preset_links_are_slower_than_gpu_links():
    cpu, gpu = make_cluster((2, 2), "cpu"), make_cluster((2, 2), "h100-80g")
    assert cpu.intra_host.bandwidth < gpu.intra_host.bandwidth
    assert cpu.inter_host.bandwidth < gpu.inter_host.bandwidth


# --- to_dict / from_dict ---------------------------------------------------------------

@pytest.mark.parametrize("mesh, device", [((1, 1), "cpu"), ((2, 8), "h100-80g"), ((4, 2), "l4")])
def test_round_trip(mesh, device):
    cluster = make_cluster(mesh, device)
    data = cluster.to_dict()
    assert data["mesh"] == list(mesh)
    assert data["device"]["name"] == device
    again = Cluster.from_dict(data)
    assert again == cluster
    assert again.to_dict() == data


def test_round_trip_through_json_and_custom_values():
    import json

    cluster = Cluster(3, 5, DeviceSpec("x", 1.5 * GIB, 1.25e12, 7e11, 2.5e-6), LinkSpec(1e11, 1e-6), LinkSpec(3e9, 7e-5))
    again = Cluster.from_dict(json.loads(json.dumps(cluster.to_dict())))
    assert again == cluster
    assert again.mesh == (3, 5) and again.num_devices == 15
    assert again.host_of(14) == 2


# --- cluster files ---------------------------------------------------------------------

def _write(tmp_path, text: str, name: str = "cluster.toml"):
    path = tmp_path / name
    path.write_text(text)
    return path


def _error(tmp_path, text: str) -> str:
    path = _write(tmp_path, text)
    with pytest.raises(ClusterError) as info:
        load_cluster_file(path)
    return str(info.value)


def test_file_preset_by_name(tmp_path):
    cluster = load_cluster_file(_write(tmp_path, 'hosts = 2\ndevices_per_host = 4\ndevice = "a100-40g"\n'))
    assert cluster == make_cluster((2, 4), "a100-40g")


def test_file_default_device(tmp_path):
    cluster = load_cluster_file(_write(tmp_path, "hosts = 1\ndevices_per_host = 3\n"))
    assert cluster.mesh == (1, 3)
    assert cluster.device == DEVICE_PRESETS["h100-80g"]


def test_file_cpu_preset_gets_cpu_links(tmp_path):
    cluster = load_cluster_file(_write(tmp_path, 'hosts = 2\ndevices_per_host = 2\ndevice = "cpu"\n'))
    assert cluster == make_cluster((2, 2), "cpu")


def test_file_accepts_str_path(tmp_path):
    path = _write(tmp_path, "hosts = 1\ndevices_per_host = 1\n")
    assert load_cluster_file(str(path)).mesh == (1, 1)


def test_file_device_table_converts_units(tmp_path):
    text = """
hosts = 2
devices_per_host = 8

[device]
name = "my-gpu"
memory_gb = 48
peak_tflops = 123.5
memory_bandwidth_gbps = 1500
kernel_overhead_us = 7
"""
    cluster = load_cluster_file(_write(tmp_path, text))
    d = cluster.device
    assert d.name == "my-gpu"
    assert d.memory_bytes == 48 * GIB
    assert d.peak_flops == pytest.approx(123.5e12)
    assert d.memory_bandwidth == pytest.approx(1500e9)
    assert d.kernel_overhead == pytest.approx(7e-6)
    # links untouched: the default preset's
    default = make_cluster((2, 8))
    assert cluster.intra_host == default.intra_host
    assert cluster.inter_host == default.inter_host


def test_file_device_table_overrides_preset_partially(tmp_path):
    text = """
hosts = 1
devices_per_host = 2
[device]
preset = "v100-32g"
memory_gb = 16
"""
    cluster = load_cluster_file(_write(tmp_path, text))
    base = DEVICE_PRESETS["v100-32g"]
    assert cluster.device.memory_bytes == 16 * GIB
    assert cluster.device.name == base.name
    assert cluster.device.peak_flops == base.peak_flops
    assert cluster.device.memory_bandwidth == base.memory_bandwidth
    assert cluster.device.kernel_overhead == base.kernel_overhead


def test_file_device_table_without_preset_starts_from_default(tmp_path):
    cluster = load_cluster_file(_write(tmp_path, "hosts = 1\ndevices_per_host = 2\n[device]\npeak_tflops = 1\n"))
    assert cluster.device.peak_flops == pytest.approx(1e12)
    assert cluster.device.memory_bandwidth == DEVICE_PRESETS["h100-80g"].memory_bandwidth


def test_file_link_sections(tmp_path):
    text = """
hosts = 2
devices_per_host = 2
device = "l4"

[intra_host]
bandwidth_gbps = 64
latency_us = 2.5

[inter_host]
bandwidth_gbps = 12.5
"""
    cluster = load_cluster_file(_write(tmp_path, text))
    assert cluster.intra_host.bandwidth == pytest.approx(64e9)
    assert cluster.intra_host.latency == pytest.approx(2.5e-6)
    assert cluster.inter_host.bandwidth == pytest.approx(12.5e9)
    # latency not given: the preset's
    assert cluster.inter_host.latency == make_cluster((2, 2), "l4").inter_host.latency
    assert cluster.device == DEVICE_PRESETS["l4"]
    assert cluster.link(0, 2).seconds(1e9) > cluster.link(0, 1).seconds(1e9)


def test_file_missing(tmp_path):
    path = tmp_path / "nope.toml"
    with pytest.raises(ClusterError) as info:
        load_cluster_file(path)
    assert "not found" in str(info.value)
    assert "nope.toml" in str(info.value)


def test_file_is_a_directory(tmp_path):
    with pytest.raises(ClusterError) as info:
        load_cluster_file(tmp_path)
    assert str(tmp_path) in str(info.value)


@pytest.mark.parametrize("text", ["hosts = \n", "hosts = 1\ndevices_per_host = 2\n[device\n", "hosts = 1\nhosts = 2\n", "= 3"])
def test_file_invalid_toml(tmp_path, text):
    message = _error(tmp_path, text)
    assert "not valid TOML" in message
    assert "cluster.toml" in message


def test_file_not_utf8(tmp_path):
    path = tmp_path / "cluster.toml"
    path.write_bytes(b"hosts = 1\ndevices_per_host = 2\n# \xff\xfe\n")
    with pytest.raises(ClusterError) as info:
        load_cluster_file(path)
    assert "not valid TOML" in str(info.value)


@pytest.mark.parametrize("missing", ["hosts", "devices_per_host"])
def test_file_missing_key(tmp_path, missing):
    lines = {"hosts": "hosts = 1", "devices_per_host": "devices_per_host = 2"}
    del lines[missing]
    message = _error(tmp_path, "\n".join(lines.values()) + "\n")
    assert "missing key" in message
    assert repr(missing) in message


def test_file_unknown_top_level_key(tmp_path):
    message = _error(tmp_path, "hosts = 1\ndevices_per_host = 2\nmesh = \"1x2\"\n")
    assert "unknown key 'mesh'" in message


@pytest.mark.parametrize(
    "section, body, key",
    [
        ("device", "memory_gib = 3", "memory_gib"),
        ("device", "peak_flops = 3", "peak_flops"),
        ("intra_host", "bandwidth = 3", "bandwidth"),
        ("inter_host", "latency_ms = 3", "latency_ms"),
    ],
)
def test_file_unknown_key_in_section(tmp_path, section, body, key):
    message = _error(tmp_path, f"hosts = 1\ndevices_per_host = 2\n[{section}]\n{body}\n")
    assert f"unknown key {key!r}" in message
    assert f"[{section}]" in message


def test_file_unknown_preset(tmp_path):
    message = _error(tmp_path, 'hosts = 1\ndevices_per_host = 2\ndevice = "gtx-9090"\n')
    assert "'gtx-9090'" in message
    assert "preset" in message


def test_file_unknown_preset_in_table(tmp_path):
    message = _error(tmp_path, 'hosts = 1\ndevices_per_host = 2\n[device]\npreset = "gtx-9090"\n')
    assert "'gtx-9090'" in message


@pytest.mark.parametrize(
    "assignment",
    ['hosts = "two"', "hosts = [1]", "hosts = 2.5", 'hosts = "2"', "hosts = true", "hosts = {a = 1}"],
)
def test_file_mesh_wrong_types(tmp_path, assignment):
    message = _error(tmp_path, f"{assignment}\ndevices_per_host = 2\n")
    assert "hosts" in message
    assert "integer" in message


@pytest.mark.parametrize("values", [("0", "2"), ("1", "0"), ("-2", "4"), ("3", "-1")])
def test_file_mesh_not_positive(tmp_path, values):
    message = _error(tmp_path, f"hosts = {values[0]}\ndevices_per_host = {values[1]}\n")
    assert "positive" in message


def test_file_device_wrong_type(tmp_path):
    message = _error(tmp_path, "hosts = 1\ndevices_per_host = 2\ndevice = 5\n")
    assert "device" in message


@pytest.mark.parametrize("section", ["intra_host", "inter_host"])
def test_file_link_section_not_a_table(tmp_path, section):
    message = _error(tmp_path, f"hosts = 1\ndevices_per_host = 2\n{section} = 300\n")
    assert f"[{section}]" in message
    assert "table" in message


@pytest.mark.parametrize(
    "section, key, value",
    [
        ("device", "memory_gb", "-1"),
        ("device", "peak_tflops", "0"),
        ("device", "memory_bandwidth_gbps", '"fast"'),
        ("device", "kernel_overhead_us", "[5]"),
        ("device", "peak_tflops", "true"),
        ("device", "memory_gb", "nan"),
        ("device", "peak_tflops", "inf"),
        ("intra_host", "bandwidth_gbps", "-300"),
        ("intra_host", "bandwidth_gbps", "0"),
        ("inter_host", "latency_us", "-20"),
        ("inter_host", "bandwidth_gbps", '"25"'),
        ("inter_host", "bandwidth_gbps", "nan"),
        ("intra_host", "latency_us", "false"),
    ],
)
def test_file_bad_numbers(tmp_path, section, key, value):
    message = _error(tmp_path, f"hosts = 2\ndevices_per_host = 2\n[{section}]\n{key} = {value}\n")
    assert f"{section}.{key}" in message
    assert "positive number" in message


def test_file_values_are_finite_after_loading(tmp_path):
    """Whatever is accepted must give a usable, finite cost model."""
    text = "hosts = 2\ndevices_per_host = 2\n[device]\npeak_tflops = 2\n[inter_host]\nbandwidth_gbps = 1\n"
    cluster = load_cluster_file(_write(tmp_path, text))
    for value in (cluster.device.peak_flops, cluster.device.memory_bandwidth, cluster.inter_host.bandwidth):
        assert math.isfinite(value) and value > 0


# --- the documented example -------------------------------------------------------------

def _docstring_example() -> str:
    import meshplan.cost.cluster as module

    lines = module.__doc__.split("TOML file::\n", 1)[1].splitlines()
    block = []
    for line in lines:
        if line.strip() and not line.startswith(" "):
            break
        block.append(line)
    return textwrap.dedent("\n".join(block))


def _docs_example() -> str:
    page = (Path(__file__).resolve().parent.parent / "docs" / "clusters.md").read_text()
    section = page.split("## Cluster description", 1)[1]
    return section.split("```toml\n", 1)[1].split("```", 1)[0]


@pytest.mark.parametrize("example", [_docstring_example, _docs_example], ids=["docstring", "docs"])
def test_documented_example_loads(example, tmp_path):
    path = tmp_path / "cluster.toml"
    path.write_text(example())
    cluster = load_cluster_file(path)
    assert cluster.mesh == (2, 8)
    assert cluster.device.name == "my-gpu"
    assert cluster.device.memory_bytes == 80 * GIB
    assert cluster.device.memory_bandwidth == 3350e9 and cluster.device.kernel_overhead == pytest.approx(5e-6)
    assert cluster.intra_host.bandwidth == 300e9 and cluster.intra_host.latency == pytest.approx(5e-6)
    assert cluster.inter_host.bandwidth == 25e9 and cluster.inter_host.latency == pytest.approx(20e-6)


# --- peaks per compute dtype -------------------------------------------------------------

def test_presets_have_a_peak_per_dtype():
    from meshplan.cost.cluster import PEAK_KEYS

    for name, spec in DEVICE_PRESETS.items():
        peaks = {key: spec.peak(key) for key in PEAK_KEYS}
        assert peaks["fp32"] == spec.peak_flops
        assert all(value >= peaks["fp32"] for value in peaks.values()), name
        if name != "cpu":
            assert peaks["fp16"] > 1.9 * peaks["fp32"] and peaks["int8"] > 1.9 * peaks["fp32"], name
    h100 = DEVICE_PRESETS["h100-80g"]
    assert (h100.peak("fp16"), h100.peak("bf16"), h100.peak("int8")) == pytest.approx((989e12, 989e12, 1979e12))
    assert DEVICE_PRESETS["a100-80g"].peak("bf16") == pytest.approx(312e12)
    assert DEVICE_PRESETS["v100-32g"].peak("bf16") == DEVICE_PRESETS["v100-32g"].peak_flops


@pytest.mark.parametrize("device", sorted(DEVICE_PRESETS))
def test_preset_record_is_unchanged_by_dtype_peaks(device):
    """plan.json's record of a preset device has the five fields it always had (float32
    plans stay pinned); reading it back restores the preset's dtype peaks."""
    data = make_cluster((1, 2), device).to_dict()
    assert set(data["device"]) == {"name", "memory_bytes", "peak_flops", "memory_bandwidth", "kernel_overhead"}
    assert Cluster.from_dict(data).device == DEVICE_PRESETS[device]


def test_file_peak_table_per_dtype(tmp_path):
    text = "hosts = 1\ndevices_per_host = 2\n[device]\nname = \"x\"\n[device.peak_tflops]\nfp32 = 10\nfp16 = 40\nint8 = 80\n"
    device = load_cluster_file(_write(tmp_path, text)).device
    base = DEVICE_PRESETS["h100-80g"]
    assert device.peak_flops == pytest.approx(10e12) and device.peak("fp32") == pytest.approx(10e12)
    assert device.peak("fp16") == pytest.approx(40e12) and device.peak("int8") == pytest.approx(80e12)
    assert device.peak("bf16") == base.peak("bf16")          # left out: the preset's
    again = Cluster.from_dict(load_cluster_file(_write(tmp_path, text)).to_dict())
    assert again.device == device and again.device.to_dict()["dtype_peaks"]["fp16"] == pytest.approx(40e12)


def test_file_plain_peak_is_fp32_alone(tmp_path):
    device = load_cluster_file(_write(tmp_path, "hosts = 1\ndevices_per_host = 2\n[device]\npeak_tflops = 7\n")).device
    assert device.peak("fp32") == pytest.approx(7e12)
    assert device.peak("fp16") == DEVICE_PRESETS["h100-80g"].peak("fp16")


@pytest.mark.parametrize("body, message", [
    ("fp8 = 3", "unknown key 'fp8' in [device.peak_tflops]"),
    ("fp16 = 0", "device.peak_tflops.fp16 must be a positive number"),
    ('int8 = "fast"', "device.peak_tflops.int8 must be a positive number"),
])
def test_file_peak_table_errors(tmp_path, body, message):
    assert message in _error(tmp_path, f"hosts = 1\ndevices_per_host = 2\n[device.peak_tflops]\n{body}\n")


def test_documented_example_sets_dtype_peaks(tmp_path):
    path = tmp_path / "cluster.toml"
    path.write_text(_docstring_example())
    device = load_cluster_file(path).device
    assert device.peak("fp32") == pytest.approx(67e12) and device.peak("fp16") == pytest.approx(989e12)
    assert device.peak("int8") == pytest.approx(1979e12)
