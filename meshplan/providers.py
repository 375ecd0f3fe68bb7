"""onnxruntime execution providers: which ones are really usable here."""

from __future__ import annotations

import ctypes
import os
from functools import lru_cache

CUDA = "CUDAExecutionProvider"
CPU = "CPUExecutionProvider"
CHOICES = ("auto", "cuda", "cpu")


@lru_cache(maxsize=None)
def cuda_usable() -> bool:
    """True when onnxruntime's CUDA provider actually loads (its libraries and a GPU exist):
    the GPU build lists it as available even on machines without either."""
    import onnxruntime as ort
    from onnx import TensorProto, helper

    if CUDA not in ort.get_available_providers():
        return False
    probe = helper.make_model(
        helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "probe",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])]),
        opset_imports=[helper.make_opsetid("", 17)], ir_version=8,
    )
    ort.set_default_logger_severity(4)  # a failed load of the CUDA library logs loudly
    try:
        session = ort.InferenceSession(probe.SerializeToString(), providers=[CUDA], enable_fallback=0)
        return CUDA in session.get_providers()
    except Exception:  # any failure to start the provider means: no CUDA here
        return False
    finally:
        ort.set_default_logger_severity(3)


@lru_cache(maxsize=None)
def cuda_device_count() -> int:
    """GPUs this process can see (the CUDA runtime's count; with none loadable, the
    entries of CUDA_VISIBLE_DEVICES, else 1)."""
    for name in ("libcudart.so", "libcudart.so.13", "libcudart.so.12", "libcudart.so.11.0"):
        try:
            runtime = ctypes.CDLL(name)
        except OSError:
            continue
        count = ctypes.c_int(0)
        if runtime.cudaGetDeviceCount(ctypes.byref(count)) == 0 and count.value > 0:
            return count.value
    visible = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    return max(1, len(visible))
