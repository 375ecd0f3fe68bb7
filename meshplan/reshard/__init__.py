"""Resharding: within one mesh (``kinds``, ``steps``) and between two meshes.

Cross-mesh resharding follows Zhuang et al., "On Optimizing the Communication of Model
Parallelism" (MLSys 2023): ``tasks`` cuts the transfer into unit tasks, ``simulator``
times a schedule of them, ``schedulers`` chooses one, and ``send_spec`` chooses how the
source mesh rearranges the tensor first and whether B finishes with an all-gather.
"""
