"""Load an ONNX model and bring it to the canonical form the planner works on.

Steps: read (without external data), check with onnx's checker, fix symbolic
dimensions from ``--dim NAME=INT``, fold what produces small tensors (``fold``: no
provider-specific casts or fusions, weights never read), check that onnxruntime loads
the graph, then run onnx's shape inference so that every tensor has a static shape.

The canonical model is written to a working directory with its large weights as
external data (``weights``); planning then reads it without weights, and emission
extracts each stage's subgraph from it.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from google.protobuf.message import DecodeError
from onnx import external_data_helper, numpy_helper

from meshplan.errors import ModelError
from meshplan.files import file_sha256
from meshplan.model.bounds import bound_dynamic_dims, read_bounds
from meshplan.model.fold import SMALL_ELEMENTS, first_line, fold_constants, infer_shapes, is_loaded
from meshplan.model.opsets import MAX_IR_VERSION, set_ir_version
from meshplan.model.ort_schemas import register_onnxruntime_schemas
from meshplan.model.sizes import input_dims as symbolic_dims   # the graph inputs' symbolic dims
from meshplan.model.weights import check_range, split_weights, write_weights

__all__ = ["MAX_IR_VERSION", "CanonicalModel", "canonicalize", "check_model", "fix_dims", "infer_shapes",
           "read_model", "set_ir_version", "symbolic_dims"]


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
        raise ModelError(f"not an ONNX model: {path} ({first_line(exc)})") from exc
    except OSError as exc:
        raise ModelError(f"cannot read model {path}: {first_line(exc)}") from exc
    if not model.graph.node:
        raise ModelError(f"not an ONNX model (no graph nodes): {path}")
    return model


def check_model(path: str | os.PathLike) -> None:
    """Run onnx's checker on a file path (the path form handles models over 2 GB). Models
    before IR 4 must list their initializers as graph inputs, and many do not although
    onnxruntime runs them: such a model is checked as if it listed them. Operators that
    onnxruntime defines in the default domain (SimplifiedLayerNormalization) are checked
    against onnxruntime's schemas (``ort_schemas``)."""
    register_onnxruntime_schemas()
    try:
        onnx.checker.check_model(str(path))
    except (onnx.checker.ValidationError, DecodeError, ValueError) as exc:
        header = _old_ir_with_inputs_added(path, exc)
        if header is None:
            raise ModelError(f"model {path} fails the ONNX checker: {first_line(exc)}") from exc
        try:
            onnx.checker.check_model(header)
        except (onnx.checker.ValidationError, ValueError) as again:
            raise ModelError(f"model {path} fails the ONNX checker: {first_line(again)}") from again


def _check_header(model: onnx.ModelProto, path: Path) -> None:
    """onnx's checker on the graph alone (its external data files are not looked at)."""
    register_onnxruntime_schemas()
    header = onnx.ModelProto()
    header.CopyFrom(model)
    unread = [t for t in header.graph.initializer if not is_loaded(t)]
    declared = {value.name for value in header.graph.input}
    # graph inputs in their place, so that the checker does not look for the files
    header.graph.input.extend(onnx.helper.make_tensor_value_info(t.name, t.data_type, list(t.dims))
                              for t in unread if t.name not in declared)
    kept = [t for t in header.graph.initializer if is_loaded(t)]
    del header.graph.initializer[:]
    header.graph.initializer.extend(kept)
    try:
        onnx.checker.check_model(header)
    except (onnx.checker.ValidationError, ValueError) as exc:
        raise ModelError(f"model {path} fails the ONNX checker: {first_line(exc)}") from exc


def _old_ir_with_inputs_added(path, exc: Exception) -> onnx.ModelProto | None:
    """The graph (weights not loaded) of an IR < 4 model whose checker failure is only
    "in initializer but not in graph input", with those initializers added as inputs."""
    if "in initializer but not in graph input" not in str(exc):
        return None
    header = onnx.load(str(path), load_external_data=False)
    if header.ir_version >= 4:
        return None
    listed = {v.name for v in header.graph.input}
    for tensor in header.graph.initializer:
        if tensor.name not in listed:
            header.graph.input.append(onnx.helper.make_tensor_value_info(tensor.name, tensor.data_type, list(tensor.dims)))
    return header


