"""The target cluster: an N×M device mesh (N hosts × M devices per host).

A cluster is given either as ``--mesh HxD --device PRESET`` or as a TOML file::

    hosts = 2
    devices_per_host = 8
    # device = "h100-80g"          # a preset name; or, as here, a [device] table

    [device]                       # optional (default: the h100-80g preset)
    preset = "h100-80g"            # the preset the other keys override (default h100-80g)
    name = "my-gpu"
    memory_gb = 80                 # device memory, GiB
    peak_tflops = 989              # dense peak for the model's dtype, TFLOP/s
    memory_bandwidth_gbps = 3350   # GB/s
    kernel_overhead_us = 5         # fixed cost per operator launch

    [intra_host]                   # link between devices of one host
    bandwidth_gbps = 300           # GB/s per direction
    latency_us = 5

    [inter_host]                   # link between hosts
    bandwidth_gbps = 25
    latency_us = 20

``device`` is either a preset name or a ``[device]`` table, not both (TOML allows a key
once).
"""

from __future__ import annotations

import math
import re
import tomllib
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from meshplan.errors import ClusterError

GB = 1e9
GIB = 1024**3


@dataclass(frozen=True)
class DeviceSpec:
    name: str
    memory_bytes: float
    peak_flops: float           # FLOP/s
    memory_bandwidth: float     # bytes/s
    kernel_overhead: float      # seconds per operator

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class LinkSpec:
    bandwidth: float            # bytes/s
    latency: float              # seconds

    def seconds(self, nbytes: float) -> float:
        return self.latency + nbytes / self.bandwidth


def _preset(name, memory_gib, tflops, bandwidth_gbps, overhead_us) -> DeviceSpec:
    return DeviceSpec(name, memory_gib * GIB, tflops * 1e12, bandwidth_gbps * GB, overhead_us * 1e-6)


# Dense fp32/tf32-class peaks (what an fp32 ONNX model gets), HBM bandwidth, device memory.
DEVICE_PRESETS: dict[str, DeviceSpec] = {
    d.name: d
    for d in (
        _preset("h200", 141, 495, 4800, 5),
        _preset("h100-80g", 80, 495, 3350, 5),
        _preset("a100-80g", 80, 156, 2039, 5),
        _preset("a100-40g", 40, 156, 1555, 5),
        _preset("v100-32g", 32, 15.7, 900, 6),
        _preset("l4", 24, 60, 300, 5),
        _preset("cpu", 16, 0.1, 20, 15),
    )
}

DEFAULT_DEVICE = "h100-80g"

# Links per device preset family: (intra-host GB/s, latency µs), (inter-host GB/s, latency µs).
_LINKS = {
    "cpu": ((10, 30), (1.25, 50)),
    "default": ((300, 5), (25, 20)),
}


@dataclass(frozen=True)
class Cluster:
    hosts: int
    devices_per_host: int
    device: DeviceSpec
    intra_host: LinkSpec
    inter_host: LinkSpec

    @property
    def num_devices(self) -> int:
        return self.hosts * self.devices_per_host

    @property
    def mesh(self) -> tuple[int, int]:
        return (self.hosts, self.devices_per_host)

    def host_of(self, rank: int) -> int:
        return rank // self.devices_per_host

    def link(self, src: int, dst: int) -> LinkSpec:
        return self.intra_host if self.host_of(src) == self.host_of(dst) else self.inter_host

    def to_dict(self) -> dict:
        return {
            "mesh": [self.hosts, self.devices_per_host],
            "device": self.device.to_dict(),
            "intra_host": asdict(self.intra_host),
            "inter_host": asdict(self.inter_host),
        }

    @classmethod
    def from_dict(cls, data: dict) -> "Cluster":
        hosts, per_host = data["mesh"]
        return cls(hosts, per_host, DeviceSpec(**data["device"]), LinkSpec(**data["intra_host"]), LinkSpec(**data["inter_host"]))


