"""Time one operator signature with onnxruntime.

Each signature becomes a one-node model (``signatures.build_timing_model``): run-time
inputs are graph inputs, weights random initializers (see ``signatures`` for why), shape
constants initializers with their values. Inputs and outputs are bound once through IOBinding on the provider's
device, so no copy is timed. A run of that model costs the operator plus a fixed cost
of ``InferenceSession.run`` (a few µs on CPU), which would swamp small operators; so a
small operator is also timed as K independent copies in one model, and its time is the
difference ``(T_K − T_1) / (K − 1)`` — what one more such node adds to a graph.

Each measurement: warm-up runs (at least two, at least ``warmup_seconds``), then the
median of a repeat count sized from the warm-up so that the measurement takes about
``budget_seconds`` (between ``min_repeats`` and ``max_repeats`` runs).

Operators timed one at a time run on inputs that stay in the caches from run to run and
pay none of what a graph of them pays between nodes. ``time_whole_model`` times the
profiled model itself, run whole as one session: the ratio of that to the sum of its
operators' timings is what a plan's estimate scales its measured operators by
(``Profile.composition``).
"""

from __future__ import annotations

import ctypes
import math
import os
import platform
import statistics
import time
from dataclasses import dataclass

import numpy as np

from meshplan.providers import cuda_provider, cuda_usable, session_options
from meshplan.profile.errors import ProfileError
from meshplan.profile.signatures import ACT, CONST, WEIGHT, TimingSpec, build_timing_model

PROVIDERS = ("auto", "cuda", "cpu")
TIMING_METHOD = 2      # bump when a change to how operators are timed makes old cached timings wrong
CPU = "CPUExecutionProvider"
CUDA = "CUDAExecutionProvider"


@dataclass(frozen=True)
class TimingConfig:
    budget_seconds: float = 0.02      # aim for this much timed running per measurement
    warmup_seconds: float = 0.003
    min_repeats: int = 5
    max_repeats: int = 300
    copies_below: float = 1e-3        # operators faster than this are also timed as K copies
    max_copies: int = 16


@dataclass
class Measurement:
    seconds: float | None             # None when the signature could not be timed
    repeats: int = 0
    spread: float = 0.0               # interquartile range / median of the timed runs
    copies: int = 1
    error: str | None = None


def resolve_provider(choice: str) -> str:
    """'auto' | 'cuda' | 'cpu' → the onnxruntime provider name to time with."""
    if choice not in PROVIDERS:
        raise ProfileError(f"unknown provider {choice!r} (choose from {', '.join(PROVIDERS)})")
    if choice == "cpu":
        return CPU
    if cuda_usable():
        return CUDA
    if choice == "cuda":
        raise ProfileError("the CUDA execution provider is not usable here (no GPU or CUDA libraries)",
                           hint="use --provider cpu")
    return CPU


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown cpu"


def gpu_names() -> list[str]:
    """Names of the CUDA devices, through the driver library (empty without one)."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return []
    try:
        if cuda.cuInit(0) != 0:
            return []
        count = ctypes.c_int()
        if cuda.cuDeviceGetCount(ctypes.byref(count)) != 0:
            return []
        names = []
        for index in range(count.value):
            device = ctypes.c_int()
            buffer = ctypes.create_string_buffer(256)
            if cuda.cuDeviceGet(ctypes.byref(device), index) != 0 or cuda.cuDeviceGetName(buffer, 256, device) != 0:
                names.append("unknown gpu")
            else:
                names.append(buffer.value.decode(errors="replace"))
        return names
    except AttributeError:
        return []


def hardware_name(provider: str, device_id: int = 0) -> str:
    """What timings are keyed by: the GPU's name for CUDA, the CPU model for the CPU provider."""
    if provider == CUDA:
        names = gpu_names()
        return names[device_id % len(names)] if names else "unknown gpu"
    return cpu_name()


def ort_version() -> str:
    import onnxruntime as ort

    return ort.__version__


