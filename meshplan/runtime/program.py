"""A device's program split at its collective nodes into segments that onnxruntime runs.

A program without collectives is one segment loaded straight from its file (external
weights included). Otherwise each run of standard nodes between two collectives becomes
its own in-memory model that still names its weights' external data, which onnxruntime
reads from the program's folder itself (no protobuf and no numpy array ever holds them:
programs over 2 GB work, and each weight is held once, on the device that runs it); the
collective that follows a segment is performed by the caller (mpi4py communicators under
mpiexec, numpy in the in-process executor).

A key/value cache of fixed capacity (onnxruntime-genai's shared past/present buffer) is
updated in place: GroupQueryAttention writes the new positions into its past buffer when
its present output is that same buffer, which is how onnxruntime-genai runs these models
(otherwise every step copies the whole cache, at every capacity). ``in_place_pairs``
finds, per segment, the present outputs that may be their past input; the caller says
which of its feeds it owns and lets be overwritten (``run(..., writable=...)``: the
resident job's state), so a cache given by someone else is never written.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import onnx
from onnx import helper

from meshplan.errors import RunError
from meshplan.model.in_place import updates_in_place
from meshplan.runtime.accumulating import applying, pruned
from meshplan.training.optimizers import idle_outputs
from meshplan.reshard.kinds import kind_of_op
from meshplan.reshard.steps import Step
from meshplan.plan_format import COLLECTIVE_DOMAIN
from meshplan.runtime.buffers import HOST, DeviceTensor
from meshplan.runtime.greedy_choice import greedy_output, with_greedy_choice
from meshplan.runtime.sessions import StageSession


# ``MESHPLAN_SEGMENT_GRAPHS=1`` in a rank's environment: a job with CUDA graphs on makes the
# integers its segments read in each of them (``remake_integers``) and lets every segment of
# a program cut at its collectives capture graphs: the experiment a GPU run measures before
# it becomes the rule (see ``ProgramRunner``).
SEGMENT_GRAPHS = "MESHPLAN_SEGMENT_GRAPHS"

# Ops whose output may be written into one of their inputs' buffer: (input, output) index
# pairs. GroupQueryAttention's present key/value are its past key/value when both are one
# buffer at a fixed capacity (a static cache: present then has past's shape).
IN_PLACE = {("com.microsoft", "GroupQueryAttention"): ((3, 1), (4, 2))}


def in_place_pairs(nodes: list[onnx.NodeProto], inputs: dict[str, onnx.ValueInfoProto],
                   outputs: dict[str, onnx.ValueInfoProto]) -> dict[str, str]:
    """Segment output → segment input whose buffer it may be written into: an op of
    ``IN_PLACE`` reading a segment input of fixed sequence capacity (dim 2) that no other
    node reads, and writing a segment output of that capacity too (or of a length left to
    the call: a shared buffer's present is the buffer). A present of another fixed length
    is a cache that grows: never paired."""
    readers: dict[str, int] = {}
    for node in nodes:
        for name in set(node.input):
            readers[name] = readers.get(name, 0) + 1
    pairs = {}
    for node in nodes:
        for source, target in IN_PLACE.get((node.domain or "", node.op_type), ()):
            if source >= len(node.input) or target >= len(node.output):
                continue
            past, present = node.input[source], node.output[target]
            if past not in inputs or present not in outputs or readers.get(past) != 1:
                continue
            dims = inputs[past].type.tensor_type.shape.dim
            if len(dims) != 4 or not dims[2].HasField("dim_value") or dims[2].dim_value <= 0:
                continue
            made = outputs[present].type.tensor_type.shape.dim
            if len(made) == 4 and made[2].HasField("dim_value") and made[2].dim_value != dims[2].dim_value:
                continue
            pairs[present] = past
    return pairs


@dataclass(frozen=True)
class Collective:
    step: Step
    input: str
    output: str


@dataclass
class Segment:
    session: StageSession | None          # None for an empty run between two collectives, or not open
    inputs: list[str]
    outputs: list[str]
    collective: Collective | None          # performed after the segment
    source: Path | bytes | None = None     # what the session is made from (None: no nodes)
    weights_dir: Path | None = None        # where a segment's external weights lie
    label: str | None = None               # what errors call it
    in_place: dict[str, str] | None = None  # output → the input whose buffer it may be written into

    def open(self, providers: list[str], threads: int = 0, spinning: bool | None = None, graphs: bool = False,
             affinities: str | None = None, training: bool = False) -> None:
        """Create the session (and so load the segment's weights) if it is not open."""
        if self.session is None and self.source is not None:
            self.session = StageSession(self.source, providers, threads, self.weights_dir, label=self.label,
                                        in_place=self.in_place, spinning=spinning, graphs=graphs,
                                        affinities=affinities, training=training)

    def close(self) -> None:
        """Drop the session and the weights it holds (``open`` loads them again)."""
        self.session = None


def _updates(nodes, updates: dict[str, str] | None, read_later: set[str], outputs, typed: dict) -> dict[str, str]:
    """The pairs of ``updates`` a run of ``nodes`` may write in place (``updates_in_place``):
    an output of its input's declared type and shape (one buffer holds both)."""
    def same(a: onnx.ValueInfoProto | None, b: onnx.ValueInfoProto | None) -> bool:
        return a is not None and b is not None and a.type.tensor_type.elem_type == b.type.tensor_type.elem_type \
            and [d.dim_value or d.dim_param for d in a.type.tensor_type.shape.dim] \
            == [d.dim_value or d.dim_param for d in b.type.tensor_type.shape.dim]

    chosen = {o: i for o, i in (updates or {}).items() if same(typed.get(o), typed.get(i))}
    if not chosen:
        return {}
    return updates_in_place([(n.op_type, list(n.input), list(n.output)) for n in nodes], chosen, read_later, outputs)


def _collective(node: onnx.NodeProto) -> Collective:
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    try:
        kind = kind_of_op(node.op_type)
    except ValueError:
        raise RunError(f"unknown collective {node.op_type} in the program") from None
    step = Step(kind, int(attrs["axis"]), attrs.get("dim"), attrs.get("to_dim"))
    return Collective(step, node.input[0], node.output[0])


_INTEGERS = {onnx.TensorProto.INT64, onnx.TensorProto.INT32, onnx.TensorProto.INT16, onnx.TensorProto.INT8,
             onnx.TensorProto.UINT64, onnx.TensorProto.UINT32, onnx.TensorProto.UINT16, onnx.TensorProto.UINT8,
             onnx.TensorProto.BOOL}
_COPIED_NODES = 16          # at most this many nodes copied to make one tensor again
_SMALL_WEIGHT = 1024        # bytes: the largest constant such a copy may read


def integers_made_where_read(runs: list[list[onnx.NodeProto]], inputs: set[str], typed: dict,
                             weights: dict) -> list[list[onnx.NodeProto]]:
    """The segments' nodes, each segment after the first also given copies of the nodes that
    make an integer tensor it reads from an earlier segment, where those nodes make only
    integer tensors from the program's inputs and small constants (a few at most): then that
    tensor is made where it is read and crosses no cut. A builder Llama's attention mask
    reformat (``seqlens_k``, ``total_sequence_length``) is such a tensor, made before the first
    collective and read by every attention after one; kept on a GPU between segments,
    GroupQueryAttention copies ``total_sequence_length`` back to the host inside the run, which
    a CUDA graph's capture refuses."""
    made_in: dict[str, tuple[int, onnx.NodeProto]] = {}
    for index, nodes in enumerate(runs):
        for node in nodes:
            for name in node.output:
                if name:
                    made_in[name] = (index, node)

    def integer(name: str) -> bool:
        if name in weights:
            tensor = weights[name]
            size = 1
            for d in tensor.dims:
                size *= d
            return tensor.data_type in _INTEGERS and size * 8 <= _SMALL_WEIGHT
        value = typed.get(name)
        return value is not None and value.type.tensor_type.elem_type in _INTEGERS

    def recipe(name: str, index: int, order: list, seen: set) -> bool:
        """Append to ``order`` the nodes that make ``name`` from inputs and small integer
        constants, producers first; False if it is not made so (or by too many)."""
        if name in inputs or name in weights:
            return integer(name)
        found = made_in.get(name)
        if found is None or found[0] >= index or not integer(name):
            return False
        node = found[1]
        if id(node) in seen:
            return True
        if any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in node.attribute):
            return False
        if not all(integer(o) for o in node.output if o):
            return False
        for i in node.input:
            if i and not recipe(i, index, order, seen):
                return False
        seen.add(id(node))
        order.append(node)
        return len(order) <= _COPIED_NODES

    copied = [list(nodes) for nodes in runs]
    for index in range(1, len(runs)):
        here = {o for node in runs[index] for o in node.output if o}
        added: list[onnx.NodeProto] = []
        for name in dict.fromkeys(i for node in runs[index] for i in node.input if i):
            if name in here or name not in made_in or made_in[name][0] >= index:
                continue
            order: list[onnx.NodeProto] = []
            if recipe(name, index, order, {id(n) for n in added}):
                added.extend(order)
        copied[index] = added + copied[index]
    return copied


class ProgramRunner:
    def __init__(self, path: Path, providers: list[str], threads: int = 0, lazy: bool = False,
                 spinning: bool | None = None, graphs: bool = False, affinities: str | None = None,
                 remake_integers: bool = False, choose: str | None = None, updates: dict[str, str] | None = None,
                 model: onnx.ModelProto | None = None):
        """``lazy``: open no session yet; the caller opens them (``open``), or opens and closes
        each segment (``Segment.open``/``close``), so that only the segments it runs hold weights.
        ``spinning``, ``graphs``, ``affinities``: see ``StageSession``. Only a program of one segment captures
        CUDA graphs: the segments of a program cut at its collectives pass shape values that
        onnxruntime copies between the GPU and the host inside a run, which a capture refuses
        (seen on an H200: "operation not permitted when stream is capturing").
        ``remake_integers``: each segment makes again the integer tensors it reads from an
        earlier one (``integers_made_where_read``), so that none crosses a cut (and none is
        handed on: a segment's outputs are what a later one reads and does not make): the step
        before graphs in programs of several segments, off until a GPU run shows it (on the
        CPU the copied nodes cost 1-5% of the int4 Llama's 1x2 decode step); a job turns both
        on with ``SEGMENT_GRAPHS`` (``open(..., graphs_in_segments=True)``).
        ``choose``: an output of logits to choose the next token from where they are computed
        (``with_greedy_choice``), in a program of one segment: ``chosen`` is then the name of
        the token ids it also returns (else None), and the logits themselves stay where they
        are computed (``keep_on``) until a caller takes them.
        ``updates``: output → the input it is the new value of (a training step's weights and
        slots); where ``model.in_place.updates_in_place`` finds it safe in a segment, the
        output may be written into the input's buffer (``in_place``, for a caller that owns it).
        ``model``: the program itself, without its weights, in place of reading ``path``'s
        (which still names its folder: a ``pruned`` program's). ``idle`` (of ``updates``): the
        state outputs a training step's call before its last microbatch gives back unchanged,
        which a call may leave out (``pruned``; ``runtime.accumulating``)."""
        self._read_after: list[set[str]] | None = None   # ``read_after``, worked out at its first use
        self._ending: list[frozenset[str]] | None = None  # ``ending_here``, likewise
        self.kept_on = None      # the device this rank's tensors are kept on (``keep_on``), if any
        self._keeping: tuple | None = None   # ``keep_on``'s arguments, for ``pruned`` and ``applying``'s programs
        header = onnx.load(str(path), load_external_data=False) if model is None else model
        self.idle = idle_outputs(header.graph, updates) if updates else {}
        self.path, self._updates, self._opened = path, updates, None
        self._header = header if self.idle else None   # (what ``pruned`` and ``applying`` start from)
        self._variants: dict = {}   # ``pruned`` and ``applying``'s programs
        self.graph_outputs = {o.name for o in header.graph.output}
        self.chosen: str | None = None
        self._choose_from: str | None = None
        if not any(n.domain == COLLECTIVE_DOMAIN for n in header.graph.node):
            weights = {t.name for t in header.graph.initializer}
            source, weights_dir = (path, None) if model is None else (model.SerializeToString(), path.parent.resolve())
            chosen = with_greedy_choice(header, choose) if choose is not None else None
            if chosen is not None:   # the same program in memory, its weights read from its folder
                header, weights_dir = chosen, path.parent.resolve()
                source = header.SerializeToString()
                self.chosen, self._choose_from = greedy_output(choose), choose
                self.graph_outputs.add(self.chosen)
            graph = header.graph
            pairs = in_place_pairs(list(graph.node), {v.name: v for v in graph.input if v.name not in weights},
                                   {v.name: v for v in graph.output})
            pairs.update(_updates(graph.node, updates, set(), self.graph_outputs,
                                  {v.name: v for v in list(graph.input) + list(graph.output)}))
            self.segments = [Segment(None, [v.name for v in graph.input if v.name not in weights],
                                     [v.name for v in graph.output], None, source, weights_dir, path.name, pairs)]
            self.providers = providers
            if not lazy:
                self.open(providers, threads, spinning, graphs, affinities)
            return
        model = header   # weights stay in their files; onnxruntime reads each segment's own
        graph = model.graph
        typed = {v.name: v for v in list(graph.input) + list(graph.output) + list(graph.value_info)}
        weights = {t.name: t for t in graph.initializer}
        runs: list[list[onnx.NodeProto]] = [[]]
        collectives: list[Collective] = []
        for node in graph.node:
            if node.domain == COLLECTIVE_DOMAIN:
                collectives.append(_collective(node))
                runs.append([])
            else:
                runs[-1].append(node)
        if remake_integers:
            runs = integers_made_where_read(runs, {v.name for v in graph.input}, typed, weights)
        # what each segment hands on: what a later segment or collective reads that no segment
        # between makes (a segment that makes an integer again reads its own, not the one made
        # before it: an output bound on the GPU that onnxruntime computes on the host, a shape,
        # is a copy inside the run, which a CUDA graph's capture refuses)
        needed_later = [set() for _ in runs]
        later = {o.name for o in graph.output}
        for index in range(len(runs) - 1, -1, -1):
            needed_later[index] = set(later)
            made = {o for node in runs[index] for o in node.output if o}
            later -= made
            if index > 0:
                later.add(collectives[index - 1].input)
            for node in runs[index]:
                later.update(n for n in node.input if n and n not in made)
        self.segments = []
        for index, nodes in enumerate(runs):
            produced = [o for n in nodes for o in n.output if o]
            consumed = list(dict.fromkeys(i for n in nodes for i in n.input if i))
            inputs = [i for i in consumed if i not in weights and i not in produced]
            outputs = [o for o in produced if o in needed_later[index]]
            collective = collectives[index] if index < len(collectives) else None
            source = None
            if nodes:
                used = [weights[i] for i in consumed if i in weights]
                sub = helper.make_graph(
                    nodes, f"{graph.name}/segment{index}", [typed[i] for i in inputs], [typed[o] for o in outputs], used,
                )
                sub_model = helper.make_model(sub, opset_imports=[o for o in model.opset_import if o.domain != COLLECTIVE_DOMAIN])
                sub_model.ir_version = model.ir_version
                source = sub_model.SerializeToString()
            pairs = in_place_pairs(nodes, {i: typed[i] for i in inputs}, {o: typed[o] for o in outputs})
            pairs.update(_updates(nodes, {o: i for o, i in (updates or {}).items() if o in outputs and i in inputs},
                                  needed_later[index] - set(outputs), outputs, typed))
            self.segments.append(Segment(None, inputs, outputs, collective, source, path.parent.resolve(),
                                         f"{path.name} (segment {index})", pairs))
        self.providers = providers
        if not lazy:
            self.open(providers, threads, spinning, graphs, affinities)

    @property
    def sessions(self) -> int:
        """How many onnxruntime sessions the program runs as (its segments with nodes)."""
        return sum(1 for s in self.segments if s.source is not None)

    def open(self, providers: list[str], threads: int = 0, spinning: bool | None = None, graphs: bool = False,
             affinities: str | None = None, graphs_in_segments: bool = False, training: bool = False) -> None:
        """Open every segment's session (``Segment.open``); CUDA graphs only in a program of one
        segment (see ``__init__``), or, with ``graphs_in_segments``, in every segment (to
        measure whether they capture once no integer crosses a cut: ``remake_integers``)."""
        self._opened = (providers, threads, spinning, graphs, affinities, graphs_in_segments, training)
        for segment in self.segments:
            segment.open(providers, threads, spinning, graphs and (len(self.segments) == 1 or graphs_in_segments),
                         affinities, training)
        self.providers = next((s.session.providers for s in self.segments if s.session), providers)

    def pruned(self, wanted) -> ProgramRunner:
        """This program cut down to the nodes (and collectives) the outputs ``wanted`` need,
        opened as this one is; made once for each set of outputs (``runtime.accumulating``)."""
        return self._variant(frozenset(wanted), lambda: pruned(self._header, wanted))

    def applying(self) -> ProgramRunner:
        """This program as a training step's last microbatch runs it, without the masks of its
        ``idle`` outputs (``runtime.accumulating.applying``), opened as this one is; made once."""
        return self._variant("applying", lambda: applying(self._header, self.idle))

    def _variant(self, key, make) -> ProgramRunner:
        if key not in self._variants:
            found = ProgramRunner(self.path, self.providers, lazy=True, updates=self._updates, model=make())
            if self._opened is not None:
                found.open(*self._opened)
            if self._keeping is not None:
                found.keep_on(*self._keeping)
            self._variants[key] = found
        return self._variants[key]

    def keep_on(self, device, staged: bool = True, kept=frozenset()) -> None:
        """Keep this rank's tensors on ``device`` between segments and calls
        (``StageSession.keep_on``): what a segment makes for any collective and the program's
        outputs come back to the host (``staged``: the job's transport moves host memory); what
        only a later segment reads stays on the device, and so do the logits a choice is made
        from (``choose``: the caller copies out what it takes of them) and the outputs the
        caller ``kept`` as its state (a training step's new weights and optimizer state: each
        run writes them into new buffers). Not ``staged`` (device buffers: a CUDA-aware MPI, or
        a job of one rank), every output stays a device tensor."""
        self.kept_on = device
        kept = frozenset(kept)
        self._keeping = (device, staged, kept)
        for variant in self._variants.values():
            variant.keep_on(device, staged, kept)
        collected = {s.collective.input for s in self.segments if s.collective is not None}
        for segment in self.segments:
            if segment.session is not None:
                made = set(segment.outputs)
                to_host = made & (collected | self.graph_outputs - {self._choose_from} - kept)
                segment.session.keep_on(device, to_host if staged else (), made & kept)

    @property
    def graphs(self) -> dict:
        """This rank's CUDA graphs: the segments whose sessions may capture them
        (``enabled``) of all (``segments``), the graphs captured, and onnxruntime's reasons
        where it would not load a segment with them (``refused``)."""
        sessions = [s.session for s in self.segments if s.session is not None]
        return {"enabled": sum(1 for s in sessions if s.graphs), "segments": len(sessions),
                "captured": sum(s.graph_count for s in sessions),
                "refused": sorted({s.graphs_refused for s in sessions if s.graphs_refused})}

    def release(self) -> None:
        """Let go of the buffers the sessions' kept bindings hold (``StageSession.release``)."""
        for segment in self.segments:
            if segment.session is not None:
                segment.session.release()

    def run(self, feeds: dict, collective_fn, buffers=HOST, observe=None, writable=frozenset(),
            narrow: dict | None = None, bound: bool = False, release: bool = False) -> dict:
        """Run every segment (``run_lockstep`` with this rank alone); ``collective_fn(step,
        tensor) -> tensor`` performs collectives (``observe(name, tensor)``, when given, sees
        each collective's input first). ``writable``: the feeds the caller owns, which a
        segment may update in place (its output is then that same buffer). ``narrow``: see
        ``run_lockstep``. ``bound``: the caller is done with this run's results before it
        runs the program again (``StageSession.run``). ``release``: each tensor no later
        segment or collective reads is let go once its last reader has run (a weight a
        collective gathered whole, say), so that the result holds the program's outputs only,
        and a collective whose input this run made and nothing reads afterwards is called
        as ``collective_fn(step, tensor, True)``: it may write into that tensor.

        On the host path (``buffers.HOST``) feeds and results are numpy arrays; with a
        ``DeviceBuffers`` they are device tensors and every segment runs with its inputs
        and outputs bound on that device."""
        mine = dict(feeds)
        _run_one(self, mine, collective_fn, buffers, writable, observe, narrow, bound,   # (``run_lockstep``'s)
                 release)
        return mine

    def read_after(self, index: int) -> set[str]:
        """What the segments after segment ``index`` and their collectives read."""
        if self._read_after is None:
            later: set[str] = set()
            self._read_after = [set() for _ in self.segments]
            for i in range(len(self.segments) - 1, -1, -1):
                self._read_after[i] = set(later)
                later.update(self.segments[i].inputs)
                if self.segments[i].collective is not None:
                    later.add(self.segments[i].collective.input)
        return self._read_after[index]

    def ending_here(self, index: int) -> frozenset[str]:
        """Segment ``index``'s outputs that neither a later segment nor its own collective reads
        (the ones a session keeping its tensors on a device may copy to the host as a box)."""
        if self._ending is None:
            self._ending = []
            for i, segment in enumerate(self.segments):
                later = self.read_after(i) | ({segment.collective.input} if segment.collective is not None else set())
                self._ending.append(frozenset(o for o in segment.outputs if o not in later))
        return self._ending[index]


def narrowed_box(step: Step, box: tuple, ndim: int) -> tuple | None:
    """``box`` (slices of a collective's output) as the same slices of its inputs, where
    taking them first gives what taking them after would: an all-reduce (element by
    element), an all-gather that the box leaves whole along its dim; else None."""
    box = tuple(box)[:ndim]
    if not box or all(s == slice(None) for s in box):
        return None
    if step.kind.name == "all_reduce":
        return box
    if step.kind.name == "all_gather":
        along = box[step.dim] if step.dim < len(box) else slice(None)
        if along.start in (None, 0) and along.stop is None:
            return box
    return None


def run_lockstep(runners: dict[int, ProgramRunner], values: list[dict[int, dict]], exchange, *, buffers=HOST,
                 writable=frozenset(), observe=None, around=None, after=None, narrow: dict | None = None,
                 bound: bool = False) -> None:
    """The one executor of segments: a stage's programs (``runners``, rank → its program),
    segment by segment, every rank in lockstep, on every microbatch of ``values``
    (microbatch → rank → its named tensors, updated in place). Each segment runs on each
    rank and microbatch, then the segment's collective across the ranks:
    ``exchange(step, {rank: tensor}) -> {rank: tensor}`` (MPI in a job, where this process
    holds one rank; numpy in memory for the in-process and stage-by-stage checks, which hold
    them all). ``observe(name, tensor)`` sees each collective's input first.

    ``around(index, rank, opening)``: called before (True) and after (False) a rank runs
    segment ``index`` (the stage-by-stage check loads one segment's weights at a time);
    ``after(index)``: called once segment ``index`` and its collective are done.

    ``bound``: one rank and one microbatch whose results the caller reads before the next
    run: each session may write a repeated run's outputs where it wrote the run before's
    (``StageSession.run``).

    ``narrow``: {output: box} of program outputs the caller takes only ``box`` of (the last
    position's logits of a prompt, say). Where such an output is a collective's, that no
    later segment reads, and the box commutes with it (``narrowed_box``), the box is taken
    of the collective's inputs, so that only it crosses the ranks; a session that keeps its
    tensors on a device copies only the box of such an output to the host
    (``StageSession.run``'s ``boxes``). The name then leaves ``narrow``: its value is the box
    already."""
    ranks = list(runners)
    if len(ranks) == 1 and len(values) == 1 and around is None and after is None:
        rank = ranks[0]
        _run_one(runners[rank], values[0][rank], lambda step, tensor: exchange(step, {rank: tensor})[rank], buffers,
                 writable, observe, narrow, bound)
        return
    for index, segment in enumerate(runners[ranks[0]].segments):
        for rank in ranks:
            part = runners[rank].segments[index]
            if around is not None:
                around(index, rank, True)
            session = part.session
            if session is not None:
                for held in values:
                    mine = held[rank]
                    feeds = {n: mine[n] for n in part.inputs}
                    mine.update(session.run(feeds, writable) if buffers is HOST or session.device is not None
                                else session.run_bound(feeds, buffers, writable))
            if around is not None:
                around(index, rank, False)
        c = segment.collective
        if c is not None:
            box = None
            if narrow and c.output in narrow and c.output not in runners[ranks[0]].read_after(index):
                box = narrowed_box(c.step, narrow[c.output], len(buffers.shape(values[0][ranks[0]][c.input])))
                if box is not None:
                    del narrow[c.output]
            for held in values:
                tensors = {rank: held[rank][c.input] for rank in ranks}
                if box is not None:
                    tensors = {rank: buffers.take(tensor, box) for rank, tensor in tensors.items()}
                if observe is not None:
                    for tensor in tensors.values():
                        observe(c.input, tensor)
                for rank, result in exchange(c.step, tensors).items():
                    held[rank][c.output] = result
        if after is not None:
            after(index)


def _run_one(runner: ProgramRunner, mine: dict, collective, buffers, writable, observe, narrow,
             bound: bool, release: bool = False) -> None:
    """``run_lockstep`` for one rank and one microbatch (a job's rank, a decode step): the
    same steps without the loops over ranks and microbatches; ``collective(step, tensor) ->
    tensor`` is this rank's part of each collective (``release``: see ``ProgramRunner.run``)."""
    host = buffers is HOST
    made: set[str] = set()    # what this run's segments and collectives made (not the caller's feeds)
    for index, part in enumerate(runner.segments):
        made.update(part.outputs)
        if release and index:   # what segment index - 1 and its collective were the last to read
            kept = runner.read_after(index - 1) | runner.graph_outputs
            for name in [n for n in mine if n not in kept]:
                del mine[name]
        session = part.session
        c = part.collective
        if session is not None:
            feeds = {n: mine[n] for n in part.inputs}
            if not host and session.device is None:
                mine.update(session.run_bound(feeds, buffers, writable))
            elif narrow and session.device is not None:   # outputs to the host: only their boxes
                ending = runner.ending_here(index)
                boxes = {name: box for name, box in narrow.items() if name in ending}
                mine.update(session.run(feeds, writable, bound, boxes))
                for name in boxes:   # its value is the box already
                    del narrow[name]
            else:
                mine.update(session.run(feeds, writable, bound))
        if c is None:
            continue
        tensor = mine[c.input]
        if narrow and c.output in narrow and c.output not in runner.read_after(index):
            box = narrowed_box(c.step, narrow[c.output], len(buffers.shape(tensor)))
            if box is not None:
                del narrow[c.output]
                tensor = buffers.take(tensor, box)
        if host and isinstance(tensor, DeviceTensor):   # (a feed kept on the device: the job's state)
            tensor = buffers.to_host(tensor)
        if observe is not None:
            observe(c.input, tensor)
        # a tensor this run made that nothing reads after this collective: the collective may
        # write into it (an all-reduce of a gradient sums it where it lies)
        if release and c.input in made and c.input not in runner.read_after(index) \
                and c.input not in runner.graph_outputs:
            mine[c.output] = collective(c.step, tensor, True)
        else:
            mine[c.output] = collective(c.step, tensor)
        made.add(c.output)