def parse_mesh(text: str) -> tuple[int, int]:
    """'2x8' → (2, 8). Raises ValueError with a readable message."""
    match = re.fullmatch(r"\s*(\d+)\s*[xX]\s*(\d+)\s*", text)
    if not match:
        raise ValueError(f"mesh must look like HxD (hosts x devices per host), e.g. 1x4; got {text!r}")
    hosts, per_host = int(match.group(1)), int(match.group(2))
    if hosts < 1 or per_host < 1:
        raise ValueError(f"mesh sizes must be positive; got {text!r}")
    return hosts, per_host


def make_cluster(mesh: tuple[int, int], device: str = DEFAULT_DEVICE) -> Cluster:
    if device not in DEVICE_PRESETS:
        raise ClusterError(f"unknown device preset {device!r} (known: {', '.join(DEVICE_PRESETS)})")
    spec = DEVICE_PRESETS[device]
    (intra_bw, intra_lat), (inter_bw, inter_lat) = _LINKS.get(device, _LINKS["default"])
    return Cluster(
        mesh[0], mesh[1], spec,
        LinkSpec(intra_bw * GB, intra_lat * 1e-6), LinkSpec(inter_bw * GB, inter_lat * 1e-6),
    )


_DEVICE_KEYS = {
    "name": ("name", None),
    "memory_gb": ("memory_bytes", GIB),
    "peak_tflops": ("peak_flops", 1e12),
    "memory_bandwidth_gbps": ("memory_bandwidth", GB),
    "kernel_overhead_us": ("kernel_overhead", 1e-6),
}
_LINK_KEYS = {"bandwidth_gbps": ("bandwidth", GB), "latency_us": ("latency", 1e-6)}


def load_cluster_file(path: str | Path) -> Cluster:
    """Read a cluster TOML file (format in this module's docstring and the README)."""
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ClusterError(f"cluster file not found: {path}") from None
    except OSError as exc:
        raise ClusterError(f"cannot read cluster file {path}: {exc.strerror or exc}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ClusterError(f"cluster file {path} is not valid TOML: {exc}") from None
    unknown = set(data) - {"hosts", "devices_per_host", "device", "intra_host", "inter_host"}
    if unknown:
        raise ClusterError(f"cluster file {path}: unknown key {sorted(unknown)[0]!r}")
    for key in ("hosts", "devices_per_host"):
        if key not in data:
            raise ClusterError(f"cluster file {path}: missing key {key!r}")
        if type(data[key]) is not int:
            raise ClusterError(f"cluster file {path}: hosts and devices_per_host must be integers, got {key} = {data[key]!r}")
    mesh = (data["hosts"], data["devices_per_host"])
    if min(mesh) < 1:
        raise ClusterError(f"cluster file {path}: hosts and devices_per_host must be positive")
    device = data.get("device", DEFAULT_DEVICE)
    if isinstance(device, str):
        cluster = make_cluster(mesh, device)
    elif isinstance(device, dict):
        cluster = make_cluster(mesh, str(device.get("preset", DEFAULT_DEVICE)))
    else:
        raise ClusterError(f"cluster file {path}: device must be a preset name or a [device] table, got {device!r}")
    if isinstance(device, dict):
        cluster = replace(cluster, device=_override(cluster.device, device, _DEVICE_KEYS | {"preset": (None, None)}, path, "device"))
    for section in ("intra_host", "inter_host"):
        if section in data:
            cluster = replace(cluster, **{section: _override(getattr(cluster, section), data[section], _LINK_KEYS, path, section)})
    return cluster


def _override(base, table: dict, keys: dict, path: Path, section: str):
    if not isinstance(table, dict):
        raise ClusterError(f"cluster file {path}: [{section}] must be a table")
    changes = {}
    for key, value in table.items():
        if key not in keys:
            raise ClusterError(f"cluster file {path}: unknown key {key!r} in [{section}]")
        field_name, scale = keys[key]
        if field_name is None:
            continue
        if scale is None:
            changes[field_name] = str(value)
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise ClusterError(f"cluster file {path}: {section}.{key} must be a positive number, got {value!r}")
        changes[field_name] = float(value) * scale
    return replace(base, **changes)
