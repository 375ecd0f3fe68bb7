"""A training step's costs, estimated from the forward graph: the stage DP and the sharding
ILP weigh training with these where a plan is made without programs (``meshplan plan
--train --no-programs`` with ``--stages`` or ``--max-stages``).

The step's graph (forward, backward and update) is not built: each forward operator
stands for itself and its backward, as Alpa's and Megatron-LM's cost models take them:

- **time**: an operator's backward costs ``BACKWARD_FACTOR`` forwards (two matrix
  products for one), so a strategy's seconds are ``1 + BACKWARD_FACTOR`` times its
  forward's; every resharding between operators happens twice (the activation forward,
  its gradient back: ``RESHARD_FACTOR``), as does every send between stages;
- **gradients**: a trained weight read by an operator whose work is split along a mesh
  axis the weight is not split along gets a partial gradient there: the strategy pays an
  all-reduce of the weight's slice over that axis once a step (``1 / B`` of it per
  microbatch, B the step's microbatches);
- **memory**: a trained weight is held with its accumulated gradient and its optimizer's
  slots, each in the weight's layout and dtype (as ``training.optimizers`` builds them):
  ``2 + slots`` times its bytes (twice that for a float16 weight held as a float32 master:
  ``--master-weights``, whose gradient's all-reduce is float32 too); a stage keeps, per
  microbatch in flight, the activations its operators make that the step's backward reads
  (``saved_for_backward``, from the step model meshplan would train) and what enters it. 1F1B keeps ``S − i`` microbatches in
  flight on stage ``i`` of ``S``, GPipe all ``B``;
- **recomputation** (``recompute``, Alpa's and Megatron-LM's activation checkpointing): a
  stage keeps only what enters each of its layers per microbatch in flight, and recomputes
  a layer's forward before its backward: one forward more per operator (and per
  resharding inside a stage), and one layer's activations held at a time, once.

Left out: the loss (the model's outputs are where the step ends), the optimizer's update
(elementwise over the weights, once a step), a tied weight's gradient meeting across
stages, and the gradient and slots of a trained weight that canonicalisation folds into a
constant of its own (a small weight sliced to static dims: counted once).
"""

from __future__ import annotations

from dataclasses import dataclass

from meshplan.intra.operator_cost import OperatorCosts
from meshplan.intra.strategies import Strategy
from meshplan.model.graph import Graph, Node
from meshplan.reshard.steps import CollectiveModel
from meshplan.sharding import LogicalMesh, ShardingSpec
from meshplan.training.master_weights import widening
from meshplan.training.optimizers import SLOTS
from meshplan.training.pipeline_step import GPIPE, ONE_F_ONE_B, SCHEDULES
from meshplan.training.step_model import BACKWARD, FORWARD

BACKWARD_FACTOR = 2.0     # an operator's backward, in forwards
RESHARD_FACTOR = 2.0      # a resharding's activation forward and gradient back
LEAN_GAP = 0.01           # a memory-lean layer ILP's stop: within 1 % of its bound,
LEAN_NODES = 1000         # or at this many branch-and-bound nodes


