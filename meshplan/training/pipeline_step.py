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
and the backward reads is kept between them (the activations in flight that 1F1B bounds);
with ``recompute``, the backward program computes those again from what the forward read
(Alpa's and Megatron-LM's activation recomputation): a stage keeps only its inputs per
microbatch in flight, and runs its forward twice.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import helper
from onnx.utils import Extractor

from meshplan.errors import TrainError
from meshplan.model.opsets import set_ir_version
from meshplan.training.autodiff import WEIGHT, tensor_types
from meshplan.training.losses import LOSS
from meshplan.training.optimizers import (ACC_COUNT, ACC_TOTAL, GRAD_ACC, GRAD_NORM, SLOTS, UPDATED, slot,
                                          unmasked, updated)
from meshplan.training.step_model import BACKWARD, FORWARD, StepModel

NORM, CLIP, UPDATE_PHASE = "norm", "clip", "update"
PHASES = (FORWARD, BACKWARD, NORM, CLIP, UPDATE_PHASE)
STATE = "state"    # Crossing.made_in of a state input another stage reads (sent once a step)
ONE_F_ONE_B, GPIPE = "1f1b", "gpipe"     # the pipeline schedules (``emit.train_schedule``)
SCHEDULES = (ONE_F_ONE_B, GPIPE)
PER_MICROBATCH = (FORWARD, BACKWARD)


@dataclass
class Part:
    """One stage's program for one phase."""

    stage: int
    phase: str
    model: onnx.ModelProto | str       # the program, or its file's path (a plan's part)
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
    into: str = ""      # the name stage ``dst`` reads it by, where its layout there differs (``crossing_layouts``)

    @property
    def received(self) -> str:
        return self.into or self.tensor


def per_microbatch(crossing: Crossing) -> bool:
    """Whether a crossing carries a tensor every microbatch (else once a step)."""
    return crossing.made_in in PER_MICROBATCH and any(p in PER_MICROBATCH for p in crossing.read_in)


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
    loss_count: str | None = None          # what the last stage divides the loss's sum by (a step's count)
    recomputed: dict[int, set[str]] = field(default_factory=dict)   # stage → what its backward makes again
    sharded: set[str] = field(default_factory=set)   # what a stage's replicas hold in row blocks (sharded_update)
    chunks: dict[int, list[list[str]]] = field(default_factory=dict)   # stage → its update's outputs, in chunks
    # stages whose T devices shard their operators (``emit.rank_parts``): device j's parts of
    # every stage (``parts`` is device 0's), and each input's layout on the [1, T] mesh
    device_parts: list[dict[tuple[int, str], Part]] = field(default_factory=list)
    specs: dict[str, str] = field(default_factory=dict)
    # crossing index → the axis of its tensor that holds a microbatch's samples, where it goes
    # between stages with different replica counts (``meshplan.stage_ranks``)
    rows: dict[int, int] = field(default_factory=dict)
    # stages whose numbers of such devices differ (``--tensor-parallel 2,1``): each stage's T,
    # its inputs' and outputs' layouts, and how each crossing between two of different
    # layouts goes (crossing index → ``crossing_layouts.Relayout``)
    tensors: list[int] = field(default_factory=list)
    stage_specs: list[dict[str, str]] = field(default_factory=list)
    relayouts: dict = field(default_factory=dict)

    @property
    def tensor(self) -> int:
        """The devices that shard each stage's operators (1: each stage's parts run whole);
        where the stages' differ, the most."""
        return max(1, len(self.device_parts))

    def tensor_of(self, stage: int) -> int:
        """The devices that shard stage ``stage``'s operators."""
        return self.tensors[stage] if self.tensors else self.tensor

    def specs_of(self, stage: int) -> dict[str, str]:
        """Stage ``stage``'s layouts of its inputs and outputs on its [1, T] mesh."""
        return self.stage_specs[stage] if self.stage_specs else self.specs