def fix_dims(model: onnx.ModelProto, dims: dict[str, int], symbolic: tuple[str, ...] = ()) -> onnx.ModelProto:
    """Return a copy whose graph inputs/outputs have the named dims set to integers.

    Unknown names in ``dims`` and symbolic dims left unset (other than ``symbolic``, which
    stay symbolic: ranged and derived dims) are errors naming them. A size may be 0.
    """
    present = symbolic_dims(model)
    unknown = sorted(set(dims) - set(present))
    if unknown:
        have = ", ".join(sorted(present)) or "none"
        raise ModelError(f"unknown dimension {unknown[0]!r} in --dim (the model's symbolic dims: {have})")
    missing = sorted(set(present) - set(dims) - set(symbolic))
    if missing:
        name = missing[0]
        raise ModelError(
            f"dimension {name!r} of input '{present[name][0]}' is unknown",
            hint=f"fix it with --dim {name}=INT",
        )
    for name, value in dims.items():
        if value < 0:
            raise ModelError(f"dimension {name!r} cannot be negative, got {value}")
    fixed = onnx.ModelProto()
    fixed.CopyFrom(model)
    for value in list(fixed.graph.input) + list(fixed.graph.output) + list(fixed.graph.value_info):
        for dim in value.type.tensor_type.shape.dim:
            if dim.HasField("dim_param") and dim.dim_param in dims:
                dim.dim_value = dims[dim.dim_param]
    # Intermediate shapes are re-inferred after folding.
    del fixed.graph.value_info[:]
    return fixed


def check_loads_in_onnxruntime(model: onnx.ModelProto) -> None:
    """Create an onnxruntime CPU session for the graph, its unread weights as graph inputs,
    so that a model onnxruntime rejects fails here with one line."""
    import onnxruntime as ort

    from meshplan.providers import session_options

    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    unread = [t for t in probe.graph.initializer if not is_loaded(t)]
    declared = {value.name for value in probe.graph.input}
    probe.graph.input.extend(onnx.helper.make_tensor_value_info(t.name, t.data_type, list(t.dims))
                             for t in unread if t.name not in declared)
    kept = [t for t in probe.graph.initializer if is_loaded(t)]
    del probe.graph.initializer[:]
    probe.graph.initializer.extend(kept)
    options = session_options()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.log_severity_level = 4   # its errors become ModelError lines
    try:
        ort.InferenceSession(set_ir_version(probe).SerializeToString(), options, providers=["CPUExecutionProvider"])
    except Exception as exc:  # onnxruntime raises several unrelated exception types
        raise ModelError(f"onnxruntime cannot load the model: {first_line(exc)}") from exc


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


# f(folded model, read): rewrites the folded model in place; read(initializer) gives its value
Rewrite = Callable[[onnx.ModelProto, Callable[[onnx.TensorProto], np.ndarray]], None]


WEIGHT_MODES = ("read", "unread", "absent")


def read_checked(source: Path, weights: str) -> onnx.ModelProto:
    """The model's graph (weights not loaded), checked as ``weights`` allows (see
    ``canonicalize``): with its external data files, with them only checked to be there
    and long enough, or with the graph alone."""
    if weights not in WEIGHT_MODES:
        raise ValueError(f"weights must be one of {WEIGHT_MODES}, got {weights!r}")
    original = read_model(source, load_external_data=False)
    if weights == "absent":
        _check_header(original, source)
        return original
    if weights == "unread":
        for tensor in original.graph.initializer:
            if not is_loaded(tensor):
                try:
                    check_range(tensor, source.parent)    # there and long enough; never read
                except ModelError as exc:
                    raise ModelError(str(exc), hint="--shapes-only plans without the weight files") from None
    check_model(source)
    return original


def canonicalize(source: str | os.PathLike, dims: dict[str, int], workdir: str | os.PathLike,
                 rewrite: Rewrite | None = None, weights: str = "read") -> CanonicalModel:
    """Load, check, fix dims, fold and infer shapes; write the result under ``workdir``.

    ``rewrite`` (a static batch cut to the microbatch size) changes the folded model
    before it is checked and written.

    ``weights`` says what may be done with the external data: ``"read"`` (programs will
    be emitted: the canonical model's weights are placed beside it, small ones read for
    folding); ``"unread"`` (a plan without programs: the external data files are checked
    to be there and long enough, but not a byte of them is read, so a sparse file does);
    ``"absent"`` (the files need not exist: the model is planned from its shapes alone).
    Without weights, small initializers stored externally are not folded, and the
    canonical model's weights are left unplaced: it serves planning only."""
    source = Path(source)
    workdir = Path(workdir)
    canonical, path = canonical_graph(source, dims, (), workdir, weights, rewrite)
    # a sample run needs the weights: without them an unbounded dim stays an error
    bound_dynamic_dims(canonical, _unbounded, lambda: _sample_shapes(canonical, workdir) if weights == "read" else {})
    _require_static_shapes(canonical)
    onnx.save_model(canonical, str(path))
    return CanonicalModel(
        source=source, source_sha256=file_sha256(source), dims=dict(dims),
        path=path, model=canonical,
    )


