"""What the MPI library under mpi4py can do (shared by the profiler and the runtime)."""

from __future__ import annotations

import ctypes
import os

from meshplan.errors import RunError


def load_mpi():
    """mpi4py's ``MPI`` module, or a one-line RunError when no MPI library loads.

    mpi4py's wheels load the MPI library at import: the ``mpich`` wheel (meshplan's
    ``mpi`` extra), or the site's MPI found by the dynamic loader (``MPI4PY_LIBMPI``
    names one explicitly); an mpi4py built from source uses the MPI it was built with.
    """
    try:
        from mpi4py import MPI
    except (ImportError, RuntimeError, OSError) as exc:
        detail = " ".join(str(exc).split()) or type(exc).__name__
        raise RunError(f"mpi4py cannot load an MPI library: {detail}",
                       hint="install meshplan[mpi] for MPICH from PyPI, or build mpi4py against the site MPI: "
                            "see docs/clusters.md") from None
    return MPI


def cuda_aware(MPI) -> dict:
    """Is the MPI library CUDA-aware? {"value": bool | None, "method": how it was found}."""
    try:
        info = MPI.COMM_WORLD.Get_info()
        kinds = info.Get("mpi_memory_alloc_kinds")
        info.Free()
        if kinds:
            return {"value": "cuda" in kinds.lower(), "method": f"mpi_memory_alloc_kinds = {kinds}"}
    except Exception:  # an MPI before 4.1 has no such key
        pass
    for path in _loaded_mpi_libraries():
        try:
            library = ctypes.CDLL(path)
            query = library.MPIX_Query_cuda_support
        except (OSError, AttributeError):
            continue
        query.restype = ctypes.c_int
        return {"value": bool(query()), "method": f"MPIX_Query_cuda_support in {os.path.basename(path)}"}
    return {"value": None, "method": "unknown: no mpi_memory_alloc_kinds key and no MPIX_Query_cuda_support"}


def _loaded_mpi_libraries() -> list[str]:
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "libmpi" in line and "/" in line}
    except OSError:
        return []
    return sorted(paths)
