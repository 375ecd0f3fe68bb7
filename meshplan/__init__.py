"""meshplan: plan and run one ONNX model on many devices.

``meshplan.Job`` (``meshplan.runtime.job``) is the resident job: a plan loaded once on
every MPI rank, serving calls driven from rank 0. It is imported on first use (it needs
mpi4py and onnxruntime)."""

__version__ = "0.1.0"


def __getattr__(name: str):
    if name in ("Job", "CallStats"):
        from meshplan.runtime import job

        return getattr(job, name)
    raise AttributeError(f"module 'meshplan' has no attribute {name!r}")