@dataclass(frozen=True)
class TrainingCosting:
    """What the planner weighs a training step by (``PlanOptions.training``); ``of`` takes it
    from the step model meshplan would train."""

    optimizer: str = "adamw"
    schedule: str = ONE_F_ONE_B
    trained: frozenset[str] = frozenset()      # the weights the step updates
    # the activations the backward reads (``saved_for_backward``); None: every one
    saved: frozenset[str] | None = None
    recompute: bool = False                    # each layer's forward again before its backward
    widening: int = 1      # a trained weight's state bytes over its own: 2 for float32 masters of float16

    @classmethod
    def of(cls, step, schedule: str = ONE_F_ONE_B, recompute: bool = False) -> "TrainingCosting":
        """The costing of a ``training.step_model.StepModel``: its optimizer, the weights it
        trains (its frozen patterns and unreached weights left out) and what its backward reads."""
        weights = step.manifest["weights"]
        return cls(step.manifest["optimizer"], schedule, frozenset(weights), saved_for_backward(step), recompute,
                   widening(weights))

    @property
    def forwards(self) -> float:
        """An operator's seconds a step, in forwards: itself, its backward, and its forward
        again where activations are recomputed."""
        return 1.0 + BACKWARD_FACTOR + (1.0 if self.recompute else 0.0)

    @property
    def reshard_factor(self) -> float:
        """Times a resharding inside a stage happens a step."""
        return RESHARD_FACTOR + (1.0 if self.recompute else 0.0)

    def __post_init__(self):
        if self.optimizer not in SLOTS:
            raise ValueError(f"unknown optimizer {self.optimizer!r}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"unknown schedule {self.schedule!r}")

    @property
    def held_per_weight(self) -> int:
        """A trained weight's bytes held, in its own bytes in the model: itself, its gradient,
        its optimizer's slots (each widened to float32 where it is held as a master)."""
        return (2 + len(SLOTS[self.optimizer])) * self.widening

    def in_flight(self, stage: int, stages: int, microbatches: int) -> int:
        """Microbatches whose activations stage ``stage`` of ``stages`` keeps at once."""
        if self.schedule == GPIPE:
            return microbatches
        return min(stages - stage, microbatches)


def saved_for_backward(step) -> frozenset[str]:
    """The tensors a training step's backward reads that its forward makes (a
    ``training.step_model.StepModel``): what a stage keeps from a microbatch's forward until
    its backward. Named as the forward model names them."""
    graph = step.model.graph
    made = {out for node in graph.node if step.roles.get(node.name) == FORWARD for out in node.output if out}
    return frozenset(name for node in graph.node if step.roles.get(node.name) == BACKWARD
                     for name in node.input if name in made)


class TrainingOperatorCosts(OperatorCosts):
    """``OperatorCosts`` of a training step (module docstring): seconds of forward and
    backward with the gradients' all-reduce, bytes of weights, gradients and slots."""

    # a layer's memory-lean ILP is a knapsack over its weights, which trained weights (held
    # 4x) make binding almost everywhere: CBC finds a near-best layout at once and proves it
    # slowly, so these stop within 1 % of the bound or after LEAN_NODES nodes (the plan's
    # solver record says where one stopped so)
    lean_gap, lean_nodes = LEAN_GAP, LEAN_NODES

    def __init__(self, graph: Graph, cost_model, cluster, constants, training: TrainingCosting, microbatches: int):
        super().__init__(graph, cost_model, cluster, constants)
        self.training = training
        self.call_factor, self.reshard_factor = training.forwards, training.reshard_factor
        self.trained = training.trained
        self.per_step = 1.0 / max(1, int(microbatches))

    def stored_bytes(self, name: str) -> float:
        held = self.training.held_per_weight if name in self.trained else 1
        return float(self.graph.tensors[name].nbytes * held)

    def strategy_seconds(self, node: Node, strategy: Strategy, mesh: LogicalMesh,
                         collectives: CollectiveModel) -> float:
        seconds = self.compute_seconds(node, strategy, mesh) * self.call_factor
        return seconds + self.per_step * self.gradient_seconds(node, strategy, mesh, collectives)

    def gradient_seconds(self, node: Node, strategy: Strategy, mesh: LogicalMesh,
                         collectives: CollectiveModel) -> float:
        """The all-reduce of the trained weights' partial gradients under ``strategy``."""
        work = set()
        for spec in list(strategy.inputs) + list(strategy.outputs):
            if spec is not None:
                work.update(spec.split_axes())
                work.update(spec.partial)
        if not work:
            return 0.0
        seconds = 0.0
        for name, spec in zip(node.inputs, strategy.inputs):
            info = self.graph.tensors.get(name) if name else None
            if info is None or not info.is_param or not self.trained.intersection(info.sources or (name,)):
                continue
            spec = spec or ShardingSpec.replicated(len(info.shape))
            local = spec.local_bytes(info.shape, info.dtype.itemsize, mesh) * self.training.widening
            for axis in work - set(spec.split_axes()):
                if mesh.axis_size(axis) > 1:
                    seconds += collectives.all_reduce_seconds(local, axis, mesh)
        return seconds

    def param_slices(self, node: Node, strategy: Strategy, mesh: LogicalMesh) -> dict[tuple[str, ShardingSpec], int]:
        held = self.training.held_per_weight
        return {key: size * held if key[0] in self.trained else size
                for key, size in super().param_slices(node, strategy, mesh).items()}