def kept_apart(stage: int, parts, crossings: list[Crossing], sharded, replicas: int) -> set[str]:
    """The state of stage ``stage`` (its ``parts``, by phase) whose new value a job writes
    beside the old rather than into its buffer: a state another stage borrows (a
    ``STATE`` crossing), and, where its ``replicas`` update in row blocks, a ``sharded``
    weight a forward or backward reads, which they gather whole again after the update."""
    lent = {c.tensor for c in crossings if c.src == stage and c.made_in == STATE}
    if replicas < 2:
        return lent
    read = {n for phase, part in parts.items() if phase in PER_MICROBATCH for n in part.inputs}
    return lent | (set(sharded) & read)


def split_step(step: StepModel, forward_stage: dict[str, int], stages: int, recompute: bool = False) -> PipelineStep:
    """``step`` in ``stages`` pipeline stages; ``forward_stage``: the stage of each node of the
    forward model (by name; stages in the forward graph's order). A global ``Sum`` of the
    step's graph is rewritten in place into one partial per stage (``_partial_sums``).
    ``recompute``: each stage's backward computes its forward's activations again (see the
    module). Raises ``TrainError`` where the step cannot be cut so."""
    if not step.manifest.get("accumulators"):
        raise TrainError("a pipelined training step accumulates its gradients: build it with stages > 1")
    if stages < 2:
        raise TrainError(f"a pipeline has two or more stages, not {stages}")
    names = [n.name for n in step.model.graph.node]
    if len(set(names)) != len(names) or not all(names):
        raise TrainError("the step's nodes need names of their own")
    bad = sorted({s for s in forward_stage.values() if not 0 <= s < stages})
    if bad:
        raise TrainError(f"stage {bad[0]} is not one of the {stages} stages")
    places = _Placing(step, stages)
    places.forward(forward_stage)
    places.backward()
    places.update()
    phase_of = places.phases()
    nodes = _partial_sums(step.model, places.nodes, places.stage_of, phase_of, places.producer)
    placement = {n.name: (places.stage_of[n.name], phase_of[n.name]) for n in nodes if n.name in phase_of}
    found = _parts(step, nodes, placement, places.home, stages, places.data_inputs, places.controls, recompute)
    loss = places.producer.get(LOSS)
    if loss is not None and loss.op_type == "Div":
        found.loss_count = loss.input[1]
    return found


