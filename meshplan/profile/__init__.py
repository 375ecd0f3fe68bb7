"""Measured operator and communication costs (``meshplan profile``).

- ``signatures``: the distinct operator signatures of a graph (op, attributes, dtypes, shapes).
- ``timing``: one-node onnxruntime models, timed on the chosen provider.
- ``comm``: collectives timed over the mesh axes of an MPI job, fit as latency + bytes / bandwidth.
- ``cache``: the SQLite cache that makes a second profile cost only what is new.
- ``document``: the versioned profile file; ``load_profile`` for planning.
- ``measured``: ``ProfiledCostModel``, the planner's cost model backed by a profile.
- ``run``: ``profile_model``, alone or as one rank of an MPI job.
"""

from meshplan.profile.document import Profile, load_profile, read_profile, write_profile
from meshplan.profile.measured import ProfiledCostModel
from meshplan.profile.run import ProfileOptions, ProfileRun, profile_model

__all__ = [
    "Profile", "ProfileOptions", "ProfileRun", "ProfiledCostModel", "load_profile", "profile_model",
    "read_profile", "write_profile",
]
