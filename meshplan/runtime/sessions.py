"""onnxruntime sessions for a plan's programs: provider choice and integrity checks."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from meshplan.files import HashRecord
from meshplan.errors import PlanError, RunError
from meshplan.providers import CPU, CUDA, cuda_provider, cuda_usable, session_options, shared_pool_threads
from meshplan.plan_format import Plan, Program

PROVIDERS = ("auto", "cuda", "cpu")

# onnxruntime's deterministic kernels (``use_deterministic_compute``: e.g. no atomic adds in
# CUDA reductions), for every session of this process once set: ``--deterministic``.
_deterministic = [False]

# ``MESHPLAN_ORT_LOG_LEVEL=N`` in a rank's environment: its sessions log at onnxruntime's
# severity N (0 verbose, 1 info, 2 warning, 3 error; 4, the default, fatal only, since errors
# reach the user as one line): onnxruntime's own account of a program, such as the copies
# between the host and the GPU it adds to a segment (which keep a CUDA graph from capturing).
ORT_LOG_LEVEL = "MESHPLAN_ORT_LOG_LEVEL"


def ort_log_level() -> int:
    """The severity ``ORT_LOG_LEVEL`` asks for (0 to 4), else 4."""
    import os

    text = os.environ.get(ORT_LOG_LEVEL, "").strip()
    return int(text) if text in ("0", "1", "2", "3", "4") else 4


def set_deterministic(enabled: bool) -> None:
    """Whether every session made from now on in this process asks onnxruntime for
    deterministic kernels. Set once per process (each rank parses the same command line),
    before the job loads."""
    _deterministic[0] = bool(enabled)

# The largest feed a run with no output written in place copies into a buffer bound once
# (``StageSession._bound_repeats``): a decode step's activations are kilobytes.
BOUND_FEED_BYTES = 1 << 20

# onnxruntime's run option: which CUDA graph a run captures or replays (-1: none)
GRAPH_ID = "gpu_graph_id"


def provider_name(provider) -> str:
    return provider[0] if isinstance(provider, tuple) else provider


def _with_graphs(provider) -> tuple[str, dict]:
    """The CUDA provider (with its options) that captures CUDA graphs."""
    name, options = provider if isinstance(provider, tuple) else (provider, {})
    return name, {**options, "enable_cuda_graph": "1"}


# onnxruntime's session option: the folder that the external data of a model loaded from
# bytes is read from (paths in the model are relative to it and may not leave it).
EXTERNAL_DATA_FOLDER = "session.model_external_initializers_file_folder_path"


def providers_for(choice: str, device_id: int = 0) -> list:
    """onnxruntime's providers for ``choice``; CUDA runs on GPU ``device_id``."""
    if choice not in PROVIDERS:
        raise RunError(f"unknown provider {choice!r} (choose from {', '.join(PROVIDERS)})")
    if choice == "cpu":
        return [CPU]
    if cuda_usable():
        return [cuda_provider(device_id), CPU]
    if choice == "cuda":
        raise RunError("the CUDA execution provider is not usable here (no GPU or CUDA libraries)")
    return [CPU]


def check_program_files(plan: Plan, plan_dir: Path, program: Program) -> Path:
    """The program file and its weights exist and are the ones planned (sha256; a file
    unchanged since the plan or an earlier run recorded its sum is not read again:
    ``Program.hash_record``)."""
    path = plan_dir / program.file
    if not path.is_file():
        raise PlanError(f"program {program.file} of rank {program.rank} is missing from {plan_dir}")
    record = HashRecord(plan_dir / program.hash_record)
    try:
        if record.sha256(path) != program.sha256:
            raise PlanError(f"program {program.file} was changed after planning (sha256 mismatch)",
                            hint="re-run meshplan plan")
        for name, digest in program.files[1:]:
            data_path = plan_dir / name
            if not data_path.is_file() or record.sha256(data_path) != digest:
                raise PlanError(f"weights file {name} is missing or changed since planning", hint="re-run meshplan plan")
    finally:
        record.save()
    return path


