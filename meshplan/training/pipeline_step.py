"""A training step cut into pipeline stages: each stage's forward, backward and update as
programs of their own, and the tensors that cross between them.

``split_step`` takes the step model (``step_model.build_step_model`` with ``stages`` > 1, so
that gradients accumulate over microbatches) and the stage of each node of the forward
model (the inter-op pass's answer: contiguous layer ranges), and places every node of the
step, as Alpa places a backward layer on its forward layer's submesh:

- a forward node where it is given; a node the step added to the forward graph (the loss,
  a tied weight's copy) after the nodes it reads, or, reading only weights, before the node
  that reads it;
- a backward node with the forward node it differentiates (``StepModel.origin``); the sum
  of a weight's gradient addends with the weight;
- an update node with the one weight whose values it reads (its slots, its gradient); one
  that reads several weights' (the global norm of the gradients) on the last stage; one
  computed from the hyperparameters alone is computed in every part that reads it.

A weight lives on the first stage that reads it (its **home**: its slots, its accumulated
gradient and its update live there too); a later stage that reads it too (a tied embedding
read by the head) receives it with the activations, and sends its gradient back. Each
stage's nodes fall into five **phases**, each a program (a ``Part``):

- ``forward`` and ``backward``: once per microbatch. The backward program also accumulates
  the microbatch's weight gradients (and, on the last stage, the loss's sum and count);
- ``norm`` (each stage, once per step after the last microbatch): its gradients' squares,
  summed into one partial per stage;
- ``clip`` (the last stage): the global norm from the partials, the clipping factor;
- ``update`` (each stage): the optimizer.

A tensor one stage makes and another reads is a ``Crossing`` (an activation forward, a
gradient backward, a scalar of the update). Within a stage, what the forward program makes
and the backward reads is kept between them (the activations in flight that 1F1B bounds).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import onnx
from onnx import helper
from onnx.utils import Extractor

from meshplan.errors import TrainError
from meshplan.training.autodiff import WEIGHT, tensor_types
from meshplan.training.losses import LOSS
from meshplan.training.optimizers import ACC_COUNT, ACC_TOTAL, GRAD_ACC, GRAD_NORM, slot, updated
from meshplan.training.step_model import BACKWARD, FORWARD, StepModel

NORM, CLIP, UPDATE_PHASE = "norm", "clip", "update"
PHASES = (FORWARD, BACKWARD, NORM, CLIP, UPDATE_PHASE)
STATE = "state"    # Crossing.made_in of a state input another stage reads (sent once a step)
PER_MICROBATCH = (FORWARD, BACKWARD)


@dataclass
class Part:
    """One stage's program for one phase."""

    stage: int
    phase: str
    model: onnx.ModelProto
    inputs: list[str]
    outputs: list[str]


@dataclass(frozen=True)
class Crossing:
    """Tensor ``tensor``, made by stage ``src``'s ``made_in`` phase, read by stage ``dst``'s
    ``read_in`` phases."""

    tensor: str
    src: int
    made_in: str
    dst: int
    read_in: tuple[str, ...]


@dataclass
class PipelineStep:
    stages: int
    parts: dict[tuple[int, str], Part]
    crossings: list[Crossing]
    home: dict[str, int]                   # each state input: the stage that holds it
    placement: dict[str, tuple[int, str]]  # node name → (stage, phase); shared nodes absent
    step: StepModel
    data_inputs: list[str] = field(default_factory=list)
    controls: list[str] = field(default_factory=list)