class _Placing:
    """The stage of every node of the step (``stage_of``), the nodes every part that reads
    them computes (``free``), the stage of every state input (``home``), and the weight each
    tensor of a weight's own belongs to (``owner``)."""

    def __init__(self, step: StepModel, stages: int):
        self.step, self.last = step, stages - 1
        graph = step.model.graph
        manifest = step.manifest
        self.nodes = list(graph.node)
        self.weights = list(manifest["weights"])
        self.state_inputs = set(step.state.values())
        self.controls = list(manifest["hyperparameters"])
        self.constants = {t.name for t in graph.initializer}
        self.data_inputs = [v.name for v in graph.input if v.name not in self.state_inputs
                            and v.name not in self.controls and v.name not in self.constants]
        self.producer = {o: n for n in self.nodes for o in n.output if o}
        self.readers = defaultdict(list)
        for node in self.nodes:
            for name in node.input:
                if name:
                    self.readers[name].append(node)
        # a weight, its slots and its accumulated gradient belong to the weight
        self.owner: dict[str, str] = {}
        for w in self.weights:
            self.owner[w] = w
            for kind in manifest["slots"]:
                self.owner[slot(w, kind)] = w
        self.stage_of: dict[str, int] = {}
        self.free: set[str] = set()
        self.home: dict[str, int] = {}
        self.shared: set[str] = set()      # update nodes that read several weights' values

    def role(self, node) -> str | None:
        return self.step.roles.get(node.name)

    def located(self, node) -> list[int]:
        """The stages of the placed nodes that make what ``node`` reads."""
        found = []
        for name in node.input:
            made = self.producer.get(name)
            if made is not None and made.name in self.stage_of:
                found.append(self.stage_of[made.name])
        return found

    def is_free(self, node) -> bool:
        return all(not i or i in self.controls or i in self.constants
                   or (i in self.producer and self.producer[i].name in self.free) for i in node.input)

    def forward(self, forward_stage: dict[str, int]) -> None:
        """Given, else after what it reads, else before what reads it; then the homes."""
        forward = [n for n in self.nodes if self.role(n) == FORWARD]
        deferred = []
        for node in forward:
            if node.name in forward_stage:
                self.stage_of[node.name] = forward_stage[node.name]
            elif self.located(node):
                self.stage_of[node.name] = max(self.located(node))
            elif self.is_free(node):
                self.free.add(node.name)
            else:
                deferred.append(node)
        for node in reversed(deferred):
            later = [self.stage_of[r.name] for out in node.output for r in self.readers.get(out, [])
                     if r.name in self.stage_of]
            self.stage_of[node.name] = min(later) if later else 0
        for node in forward:   # in the forward graph's order: a stage never reads a later one's
            for name in node.input:
                made = self.producer.get(name)
                if made is not None and made.name in self.stage_of and node.name in self.stage_of \
                        and self.stage_of[made.name] > self.stage_of[node.name]:
                    raise TrainError(f"node '{node.name}' on stage {self.stage_of[node.name]} reads '{name}' from "
                                     f"the later stage {self.stage_of[made.name]}: stages must follow the forward "
                                     "graph's order")
        for w in self.weights + [s for s in self.state_inputs if s not in self.owner]:
            found = [self.stage_of[r.name] for r in self.readers.get(w, []) if r.name in self.stage_of]
            self.home[w] = min(found) if found else self.last
        for name, w in self.owner.items():
            self.home[name] = self.home[w]
        for name in (ACC_TOTAL, ACC_COUNT):
            self.home[name] = self.last

    def backward(self) -> None:
        """With the forward node it differentiates, a weight's sum with the weight; addends
        that all come from one later stage summed there (one tensor crosses, not each)."""
        backward = [n for n in self.nodes if self.role(n) == BACKWARD]
        for node in backward:
            origin = self.step.origin.get(node.name, "")
            if origin.startswith(WEIGHT):
                w = origin[len(WEIGHT):]
                self.stage_of[node.name] = self.home.get(w, self.last)
                for out in node.output:
                    self.owner[out] = w
            elif origin in self.stage_of:
                self.stage_of[node.name] = self.stage_of[origin]
            elif self.located(node):
                self.stage_of[node.name] = max(self.located(node))
            else:
                self.free.add(node.name)
        for node in backward:
            if node.op_type == "Sum" and node.name in self.stage_of:
                found = set(self.located(node))
                if len(found) == 1 and len(self.located(node)) == len(node.input) \
                        and found != {self.stage_of[node.name]}:
                    self.stage_of[node.name] = found.pop()
        for w, name in self.step.gradients.items():
            self.owner[name] = w

    def update(self) -> None:
        """With the one weight whose values it reads; several weights' on the last stage."""
        for node in self.nodes:
            if self.role(node) in (FORWARD, BACKWARD):
                continue
            owners = {self.owner[i] for i in node.input if i in self.owner}
            if len(owners) == 1:
                w = owners.pop()
                self.stage_of[node.name] = self.home[w]
                for out in node.output:
                    self.owner[out] = w
            elif owners:
                self.stage_of[node.name] = self.last
                self.shared.add(node.name)
            elif self.is_free(node):
                self.free.add(node.name)
            else:
                found = self.located(node) + [self.home[i] for i in node.input if i in self.home]
                self.stage_of[node.name] = max(found) if found else self.last

    def phases(self) -> dict[str, str]:
        """Each placed node's phase: the update's accumulation runs with the backward, what
        the global norm is made of in ``norm``, the norm and the clipping factor in ``clip``
        (last stage), the rest in ``update``."""
        weights = self.weights
        update_nodes = {n.name for n in self.nodes if self.role(n) not in (FORWARD, BACKWARD)}
        per_mb_outputs = {updated(slot(w, GRAD_ACC)) for w in weights} | \
            {updated(ACC_TOTAL), updated(ACC_COUNT), LOSS}
        per_mb = _ancestors(per_mb_outputs, self.producer, update_nodes)
        before_norm = _ancestors({GRAD_NORM}, self.producer, update_nodes)
        after_shared = _descendants(self.shared, self.nodes, update_nodes)
        phase_of: dict[str, str] = {}
        for node in self.nodes:
            if node.name in self.free:
                continue
            kind = self.role(node)
            if kind in (FORWARD, BACKWARD):
                phase_of[node.name] = kind
            elif node.name in per_mb:
                phase_of[node.name] = BACKWARD
            elif node.name in self.shared or \
                    (node.name in after_shared and not any(i in self.owner for i in node.input)):
                phase_of[node.name] = CLIP
                self.stage_of[node.name] = self.last
            elif node.name in before_norm:
                phase_of[node.name] = NORM
            else:
                phase_of[node.name] = UPDATE_PHASE
        return phase_of


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
           controls: list, recompute: bool = False) -> PipelineStep:
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
    recomputed = _recomputing(nodes, placement, made_in, reads, readers, stages) if recompute else {}
    for name in graph_outputs:
        if name in made_in and made_in[name][1] != STATE:
            wanted[made_in[name]].add(name)
    for stage, again in recomputed.items():   # the forward no longer hands these on
        for name in again:
            if not readers[name] and name not in graph_outputs:
                wanted[(stage, FORWARD)].discard(name)
    _update_computes_again(nodes, placement, made_in, reads, wanted, readers, stages, graph_outputs | constants)
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
    parts, chunks = {}, {}
    for where in sorted(set(placement.values())):
        inputs = sorted(reads[where])
        outputs = sorted(wanted[where])
        if not outputs:
            continue
        missing = [n for n in inputs + outputs if n not in extractor.value_infos]
        if missing:
            raise TrainError(f"tensor '{missing[0]}' of the training step has no known type")
        part_model = set_ir_version(extractor.extract_model(inputs, outputs))   # one onnxruntime loads
        if where[1] == UPDATE_PHASE:
            unmasked(part_model)
            _output_by_output(part_model)
            chunks[where[0]] = update_chunks(part_model)
        parts[where] = Part(where[0], where[1], part_model, inputs, outputs)
    return PipelineStep(stages, parts, crossings, home, placement, step, data_inputs, controls,
                        recomputed=recomputed, chunks=chunks)


