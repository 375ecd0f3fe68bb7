"""A session's runs with its tensors kept where the provider computes (``StageSession.keep_on``).

On CUDA the job keeps the key/value cache, the step's inputs, the outputs and the tensors
passed between segments of one rank on the GPU, whatever its MPI: only what crosses ranks
or returns to the caller is copied to the host (``to_host``). Each run:

* binds a feed that is already a device tensor (the cache, or a view of some of its rows)
  where it lies, and copies a numpy feed into a buffer this session keeps per input name
  and shape (``OrtValue.update_inplace``), so a decode step finds every input at the
  address it had the step before;
* binds the outputs to buffers kept per set of input shapes (onnxruntime allocates them on
  the first run of those shapes; kept while a graph reads them, or, up to 16 MiB, for the
  shapes of the run before: a prompt and a decode step taking turns), or to the feed they
  are written into in place;
* binds again only what changed since the run before;
* writes each output the caller keeps (``given``: a training step's new weights and optimizer
  state, which the job holds as its state and feeds to the next step) into a new buffer at
  every run, so that a run never overwrites what the step before gave away: the old state is
  let go once the job holds the new one.

A session loaded with CUDA graphs (``StageSession(graphs=True)``) captures a run the second
time its shapes and device addresses repeat (a decode step) and replays the graph from
then on (onnxruntime's ``enable_cuda_graph`` with one ``gpu_graph_id`` per such run, at
most ``MAX_GRAPHS``); every other run (a prompt, a new shape) runs without. A graph reads
the addresses it was captured with: the buffers it uses are kept for the session's life,
and a run is replayed only when every address it binds is the captured one.

The same code runs with the CPU provider and OrtValues in host memory (graphs aside),
which is how it is tested on machines without a GPU.
"""

from __future__ import annotations

import numpy as np

from meshplan.runtime.buffers import DeviceTensor

MAX_GRAPHS = 8      # graphs per session: a decode shape per batch a server runs, say
_FEEDS_KEPT = 64    # numpy feeds' buffers kept (prompt pieces of many lengths come and go)
_OUTPUTS_KEPT = 16 << 20   # bytes: the run before's outputs kept for its shapes' next run, at most