def split_step(step: StepModel, forward_stage: dict[str, int], stages: int) -> PipelineStep:
    """``step`` in ``stages`` pipeline stages; ``forward_stage``: the stage of each node of the
    forward model (by name; stages in the forward graph's order). Raises ``TrainError`` where
    the step cannot be cut so."""
    manifest = step.manifest
    if not manifest.get("accumulators"):
        raise TrainError("a pipelined training step accumulates its gradients: build it with stages > 1")
    if stages < 2:
        raise TrainError(f"a pipeline has two or more stages, not {stages}")
    graph = step.model.graph
    nodes = list(graph.node)
    names = [n.name for n in nodes]
    if len(set(names)) != len(names) or not all(names):
        raise TrainError("the step's nodes need names of their own")
    bad = sorted({s for s in forward_stage.values() if not 0 <= s < stages})
    if bad:
        raise TrainError(f"stage {bad[0]} is not one of the {stages} stages")
    last = stages - 1
    weights = list(manifest["weights"])
    state_inputs = set(step.state.values())
    controls = list(manifest["hyperparameters"])
    constants = {t.name for t in graph.initializer}
    data_inputs = [v.name for v in graph.input if v.name not in state_inputs and v.name not in controls
                   and v.name not in constants]
    producer = {o: n for n in nodes for o in n.output if o}
    readers = defaultdict(list)
    for node in nodes:
        for name in node.input:
            if name:
                readers[name].append(node)

    # the state's owners: a weight, its slots and accumulated gradient belong to the weight
    owner: dict[str, str] = {}
    for w in weights:
        owner[w] = w
        for kind in manifest["slots"]:
            owner[slot(w, kind)] = w

    stage_of: dict[str, int] = {}
    free: set[str] = set()          # nodes computed from controls and constants alone

    def located(node) -> list[int]:
        found = []
        for name in node.input:
            made = producer.get(name)
            if made is not None and made.name in stage_of:
                found.append(stage_of[made.name])
        return found

    def is_free(node) -> bool:
        return all(not i or i in controls or i in constants or (i in producer and producer[i].name in free)
                   for i in node.input)

    # forward: given, else after what it reads, else before what reads it
    role = step.roles
    forward = [n for n in nodes if role.get(n.name) == FORWARD]
    deferred = []
    for node in forward:
        if node.name in forward_stage:
            stage_of[node.name] = forward_stage[node.name]
        elif located(node):
            stage_of[node.name] = max(located(node))
        elif is_free(node):
            free.add(node.name)
        else:
            deferred.append(node)
    for node in reversed(deferred):
        later = [stage_of[r.name] for out in node.output for r in readers.get(out, []) if r.name in stage_of]
        stage_of[node.name] = min(later) if later else 0
    for node in forward:   # in the forward graph's order: a stage never reads a later one's
        for name in node.input:
            made = producer.get(name)
            if made is not None and made.name in stage_of and node.name in stage_of \
                    and stage_of[made.name] > stage_of[node.name]:
                raise TrainError(f"node '{node.name}' on stage {stage_of[node.name]} reads '{name}' from the "
                                 f"later stage {stage_of[made.name]}: stages must follow the forward graph's order")
    home: dict[str, int] = {}
    for w in weights + [s for s in state_inputs if s not in owner]:
        found = [stage_of[r.name] for r in readers.get(w, []) if r.name in stage_of]
        home[w] = min(found) if found else last
    for name, w in owner.items():
        home[name] = home[w]
    for name in (ACC_TOTAL, ACC_COUNT):
        home[name] = last

    # backward: with the forward node it differentiates, a weight's sum with the weight
    gradient_of = {}
    for node in nodes:
        if role.get(node.name) != BACKWARD:
            continue
        origin = step.origin.get(node.name, "")
        if origin.startswith(WEIGHT):
            w = origin[len(WEIGHT):]
            stage_of[node.name] = home.get(w, last)
            for out in node.output:
                gradient_of[out] = w
        elif origin in stage_of:
            stage_of[node.name] = stage_of[origin]
        elif located(node):
            stage_of[node.name] = max(located(node))
        else:
            free.add(node.name)
    for node in nodes:   # addends all from one later stage: summed there, one tensor crosses
        if role.get(node.name) == BACKWARD and node.op_type == "Sum" and node.name in stage_of:
            found = set(located(node))
            if len(found) == 1 and len(located(node)) == len(node.input) and found != {stage_of[node.name]}:
                stage_of[node.name] = found.pop()
    for name, w in gradient_of.items():
        owner[name] = w
    for w, name in step.gradients.items():
        owner[name] = w

    # update: with its weight; several weights' on the last stage
    per_mb_outputs = {updated(slot(w, GRAD_ACC)) for w in weights} | {updated(ACC_TOTAL), updated(ACC_COUNT), LOSS}
    update_nodes = [n for n in nodes if role.get(n.name) not in (FORWARD, BACKWARD)]
    shared: set[str] = set()        # read several weights' values
    for node in update_nodes:
        owners = {owner[i] for i in node.input if i in owner}
        if len(owners) == 1:
            w = owners.pop()
            stage_of[node.name] = home[w]
            for out in node.output:
                owner[out] = w
        elif owners:
            stage_of[node.name] = last
            shared.add(node.name)
        elif is_free(node):
            free.add(node.name)
        else:
            found = located(node) + [home[i] for i in node.input if i in home]
            stage_of[node.name] = max(found) if found else last
    per_mb = _ancestors(per_mb_outputs, producer, {n.name for n in update_nodes})
    before_norm = _ancestors({GRAD_NORM}, producer, {n.name for n in update_nodes})
    after_shared = _descendants(shared, nodes, {n.name for n in update_nodes})
    phase_of: dict[str, str] = {}
    for node in nodes:
        if node.name in free:
            continue
        kind = role.get(node.name)
        if kind in (FORWARD, BACKWARD):
            phase_of[node.name] = kind
        elif node.name in per_mb:
            phase_of[node.name] = BACKWARD
        elif node.name in shared or (node.name in after_shared and not any(i in owner for i in node.input)):
            phase_of[node.name] = CLIP
            stage_of[node.name] = last
        elif node.name in before_norm:
            phase_of[node.name] = NORM
        else:
            phase_of[node.name] = UPDATE_PHASE
    nodes = _partial_sums(step.model, nodes, stage_of, phase_of, producer)
    placement = {n.name: (stage_of[n.name], phase_of[n.name]) for n in nodes if n.name in phase_of}
    return _parts(step, nodes, placement, home, stages, data_inputs, controls)


