"""A training plan without programs, at any scale: ``meshplan plan --train --no-programs``
with ``--stages S`` or ``--max-stages N``.

The plan is the forward model's, made by the planner itself (layers, the stage DP over
submeshes, the sharding ILP inside each stage: ``inter.pipeline``) with a training step's
costs (``inter.training_costs``): forward and backward time, the gradients' all-reduce,
weights with their gradients and optimizer slots, and the activations each stage keeps
for the microbatches its schedule has in flight. Nothing is written to run: such a plan
says how a model that needs many hosts would be trained, its stages, submeshes, logical
meshes and sharding, its step time and memory per device, in the time of an inference
plan and without reading a weight. The step model is built (and dropped) so that a model
meshplan cannot train is refused here as it would be with programs.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np

from meshplan.cost.analytic import CostModel
from meshplan.cost.cluster import Cluster
from meshplan.emit.report import human_bytes
from meshplan.inter.pipeline import PlanOptions
from meshplan.inter.training_costs import TrainingCosting
from meshplan.plan_format import Plan
from meshplan.training.master_weights import model_itemsize
from meshplan.training.step_model import TrainSpec, build_step_model


def plan_training_estimate(model_path: Path, cluster: Cluster, dims: dict, out_dir: Path, options: PlanOptions,
                           spec: TrainSpec, cost_model: CostModel | None, shapes_only: bool, make_plan) -> Plan:
    """``dims``: the whole batch's (``options.microbatches`` splits it); ``make_plan`` writes
    the plan directory (``make_plan.make_plan``, passed in: it calls this module)."""
    step = build_step_model(model_path, replace(spec, microbatches=options.microbatches))
    costing = TrainingCosting.of(step, options.schedule, options.recompute)
    weights = step.manifest["weights"]

    def record(plan: Plan, graph, shardings) -> None:
        stages = len(plan.stages)
        in_flight = [costing.in_flight(s.index, stages, options.microbatches) for s in plan.stages]
        plan.training = {
            "estimate_only": True, "loss": spec.loss, "optimizer": spec.optimizer, "frozen": list(spec.frozen),
            "schedule": options.schedule, "microbatches": options.microbatches,
            "weights": weights, "in_flight": in_flight,
            "held_per_weight": costing.held_per_weight, "recompute": costing.recompute,
        }
        total = sum(_nbytes(w) for w in weights.values())
        plan.notes.append(
            f"training (estimated, no programs): {spec.optimizer} on {spec.loss}, {len(weights)} weight(s) trained "
            f"({human_bytes(total)}, held {costing.held_per_weight}x with gradients and optimizer slots"
            + (", in float32 masters" if costing.widening > 1 else "") + "), "
            f"{options.schedule.upper() if options.schedule == '1f1b' else 'GPipe'} over {options.microbatches} "
            f"microbatch(es), activations in flight per stage {in_flight}"
            + (", each layer's activations recomputed before its backward (only what enters a layer kept)"
               if costing.recompute else "")
            + "; stage times are forward and backward of one microbatch")

    return make_plan(model_path, cluster, dims, out_dir, replace(options, training=costing),
                     cost_model=cost_model, programs=False, shapes_only=shapes_only, _record=record)


def _nbytes(weight: dict) -> int:
    """A trained weight's bytes in the model (a float32 master's in its float16 or bfloat16)."""
    return int(np.prod(weight["shape"])) * model_itemsize(weight)
