"""What a training step holds on each device at its peak, from the plan's layouts.

The stage DP's activation figure (the largest sum of one operator's operands) suits a
forward pass, whose tensors die within a layer or two; a training step keeps the forward
activations until the backward pass reads them, writes every weight's and slot's new
value (into the old one's buffer where nothing reads the old value afterwards:
``model.in_place``, as the job runs it; else beside it), and makes each gradient in its
weight's layout. So a training plan's memory is estimated by liveness over the step
program, in the order the program runs its nodes:

- a graph input (the batch, the hyperparameters, the weights and optimizer slots) is held
  for the whole step, an initializer (a frozen weight, a constant) for as long as its
  session lives: the whole step;
- a new weight or slot written in place adds nothing (its bytes are the old value's);
- an intermediate tensor lives from the node that makes it to its last reader, a program
  output (the loss, a new weight or slot) from the node that makes it to the end;
- each at its local size on the device: its producer's output layout (a weight's and
  slot's the layout the plan keeps it in), whole where partial.

The peak's bytes are split into weights (old and new values of the trained weights, and
the frozen ones), optimizer (old and new slots, running statistics), gradients (the
backward pass's tensors) and activations (the batch and the forward pass's tensors), plus
``PROCESS_BYTES``: what a rank's process holds before its programs run (the interpreter,
numpy, onnxruntime, MPI), measured on CPU as the resident set after those imports.
Copies made by resharding and onnxruntime's arena rounding are not counted.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from meshplan.intra.strategies import Strategy
from meshplan.model.graph import Graph
from meshplan.model.in_place import updates_in_place
from meshplan.sharding import LogicalMesh, ShardingSpec

MiB = 1 << 20
PROCESS_BYTES = 80 * MiB    # a rank's resident set once numpy, onnxruntime, onnx and mpi4py are loaded (CPU)
KINDS = ("weights", "optimizer", "gradients", "activations")


def step_memory(graph: Graph, strategies: Mapping[str, Strategy], state_specs: Mapping[str, ShardingSpec],
                mesh: LogicalMesh, weights: set[str]) -> dict[str, float]:
    """Bytes on one device of the stage at the step's liveness peak, by ``KINDS``, and
    ``process``. ``strategies``: node name → its strategy (absent: whole); ``state_specs``:
    state input → the layout it is kept in; ``weights``: the trained weights' names."""
    specs: dict[str, ShardingSpec] = dict(state_specs)
    for node in graph.nodes:
        chosen = strategies.get(node.name)
        if chosen is None:
            continue
        for name, spec in zip(node.outputs, chosen.outputs):
            if name and spec is not None:
                specs.setdefault(name, spec)
        for name, spec in zip(node.inputs, chosen.inputs):   # inputs and initializers: as first read
            if name and spec is not None and name not in specs:
                specs[name] = spec

    def local(name: str) -> float:
        info = graph.tensors[name]
        spec = specs.get(name)
        shape = info.shape if spec is None else spec.local_shape(info.shape, mesh)
        return float(np.prod(shape, dtype=np.float64)) * info.dtype.itemsize

    state_inputs = set(graph.state.values())
    base = {output: name for output, name in graph.state.items()}

    def kind(name: str) -> str:
        source = base.get(name, name)
        if source in state_inputs:
            return "weights" if source in weights else "optimizer"
        if graph.tensors[name].is_param:
            return "weights"
        return "gradients" if name.startswith("grad/") else "activations"

    in_place = updates_in_place([(n.op_type, n.inputs, n.outputs) for n in graph.nodes], graph.state,
                                outputs=graph.outputs)
    last_use: dict[str, int] = {}
    for index, node in enumerate(graph.nodes):
        for name in node.inputs:
            if name:
                last_use[name] = index
    outputs = set(graph.outputs)
    held = {k: 0.0 for k in KINDS}
    for name, info in graph.tensors.items():   # held throughout: inputs and initializers the step reads
        if (name in graph.inputs or info.is_param) and name in last_use:
            held[kind(name)] += local(name)
    peak, at_peak = sum(held.values()), dict(held)
    for index, node in enumerate(graph.nodes):
        for name in node.outputs:
            if name and name not in in_place:
                held[kind(name)] += local(name)
        total = sum(held.values())
        if total > peak:
            peak, at_peak = total, dict(held)
        for name in set(node.inputs) | set(node.outputs):
            if (name and name not in outputs and not graph.tensors[name].is_param and name not in graph.inputs
                    and last_use.get(name, index) <= index):
                held[kind(name)] -= local(name)
    return {**at_peak, "process": float(PROCESS_BYTES)}