def _ancestors(outputs: set[str], producer: dict, among: set[str]) -> set[str]:
    """The nodes of ``among`` that ``outputs`` depend on (through nodes of ``among``)."""
    found, stack = set(), [producer[o] for o in outputs if o in producer]
    while stack:
        node = stack.pop()
        if node.name in found or node.name not in among:
            continue
        found.add(node.name)
        stack.extend(producer[i] for i in node.input if i in producer)
    return found


def _descendants(start: set[str], nodes: list, among: set[str]) -> set[str]:
    made: set[str] = set()
    found: set[str] = set()
    for node in nodes:
        if node.name in start or (node.name in among and any(i in made for i in node.input)):
            found.add(node.name)
            made.update(node.output)
    return found


def _partial_sums(model: onnx.ModelProto, nodes: list, stage_of: dict, phase_of: dict, producer: dict) -> list:
    """A ``Sum`` of the last stage's clip phase over addends several stages make (the squares
    of every weight's gradient) becomes a sum of one partial per stage, each summed where
    its addends are: one scalar crosses per stage, not one per weight."""
    out = []
    for node in nodes:
        if node.op_type != "Sum" or phase_of.get(node.name) != CLIP:
            out.append(node)
            continue
        by_stage = defaultdict(list)
        for name in node.input:
            made = producer.get(name)
            by_stage[stage_of.get(made.name) if made is not None else None].append(name)
        if len([s for s in by_stage if s is not None]) < 2:
            out.append(node)
            continue
        partials = []
        for stage, addends in sorted(by_stage.items(), key=lambda kv: -1 if kv[0] is None else kv[0]):
            if stage is None or len(addends) == 1:
                partials.extend(addends)
                continue
            name = f"{node.output[0]}/stage{stage}"
            partial = helper.make_node("Sum", addends, [name], name=f"{node.name}/stage{stage}")
            stage_of[partial.name], phase_of[partial.name] = stage, phase_of[producer[addends[0]].name]
            out.append(partial)
            partials.append(name)
        total = helper.make_node("Sum", partials, list(node.output), name=node.name)
        stage_of[total.name], phase_of[total.name] = stage_of[node.name], CLIP
        out.append(total)
    if len(out) != len(nodes):
        del model.graph.node[:]
        model.graph.node.extend(out)
    return out