UPDATE_CHUNKS = 8   # the runs a stage's update is cut into (what its new values hold at once: 1/8)


def update_chunks(model: onnx.ModelProto, count: int = UPDATE_CHUNKS) -> list[list[str]]:
    """An update part's outputs in at most ``count`` groups of about equal bytes, each
    weight's new value with its slots' (``NAME.updated``, ``NAME.KIND.updated``), in the
    part's order. A job runs the groups one after another, each group's new values taking
    their old values' place before the next runs, so that a stage holds the new values of
    one group at a time rather than of all its weights (``runtime.pipeline_stage.stage_sessions``)."""
    kinds = {kind for slots in SLOTS.values() for kind in slots} | {GRAD_ACC}
    owners: dict[str, list[str]] = {}
    sizes: dict[str, float] = defaultdict(float)
    for value in model.graph.output:
        name = value.name[:-len(UPDATED)] if value.name.endswith(UPDATED) else value.name
        base, _, kind = name.rpartition(".")
        owner = base if base and kind in kinds else name
        owners.setdefault(owner, []).append(value.name)
        kind_of = value.type.tensor_type
        elements = float(np.prod([d.dim_value or 1 for d in kind_of.shape.dim], dtype=np.float64))
        sizes[owner] += elements * np.dtype(helper.tensor_dtype_to_np_dtype(kind_of.elem_type)).itemsize
    target = max([sum(sizes.values()) / max(count, 1)] + list(sizes.values()))
    groups: list[list[str]] = []
    held = target
    for owner, names in owners.items():
        if held + sizes[owner] > target * 1.0001 and len(groups) < count:
            groups.append([])
            held = 0.0
        groups[-1].extend(names)
        held += sizes[owner]
    return groups


# What an update computes again of its stage's norm rather than hold it between the two: a
# weight's mean gradient and its square (a division by the step's count, a product, a cast).
_AGAIN_IN_UPDATE = {"Div", "Mul", "Cast"}


