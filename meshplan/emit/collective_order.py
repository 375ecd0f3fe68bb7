"""A rank's program ordered so that its collectives cut it as few times as they must.

The runtime cuts a program at its collectives (``runtime.program.ProgramRunner``): each run
of nodes between two collectives is an onnxruntime session of its own, and what crosses a cut
is handed from one session to the next (through the host, on a GPU whose transport stages
through it). Emitted as the sharding rules meet them, a data-parallel training step's
gradient all-reduces fall between the backward's nodes, each followed at once by the few
nodes that read its result (a Reshape, the sum of a tied weight's gradients): one cut each,
71 on the sample GPT's 1x2 step. Yet nothing in the backward waits for a reduced gradient.

Each node gets a level: the number of collectives that must run before it (on the longest
chain of collectives leading to it), and is then placed as late as the nodes that read it
allow, never later than its level needs (so what only the update reads, a moment's decay,
say, stays beside the update). The program runs as its levels, each a session, with the
collectives between two levels side by side: the 1x2 step's backward is one session and its
gradient all-reduces follow it together.

Every rank of a group orders its program by the same rule, so the collectives still come in
the same order on each of them; a node moves only past nodes it does not read from, so the
program computes what it did. A program with subgraphs (If, Loop, Scan: they may read any
outer value) keeps its order.
"""

from __future__ import annotations

import onnx

from meshplan.plan_format import COLLECTIVE_DOMAIN


def order_by_levels(nodes: list[onnx.NodeProto], outputs: list[str]) -> list[onnx.NodeProto]:
    """``nodes`` (topologically ordered; ``outputs``: the graph's) reordered as described above."""
    if not any(n.domain == COLLECTIVE_DOMAIN for n in nodes) or any(
            a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for n in nodes for a in n.attribute):
        return list(nodes)
    collective = [n.domain == COLLECTIVE_DOMAIN for n in nodes]
    # as soon as possible: the level at which each value exists (a collective's result one
    # level after its input's)
    ready: dict[str, int] = {}
    earliest = []
    for node, is_collective in zip(nodes, collective):
        level = max((ready.get(i, 0) for i in node.input if i), default=0)
        earliest.append(level)
        for o in node.output:
            if o:
                ready[o] = level + 1 if is_collective else level
    last = max([*earliest, *(ready.get(o, 0) for o in outputs)])
    # as late as possible: the level by which each value is needed (a collective runs after
    # the level it is given: its input is needed at that level, its result one level later)
    needed: dict[str, int] = {o: last for o in outputs}
    latest = [0] * len(nodes)
    for index in range(len(nodes) - 1, -1, -1):
        node = nodes[index]
        level = min((needed.get(o, last + 1) for o in node.output if o), default=last + 1)
        level = min(level - 1 if collective[index] else level, last)
        latest[index] = max(level, earliest[index])
        for i in node.input:
            if i:
                needed[i] = min(needed.get(i, last), latest[index])
    order = sorted(range(len(nodes)), key=lambda k: (latest[k], collective[k], k))
    return [nodes[k] for k in order]