def _parts(step: StepModel, nodes: list, placement: dict, home: dict, stages: int, data_inputs: list,
           controls: list) -> PipelineStep:
    model = step.model
    graph = model.graph
    constants = {t.name for t in graph.initializer}
    made_in = {o: placement[n.name] for n in nodes if n.name in placement for o in n.output if o}
    made_in.update({name: (stage, STATE) for name, stage in home.items()})
    shared_by = {o: n for n in nodes if n.name not in placement for o in n.output if o}
    graph_outputs = {v.name for v in graph.output}
    wanted = defaultdict(set)      # (stage, phase) → tensors it must give out
    reads = defaultdict(set)       # (stage, phase) → tensors it takes in
    readers = defaultdict(set)     # tensor → the parts that read it
    for node in nodes:
        where = placement.get(node.name)
        if where is None:
            continue
        for name in _reads(node, shared_by):
            if name in constants:
                continue
            if made_in.get(name) == where:
                continue
            reads[where].add(name)
            if name in made_in:
                if made_in[name][1] != STATE:
                    wanted[made_in[name]].add(name)
                readers[name].add(where)
    for name in graph_outputs:
        if name in made_in and made_in[name][1] != STATE:
            wanted[made_in[name]].add(name)
    crossings = []
    for name, parts in readers.items():
        src, made_phase = made_in[name]
        by_stage = defaultdict(list)
        for stage, phase in parts:
            if stage != src:
                by_stage[stage].append(phase)
        for dst, phases in sorted(by_stage.items()):
            crossings.append(Crossing(name, src, made_phase, dst, tuple(p for p in PHASES if p in phases)))
    _check_directions(crossings)
    shapes, dtypes = tensor_types(model)
    typed = onnx.ModelProto()
    typed.CopyFrom(model)
    known = {v.name for v in list(graph.input) + list(graph.output)}
    del typed.graph.value_info[:]
    typed.graph.value_info.extend(
        helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(dtype),
                                      list(shapes[name]) if name in shapes else None)
        for name, dtype in dtypes.items() if name not in known and name not in constants)
    extractor = Extractor(typed)
    parts = {}
    for where in sorted(set(placement.values())):
        inputs = sorted(reads[where])
        outputs = sorted(wanted[where])
        if not outputs:
            continue
        missing = [n for n in inputs + outputs if n not in extractor.value_infos]
        if missing:
            raise TrainError(f"tensor '{missing[0]}' of the training step has no known type")
        part_model = extractor.extract_model(inputs, outputs)
        parts[where] = Part(where[0], where[1], part_model, inputs, outputs)
    return PipelineStep(stages, parts, crossings, home, placement, step, data_inputs, controls)


def _reads(node, shared_by: dict) -> set[str]:
    """What ``node`` reads, through the shared nodes (``shared_by``: their outputs) it reads:
    the part computes those itself, from their inputs."""
    found, stack, seen = set(), [i for i in node.input if i], set()
    while stack:
        name = stack.pop()
        if name in seen:
            continue
        seen.add(name)
        if name in shared_by:
            stack.extend(i for i in shared_by[name].input if i)
        else:
            found.add(name)
    return found


def _check_directions(crossings: list[Crossing]) -> None:
    """Activations go to later stages, gradients to earlier ones: a crossing another way
    round would make two stages wait on each other."""
    for c in crossings:
        if c.made_in == FORWARD and FORWARD in c.read_in and c.dst < c.src:
            raise TrainError(f"'{c.tensor}' would go from stage {c.src}'s forward to stage {c.dst}'s: "
                             "stages must follow the forward graph's order")
        if c.made_in == BACKWARD and BACKWARD in c.read_in and c.dst > c.src:
            raise TrainError(f"'{c.tensor}' would go from stage {c.src}'s backward to the later stage {c.dst}'s")
        if c.made_in == BACKWARD and FORWARD in c.read_in:
            raise TrainError(f"stage {c.dst}'s forward would read '{c.tensor}' from stage {c.src}'s backward")