def canonical_graph(source: Path, dims: dict[str, int], symbolic: tuple[str, ...], workdir: Path, weights: str,
                    rewrite: Rewrite | None = None) -> tuple[onnx.ModelProto, Path]:
    """The steps every canonical model shares: read and check ``source``, fix ``dims``
    (``symbolic`` dims stay symbolic), fold, apply ``rewrite``, place parameters, check that
    onnxruntime loads it, write its weights beside ``workdir/canonical.onnx`` (with
    ``weights="read"``; one tensor at a time, never all held) and infer shapes. Returns the
    model, not yet saved, and the path it is to be saved at."""
    original = read_checked(source, weights)
    model = fix_dims(original, dims, symbolic)
    del original
    held = split_weights(model, source.parent, SMALL_ELEMENTS, read_external=weights == "read")
    fold_constants(model, SMALL_ELEMENTS)
    if rewrite is not None:
        name_nodes(model)   # so that what the rewrite refuses is named
        rewrite(model, _reader(held, source.parent))
    place_parameter_nodes(model)
    check_loads_in_onnxruntime(model)
    workdir.mkdir(parents=True, exist_ok=True)
    if weights == "read":
        write_weights(model, held, source.parent, workdir / "canonical.onnx.data")
    del held
    canonical = set_ir_version(infer_shapes(model))
    name_nodes(canonical)
    _require_tensors(canonical)
    return canonical, workdir / "canonical.onnx"


def _reader(held: dict[str, bytes], source_dir: Path) -> Callable[[onnx.TensorProto], np.ndarray]:
    """The value of an initializer of the folded model: loaded, held aside, or read from
    the source's external data (one tensor at a time)."""
    def read(tensor: onnx.TensorProto) -> np.ndarray:
        if is_loaded(tensor):
            return numpy_helper.to_array(tensor)
        copy = onnx.TensorProto()
        copy.CopyFrom(tensor)
        del copy.external_data[:]
        copy.data_location = onnx.TensorProto.DEFAULT
        if tensor.name in held:
            copy.raw_data = held[tensor.name]
        else:
            copy.CopyFrom(tensor)
            try:
                external_data_helper.load_external_data_for_tensor(copy, str(source_dir))
            except (OSError, ValueError, onnx.checker.ValidationError) as exc:
                raise ModelError(f"cannot read the model's external data: {first_line(exc)}") from exc
            del copy.external_data[:]
            copy.data_location = onnx.TensorProto.DEFAULT
        return numpy_helper.to_array(copy)

    return read


def place_parameter_nodes(model: onnx.ModelProto) -> None:
    """Move each node that computes from initializers alone (a parameter: a weight made by
    ConstantOfShape, a Transpose of a weight) to just before the first node that reads it;
    every other node keeps the model's order (the planner clusters layers in this order)."""
    static = {t.name for t in model.graph.initializer}
    deferred: dict[str, onnx.NodeProto] = {}   # output name → parameter node not placed yet
    ordered: list[onnx.NodeProto] = []

    def place(node: onnx.NodeProto) -> None:
        for name in node.input:
            producer = deferred.pop(name, None)
            if producer is not None:
                for other in producer.output:
                    deferred.pop(other, None)
                place(producer)
        ordered.append(node)

    for node in model.graph.node:
        if all(name in static for name in node.input if name):
            static.update(node.output)
            deferred.update((name, node) for name in node.output if name)
        else:
            place(node)
    for node in model.graph.node:   # parameters only graph outputs read, in model order
        if any(deferred.get(name) is node for name in node.output):
            place(node)
            for name in node.output:
                deferred.pop(name, None)
    del model.graph.node[:]
    model.graph.node.extend(ordered)


