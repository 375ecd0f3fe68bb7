"""Which of a program's state updates may be written into the buffer of the state they replace.

A training step reads each weight and optimizer slot (a graph input) and writes its new
value (a graph output). onnxruntime lets a caller bind an output to the very buffer of an
input (``IOBinding``); the new value then replaces the old one where it lies, and the step
holds one copy of the state instead of two (a 30 M-parameter GPT under AdamW: 349 MiB
less). That is right only where nothing reads the old value after the new one is written:

- every node that reads the input, or a tensor onnxruntime may make share its buffer
  (``ALIASES``: a Reshape of the input is a view of it), is an ancestor of the node that
  writes the output, so it has run before, in any order onnxruntime chooses;
- the writing node itself reads none of them (an elementwise kernel is not promised to
  read an element before it writes it: ``Where(apply, new, old)`` into ``old`` is not safe);
- nothing after the program (``read_later``: a later segment, a collective) reads the
  input or an alias of it, and no alias is an output of the program;
- the output has the input's shape and dtype (the caller checks: it binds one buffer).

Ancestry is a bitset over the nodes that read a candidate (few: each state's readers), carried
along the nodes in their order, so a step of thousands of nodes is checked in milliseconds.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

# ops whose output onnxruntime may place in the buffer of their first input (its kernels'
# ``Alias(0, 0)``), and Cast and Dropout, which may hand their input on unchanged
ALIASES = frozenset({"Reshape", "Squeeze", "Unsqueeze", "Flatten", "Identity", "Optional", "OptionalGetElement",
                     "Cast", "Dropout"})

# (op_type, inputs, outputs) of one node, in the program's order
NodeTriple = tuple[str, Sequence[str], Sequence[str]]


def updates_in_place(nodes: Sequence[NodeTriple], candidates: Mapping[str, str],
                     read_later: Iterable[str] = (), outputs: Iterable[str] = ()) -> dict[str, str]:
    """The pairs of ``candidates`` (output → the input it replaces) whose output may be
    written into the input's buffer (the rules above). ``read_later``: what is read after
    these nodes have run; ``outputs``: the program's outputs (an alias of a state among them
    would show the new value)."""
    later, program_outputs = set(read_later), set(outputs)
    producer: dict[str, int] = {}
    readers: dict[str, list[int]] = {}
    for index, (_, ins, outs) in enumerate(nodes):
        for name in outs:
            if name:
                producer[name] = index
        for name in set(ins):
            if name:
                readers.setdefault(name, []).append(index)
    sources = list(candidates.values())
    twice = {s for s in sources if sources.count(s) > 1}   # one buffer cannot take two new values
    closures: dict[str, set[str]] = {}
    for output, source in candidates.items():
        if output not in producer or source in producer or source in twice:
            continue
        closure, frontier = {source}, [source]
        while frontier:
            name = frontier.pop()
            for r in readers.get(name, ()):
                op, ins, outs = nodes[r]
                if op in ALIASES and ins and ins[0] == name:
                    for made in outs:
                        if made and made not in closure:
                            closure.add(made)
                            frontier.append(made)
        if closure & later or (closure - {source}) & program_outputs:
            continue
        writer = nodes[producer[output]]
        if closure & set(writer[1]):
            continue
        closures[output] = closure
    if not closures:
        return {}
    bit: dict[int, int] = {}          # a reader of some closure → its bit
    for closure in closures.values():
        for name in closure:
            for r in readers.get(name, ()):
                bit.setdefault(r, 1 << len(bit))
    above = [0] * len(nodes)          # node → the bits of the readers among its ancestors
    for index, (_, ins, _) in enumerate(nodes):
        mask = 0
        for name in ins:
            p = producer.get(name)
            if p is not None:
                mask |= above[p] | bit.get(p, 0)
        above[index] = mask
    safe = {}
    for output, closure in closures.items():
        before = above[producer[output]]
        needed = 0
        for name in closure:
            for r in readers.get(name, ()):
                needed |= bit[r]
        if needed & ~before == 0:
            safe[output] = candidates[output]
    return safe


def written_in_place(graph, groups: Sequence[Sequence[str]], writable: Iterable[str],
                     suffix: str = ".updated") -> list[dict[str, str]]:
    """For each group of a graph's outputs, each group computed by a run of its own (the nodes
    it needs, as ``onnx.utils.Extractor`` cuts them) after the groups before it, the outputs
    ``NAME`` + ``suffix`` that run may write into the buffer of its input ``NAME`` (one of
    ``writable``): of the input's dtype and rank (and size where both are known), and safe by
    ``updates_in_place`` over the run's nodes, with what a later run reads read later.
    ``graph``: an ``onnx.GraphProto``."""
    typed = {v.name: v.type.tensor_type for v in list(graph.input) + list(graph.output)}
    writable = set(writable)

    def same(a, b) -> bool:
        if a is None or b is None or a.elem_type != b.elem_type or len(a.shape.dim) != len(b.shape.dim):
            return False
        return all(not (x.dim_value and y.dim_value) or x.dim_value == y.dim_value
                   for x, y in zip(a.shape.dim, b.shape.dim))

    runs = [needed_by(graph, group) for group in groups]   # (each run's nodes, the graph inputs it reads)
    found = []
    for index, group in enumerate(groups):
        nodes, reads = runs[index]
        nodes = [(n.op_type, list(n.input), list(n.output)) for n in nodes]
        candidates = {o: o[:-len(suffix)] for o in group if o.endswith(suffix) and o[:-len(suffix)] in writable
                      and o[:-len(suffix)] in reads and same(typed.get(o), typed.get(o[:-len(suffix)]))}
        later = {n for _, names in runs[index + 1:] for n in names}
        found.append(updates_in_place(nodes, candidates, later, group) if candidates else {})
    return found


def needed_by(graph, outputs: Iterable[str]) -> tuple[list, set[str]]:
    """The nodes of ``graph`` (an ``onnx.GraphProto``) that computing ``outputs`` needs, in
    the graph's order, and the names it reads that no node makes (its inputs, initializers)."""
    producer = {o: node for node in graph.node for o in node.output if o}
    reached, stack = set(), list(outputs)
    while stack:
        name = stack.pop()
        if name and name not in reached:
            reached.add(name)
            if name in producer:
                stack.extend(producer[name].input)
    return [n for n in graph.node if any(o in reached for o in n.output)], reached - set(producer)