class StageSession:
    """One rank's program in onnxruntime."""

    def __init__(self, source: Path | bytes, providers: list[str], threads: int = 0,
                 weights_dir: Path | None = None, optimization: str = "all", label: str | None = None,
                 in_place: dict[str, str] | None = None, spinning: bool | None = None, graphs: bool = False,
                 affinities: str | None = None, training: bool = False):
        """``source``: a model file, or a model built in memory (its bytes). ``weights_dir``:
        where the external data files of a model given as bytes lie; onnxruntime reads
        them itself, straight into the memory it runs from (the host for the CPU provider,
        the GPU for CUDA), so no second copy of a weight stays behind in this process.
        ``optimization``: ``"all"`` (onnxruntime's default) or ``"basic"`` (only rewrites
        that keep the arithmetic: constant folding, redundant nodes). ``in_place``: output →
        the input whose buffer it may be written into (``program.in_place_pairs``). ``spinning``:
        whether onnxruntime's pool threads may spin-wait between runs (``runtime.threads``;
        None: onnxruntime's default, off for one thread). ``graphs``: on CUDA, let the session
        capture CUDA graphs (``keep_on``; a model that cannot, e.g. one with nodes on the
        CPU, loads without them). ``affinities``: the pool threads' CPUs, onnxruntime's
        ``session.intra_op_thread_affinities`` (``ThreadChoice.pool_affinities``). ``threads``,
        ``spinning`` and ``affinities`` are the process's where its sessions share one pool
        (``providers.share_one_pool``). ``training``: the program is a training step (``Job``),
        which runs once a step over large tensors: without onnxruntime's memory pattern (one
        block laid out from the first run's allocations: on a 30 M-parameter GPT's step it
        came to 410 MiB above the arena's own peak, and the step ran as fast without it) and
        without its constant folding (which turned the zeros a gradient is scattered into,
        ``ConstantOfShape`` of an activation's shape, into 48 MiB of constants held for the
        session's life; meshplan folds small constants itself)."""
        import onnxruntime as ort

        options = session_options(threads, one_arena=True)
        options.enable_mem_pattern = not training
        unfolded = {"disabled_optimizers": ["ConstantFolding"]} if training else {}
        if weights_dir is not None:
            options.add_session_config_entry(EXTERNAL_DATA_FOLDER, str(weights_dir))
        options.log_severity_level = ort_log_level()   # errors reach the user as RunError lines
        if _deterministic[0]:
            options.use_deterministic_compute = True
        if optimization == "basic":
            options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
        # Dequantize-then-compute stays that: onnxruntime's QDQ fusions would quantize
        # activations too, which is another computation than the model's.
        options.add_session_config_entry("session.disable_quant_qdq", "1")
        shared = shared_pool_threads() > 0   # the process's one pool: its own threads and spinning
        if affinities and threads > 1 and not shared:
            options.add_session_config_entry("session.intra_op_thread_affinities", affinities)
        if not shared and (spinning is False or spinning is None and threads == 1):   # cores shared with others
            options.add_session_config_entry("session.intra_op.allow_spinning", "0")
            options.add_session_config_entry("session.inter_op.allow_spinning", "0")
        label = label or ("a program segment" if isinstance(source, bytes) else Path(source).name)
        self.label = label
        model = source if isinstance(source, bytes) else str(source)
        self.graphs = False
        self.graphs_refused = None     # onnxruntime's reason, where it would not capture this model
        if graphs and providers and provider_name(providers[0]) == CUDA:
            try:
                self.session = ort.InferenceSession(model, options, providers=[_with_graphs(providers[0]),
                                                                               *providers[1:]], **unfolded)
                self.graphs = True
            except Exception as exc:  # e.g. "not all compute nodes on the CUDA EP": load it without graphs
                self.graphs_refused = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else type(exc).__name__
        if not self.graphs:
            try:
                self.session = ort.InferenceSession(model, options, providers=providers, **unfolded)
            except Exception as exc:
                raise RunError(f"onnxruntime cannot load {label}: {str(exc).splitlines()[0][:300]}") from exc
        # Models before IR 4 list their weights as (optional) inputs too: feed only what is given.
        self.input_names = [i.name for i in self.session.get_inputs()]
        self.output_names = [o.name for o in self.session.get_outputs()]
        self.providers = self.session.get_providers()
        self.in_place = dict(in_place or {})
        self.training = training
        # outputs numpy can view where onnxruntime made them (not bfloat16: no numpy type)
        self._numpy_outputs = all(o.type != "tensor(bfloat16)" for o in self.session.get_outputs())
        self._binding = None   # the in-place runs' IOBinding and what its outputs are bound to
        self._bound: dict[str, tuple] = {}
        self._repeat = None     # what a run repeating the in-place run before does (``_run_again``)
        self._plain_shapes = None   # the input shapes of the last run without outputs written in place
        self._plain_run = None  # run options of a run that is not a graph's (a session with graphs)
        if self.graphs:
            self._plain_run = ort.RunOptions()
            self._plain_run.add_run_config_entry(GRAPH_ID, "-1")
        self.device = None      # ``keep_on``: tensors stay on this device between runs

    def _reused(self, feeds: dict, writable) -> dict[str, str]:
        """The outputs written into their input's buffer on this run: the input is fed and
        ``writable``."""
        return {o: i for o, i in self.in_place.items() if i in writable and i in feeds}

    def run(self, feeds: dict[str, np.ndarray], writable=frozenset(), bound: bool = False,
            boxes: dict | None = None) -> dict[str, np.ndarray]:
        """``writable``: feeds this run may overwrite; an output written in place is returned
        as that very array. ``bound``: the caller reads this run's outputs before it runs the
        session again (one microbatch at a time): a run that repeats the input shapes of the
        run before may then bind its buffers once and write its outputs where the run before
        wrote them (``_bound_repeats``). ``boxes``: {output: box} the caller takes only the box
        of; a session that keeps its tensors on a device copies only the box of such an output
        to the host, and ``boxes`` keeps the names it did so for (an output in host memory is
        whole: ``boxes`` is emptied)."""
        if self.device is not None:   # tensors kept where the provider computes (``keep_on``)
            return self._resident.run(feeds, self._reused(feeds, writable), boxes)
        if boxes:
            boxes.clear()
        if self._repeat is not None and (bound or self._repeat[2]):   # a decode step: the run before's buffers
            found = self._run_again(feeds, writable)
            if found is not None:
                return found
        # numpy's own dtypes only: onnxruntime wraps no extension type (ml_dtypes' bfloat16)
        reused = {o: i for o, i in self._reused(feeds, writable).items()
                  if isinstance(feeds[i], np.ndarray) and feeds[i].flags.c_contiguous and feeds[i].flags.writeable
                  and feeds[i].dtype.isbuiltin == 1}
        if self.training and self._numpy_outputs and all(
                isinstance(a, np.ndarray) and a.dtype.isbuiltin == 1 and a.dtype != object for a in feeds.values()):
            return self._run_updating(feeds, reused)
        if reused or bound and self._bound_repeats(feeds):
            return self._run_in_place(feeds, reused, writable)
        try:
            values = self.session.run(self.output_names, {n: feeds[n] for n in self.input_names if n in feeds},
                                      self._plain_run)
        except Exception as exc:  # onnxruntime raises several unrelated exception types
            raise self._failed(exc) from exc
        return dict(zip(self.output_names, values))

    def _run_updating(self, feeds: dict[str, np.ndarray], reused: dict[str, str]) -> dict[str, np.ndarray]:
        """A run of a training step: the outputs that are new state written into the old
        state's buffers (``reused``: output → feed) are bound to their feeds' memory, every
        other feed is read where it lies (a gradient handed on by a collective is not copied),
        and every other output is onnxruntime's, new each run, and comes back as a view of
        the arena's block it was made in (a plain run copies each output into an array of its
        own, outside the arena: a data-parallel step's gradients, 116 MiB on a 30 M GPT)."""
        import onnxruntime as ort

        binding = self.session.io_binding()
        held = {}   # (numpy's own dtypes only: the caller checked)
        for name in self.input_names:
            if name in feeds:   # wraps the array, no copy (a written-in-place one is contiguous)
                held[name] = ort.OrtValue.ortvalue_from_numpy(np.asarray(feeds[name], order="C"))   # (0-d stays 0-d)
                binding.bind_ortvalue_input(name, held[name])
        for name in self.output_names:
            if name in reused:
                binding.bind_ortvalue_output(name, held[reused[name]])
            else:
                binding.bind_output(name, "cpu")
        try:
            self.session.run_with_iobinding(binding, self._plain_run)
        except Exception as exc:  # onnxruntime raises several unrelated exception types
            raise self._failed(exc) from exc
        return {name: feeds[reused[name]] if name in reused else value.numpy()
                for name, value in zip(self.output_names, binding.get_outputs())}

    def _bound_repeats(self, feeds: dict) -> bool:
        """Whether a run with no output written in place runs bound (``_run_in_place``): it has
        the input shapes of the run before (a decode step has, a growing cache has not) and
        small feeds (copied into the bound buffers; a large one, a cache not written in
        place, is read where it lies)."""
        shapes = []
        for name in self.input_names:
            array = feeds.get(name)
            if array is not None:
                if not isinstance(array, np.ndarray) or array.nbytes > BOUND_FEED_BYTES:
                    self._plain_shapes = None
                    return False
                shapes.append(array.shape)
        shapes = tuple(shapes)
        if shapes == self._plain_shapes:
            return True
        self._plain_shapes = shapes
        return False

    def _run_in_place(self, feeds: dict[str, np.ndarray], reused: dict[str, str],
                      writable=None) -> dict[str, np.ndarray]:
        """One IOBinding per session, kept between runs (``release`` drops it): a generation
        step runs the same segments on the same cache buffers every time, so an output written
        in place stays bound to its buffer's OrtValue while that same array is fed; the other
        inputs are copied into buffers kept per shape (``_bind_feed``); the other outputs are
        onnxruntime's, allocated by the first run of a set of input shapes and bound again on the
        next runs of those shapes (each run's value is a view of that buffer, which the next run
        of those shapes overwrites)."""
        import onnxruntime as ort

        self._repeat = None
        if self._binding is None:
            self._binding, self._bound = self.session.io_binding(), {}
        binding, bound = self._binding, self._bound
        shapes = tuple(np.shape(feeds[n]) for n in self.input_names if n in feeds)
        kept = bound.get("outputs")     # (the input shapes, their outputs' values) of the last run
        reuse = kept is not None and kept[0] == shapes
        shared = {}
        for name in self.output_names:
            source = reused.get(name)
            if source is None:   # onnxruntime allocates it, at this run's shape
                if not reuse:
                    binding.bind_output(name, "cpu")
                bound.pop(name, None)
                continue
            held = bound.get(name)
            if held is None or held[0] is not feeds[source]:
                held = bound[name] = (feeds[source], ort.OrtValue.ortvalue_from_numpy(feeds[source]))  # wraps, no copy
                binding.bind_ortvalue_output(name, held[1])
            shared[source] = held[1]
        for name in self.input_names:
            if name in shared:
                if bound.get(("input", name)) is not shared[name]:   # still bound from the last run otherwise
                    binding.bind_ortvalue_input(name, shared[name])
                    bound[("input", name)] = shared[name]
                    bound.pop(("feed", name), None)
            elif name in feeds:
                bound.pop(("input", name), None)
                self._bind_feed(binding, bound, name, feeds[name])
        try:
            self.session.run_with_iobinding(binding, self._plain_run)
        except Exception as exc:  # onnxruntime raises several unrelated exception types
            bound.pop("outputs", None)
            if reuse:   # an output whose shape follows from values, not shapes: let onnxruntime allocate
                return self._run_in_place(feeds, reused, writable)
            raise self._failed(exc) from exc
        if reuse:
            values = kept[1]
        else:
            values = {name: value for name, value in zip(self.output_names, binding.get_outputs())
                      if name not in reused}
            for name, value in values.items():   # the next run of these shapes writes into them
                binding.bind_ortvalue_output(name, value)
            bound["outputs"] = (shapes, values)
        result = {name: feeds[reused[name]] if name in reused else values[name].numpy() for name in self.output_names}
        if reuse and writable is not None and all(("input", n) in bound or ("feed", n) in bound
                                                  for n in self.input_names if n in feeds):
            # the second run of these shapes: the next run that feeds the same in-place buffers
            # and inputs of the same shapes only copies those inputs in and runs, and its
            # results are these arrays again (the same buffers)
            self._repeat = (writable, len(feeds), tuple((i, feeds[i]) for i in reused.values()),
                            tuple((n, bound[("feed", n)][1], np.shape(feeds[n]), feeds[n].dtype)
                                  for n in self.input_names if ("feed", n) in bound and n in feeds),
                            result)
        return result

    def _run_again(self, feeds: dict, writable) -> dict | None:
        """A run that repeats the in-place run recorded by ``_run_in_place``: the same
        ``writable``, the same arrays fed for the outputs written in place, the other inputs
        of the same shapes and dtypes (copied into the buffers bound to them). None, having
        done nothing, where the run differs."""
        kept_writable, count, shared, fed, result = self._repeat
        if len(feeds) != count or (writable is not kept_writable and writable != kept_writable):
            return None
        for name, array in shared:
            if feeds.get(name) is not array:
                return None
        for name, _, shape, dtype in fed:
            array = feeds.get(name)
            if not isinstance(array, np.ndarray) or array.shape != shape or array.dtype != dtype:
                return None
        for name, value, _, _ in fed:
            value.update_inplace(np.ascontiguousarray(feeds[name]))
        try:
            self.session.run_with_iobinding(self._binding, self._plain_run)
        except Exception:  # e.g. an output whose shape follows from values: the full path tries again
            self._repeat = None
            return None
        return dict(result)

    @staticmethod
    def _bind_feed(binding, bound: dict, name: str, array: np.ndarray) -> None:
        """An input the caller does not own, copied into a buffer this session keeps: bound
        once per shape, then updated in place (``OrtValue.update_inplace``), so that a decode
        step of one shape finds every input at the address it had the step before."""
        import onnxruntime as ort

        key = ("feed", name)
        held = bound.get(key)
        if held is not None and held[0] == (array.shape, array.dtype) and array.dtype.isbuiltin == 1:
            held[1].update_inplace(np.ascontiguousarray(array))
            return
        if array.dtype.isbuiltin != 1 or array.dtype == object:
            binding.bind_cpu_input(name, array)
            bound.pop(key, None)
            return
        value = ort.OrtValue.ortvalue_from_numpy(np.array(array, order="C", copy=True))
        binding.bind_ortvalue_input(name, value)
        bound[key] = ((array.shape, array.dtype), value)

    def release(self) -> None:
        """Forget the kept binding and the buffers it holds (the job's state was dropped). A
        session that keeps its tensors on the device keeps its buffers: its graphs read them."""
        self._binding, self._bound, self._repeat, self._plain_shapes = None, {}, None, None

    def keep_on(self, device, to_host=frozenset(), given=frozenset()) -> None:
        """From now on, run with every tensor where the provider computes (``device``, a
        ``DeviceBuffers``): feeds given as device tensors are bound where they lie, numpy feeds
        are copied into buffers of this session, outputs are written into buffers kept per
        call shapes and stay there, except ``to_host`` (what the caller sends or returns),
        copied out, and ``given`` (what the caller keeps: the job's new state), written into
        a new buffer at each run. On a session with graphs, a call that repeats its shapes and addresses is
        captured once and replayed (``resident.ResidentRuns``)."""
        from meshplan.runtime.resident import ResidentRuns

        self.device = device
        self._resident = ResidentRuns(self, device, frozenset(to_host), frozenset(given))

    @property
    def graph_count(self) -> int:
        """CUDA graphs this session has captured (0 without graphs)."""
        return self._resident.graph_count if self.device is not None else 0

    def _failed(self, exc: Exception) -> RunError:
        """onnxruntime's error while running (bad input values, e.g. an index out of
        range) as one line naming the model."""
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return RunError(f"onnxruntime failed running {self.label}: {text[:400]}")

    def run_bound(self, feeds: dict, buffers, writable=frozenset()) -> dict:
        """The device path: ``feeds`` are ``DeviceTensor``\\ s, bound as they are (IOBinding);
        the outputs are bound to ``buffers``' device and come back as ``DeviceTensor``\\ s,
        ready to use (the run is synchronised). An output written in place (``writable``)
        is bound to its input's tensor and returned as that tensor."""
        reused = self._reused(feeds, writable)
        binding = self.session.io_binding()
        for name in self.input_names:
            if name in feeds:
                binding.bind_ortvalue_input(name, feeds[name].value)
        for name in self.output_names:
            if name in reused:
                binding.bind_ortvalue_output(name, feeds[reused[name]].value)
            else:
                binding.bind_output(name, buffers.device_type, buffers.device_id)
        try:
            self.session.run_with_iobinding(binding, self._plain_run)
        except Exception as exc:  # onnxruntime raises several unrelated exception types
            raise self._failed(exc) from exc
        binding.synchronize_outputs()
        return {name: feeds[reused[name]] if name in reused else buffers.wrap(value)
                for name, value in zip(self.output_names, binding.get_outputs())}