STATIC_SHAPES_HINT = ("meshplan plans static shapes, and data-dependent ones with an upper bound (NonZero, Compress, "
                      "Unique, TopK, NonMaxSuppression and what they flow into); this one is not known from the input "
                      "shapes alone: it depends on tensor values, or onnx's shape inference cannot follow it")


def _require_tensors(model: onnx.ModelProto) -> None:
    typed = {v.name: v for v in list(model.graph.value_info) + list(model.graph.output) + list(model.graph.input)}
    for node in model.graph.node:
        for name in node.output:
            value = typed.get(name) if name else None
            kind = value.type.WhichOneof("value") if value is not None else None
            if kind in ("sequence_type", "optional_type", "map_type"):
                what = {"sequence_type": "a sequence", "optional_type": "an optional", "map_type": "a map"}[kind]
                raise ModelError(f"value '{name}' (output of {node.op_type} node '{node.name}') is {what}, "
                                 "not a tensor: meshplan plans tensors only")


def _sample_shapes(model: onnx.ModelProto, workdir: Path) -> dict[str, tuple[int, ...]]:
    """The shape of every node output in one onnxruntime CPU run of ``model`` (its weights in
    ``workdir``) on random inputs (``inputs.random_inputs``); empty where the run fails."""
    import onnxruntime as ort

    from meshplan.model.inputs import random_inputs
    from meshplan.providers import session_options

    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    typed = {v.name: v for v in list(probe.graph.value_info) + list(probe.graph.output)}
    declared = {v.name for v in probe.graph.output}
    for node in probe.graph.node:
        for name in node.output:
            value = typed.get(name)
            if name and name not in declared and value is not None and value.type.HasField("tensor_type"):
                probe.graph.output.append(onnx.helper.make_tensor_value_info(name, value.type.tensor_type.elem_type, None))
                declared.add(name)
    path = workdir / "sample-run.onnx"
    try:
        onnx.save_model(probe, str(path))
        options = session_options()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        options.log_severity_level = 4   # a failing run is an answer here, not something to print
        session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        quiet = ort.RunOptions()
        quiet.log_severity_level = 4
        names = [o.name for o in session.get_outputs()]
        values = session.run(names, random_inputs(model, {}), quiet)
        return {name: tuple(np.shape(value)) for name, value in zip(names, values)}
    except Exception:  # onnxruntime raises several unrelated exception types; so may random inputs
        return {}
    finally:
        path.unlink(missing_ok=True)


def _unbounded(node: onnx.NodeProto, name: str) -> None:
    raise ModelError(f"tensor '{name}' (output of {node.op_type} node '{node.name}') has a dynamic dimension after "
                     "folding, with no known upper bound (and a sample run did not give it)", hint=STATIC_SHAPES_HINT)


def _require_static_shapes(model: onnx.ModelProto) -> None:
    """Every node output is a tensor with a known shape: each dim a number, or a
    data-dependent symbol with a bound (``bounds``)."""
    _require_tensors(model)
    bounds = read_bounds(model)
    typed = {v.name: v for v in list(model.graph.value_info) + list(model.graph.output) + list(model.graph.input)}
    for node in model.graph.node:
        for name in node.output:
            if not name:
                continue
            value = typed.get(name)
            # Every input dim is fixed by now (fix_dims): what is still unknown depends on
            # tensor values (an input read as a shape, axes or a size) with no bound, or is
            # beyond onnx's shape inference.
            if value is None or not value.type.HasField("tensor_type") or not value.type.tensor_type.HasField("shape"):
                raise ModelError(
                    f"the shape of tensor '{name}' (output of {node.op_type} node '{node.name}') is unknown after shape "
                    "inference", hint=STATIC_SHAPES_HINT)
            for dim in value.type.tensor_type.shape.dim:
                if not dim.HasField("dim_value") and dim.dim_param not in bounds:
                    _unbounded(node, name)


def name_nodes(model: onnx.ModelProto) -> None:
    """Give every node a unique name (plans, and a training pipeline's stages, refer to
    operators by name); a node's own name is kept where it is one of a kind."""
    seen: set[str] = set()
    for index, node in enumerate(model.graph.node):
        name = node.name or f"{node.op_type}_{index}"
        while name in seen:
            name = f"{name}_{index}"
        node.name = name
        seen.add(name)
