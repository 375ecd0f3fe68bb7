"""The job the generation scripts under mpiexec open (``narrow_outputs_case.py``,
``row_calls_case.py``): the plan of ``sys.argv[1]``, its cache updated in place, and with
``on-device`` as ``sys.argv[2]`` its state and activations kept in onnxruntime's buffers
(``Job(on_device=True)``: the path a GPU runs, here on OrtValues in host memory)."""

from __future__ import annotations

import sys


def generation_job():
    """The job (a context: None on the ranks that serve) and whether it is on the device."""
    from meshplan.runtime.job import Job

    on_device = sys.argv[2:] == ["on-device"]
    return Job(sys.argv[1], provider="cpu", cache_in_place=True, on_device=on_device), on_device
