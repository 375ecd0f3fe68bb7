"""Input and output files (.npz) of a run, checked against the plan, split into microbatches."""

from __future__ import annotations

import io
import zipfile
from pathlib import Path

import numpy as np

from meshplan.errors import RunError
from meshplan.files import atomic_write_bytes
from meshplan.plan_format import Plan


def read_inputs(path: str | Path, plan: Plan, empty_state: bool = False) -> dict[str, np.ndarray]:
    """Read an .npz of model inputs and check names, shapes and dtypes against the plan.
    State inputs may be missing (the job starts them empty); with ``empty_state`` they are
    then made here, as zeros at the call's sizes."""
    path = Path(path)
    if not path.is_file():
        raise RunError(f"inputs file not found: {path}")
    try:
        with np.load(path, allow_pickle=False) as archive:
            arrays = {name: archive[name] for name in archive.files}
    except (ValueError, OSError, zipfile.BadZipFile, EOFError) as exc:
        hint = "save string tensors as numpy str arrays (dtype str), not objects" if "Object arrays" in str(exc) else None
        raise RunError(f"cannot read inputs {path}: not a valid .npz file ({str(exc).splitlines()[0][:200]})",
                       hint=hint) from None
    optional = {entry["input"] for entry in plan.state}   # state starts empty when not given
    for spec in plan.inputs:
        if spec.name not in arrays and spec.name in optional:
            continue
        if spec.name not in arrays:
            raise RunError(f"inputs file {path} has no array '{spec.name}' (the model's inputs: "
                           f"{', '.join(s.name for s in plan.inputs)})")
        array = arrays[spec.name]
        if array.dtype.kind == "U" and np.dtype(spec.dtype) == np.dtype(object):
            array = arrays[spec.name] = array.astype(object)   # numpy writes str arrays as fixed-width unicode
        if len(array.shape) != len(spec.shape) or any(
                isinstance(want, int) and want >= 0 and want != size for want, size in zip(spec.shape, array.shape)):
            raise RunError(f"input '{spec.name}' has shape {list(array.shape)}, the plan expects {spec.shape}")
        if array.dtype != np.dtype(spec.dtype):
            raise RunError(f"input '{spec.name}' has dtype {array.dtype}, the plan expects {spec.dtype}")
    if plan.sizes:   # a ranged plan: the sizes must be ones it accepts, and agree
        from meshplan.runtime.call_sizes import check_inputs

        values = check_inputs(plan, {name: np.shape(a) for name, a in arrays.items()})
    else:
        values = dict(plan.model.get("dims", {}))
    if empty_state:
        from meshplan.runtime.call_sizes import shape_at

        for spec in plan.inputs:
            if spec.name in optional and spec.name not in arrays:
                shape = shape_at(spec.shape, values)
                if shape is None:
                    raise RunError(f"inputs file {path} has no state '{spec.name}' and its shape {spec.shape} does "
                                   "not follow from the other inputs")
                arrays[spec.name] = np.zeros(shape, dtype=spec.dtype)
    return {spec.name: np.asarray(arrays[spec.name], order="C") for spec in plan.inputs if spec.name in arrays}


def split_microbatches(inputs: dict[str, np.ndarray], plan: Plan) -> list[dict[str, np.ndarray]]:
    """The inputs of each microbatch: batched inputs are cut along their batch axis (axis 0
    unless the plan's batch lists ``axes``), others shared."""
    count = plan.microbatches
    if count == 1:
        return [inputs]
    size = plan.batch["microbatch_size"]
    batched = set(plan.batch["batched_inputs"])
    axes = plan.batch.get("axes", {})

    def part(a: np.ndarray, axis: int, mb: int) -> np.ndarray:
        index = (slice(None),) * axis + (slice(mb * size, (mb + 1) * size),)
        return np.ascontiguousarray(a[index])

    return [
        {name: part(a, axes.get(name, 0), mb) if name in batched else a for name, a in inputs.items()}
        for mb in range(count)
    ]


def join_microbatches(parts: list[dict[str, np.ndarray]], plan: Plan) -> dict[str, np.ndarray]:
    if len(parts) == 1:
        return parts[0]
    axes = plan.batch.get("axes", {})
    return {spec.name: np.concatenate([p[spec.name] for p in parts], axis=axes.get(spec.name, 0)) for spec in plan.outputs}


def write_outputs(path: str | Path, outputs: dict[str, np.ndarray]) -> None:
    """Write the outputs once, atomically (a temporary file renamed into place)."""
    path = Path(path)
    if path.suffix != ".npz":
        raise RunError(f"output file must end in .npz: {path}")
    if not path.parent.is_dir():
        raise RunError(f"output directory does not exist: {path.parent}")
    buffer = io.BytesIO()
    np.savez(buffer, **{name: _storable(a) for name, a in outputs.items()})
    atomic_write_bytes(path, buffer.getvalue())


def _storable(array: np.ndarray) -> np.ndarray:
    """onnxruntime returns string tensors as object arrays, which .npz stores only by
    pickling (and readers then refuse): write them as numpy str arrays."""
    if array.dtype == object:
        return np.asarray(array, dtype=str)
    return array
