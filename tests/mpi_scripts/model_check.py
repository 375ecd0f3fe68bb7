"""The last check of the scripts that run a job: its outputs against onnxruntime's on the
original model, as rank 0's ``ok``/``FAIL`` line."""

from __future__ import annotations

import numpy as np


def print_outputs_check(plan, inputs: dict, got: dict) -> None:
    from meshplan.runtime.inprocess import reference_outputs

    reference = reference_outputs(plan, inputs)
    close = all(np.allclose(got[k], reference[k], rtol=1e-4, atol=1e-5) for k in reference)
    print(f"{'ok' if close else 'FAIL'} outputs equal onnxruntime's on the original model")
