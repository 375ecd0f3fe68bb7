"""The target cluster: an N×M device mesh (N hosts × M devices per host).

A cluster is given either as ``--mesh HxD --device PRESET`` or as a TOML file::

    hosts = 2
    devices_per_host = 8
    # shared_host = true           # the devices of a host are shares of one machine (CPU ranks)
    # device = "h100-80g"          # a preset name; or, as here, a [device] table

    [device]                       # optional (default: the h100-80g preset)
    preset = "h100-80g"            # the preset the other keys override (default h100-80g)
    name = "my-gpu"
    memory_gb = 80                 # device memory, GiB
    memory_bandwidth_gbps = 3350   # GB/s
    kernel_overhead_us = 5         # fixed cost per operator launch

    [device.peak_tflops]           # dense peaks per compute dtype, TFLOP/s (int8: TOP/s);
    fp32 = 67                      # keys left out keep the preset's; a plain number,
    fp16 = 989                     # peak_tflops = 67 under [device], sets fp32 alone
    bf16 = 989
    int8 = 1979

    [intra_host]                   # link between devices of one host
    bandwidth_gbps = 300           # GB/s per direction
    latency_us = 5

    [inter_host]                   # link between hosts
    bandwidth_gbps = 25
    latency_us = 20

``device`` is either a preset name or a ``[device]`` table, not both (TOML allows a key
once).

``shared_host = true`` (``meshplan plan --shared-host``; ``Cluster.host_shares``): the
devices of a host are shares of one machine's cores and memory bandwidth, as the ranks of a
job on one CPU machine are, not devices with their own (a GPU's memory and cores are its
own). A device's figures are then its share when every device of its host works; one that
works while others of its host are idle takes their cores too (a job gives an idle rank's
cores to the ranks that work beside it: ``runtime.threads``), so its work runs
``working / shares`` of the time (``work_scale``). Splitting an operator over ranks of one
machine then divides no bandwidth (a batch-1 decode step reads the same bytes through the
same memory) and adds the collectives: a plan leaves devices idle where that does not pay.

Peaks are per compute dtype (``PEAK_KEYS``): an operator computing in float16 is costed at
the ``fp16`` peak, bfloat16 at ``bf16``, 8-bit integer products at ``int8``, everything else
at ``fp32`` (see ``meshplan.cost.analytic.compute_dtype``). ``tf32`` is recorded but unused:
sessions run float32 with TF32 off (``meshplan.providers``).
"""

from __future__ import annotations

import math
import re
import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10: the same parser, from PyPI
    import tomli as tomllib

from meshplan.errors import ClusterError

GB = 1e9
GIB = 1024**3


# Compute dtypes a device has a peak for; ``fp32`` is ``DeviceSpec.peak_flops``.
PEAK_KEYS = ("fp32", "tf32", "fp16", "bf16", "int8")


@dataclass(frozen=True)
class DeviceSpec:
    name: str
    memory_bytes: float
    peak_flops: float           # FLOP/s computing in fp32
    memory_bandwidth: float     # bytes/s
    kernel_overhead: float      # seconds per operator
    # FLOP/s of the other PEAK_KEYS, as sorted (key, FLOP/s) pairs; a key left out runs at fp32's.
    dtype_peaks: tuple[tuple[str, float], ...] = ()

    def peak(self, key: str) -> float:
        """Dense peak FLOP/s computing in ``key`` (one of PEAK_KEYS)."""
        if key == "fp32":
            return self.peak_flops
        return dict(self.dtype_peaks).get(key, self.peak_flops)

    def with_peaks(self, peaks: dict[str, float]) -> "DeviceSpec":
        """This device with the FLOP/s of some PEAK_KEYS replaced."""
        fp32 = peaks.get("fp32", self.peak_flops)
        others = dict(self.dtype_peaks) | {k: v for k, v in peaks.items() if k != "fp32"}
        return replace(self, peak_flops=fp32, dtype_peaks=tuple(sorted(others.items())))

    def to_dict(self) -> dict:
        """Its fields; ``dtype_peaks`` (as a dict) only where they differ from those of the
        preset of the same name, so a preset's record reads as it did before there were
        per-dtype peaks (``from_dict`` takes them back from the preset)."""
        data = asdict(self)
        data.pop("dtype_peaks")
        preset = DEVICE_PRESETS.get(self.name)
        if preset is None or preset.dtype_peaks != self.dtype_peaks:
            data["dtype_peaks"] = dict(self.dtype_peaks)
        return data

    @classmethod
    def from_dict(cls, data: dict) -> "DeviceSpec":
        data = dict(data)
        if "dtype_peaks" in data:
            peaks = tuple(sorted(data.pop("dtype_peaks").items()))
        else:
            peaks = DEVICE_PRESETS[data["name"]].dtype_peaks if data["name"] in DEVICE_PRESETS else ()
        return cls(**data, dtype_peaks=peaks)


