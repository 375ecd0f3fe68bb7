"""A tensor-parallel pipeline's parts: each rank's program of the whole training step, cut
into its stages' forward, backward, norm, clip and update.

Where each stage of a pipeline has T devices that shard its operators (``meshplan plan
--train --stages S --tensor-parallel T``), the sharding ILP runs once over the whole step
(forward, backward and update, every stage's) on a [1, T] mesh, and the emitter writes one
program for each of the T coordinates (``emit.programs``). Since every stage's mesh has that
same shape, coordinate j's program cut along the stages and phases of the step
(``training.pipeline_step``) gives the parts that device j of every stage runs: what one
stage's device j hands on is what the next stage's device j reads, in the layout the ILP
chose, so a crossing goes from device j to device j and needs no resharding of its own.

The program's compute nodes keep the step's node names, so they go where the step placed
them. The nodes the emitter inserted (collectives, local slices, shape rewrites) go with what
they read: after the node that made their input, in its stage and phase; one that reads only
the program's inputs (a weight's all-gather, the slice of a data input) is made again in
every stage and phase that reads it, so that a weight gathered for the forward is gathered
again for the backward instead of being held in between. The program's inputs and outputs
take back their global names (a weight's shard is fed as the weight), so that a stage holds
its state as any stage does, in its shards.
"""

from __future__ import annotations

from collections import defaultdict

import onnx

from meshplan.errors import TrainError
from meshplan.training.losses import LOSS
from meshplan.training.pipeline_step import PHASES, PipelineStep, _parts
from meshplan.training.step_model import StepModel


def rank_pipeline(program: onnx.ModelProto, pipeline: PipelineStep, inputs: dict[str, str],
                  outputs: dict[str, str]) -> PipelineStep:
    """The parts of one rank's ``program`` (the step sharded on a [1, T] mesh) for the stages
    of ``pipeline`` (the step cut as one device a stage has it: its placement, homes and
    phases); ``inputs`` and ``outputs``: the program's local names of the step's inputs and
    outputs, by global name. Raises ``TrainError`` where a node cannot be placed."""
    model = onnx.ModelProto()
    model.CopyFrom(program)
    _rename(model, {local: name for name, local in list(inputs.items()) + list(outputs.items())})
    nodes, placement, copies = _placed(list(model.graph.node), pipeline.placement, pipeline.step)
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    typed = {v.name: v for v in model.graph.value_info}
    for (name, _), copy in copies.items():   # each copy of a tensor typed as the tensor
        if copy != name and name in typed:
            value = onnx.ValueInfoProto()
            value.CopyFrom(typed[name])
            value.name = copy
            model.graph.value_info.append(value)
    step = StepModel(model, pipeline.step.state, pipeline.step.manifest, pipeline.step.roles, pipeline.step.origin,
                     pipeline.step.gradients)
    found = _parts(step, nodes, placement, pipeline.home, pipeline.stages, pipeline.data_inputs,
                   pipeline.controls, bool(pipeline.recomputed))
    found.chunks = {}      # (an update with collectives runs whole)
    producer = {o: n for n in nodes for o in n.output if o}
    loss = producer.get(LOSS)
    found.loss_count = loss.input[1] if loss is not None and loss.op_type == "Div" else None
    return found


def same_structure(first: PipelineStep, other: PipelineStep) -> bool:
    """Whether two ranks' cuts have the same parts, inputs, outputs and crossings (the
    instruction lists of one stage serve all its devices)."""
    if first.crossings != other.crossings or set(first.parts) != set(other.parts):
        return False
    return all(first.parts[k].inputs == other.parts[k].inputs and first.parts[k].outputs == other.parts[k].outputs
               for k in first.parts)


def _rename(model: onnx.ModelProto, names: dict[str, str]) -> None:
    """Every tensor ``names`` maps, renamed throughout ``model``'s graph; a tensor the graph
    makes under a name given to another (a weight gathered whole under the weight's own name,
    while its shard comes in as the input) becomes ``NAME@whole``."""
    names = {old: new for old, new in names.items() if old != new}
    if not names:
        return
    graph = model.graph
    taken = set(names.values())
    names.update({o: f"{o}@whole" for node in graph.node for o in node.output if o in taken and o not in names})
    for node in graph.node:
        for k, name in enumerate(node.input):
            if name in names:
                node.input[k] = names[name]
        for k, name in enumerate(node.output):
            if name in names:
                node.output[k] = names[name]
    for value in list(graph.input) + list(graph.output) + list(graph.value_info):
        if value.name in names:
            value.name = names[value.name]
    for tensor in graph.initializer:
        if tensor.name in names:
            tensor.name = names[tensor.name]


