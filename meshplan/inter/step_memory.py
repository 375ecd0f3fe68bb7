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
  slot's the layout the plan keeps it in), whole where partial;
- a tensor a node reads in another layout than it was made in is resharded: that copy, at
  its local size in the reader's layout, lives from the first node that reads it so to the
  last (a weight split over the mesh and gathered whole for the forward is held until the
  backward's product has read it too), counted with the tensor's own kind.

The peak's bytes are split into weights (the trained weights, their new values where not
written in place, their resharded copies, and the frozen ones), optimizer (the slots,
running statistics), gradients (the backward pass's tensors) and activations (the batch
and the forward pass's tensors), plus ``PROCESS_BYTES``: what a rank's process holds once
its job has opened its sessions, before a step runs (the interpreter, numpy, onnxruntime
and its sessions, MPI), measured on CPU as the resident set then: 91–93 MiB for the sample
MLP's training rank, 104–106 MiB for a 30 M-parameter GPT's (one rank or two). onnxruntime's
arena (the blocks it keeps beyond the live tensors) is not counted.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from meshplan.intra.strategies import Strategy
from meshplan.model.graph import Graph
from meshplan.model.in_place import updates_in_place
from meshplan.sharding import LogicalMesh, ShardingSpec

MiB = 1 << 20
PROCESS_BYTES = 100 * MiB   # a rank's resident set once its job's sessions are open (CPU)
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

    def local(name: str, spec: ShardingSpec | None = None) -> float:
        info = graph.tensors[name]
        spec = specs.get(name) if spec is None else spec
        shape = info.shape if spec is None else spec.local_shape(info.shape, mesh)
        return float(np.prod(shape, dtype=np.float64)) * info.dtype.itemsize

    # resharded copies: (tensor, the layout its readers take) → [first reader, last reader, bytes];
    # a tensor itself is needed until its last reader in its own layout and until each copy is made
    copies: dict[tuple[str, str], list] = {}
    last_use: dict[str, int] = {}
    for index, node in enumerate(graph.nodes):
        chosen = strategies.get(node.name)
        wanted = list(chosen.inputs) if chosen is not None else []
        for i, name in enumerate(node.inputs):
            if not name:
                continue
            spec, made = (wanted[i] if i < len(wanted) else None), specs.get(name)
            if made is None or spec is None or spec.normalised(mesh) == made.normalised(mesh):
                last_use[name] = index
                continue
            copy = copies.setdefault((name, str(spec.normalised(mesh))), [index, index, local(name, spec)])
            copy[1] = index
            last_use[name] = max(last_use.get(name, -1), copy[0])
    opening: dict[int, list] = {}
    closing: dict[int, list] = {}
    for (name, _), (first, last, size) in copies.items():
        opening.setdefault(first, []).append((name, size))
        closing.setdefault(last, []).append((name, size))

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
    outputs = set(graph.outputs)
    released: set[str] = set()
    held = {k: 0.0 for k in KINDS}
    for name, info in graph.tensors.items():   # held throughout: inputs and initializers the step reads
        if (name in graph.inputs or info.is_param) and name in last_use:
            held[kind(name)] += local(name)
    peak, at_peak = sum(held.values()), dict(held)
    for index, node in enumerate(graph.nodes):
        for name in node.outputs:
            if name and name not in in_place:
                held[kind(name)] += local(name)
        for name, size in opening.get(index, ()):
            held[kind(name)] += size
        total = sum(held.values())
        if total > peak:
            peak, at_peak = total, dict(held)
        for name in set(node.inputs) | set(node.outputs):
            if (name and name not in released and name not in outputs and not graph.tensors[name].is_param
                    and name not in graph.inputs and last_use.get(name, index) <= index):
                held[kind(name)] -= local(name)
                released.add(name)
        for name, size in closing.get(index, ()):
            held[kind(name)] -= size
    return {**at_peak, "process": float(PROCESS_BYTES)}
