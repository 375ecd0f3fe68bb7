"""Log-probabilities of the most likely tokens, computed where the logits are.

A job of one rank that chooses greedy ids next to its logits (``greedy_choice``) keeps the
logits where its program made them (on a GPU: in GPU memory). A request that asks for
``logprobs`` needs the log-softmax of a position and its top k, not the whole row: the
``LogitScorer`` runs a small onnxruntime model on the logits as they lie (an OrtValue on
the job's device, bound by address) — the box the caller asks for (``Slice``), widened to
float32 (``Cast``), ``LogSoftmax`` over the vocabulary, ``TopK`` with k = ``TOP_COUNT`` —
and only those k values and ids per position reach the host. The highest comes first, the
lower id first on a tie (as ONNX defines ``TopK``): the first id is the greedy choice.

Its two outputs are named after the logits' (``top_logprobs_output``, ``top_ids_output``);
a job lists them among its outputs, and ``Job.run(outputs={...})`` asks for them like any
other (the interpreter runs the scorer after the program, on rank 0).
"""

from __future__ import annotations

import numpy as np

# the alternatives a request may ask for per token (the OpenAI API's most): every scored
# position brings this many (fewer where the vocabulary is smaller)
TOP_COUNT = 20
TOP_SUFFIX, IDS_SUFFIX = ".top_logprobs", ".top_ids"


def top_logprobs_output(logits: str) -> str:
    """The name of the top log-probabilities of ``logits`` (float32, [..., TOP_COUNT])."""
    return logits + TOP_SUFFIX


def top_ids_output(logits: str) -> str:
    """The name of the ids of those (int64, [..., TOP_COUNT])."""
    return logits + IDS_SUFFIX


class LogitScorer:
    """The top log-probabilities of a box of the logits output ``source``, on ``providers``
    (the job's: the logits' own device); one session, built at the first call."""

    def __init__(self, source: str, providers: list, vocab):
        self.source = source
        self.count = max(1, min(TOP_COUNT, vocab)) if isinstance(vocab, int) and vocab > 0 else TOP_COUNT
        self.providers = providers
        self.outputs = (top_logprobs_output(source), top_ids_output(source))
        self._sessions: dict[tuple, object] = {}   # (rank, dtype) → session

    def __call__(self, logits, box: tuple) -> tuple[np.ndarray, np.ndarray]:
        """(top log-probabilities, their ids) of ``box`` of ``logits`` (an output of the
        program: a ``DeviceTensor`` or a numpy array), on the host. ``box``: slices over the
        outputs' dims (the logits' less the vocabulary, then the top k's)."""
        from meshplan.runtime.buffers import DeviceTensor

        shape = logits.shape
        lead = list(box[:len(shape) - 1]) + [slice(None)] * (len(shape) - 1 - len(box[:len(shape) - 1]))
        bounds = [s.indices(n)[:2] for s, n in zip(lead, shape[:-1])]
        starts = np.array([a for a, _ in bounds] + [0], dtype=np.int64)
        ends = np.array([b for _, b in bounds] + [shape[-1]], dtype=np.int64)
        on_device = isinstance(logits, DeviceTensor)
        dtype = logits.dtype if on_device else np.asarray(logits).dtype
        session = self._session(len(shape), dtype)
        binding = session.io_binding()
        if on_device and logits.whole:
            binding.bind_ortvalue_input("logits", logits.value)
        elif on_device and logits.device is not None:   # a view of some rows: by its address
            binding.bind_input("logits", *logits.device, logits.dtype.type, list(shape), logits.address)
        else:
            binding.bind_cpu_input("logits", logits.numpy() if on_device else np.ascontiguousarray(logits))
        binding.bind_cpu_input("starts", starts)
        binding.bind_cpu_input("ends", ends)
        binding.bind_output("top", "cpu")
        binding.bind_output("ids", "cpu")
        session.run_with_iobinding(binding)
        top, ids = (v.numpy() for v in binding.get_outputs())
        if len(box) >= len(shape):   # a box over the k alternatives too
            top, ids = top[..., box[len(shape) - 1]], ids[..., box[len(shape) - 1]]
        return top, ids

    def _session(self, rank: int, dtype):
        key = (rank, np.dtype(dtype).str)
        found = self._sessions.get(key)
        if found is None:
            import onnxruntime as ort

            from meshplan.providers import session_options

            options = session_options(threads=1)
            options.log_severity_level = 3
            found = self._sessions[key] = ort.InferenceSession(
                scoring_model(rank, dtype, self.count).SerializeToString(), options, providers=self.providers)
        return found


def scoring_model(rank: int, dtype, count: int):
    """Slice(logits, starts, ends) → Cast to float32 → LogSoftmax → TopK(count): any shape
    of ``rank`` dims, the vocabulary last."""
    from onnx import TensorProto, helper, numpy_helper

    element = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    dims = [f"d{i}" for i in range(rank)]
    inputs = [helper.make_tensor_value_info("logits", element, dims),
              helper.make_tensor_value_info("starts", TensorProto.INT64, [rank]),
              helper.make_tensor_value_info("ends", TensorProto.INT64, [rank])]
    outputs = [helper.make_tensor_value_info("top", TensorProto.FLOAT, [f"o{i}" for i in range(rank)]),
               helper.make_tensor_value_info("ids", TensorProto.INT64, [f"o{i}" for i in range(rank)])]
    k = numpy_helper.from_array(np.array([count], dtype=np.int64), "k")
    nodes = [helper.make_node("Slice", ["logits", "starts", "ends"], ["box"]),
             helper.make_node("Cast", ["box"], ["wide"], to=TensorProto.FLOAT),
             helper.make_node("LogSoftmax", ["wide"], ["logprobs"], axis=-1),
             helper.make_node("TopK", ["logprobs", "k"], ["top", "ids"], axis=-1, largest=1, sorted=1)]
    graph = helper.make_graph(nodes, "scores", inputs, outputs, [k])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
