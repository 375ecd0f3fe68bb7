"""onnxruntime execution providers: which ones are really usable here; and the options every
session of meshplan's starts from (``session_options``: one thread pool for the process's
sessions, where a rank's process asked for it)."""

from __future__ import annotations

import contextlib
import ctypes
import importlib.util
import io
import os
from functools import lru_cache

from meshplan.model.opsets import DEFAULT_OPSET

CUDA = "CUDAExecutionProvider"
CPU = "CPUExecutionProvider"
CHOICES = ("auto", "cuda", "cpu")


def cuda_provider(device_id: int = 0) -> tuple[str, dict]:
    """The CUDA provider with meshplan's options, for every session it makes (programs,
    timing, transfer kernels): GPU ``device_id``, and TF32 off, so that a float32 model
    computes in float32 as on the CPU (onnxruntime's CUDA provider otherwise rounds the
    operands of matrix products and convolutions to TF32's 10-bit mantissa)."""
    return CUDA, {"device_id": str(device_id), "use_tf32": "0"}


_shared_pool: list[int] = [0]   # threads of the process's one onnxruntime pool (0: none)


def share_one_pool(threads: int) -> bool:
    """From now on every session this process opens runs its operators on one thread pool of
    ``threads`` threads (the calling thread included), onnxruntime's global pool, instead of a
    pool of its own: for a rank whose program is cut at its collectives into several sessions
    that run one after another, each with a pool of its own whose spinning threads would
    compete for the rank's cores with the pool of the session that runs. onnxruntime makes the
    pool's threads at this call (they inherit the calling thread's affinity) and lets a
    process size it once; its threads spin. Only a process that is the rank's own may ask
    (onnxruntime then refuses sessions with pools of their own): False where it asked before
    with another size or onnxruntime refuses."""
    if _shared_pool[0]:
        return _shared_pool[0] == threads
    import onnxruntime as ort

    try:
        ort.set_global_thread_pool_sizes(int(threads), 1)
    except Exception:  # an onnxruntime without it, or one that refuses: pools of their own
        return False
    _shared_pool[0] = int(threads)
    return True


def shared_pool_threads() -> int:
    """The threads of this process's one pool (``share_one_pool``), 0 where sessions have their own."""
    return _shared_pool[0]


_shared_arena: list[bool] = [False]


def _share_one_arena(ort) -> bool:
    """Register one CPU arena for the whole process (onnxruntime's environment allocator),
    growing by what is asked rather than to the next power of two; False where this
    onnxruntime cannot. A rank's program is cut at its collectives into many sessions
    that run one after another: each with an arena of its own kept every session's peak
    at once (a 30 M-parameter GPT's data-parallel training step: 2.8 GiB a rank, against
    1.7 GiB on one arena)."""
    if not _shared_arena[0]:
        try:
            info = ort.OrtMemoryInfo("Cpu", ort.OrtAllocatorType.ORT_ARENA_ALLOCATOR, 0, ort.OrtMemType.DEFAULT)
            ort.create_and_register_allocator(info, ort.OrtArenaCfg(0, SAME_AS_REQUESTED, -1, -1))
        except Exception:  # an onnxruntime without environment allocators: arenas of their own
            return False
        _shared_arena[0] = True
    return True


SAME_AS_REQUESTED = 1   # onnxruntime's arena_extend_strategy kSameAsRequested