class ResidentRuns:
    def __init__(self, session, device, to_host: frozenset, given: frozenset = frozenset()):
        self.session = session          # a StageSession
        self.device = device            # a DeviceBuffers: where new buffers are made
        self.to_host = to_host
        self.given = given & set(session.output_names)   # outputs the caller keeps: a new buffer each run
        self.binding = session.session.io_binding()
        self.bound: dict[tuple, tuple] = {}            # ("in"|"out", name) → (address, shape) bound
        self.feeds: dict[tuple, DeviceTensor] = {}     # (name, shape, dtype) → the buffer a numpy feed is copied to
        self.outputs: dict[tuple, dict] = {}           # input shapes → output name → its buffer
        self.last_shapes = None
        self.seen: dict[tuple, int] = {}               # a run's shapes and addresses → runs so far
        self.graphs: dict[tuple, object] = {}          # … → the run options of its graph
        self.pinned: set = set()                       # input shapes whose buffers a graph reads
        self.no_graph: set = set()                     # input shapes whose outputs were remade
        self.retired: list = []                        # their old outputs, which a graph may have read
        self.captured = 0                              # graph ids given so far (each id once)
        self.repeat = None                             # ``_Repeat`` of the last run whose graph or plain run is settled

    @property
    def graph_count(self) -> int:
        """Graphs in use (a dropped one no longer counts)."""
        return len(self.graphs)

    def run(self, feeds: dict, reused: dict[str, str], boxes: dict | None = None) -> dict:
        """``reused``: output → the feed it is written into (a device tensor the caller owns).
        ``boxes``: {output: box} of outputs returned to the host whose box alone the caller
        takes: only the box is copied (``DeviceTensor.box_numpy``) where its memory allows;
        ``boxes`` keeps the names so copied and loses the others.

        A run that repeats the run before (a decode step: the same device memory fed, numpy
        feeds of the same shapes and dtypes, the same outputs written in place) and whose
        graph is captured, or that has none to capture, copies its numpy feeds into their
        buffers and runs: everything is bound where the run before bound it (``_Repeat``)."""
        session = self.session
        repeat = self.repeat
        if self.given:
            return self._run_giving(feeds, reused, boxes)
        if repeat is not None and repeat.matches(feeds, reused):
            for name, buffer in repeat.copies:
                buffer.value.update_inplace(np.ascontiguousarray(feeds[name]))
            if repeat.graph:
                _wait_for_copies()
            try:
                session.session.run_with_iobinding(self.binding, repeat.options)
            except Exception:  # onnxruntime raises several unrelated exception types: the checked path decides
                self.repeat = None
                return self.run(feeds, reused, boxes)
            return self._results(feeds, repeat.reused, repeat.outputs, boxes)
        self.repeat = None
        asked = reused
        reused = {o: i for o, i in reused.items() if isinstance(feeds[i], DeviceTensor)}
        shapes, addresses, copies = self._bind_feeds(feeds)
        outputs = self.outputs.get(shapes)
        for name in session.output_names:
            if name in reused:
                self._bind(("out", name), feeds[reused[name]])
            elif outputs is not None:
                self._bind(("out", name), outputs[name])
            else:   # onnxruntime allocates it on the device at this run's shape
                self.binding.bind_output(name, self.device.device_type, self.device.device_id)
                self.bound.pop(("out", name), None)
        key = (shapes, tuple(addresses), tuple(feeds[reused[o]].address for o in sorted(reused)))
        # a graph only for shapes that repeat the run before's (a decode step's), not for the
        # outputs a prompt finds again after a decode step: the prompt runs without
        repeated = outputs is not None and (shapes == self.last_shapes or shapes in self.pinned)
        options = self._graph_options(key, repeated)
        try:
            session.session.run_with_iobinding(self.binding, options)
        except Exception as exc:  # onnxruntime raises several unrelated exception types
            if outputs is None:
                raise session._failed(exc) from exc
            # an output whose shape follows from values, not shapes: let onnxruntime allocate again;
            # the graphs of these shapes are dropped, the buffers they were captured with kept
            # (a graph still holds their addresses)
            self.retired.append(self.outputs.pop(shapes))
            self.graphs = {k: o for k, o in self.graphs.items() if k[0] != shapes}
            self.no_graph.add(shapes)
            self.pinned.discard(shapes)
            for name in session.output_names:
                self.bound.pop(("out", name), None)
            return self.run(feeds, reused, boxes)
        if outputs is None:
            outputs = {name: self.device.wrap(value) for name, value in zip(session.output_names,
                                                                            self.binding.get_outputs())
                       if name not in reused}
            for name, tensor in outputs.items():
                self.bound[("out", name)] = (tensor.address, tensor.shape)   # bound by onnxruntime to it
                self.binding.bind_ortvalue_output(name, tensor.value)
            # besides the graphs' buffers, the outputs of the run before of other shapes stay
            # where they are small (a prompt's and a decode step's, taking turns), else go
            for kept in [k for k in self.outputs if k not in self.pinned]:
                if kept != self.last_shapes or sum(t.nbytes for t in self.outputs[kept].values()) > _OUTPUTS_KEPT:
                    self.outputs.pop(kept)
            self.outputs[shapes] = outputs
        self.last_shapes = shapes
        settled = self.graphs.get(key) if session.graphs else None
        if (settled is not None or not session.graphs) and None not in key[1]:
            self.repeat = _Repeat(feeds, asked, reused, copies, options, settled is not None, outputs)
        return self._results(feeds, reused, outputs, boxes)

    def _run_giving(self, feeds: dict, reused: dict, boxes: dict | None) -> dict:
        """A run of a session with outputs the caller keeps (``given``): those are bound anew
        (onnxruntime allocates them on the device), the others to the buffers kept for these
        shapes; no graph, no repeat (the given outputs' addresses change every run)."""
        session = self.session
        reused = {o: i for o, i in reused.items() if isinstance(feeds[i], DeviceTensor)}
        shapes, _, _ = self._bind_feeds(feeds)
        kept = self.outputs.get(shapes)
        for name in session.output_names:
            if name in reused:
                self._bind(("out", name), feeds[reused[name]])
            elif kept is not None and name not in self.given:
                self._bind(("out", name), kept[name])
            else:
                self.binding.bind_output(name, self.device.device_type, self.device.device_id)
                self.bound.pop(("out", name), None)
        try:
            session.session.run_with_iobinding(self.binding, session._plain_run if session.graphs else None)
        except Exception as exc:  # onnxruntime raises several unrelated exception types
            raise session._failed(exc) from exc
        outputs = {name: self.device.wrap(value) for name, value in zip(session.output_names,
                                                                        self.binding.get_outputs())
                   if name not in reused}
        if kept is None:
            kept = self.outputs[shapes] = {n: t for n, t in outputs.items() if n not in self.given}
            for name, tensor in kept.items():
                self.bound[("out", name)] = (tensor.address, tensor.shape)
                self.binding.bind_ortvalue_output(name, tensor.value)
        return self._results(feeds, reused, outputs, boxes)

    def _bind_feeds(self, feeds: dict) -> tuple[tuple, list, list]:
        """Bind every feed: a device tensor where it lies, a numpy array copied into this
        session's buffer for its name and shape (strings and extension types bound as they
        are). Returns the feeds' shapes, their addresses (None for one bound by copy) and the
        (name, buffer) of each numpy feed copied."""
        shapes, addresses, copies = [], [], []
        for name in self.session.input_names:
            if name not in feeds:
                continue
            value = feeds[name]
            if isinstance(value, DeviceTensor):
                self._bind(("in", name), value)
                shapes.append(value.shape)
                addresses.append(value.address)
                continue
            array = np.asarray(value)
            shapes.append(array.shape)
            if array.dtype == object or array.dtype.isbuiltin != 1:   # strings, extension types: by copy
                self.binding.bind_cpu_input(name, array)
                self.bound.pop(("in", name), None)
                addresses.append(None)
                continue
            buffer = self._feed_buffer(name, array)
            self._bind(("in", name), buffer)
            addresses.append(buffer.address)
            copies.append((name, buffer))
        return tuple(shapes), addresses, copies

    def _results(self, feeds: dict, reused: dict, outputs: dict, boxes: dict | None) -> dict:
        """The run's outputs: a feed written in place as that feed, what returns to the host
        as numpy (its box alone where ``boxes`` asks and its memory allows), the rest as the
        device tensors they are."""
        found = {}
        for name in self.session.output_names:
            if name in reused:
                found[name] = feeds[reused[name]]
            elif name not in self.to_host:
                found[name] = outputs[name]
            else:
                box = boxes.get(name) if boxes else None
                host = outputs[name].box_numpy(box) if box is not None else None
                found[name] = host if host is not None else outputs[name].numpy()
                if host is None and boxes:
                    boxes.pop(name, None)
        if boxes:
            for name in [n for n in boxes if n in reused or n not in self.to_host or n not in found]:
                del boxes[name]
        return found

    def _bind(self, slot: tuple, tensor: DeviceTensor) -> None:
        """Bind ``tensor`` to an input or output unless it is bound there already: a whole
        OrtValue as itself, a view of some rows by its address."""
        ident = (tensor.address, tensor.shape)
        if self.bound.get(slot) == ident:
            return
        kind, name = slot
        if tensor.whole:
            (self.binding.bind_ortvalue_input if kind == "in" else self.binding.bind_ortvalue_output)(name, tensor.value)
        else:
            device_type, device_id = tensor.device or (self.device.device_type, self.device.device_id)
            bind = self.binding.bind_input if kind == "in" else self.binding.bind_output
            bind(name, device_type, device_id, tensor.dtype.type, list(tensor.shape), tensor.address)
        self.bound[slot] = ident

    def _feed_buffer(self, name: str, array: np.ndarray) -> DeviceTensor:
        key = (name, array.shape, array.dtype.str)
        buffer = self.feeds.get(key)
        if buffer is None:
            if len(self.feeds) >= _FEEDS_KEPT:   # keep what the graphs read
                kept = {s for shapes in self.pinned for s in shapes}
                self.feeds = {k: b for k, b in self.feeds.items() if k[1] in kept}
            buffer = self.feeds[key] = self.device.empty(array.shape, array.dtype)
        buffer.value.update_inplace(np.ascontiguousarray(array))
        return buffer

    def _graph_options(self, key: tuple, repeated: bool):
        """The run options of this run: its graph's where it has one or is captured now
        (the second run of these shapes and addresses, ``repeated``: on the outputs of the
        run before, of the same shapes), else none (onnxruntime's default on a session without
        graphs; "no graph" on one with them)."""
        session = self.session
        if not session.graphs:
            return None
        options = self.graphs.get(key)
        if options is not None:
            _wait_for_copies()
            return options
        count = self.seen.get(key, 0) + 1
        shapes = key[0]
        if (count < 2 or not repeated or shapes in self.no_graph or self.captured >= MAX_GRAPHS
                or None in key[1]):
            if len(self.seen) < 4096:
                self.seen[key] = count
            return session._plain_run
        import onnxruntime as ort

        options = ort.RunOptions()
        self.captured += 1
        options.add_run_config_entry("gpu_graph_id", str(self.captured))   # never an id given before
        self.graphs[key] = options
        self.pinned.add(shapes)
        self.seen.pop(key, None)
        _wait_for_copies()
        return options


