"""A training step's calls before its last microbatch: only what accumulates.

A one-stage training plan of M microbatches runs its step program once a microbatch, with
``train.apply`` 0 on all but the last (``training.optimizers``): every weight's and slot's
new value is then its mask ``Where(apply, new, old)``, which gives the old value back, and
the update, the gradients' norm and whatever only they read are computed for nothing. A
rank runs those calls on its program pruned to what the call keeps or sends: the
accumulated gradients, the loss's sums, the outputs asked for (``pruned``), and the job
keeps the weights and slots as they are (``training.optimizers.idle_outputs``: the state
outputs so masked). The last call runs the program without those masks (``applying``), so
that it writes the new weights and slots into the old ones' buffers, as a step of one call
does.
onnxruntime runs every node of a session whatever outputs a run asks for, so the pruned
program is a session of its own. Its collectives are pruned too: every rank of a stage
runs the same program structure, so each prunes the same ones.
"""

from __future__ import annotations

from collections.abc import Mapping

import onnx

from meshplan.model.in_place import needed_by
from meshplan.training.optimizers import unmasked


def pruned(model: onnx.ModelProto, wanted) -> onnx.ModelProto:
    """``model`` with only the nodes ``wanted`` outputs need (collective nodes included) and
    those outputs; its inputs and initializers as they are (the segments take what they read)."""
    kept, _ = needed_by(model.graph, wanted)
    found = onnx.ModelProto()
    found.CopyFrom(model)
    del found.graph.node[:]
    found.graph.node.extend(kept)
    outputs = [v for v in model.graph.output if v.name in set(wanted)]
    del found.graph.output[:]
    found.graph.output.extend(outputs)
    return found


def applying(model: onnx.ModelProto, idle: Mapping[str, str]) -> onnx.ModelProto:
    """``model`` as a step's last call runs it (``APPLY`` 1): the masks of ``idle``'s outputs
    that only ``APPLY`` decides are gone (``training.optimizers.unmasked``), so that each new
    weight and slot is made by a node that does not read the old one, and a job may write it
    into the old one's buffer."""
    found = onnx.ModelProto()
    found.CopyFrom(model)
    unmasked(found, idle)
    return found