def _placed(nodes: list, placement: dict, step: StepModel) -> tuple[list, dict, dict]:
    """``nodes`` (a program's, in order) with every inserted node placed: the step's nodes
    where ``placement`` puts them (its shared nodes stay unplaced: each part that reads them
    computes them); an inserted node with the first placed thing it reads, or, reading only
    inputs, copied into each place that reads it (see the module). Returns the nodes, the
    place of each and the name of each copy of a tensor by (tensor, place)."""
    step_nodes = {n.name for n in step.model.graph.node}
    producer = {o: n for n in nodes for o in n.output if o}
    where: dict[str, tuple[int, str]] = {}
    rooted: set[str] = set()        # inserted nodes that read only inputs (through each other)
    for node in nodes:
        if node.name in step_nodes:
            if node.name in placement:
                where[node.name] = placement[node.name]
            continue
        place = None
        for name in node.input:
            made = producer.get(name)
            if made is not None and made.name in where:
                place = where[made.name]
                break
        if place is not None:
            where[node.name] = place
        else:
            rooted.add(node.name)
    # the places that read each rooted node's outputs (through rooted and shared nodes)
    readers = defaultdict(list)
    for node in nodes:
        for name in node.input:
            if name:
                readers[name].append(node)
    graph_outputs = {v.name for v in step.model.graph.output}
    wanted: dict[str, set] = {}
    for node in reversed(nodes):
        if node.name in where:
            continue
        found = set()
        for out in node.output:
            for reader in readers.get(out, ()):
                if reader.name in where:
                    found.add(where[reader.name])
                else:
                    found.update(wanted.get(reader.name, ()))
            if out in graph_outputs and node.name in rooted:
                raise TrainError(f"the step's output '{out}' is made from its inputs alone by '{node.name}'")
        wanted[node.name] = found
    # copies of the rooted nodes, one each place that reads them
    copies: dict[tuple[str, tuple], str] = {}     # (tensor, place) → the copy's name of it
    split: set[str] = set()                        # tensors made again under other names
    out_nodes, places = [], {}
    made_again: set[str] = set()                   # the copies' names
    for node in nodes:
        if node.name in rooted:
            targets = sorted(wanted.get(node.name, ()), key=_order)
            for place in targets:
                copy = onnx.NodeProto()
                copy.CopyFrom(node)
                suffix = "" if len(targets) == 1 else f"/{place[0]}.{place[1]}"
                copy.name = node.name + suffix
                for k, name in enumerate(copy.input):
                    copy.input[k] = copies.get((name, place), name)
                for k, name in enumerate(copy.output):
                    if name:
                        copies[(name, place)] = name + suffix
                        copy.output[k] = name + suffix
                        if suffix:
                            split.add(name)
                out_nodes.append(copy)
                places[copy.name] = place
                made_again.add(copy.name)
            continue
        if node.name in where:
            place = where[node.name]
            for k, name in enumerate(node.input):
                node.input[k] = copies.get((name, place), name)
            places[node.name] = place
        elif any(i in split for i in node.input):
            raise TrainError(f"node '{node.name}' reads '{next(i for i in node.input if i in split)}', made again in "
                             "each stage that reads it, but is computed in every part")
        out_nodes.append(node)
    return _just_in_time(out_nodes, made_again), places, copies


def _just_in_time(nodes: list, moved: set[str]) -> list:
    """``nodes`` with each of ``moved`` (the copies of nodes that read only inputs: a weight's
    all-gather) put right before the first node that reads it, rather than where the emitter
    put it (before everything that does not wait on it): a run gathers a weight when it is
    about to use it, and lets it go after, instead of holding every gathered weight from its
    start (``ProgramRunner.run(release=True)``)."""
    producer = {o: n for n in nodes if n.name in moved for o in n.output if o}
    placed: set[str] = set()
    ordered = []

    def put(node) -> None:
        for name in node.input:
            made = producer.get(name)
            if made is not None and made.name not in placed:
                placed.add(made.name)
                put(made)
        ordered.append(node)

    for node in nodes:
        if node.name in moved:
            continue
        put(node)
    ordered.extend(n for n in nodes if n.name in moved and n.name not in placed)
    return ordered


def _order(place: tuple[int, str]) -> tuple[int, int]:
    return place[0], PHASES.index(place[1])


__all__ = ["rank_pipeline", "same_structure"]