class _Repeat:
    """What a run left for the next run that repeats it (``ResidentRuns.run``): the device
    tensors it was fed (the same, or views of the same addresses and shapes), its numpy feeds'
    shapes and dtypes and the buffers they are copied into, the outputs it wrote in place,
    its run options (a graph's, or a plain run's) and its outputs' buffers. ``asked``: the
    outputs the caller asked to write in place, ``reused``: those written so."""

    __slots__ = ("device", "numpy", "asked", "reused", "copies", "options", "graph", "outputs", "count")

    def __init__(self, feeds: dict, asked: dict, reused: dict, copies: list, options, graph: bool, outputs: dict):
        self.device = {n: v for n, v in feeds.items() if isinstance(v, DeviceTensor)}
        self.numpy = {n: (buffer.shape, buffer.dtype) for n, buffer in copies}
        self.asked, self.reused = dict(asked), dict(reused)
        self.copies, self.options, self.graph, self.outputs = copies, options, graph, outputs
        self.count = len(feeds)

    def matches(self, feeds: dict, asked: dict) -> bool:
        if len(feeds) != self.count or asked != self.asked:
            return False
        for name, value in self.device.items():
            fed = feeds.get(name)
            if fed is not value and (type(fed) is not DeviceTensor or fed.address != value.address
                                     or fed.shape != value.shape):
                return False
        for name, (shape, dtype) in self.numpy.items():
            value = feeds.get(name)
            if type(value) is not np.ndarray or value.shape != shape or value.dtype != dtype:
                return False
        return True


def _wait_for_copies() -> None:
    """A graph's replay reads its inputs on onnxruntime's stream: the copies into them
    (``update_inplace``) must have landed first."""
    from meshplan.providers import cuda_synchronize

    cuda_synchronize()
