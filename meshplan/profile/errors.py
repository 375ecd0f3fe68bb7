"""Errors of the profiler (subclasses of meshplan's user-facing error)."""

from meshplan.errors import MeshplanError


class ProfileError(MeshplanError):
    """Profiling cannot start or continue (provider, cache, MPI job, options)."""


class FailedElsewhere(ProfileError):
    """Under mpiexec: another rank failed and reports it; this rank only exits 1."""