def _update_computes_again(nodes: list, placement: dict, made_in: dict, reads: dict, wanted: dict, readers: dict,
                           stages: int, kept: set) -> None:
    """Each stage's update reads what its norm read (the accumulated gradients, the count)
    and computes the mean gradients and their squares again, instead of the norm handing
    them on: the norm then keeps nothing per weight, and the update, which runs group by
    group, lets each weight's accumulated gradient go once its group has run. Only where
    every node between is a division, a product or a cast of the norm's (``reads``,
    ``wanted`` and ``readers`` are changed in place; ``kept``: the step's outputs and
    constants, which stay as they are)."""
    producer = {o: node for node in nodes for o in node.output if o}
    for stage in range(stages):
        norm, update = (stage, NORM), (stage, UPDATE_PHASE)
        handed = sorted(n for n in reads.get(update, ()) if made_in.get(n) == norm)
        sources: set[str] = set()
        ok = bool(handed)
        for name in handed:
            stack = [name]
            while stack and ok:
                tensor = stack.pop()
                node = producer.get(tensor)
                if node is None or placement.get(node.name) != norm:
                    sources.add(tensor)
                    continue
                if node.op_type not in _AGAIN_IN_UPDATE:
                    ok = False
                stack.extend(i for i in node.input if i)
        if not ok:
            continue
        for name in handed:
            reads[update].discard(name)
            readers[name].discard(update)
            if not readers[name] and name not in kept:
                wanted[norm].discard(name)
        for name in sources - kept:
            if name in made_in and made_in[name] != update:
                reads[update].add(name)
                readers[name].add(update)
                if made_in[name][1] != STATE:
                    wanted[made_in[name]].add(name)
            elif name not in made_in:
                reads[update].add(name)


def _output_by_output(model: onnx.ModelProto) -> None:
    """Order ``model``'s nodes output by output, each after what it reads (depth first): an
    update computes one weight's new values and slots before the next weight's, so that
    onnxruntime holds one weight's temporaries at a time rather than every weight's of a
    step of the chain (a 68 MiB stage's AdamW update: 271 MiB at its peak, against 318 in
    the step model's order)."""
    producer = {o: node for node in model.graph.node for o in node.output if o}
    placed: set[int] = set()
    ordered = []
    for start in [producer[v.name] for v in model.graph.output if v.name in producer] + list(model.graph.node):
        stack = [(start, False)]
        while stack:
            node, ready = stack.pop()
            if id(node) in placed:
                continue
            if ready:
                placed.add(id(node))
                ordered.append(node)
                continue
            stack.append((node, True))
            stack.extend((producer[name], False) for name in reversed(node.input)
                         if name in producer and id(producer[name]) not in placed)
    copies = []
    for node in ordered:
        copies.append(onnx.NodeProto())
        copies[-1].CopyFrom(node)
    del model.graph.node[:]
    model.graph.node.extend(copies)


_RANDOM = {"RandomNormal", "RandomNormalLike", "RandomUniform", "RandomUniformLike", "Bernoulli", "Multinomial"}


def _recomputing(nodes: list, placement: dict, made_in: dict, reads: dict, readers: dict,
                 stages: int) -> dict[int, set[str]]:
    """Each stage's backward reads its forward's inputs instead of what the forward made (the
    part computes those again: its program is extracted from the new inputs); ``reads`` and
    ``readers`` are changed so. A forward that draws random numbers (a Dropout in training
    mode, whose mask output the step keeps; a Random* or Bernoulli node) cannot be run twice
    (a second draw would differ): refused."""
    again: dict[int, set[str]] = {}
    for stage in range(stages):
        forward, backward = (stage, FORWARD), (stage, BACKWARD)
        kept = {name for name in reads[backward] if made_in.get(name) == forward}
        if not kept:
            continue
        for node in nodes:
            drawn = node.op_type in _RANDOM or (node.op_type == "Dropout" and len(node.output) > 1 and node.output[1])
            if drawn and placement.get(node.name) == forward:
                raise TrainError(f"stage {stage} draws random numbers in its forward ({node.op_type} node "
                                 f"'{node.name}'): recomputed, they would differ; plan without --recompute")
        reads[backward] = (reads[backward] - kept) | reads[forward]
        for name in kept:
            readers[name].discard(backward)
        for name in reads[forward]:
            if name in made_in:
                readers[name].add(backward)
        again[stage] = kept
    return again


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