def default_threads(ranks_per_host: int) -> int:
    """One share of the host's cores per rank, as ``meshplan run`` gives its ranks."""
    return max(1, (os.cpu_count() or 1) // max(1, ranks_per_host))


def _random_input(signature, index: int, rng: np.random.Generator) -> np.ndarray:
    dtype, shape, _ = signature.inputs[index]
    dtype = np.dtype(dtype)
    if dtype.kind == "f":
        return rng.uniform(0.5, 1.5, size=shape).astype(dtype)
    if dtype.kind == "b":
        return rng.integers(0, 2, size=shape).astype(dtype)
    if dtype.kind in "iu":
        bound = _index_bound(signature, index)
        if bound is not None:
            return rng.integers(0, max(bound, 1), size=shape).astype(dtype)
        # 1 is a valid index almost everywhere, and no integer division by it traps.
        return np.ones(shape, dtype=dtype)
    return np.zeros(shape, dtype=dtype)


def _index_bound(signature, index: int) -> int | None:
    """Exclusive upper bound for index inputs whose values must address their data."""
    import json

    op = signature.op_type
    if index == 1 and op in ("Gather", "GatherElements") and signature.inputs[0] is not None:
        attrs = json.loads(signature.attrs)
        data = signature.inputs[0][1]
        axis = attrs.get("axis", 0)
        return data[axis % len(data)] if data else 1
    if index == 1 and op in ("GatherND", "ScatterND", "ScatterElements", "Scatter"):
        return 1
    return None


class OpTimer:
    """Times signatures on one provider with a fixed thread count."""

    def __init__(self, provider: str, threads: int, config: TimingConfig = TimingConfig(), device_id: int = 0):
        import onnxruntime as ort

        self.ort = ort
        self.provider = provider
        self.threads = threads
        self.config = config
        self.device_id = device_id
        self.device = "cuda" if provider == CUDA else "cpu"
        self.rng = np.random.default_rng(0)

    def _session(self, spec: TimingSpec, copies: int, weights: dict):
        ort = self.ort
        options = session_options(self.threads)
        options.log_severity_level = 4   # a signature that fails to run is reported as analytic, not logged
        providers = [cuda_provider(self.device_id), CPU] if self.provider == CUDA else [CPU]
        model = build_timing_model(spec, copies, weights=weights)
        # Identical copies must stay separate nodes: turn off common-subexpression elimination.
        return ort.InferenceSession(model.SerializeToString(), options, providers=providers, enable_fallback=0,
                                    disabled_optimizers=["CommonSubexpressionElimination"])

    def _bound(self, session, spec: TimingSpec, feeds: dict):
        ort = self.ort
        binding = session.io_binding()
        keep = []
        for value in session.get_inputs():
            ort_value = ort.OrtValue.ortvalue_from_numpy(feeds[value.name], self.device, self.device_id)
            binding.bind_ortvalue_input(value.name, ort_value)
            keep.append(ort_value)
        outputs = {}
        for index, item in enumerate(spec.signature.outputs):
            if item is not None:
                outputs[index] = item
        for value in session.get_outputs():
            index = int(value.name[3:].split("_")[0])
            dtype, shape = outputs[index]
            ort_value = ort.OrtValue.ortvalue_from_shape_and_type(list(shape), np.dtype(dtype), self.device, self.device_id)
            binding.bind_ortvalue_output(value.name, ort_value)
            keep.append(ort_value)
        return binding, keep

    def _run_times(self, session, binding) -> list[float]:
        config = self.config
        run = session.run_with_iobinding
        warm = 0
        started = time.perf_counter()
        last = 0.0
        while warm < 2 or time.perf_counter() - started < config.warmup_seconds:
            t0 = time.perf_counter()
            run(binding)
            last = time.perf_counter() - t0
            warm += 1
            if last > config.budget_seconds:   # slow operator: the warm-up has seen enough
                break
        repeats = int(min(config.max_repeats, max(config.min_repeats, config.budget_seconds / max(last, 1e-7))))
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            run(binding)
            times.append(time.perf_counter() - t0)
        return times

    def time(self, spec: TimingSpec) -> Measurement:
        """Median seconds of one application of the signature's operator."""
        try:
            feeds, weights = {}, {}
            roles = [item[2] for item in spec.signature.inputs if item is not None]
            packed = ACT in roles       # weights are initializers when the node has a run-time input
            for index, item in enumerate(spec.signature.inputs):
                if item is None or item[2] == CONST:
                    continue
                value = _random_input(spec.signature, index, self.rng)
                if item[2] == WEIGHT and packed:
                    weights[index] = value
                else:
                    feeds[f"in{index}"] = value
            t1, repeats, spread = self._measure(spec, 1, feeds, weights)
            copies = 1
            seconds = t1
            if t1 < self.config.copies_below:
                copies = int(min(self.config.max_copies, max(2, math.ceil(self.config.copies_below / max(t1, 1e-7)))))
                tk, more, spread = self._measure(spec, copies, feeds, weights)
                repeats += more
                seconds = (tk - t1) / (copies - 1)
                # Noise can make the difference vanish for the tiniest operators.
                seconds = max(seconds, 0.05 * t1 / copies, 1e-8)
            return Measurement(seconds, repeats, spread, copies)
        except Exception as exc:  # onnxruntime raises several unrelated types; the signature is analytic then
            text = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else type(exc).__name__
            return Measurement(None, error=text)

    def _measure(self, spec: TimingSpec, copies: int, feeds: dict, weights: dict) -> tuple[float, int, float]:
        session = self._session(spec, copies, weights)
        binding, keep = self._bound(session, spec, feeds)
        times = self._run_times(session, binding)
        del keep
        median = statistics.median(times)
        q = statistics.quantiles(times, n=4) if len(times) >= 4 else [median, median, median]
        return median, len(times), (q[2] - q[0]) / median if median > 0 else 0.0


WHOLE_MODEL_BYTES = 2 << 30    # a model with more weights than this (or an eighth of the machine's memory) is not run whole
WHOLE_MODEL_SECONDS = 1.0      # timed runs of the whole model stop past this much running (at least 3)


def time_whole_model(model, path, provider: str, threads: int, weight_bytes: int, device_id: int = 0,
                     training: bool = False) -> dict:
    """The median seconds of ``model`` (the canonical model written at ``path``, its weights
    beside it) run whole as one session, its inputs random and bound once (integers 0, so
    that an index or a class is valid; a training step's controls as torch's defaults, the
    learning rate 1e-3 and the step 1): {"seconds": ...}, or {"skipped": why} where it
    cannot be run here. ``training``: the session as a job opens a training step's (no
    memory pattern, no constant folding: ``runtime.sessions``)."""
    import onnxruntime as ort
    from onnx import helper

    limit = min(WHOLE_MODEL_BYTES, _memory_bytes() // 8)
    if weight_bytes > limit:
        return {"skipped": f"weights of {weight_bytes / 2**30:.2f} GiB (above {limit / 2**30:.2f} GiB)"}
    try:
        from meshplan.training.optimizers import DEFAULTS

        options = session_options(threads)
        options.log_severity_level = 4
        options.enable_mem_pattern = not training
        providers = [cuda_provider(device_id), CPU] if provider == CUDA else [CPU]
        session = ort.InferenceSession(str(path), options, providers=providers,
                                       disabled_optimizers=["ConstantFolding"] if training else [])
        controls = {**DEFAULTS, "train.step": 1.0, "train.apply": 1.0}
        device = "cuda" if provider == CUDA else "cpu"
        rng = np.random.default_rng(0)
        binding, keep = session.io_binding(), []
        for value in model.graph.input:
            dtype = np.dtype(helper.tensor_dtype_to_np_dtype(value.type.tensor_type.elem_type))
            shape = [d.dim_value for d in value.type.tensor_type.shape.dim]
            if value.name in controls:
                data = np.full(shape, controls[value.name], dtype)
            else:
                data = (rng.normal(0.0, 0.02, size=shape).astype(dtype) if dtype.kind == "f"
                        else np.zeros(shape, dtype))
            keep.append(ort.OrtValue.ortvalue_from_numpy(data, device, device_id))
            binding.bind_ortvalue_input(value.name, keep[-1])
        for value in session.get_outputs():
            binding.bind_output(value.name, device, device_id)
        for _ in range(2):
            session.run_with_iobinding(binding)
        times: list[float] = []
        while len(times) < 3 or sum(times) < WHOLE_MODEL_SECONDS and len(times) < 30:
            t0 = time.perf_counter()
            session.run_with_iobinding(binding)
            times.append(time.perf_counter() - t0)
        return {"seconds": statistics.median(times), "runs": len(times)}
    except Exception as exc:  # onnxruntime raises several unrelated types: no composition then
        text = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else type(exc).__name__
        return {"skipped": text}


def _memory_bytes() -> int:
    """The machine's memory (its physical pages)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 16 << 30
