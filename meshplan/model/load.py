"""Load an ONNX model and bring it to the canonical form the planner works on.

Steps: read (with external data, so models over 2 GB work), check with onnx's
checker, fix symbolic dimensions from ``--dim NAME=INT``, fold shape
sub-computations with onnxruntime's offline graph optimisation (basic level:
constant folding and redundant-node elimination, no hardware-specific fusions),
then run onnx's shape inference so that every tensor has a static shape.

The canonical model is written to a working directory with its weights as
external data; planning then reads it without weights, and emission extracts
each stage's subgraph from it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import onnx
from google.protobuf.message import DecodeError

from meshplan.errors import ModelError
from meshplan.files import file_sha256
from meshplan.model.contrib_shapes import infer_with_contrib

# onnx 1.23 writes IR 14 by default, newer than onnxruntime 1.31 reads (13). Every file
# meshplan writes carries the least IR version its opsets need, never above this.
MAX_IR_VERSION = 13


def read_model(path: str | os.PathLike, load_external_data: bool = True) -> onnx.ModelProto:
    """Read an ONNX file; raise ModelError with one line for anything unreadable."""
    path = Path(path)
    if not path.exists():
        raise ModelError(f"model file not found: {path}")
    if path.is_dir():
        raise ModelError(f"model path is a directory, not an ONNX file: {path}")
    try:
        model = onnx.load(str(path), load_external_data=load_external_data)
    except (DecodeError, RuntimeError, ValueError) as exc:
        raise ModelError(f"not an ONNX model: {path} ({_first_line(exc)})") from exc
    except OSError as exc:
        raise ModelError(f"cannot read model {path}: {_first_line(exc)}") from exc
    if not model.graph.node:
        raise ModelError(f"not an ONNX model (no graph nodes): {path}")
    return model


def check_model(path: str | os.PathLike) -> None:
    """Run onnx's checker on a file path (the path form handles models over 2 GB)."""
    try:
        onnx.checker.check_model(str(path))
    except (onnx.checker.ValidationError, DecodeError, ValueError) as exc:
        raise ModelError(f"model {path} fails the ONNX checker: {_first_line(exc)}") from exc


def symbolic_dims(model: onnx.ModelProto) -> dict[str, list[str]]:
    """Symbolic dimension names of the graph inputs, each with the inputs that use it."""
    found: dict[str, list[str]] = {}
    initializers = {t.name for t in model.graph.initializer}
    for value in model.graph.input:
        if value.name in initializers:
            continue
        for dim in value.type.tensor_type.shape.dim:
            if dim.HasField("dim_param") and dim.dim_param:
                found.setdefault(dim.dim_param, []).append(value.name)
            elif not dim.HasField("dim_value"):
                raise ModelError(
                    f"input '{value.name}' has an unnamed dynamic dimension",
                    hint="give it a name in the model, then fix it with --dim NAME=INT",
                )
    return found


def fix_dims(model: onnx.ModelProto, dims: dict[str, int]) -> onnx.ModelProto:
    """Return a copy whose graph inputs/outputs have the named dims set to integers.

    Unknown names in ``dims`` and symbolic dims left unset are errors naming them.
    """
    present = symbolic_dims(model)
    unknown = sorted(set(dims) - set(present))
    if unknown:
        have = ", ".join(sorted(present)) or "none"
        raise ModelError(f"unknown dimension {unknown[0]!r} in --dim (the model's symbolic dims: {have})")
    missing = sorted(set(present) - set(dims))
    if missing:
        name = missing[0]
        raise ModelError(
            f"dimension {name!r} of input '{present[name][0]}' is unknown",
            hint=f"fix it with --dim {name}=INT",
        )
    for name, value in dims.items():
        if value <= 0:
            raise ModelError(f"dimension {name!r} must be positive, got {value}")
    fixed = onnx.ModelProto()
    fixed.CopyFrom(model)
    for value in list(fixed.graph.input) + list(fixed.graph.output) + list(fixed.graph.value_info):
        for dim in value.type.tensor_type.shape.dim:
            if dim.HasField("dim_param") and dim.dim_param in dims:
                dim.dim_value = dims[dim.dim_param]
    # Intermediate shapes are re-inferred after folding.
    del fixed.graph.value_info[:]
    return fixed