def session_options(threads: int = 0, one_arena: bool = False):
    """A new ``onnxruntime.SessionOptions`` for a session meshplan opens: with ``one_arena``
    (a job's sessions) its CPU tensors in the process's one arena (``_share_one_arena``;
    never shrinks, so not for the planner's passing sessions); on the process's one pool where there
    is one (``share_one_pool``; spinning set on it is then ignored), else with a pool of its
    own of ``threads`` threads (0: onnxruntime's choice) and one thread between operators."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    if one_arena and _share_one_arena(ort):
        options.add_session_config_entry("session.use_env_allocators", "1")
    if _shared_pool[0]:
        options.use_per_session_threads = False
    elif threads:
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
    return options


@lru_cache(maxsize=None)
def cuda_usable() -> bool:
    """True when onnxruntime's CUDA provider actually loads (its libraries and a GPU exist):
    the GPU build lists it as available even on machines without either."""
    return cuda_problem() is None


@lru_cache(maxsize=None)
def cuda_problem() -> str | None:
    """Why onnxruntime's CUDA provider cannot run here (one line), or None when it can."""
    import onnxruntime as ort

    if CUDA not in ort.get_available_providers():
        return "this onnxruntime build has no CUDA provider (install onnxruntime-gpu)"
    failure = _probe(ort)
    if failure is None:
        return None
    # pip-installed CUDA libraries (onnxruntime-gpu[cuda,cudnn]) are found once preloaded;
    # without them there is nothing to preload (and preload_dlls would print its failures).
    preload = getattr(ort, "preload_dlls", None)
    if preload is not None and importlib.util.find_spec("nvidia") is not None:
        try:
            with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
                preload()
        except Exception:  # the libraries would not load: the provider stays unusable
            pass
        else:
            failure = _probe(ort)
            if failure is None:
                return None
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return "no NVIDIA driver here (libcuda.so.1 does not load)"
    return f"the CUDA provider does not start: {failure}"


def _probe(ort) -> str | None:
    """Can a session start on the CUDA provider? None if so, else why not (one line)."""
    from onnx import TensorProto, helper

    probe = helper.make_model(
        helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "probe",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])]),
        opset_imports=[helper.make_opsetid("", DEFAULT_OPSET)], ir_version=8,
    )
    ort.set_default_logger_severity(4)  # a failed load of the CUDA library logs loudly
    try:
        session = ort.InferenceSession(probe.SerializeToString(), session_options(), providers=[cuda_provider()],
                                       enable_fallback=0)
        return None if CUDA in session.get_providers() else "onnxruntime fell back to another provider"
    except Exception as exc:  # any failure to start the provider means: no CUDA here
        return (" ".join(str(exc).split()) or type(exc).__name__)[:200]
    finally:
        ort.set_default_logger_severity(3)


@lru_cache(maxsize=None)
def _cuda_runtime():
    """The CUDA runtime library (the one onnxruntime's CUDA provider loaded, where it did),
    or None."""
    for name in ("libcudart.so.13", "libcudart.so.12", "libcudart.so", "libcudart.so.11.0"):
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    return None


def cuda_copy_to_host(target_address: int, source_address: int, width: int, pitch: int, rows: int) -> bool:
    """Copy ``rows`` runs of ``width`` bytes, ``pitch`` bytes apart, from GPU memory at
    ``source_address`` to host memory at ``target_address`` (one after another):
    ``cudaMemcpy2D``, which waits for the copy; False where there is no CUDA runtime or it
    refused."""
    runtime = _cuda_runtime()
    if runtime is None:
        return False
    device_to_host = 2
    return runtime.cudaMemcpy2D(ctypes.c_void_p(target_address), ctypes.c_size_t(width),
                                ctypes.c_void_p(source_address), ctypes.c_size_t(pitch), ctypes.c_size_t(width),
                                ctypes.c_size_t(rows), ctypes.c_int(device_to_host)) == 0


def cuda_synchronize() -> None:
    """Wait until this process's work on the current GPU is done (copies into buffers
    included); nothing without a CUDA runtime."""
    runtime = _cuda_runtime()
    if runtime is not None:
        runtime.cudaDeviceSynchronize()


@lru_cache(maxsize=None)
def cuda_device_count() -> int:
    """GPUs this process can see (the CUDA runtime's count; with none loadable, the
    entries of CUDA_VISIBLE_DEVICES, else 1)."""
    runtime = _cuda_runtime()
    if runtime is not None:
        count = ctypes.c_int(0)
        if runtime.cudaGetDeviceCount(ctypes.byref(count)) == 0 and count.value > 0:
            return count.value
    visible = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    return max(1, len(visible))