@dataclass(frozen=True)
class LinkSpec:
    bandwidth: float            # bytes/s
    latency: float              # seconds

    def seconds(self, nbytes: float) -> float:
        return self.latency + nbytes / self.bandwidth


def _preset(name, memory_gib, tflops: tuple[float, ...], bandwidth_gbps, overhead_us) -> DeviceSpec:
    peaks = dict(zip(PEAK_KEYS, (t * 1e12 for t in tflops), strict=True))
    spec = DeviceSpec(name, memory_gib * GIB, peaks["fp32"], bandwidth_gbps * GB, overhead_us * 1e-6)
    return spec.with_peaks(peaks)


# Dense peaks, TFLOP/s (int8: TOP/s), in PEAK_KEYS order (fp32, tf32, fp16, bf16, int8), from
# the vendors' datasheets (SXM parts; sparse figures halved); HBM bandwidth; device memory.
# fp32 is the datasheet FP32 rate (A100 19.5, H100/H200 67, L4 30.3): meshplan's sessions
# run float32 with TF32 off (docs/gpu.md: an H100 ran fp32 Gemms at 48 TFLOP/s), so TF32's
# tensor-core figure is only the tf32 entry.
# V100 has no bf16 or tf32 units (its fp32 rate) and int8 only through DP4A (4x fp32).
# The CPU: fp16/bf16 at the fp32 rate (onnxruntime widens most of them), int8 (VNNI) at 2x.
DEVICE_PRESETS: dict[str, DeviceSpec] = {
    d.name: d
    for d in (
        _preset("h200", 141, (67, 495, 989, 989, 1979), 4800, 5),
        _preset("h100-80g", 80, (67, 495, 989, 989, 1979), 3350, 5),
        _preset("a100-80g", 80, (19.5, 156, 312, 312, 624), 2039, 5),
        _preset("a100-40g", 40, (19.5, 156, 312, 312, 624), 1555, 5),
        _preset("v100-32g", 32, (15.7, 15.7, 125, 15.7, 62.8), 900, 6),
        _preset("l4", 24, (30.3, 60, 121, 121, 242), 300, 5),
        _preset("cpu", 16, (0.1, 0.1, 0.1, 0.1, 0.2), 20, 15),
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
    # 0: each device has its own cores and memory; N: a device is one of N equal shares of its
    # host's (the devices per host of the cluster described; see the module)
    host_shares: int = 0

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

    def work_scale(self, devices: int) -> float:
        """The part of a device's compute and memory time its work takes when ``devices``
        devices work at once, as a submesh spreads them (at most ``devices_per_host`` on a
        host): 1 where devices are their own; ``working / host_shares`` where they share their
        host (the idle devices' cores and bandwidth go to those that work)."""
        if not self.host_shares:
            return 1.0
        return min(max(1, devices), self.devices_per_host, self.host_shares) / self.host_shares

    def shared_seconds(self, seconds, devices: int):
        """``seconds`` of a device's work (a number, or a numpy array of them) when ``devices``
        work at once (``work_scale``): the part beyond a kernel's fixed overhead scaled."""
        scale = self.work_scale(devices)
        if scale == 1.0:
            return seconds
        overhead = np.minimum(seconds, self.device.kernel_overhead)
        return overhead + (seconds - overhead) * scale

    def costed(self, microbatches: int) -> "Cluster":
        """The cluster a plan of ``microbatches`` is costed on: with several in flight, the
        stages on a host's devices work at once and no share is free for another
        (``work_scale`` is then 1)."""
        return replace(self, host_shares=0) if microbatches > 1 and self.host_shares else self

    def to_dict(self) -> dict:
        data = {
            "mesh": [self.hosts, self.devices_per_host],
            "device": self.device.to_dict(),
            "intra_host": asdict(self.intra_host),
            "inter_host": asdict(self.inter_host),
        }
        if self.host_shares:
            data["host_shares"] = self.host_shares
        return data

    @classmethod
    def from_dict(cls, data: dict) -> "Cluster":
        hosts, per_host = data["mesh"]
        return cls(hosts, per_host, DeviceSpec.from_dict(data["device"]), LinkSpec(**data["intra_host"]),
                   LinkSpec(**data["inter_host"]), int(data.get("host_shares", 0)))


def parse_mesh(text: str) -> tuple[int, int]:
    """'2x8' → (2, 8). Raises ValueError with a readable message."""
    match = re.fullmatch(r"\s*(\d+)\s*[xX]\s*(\d+)\s*", text)
    if not match:
        raise ValueError(f"mesh must look like HxD (hosts x devices per host), e.g. 1x4; got {text!r}")
    hosts, per_host = int(match.group(1)), int(match.group(2))
    if hosts < 1 or per_host < 1:
        raise ValueError(f"mesh sizes must be positive; got {text!r}")
    return hosts, per_host


def make_cluster(mesh: tuple[int, int], device: str = DEFAULT_DEVICE, shared_host: bool = False) -> Cluster:
    """``shared_host``: the devices of a host share one machine's cores and memory (see the module)."""
    if device not in DEVICE_PRESETS:
        raise ClusterError(f"unknown device preset {device!r} (known: {', '.join(DEVICE_PRESETS)})")
    spec = DEVICE_PRESETS[device]
    (intra_bw, intra_lat), (inter_bw, inter_lat) = _LINKS.get(device, _LINKS["default"])
    return Cluster(
        mesh[0], mesh[1], spec,
        LinkSpec(intra_bw * GB, intra_lat * 1e-6), LinkSpec(inter_bw * GB, inter_lat * 1e-6),
        mesh[1] if shared_host else 0,
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
    """Read a cluster TOML file (format in this module's docstring and docs/clusters.md)."""
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ClusterError(f"cluster file not found: {path}") from None
    except OSError as exc:
        raise ClusterError(f"cannot read cluster file {path}: {exc.strerror or exc}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ClusterError(f"cluster file {path} is not valid TOML: {exc}") from None
    unknown = set(data) - {"hosts", "devices_per_host", "device", "intra_host", "inter_host", "shared_host"}
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
    shared = data.get("shared_host", False)
    if type(shared) is not bool:
        raise ClusterError(f"cluster file {path}: shared_host must be true or false, got {shared!r}")
    device = data.get("device", DEFAULT_DEVICE)
    if isinstance(device, str):
        cluster = make_cluster(mesh, device)
    elif isinstance(device, dict):
        cluster = make_cluster(mesh, str(device.get("preset", DEFAULT_DEVICE)))
    else:
        raise ClusterError(f"cluster file {path}: device must be a preset name or a [device] table, got {device!r}")
    if isinstance(device, dict):
        peaks = device.get("peak_tflops")
        if isinstance(peaks, dict):
            device = {k: v for k, v in device.items() if k != "peak_tflops"}
        spec = _override(cluster.device, device, _DEVICE_KEYS | {"preset": (None, None)}, path, "device")
        if isinstance(peaks, dict):
            spec = spec.with_peaks(_numbers(peaks, {k: (k, 1e12) for k in PEAK_KEYS}, path, "device.peak_tflops"))
        cluster = replace(cluster, device=spec)
    for section in ("intra_host", "inter_host"):
        if section in data:
            cluster = replace(cluster, **{section: _override(getattr(cluster, section), data[section], _LINK_KEYS, path, section)})
    return replace(cluster, host_shares=mesh[1] if shared else 0)


def _override(base, table: dict, keys: dict, path: Path, section: str):
    return replace(base, **_numbers(table, keys, path, section))


def _numbers(table: dict, keys: dict, path: Path, section: str) -> dict:
    """``table``'s values under their field names (``keys``: key → (field, scale)), checked."""
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
    return changes
