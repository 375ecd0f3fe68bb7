"""The step of a one-stage training plan of M microbatches, as a job runs it.

A job calls the step program once a microbatch. The M − 1 calls before the last run it
pruned to what they keep or send (the accumulated gradients, the loss's sums:
``runtime.accumulating``); only the last runs the update, the gradients' norm and the
clipping (``training.optimizers.idle_outputs`` names the weights and slots those calls hand
back unchanged). So the step is M calls of the program less M − 1 times what only the last
call runs: the cost of the nodes no output of an earlier call needs, at the strategies the
plan chose for them.
"""

from __future__ import annotations

from collections.abc import Mapping

import onnx

from meshplan.model.in_place import needed_by
from meshplan.training.optimizers import GRAD_NORM, idle_outputs


def applying_only(graph: onnx.GraphProto, state: Mapping[str, str]) -> list[str]:
    """The names of the nodes of a step program ``graph`` (state: output → the input it
    replaces) that only a step's last call runs: those no output but the idle weights and
    slots and the gradients' norm needs."""
    idle = idle_outputs(graph, state)
    if not idle:
        return []
    wanted = [v.name for v in graph.output if v.name not in idle and v.name != GRAD_NORM]
    kept, _ = needed_by(graph, wanted)
    names = {node.name for node in kept}
    return [node.name for node in graph.node if node.name not in names]


def accumulated_step(call_seconds: float, microbatches: int, node_seconds: Mapping[str, float],
                     graph: onnx.GraphProto, state: Mapping[str, str]) -> tuple[float, float]:
    """(the step's seconds, the update's) for ``microbatches`` calls of a program of
    ``call_seconds`` whose nodes cost ``node_seconds`` (by name) under the plan's strategies."""
    update = sum(node_seconds.get(name, 0.0) for name in applying_only(graph, state))
    update = min(update, call_seconds)
    return microbatches * call_seconds - (microbatches - 1) * update, update