def set_ir_version(model: onnx.ModelProto) -> onnx.ModelProto:
    """Give the model the least IR version its opsets need (onnxruntime rejects newer ones)."""
    used = {node.domain or "" for node in model.graph.node} | {""}
    keep = [op for op in model.opset_import if (op.domain or "") in used]
    del model.opset_import[:]
    model.opset_import.extend(keep)
    needed = onnx.helper.find_min_ir_version_for(list(model.opset_import), ignore_unknown=True)
    model.ir_version = max(min(needed, MAX_IR_VERSION), 3)
    return model


def fold_constants(model_path: Path, out_path: Path) -> None:
    """Fold shape sub-computations and constants with onnxruntime's offline optimiser.

    The result is written to ``out_path`` with every initializer over 1 KiB in an
    external data file beside it.
    """
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    options.optimized_model_filepath = str(out_path)
    options.log_severity_level = 3
    options.add_session_config_entry(
        "session.optimized_model_external_initializers_file_name", out_path.name + ".data"
    )
    options.add_session_config_entry(
        "session.optimized_model_external_initializers_min_size_in_bytes", "1024"
    )
    try:
        ort.InferenceSession(str(model_path), options, providers=["CPUExecutionProvider"])
    except Exception as exc:  # onnxruntime raises several unrelated exception types
        raise ModelError(f"onnxruntime cannot load the model: {_first_line(exc)}") from exc


def infer_shapes(model: onnx.ModelProto) -> onnx.ModelProto:
    """onnx shape inference, strict, with data propagation for shape tensors."""
    try:
        return infer_with_contrib(model, lambda m: onnx.shape_inference.infer_shapes(m, strict_mode=True, data_prop=True))
    except (onnx.shape_inference.InferenceError, onnx.checker.ValidationError) as exc:
        raise ModelError(f"shape inference failed: {_first_line(exc)}") from exc


@dataclass
class CanonicalModel:
    """The model as the planner sees it.

    ``model`` has static shapes everywhere and no weight data loaded (initializers
    refer to ``path``'s external data); ``path`` is the canonical file on disk.
    """

    source: Path
    source_sha256: str
    dims: dict[str, int]
    path: Path
    model: onnx.ModelProto


def canonicalize(source: str | os.PathLike, dims: dict[str, int], workdir: str | os.PathLike) -> CanonicalModel:
    """Load, check, fix dims, fold and infer shapes; write the result under ``workdir``."""
    source = Path(source)
    workdir = Path(workdir)
    original = read_model(source, load_external_data=False)
    check_model(source)
    fixed = fix_dims(original, dims)
    # Load the weights only now, into the copy that goes to onnxruntime.
    if source.parent:
        try:
            onnx.external_data_helper.load_external_data_for_model(fixed, str(source.parent))
        except OSError as exc:
            raise ModelError(f"cannot read the model's external data: {_first_line(exc)}") from exc
    staged = workdir / "fixed.onnx"
    onnx.save_model(
        set_ir_version(fixed), str(staged), save_as_external_data=True,
        all_tensors_to_one_file=True, location="fixed.onnx.data", size_threshold=1024,
    )
    del fixed
    folded_path = workdir / "canonical.onnx"
    fold_constants(staged, folded_path)
    folded = onnx.load(str(folded_path), load_external_data=False)
    folded = set_ir_version(infer_shapes(folded))
    _name_nodes(folded)
    _require_static_shapes(folded)
    onnx.save_model(folded, str(folded_path))
    return CanonicalModel(
        source=source, source_sha256=file_sha256(source), dims=dict(dims),
        path=folded_path, model=folded,
    )


def _require_static_shapes(model: onnx.ModelProto) -> None:
    typed = {v.name: v for v in list(model.graph.value_info) + list(model.graph.output) + list(model.graph.input)}
    for node in model.graph.node:
        for name in node.output:
            if not name:
                continue
            value = typed.get(name)
            if value is None or not value.type.HasField("tensor_type") or not value.type.tensor_type.HasField("shape"):
                raise ModelError(
                    f"the shape of tensor '{name}' (output of {node.op_type} node '{node.name}') is unknown after shape inference"
                )
            for dim in value.type.tensor_type.shape.dim:
                if not dim.HasField("dim_value"):
                    raise ModelError(
                        f"tensor '{name}' (output of {node.op_type} node '{node.name}') has a dynamic dimension after folding",
                        hint="fix the model's symbolic dims with --dim NAME=INT",
                    )


def _name_nodes(model: onnx.ModelProto) -> None:
    """Give every node a unique name (plans refer to operators by name)."""
    seen: set[str] = set()
    for index, node in enumerate(model.graph.node):
        name = node.name or f"{node.op_type}_{index}"
        while name in seen:
            name = f"{name}_{index}"
        node.name = name
        seen.add(name)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0][:300]
