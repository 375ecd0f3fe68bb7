"""Log-probabilities of tokens and the top k of a position, for ``logprobs``.

Rows of logits (the positions of one step, or of a prompt) are scored in one call of a
small onnxruntime graph: LogSoftmax over the vocabulary, then TopK (the largest first, the
lower id first on a tie, as ONNX defines it). onnxruntime's CPU kernels vectorise the
exponentials: 8 rows of a 32,000-token vocabulary take about 0.2 ms where numpy's float64
log-softmax and a partition took 8 x 0.45 ms, which was a quarter of a 0.1 GB model's
decode step. The logits are scored in float32 (float16 or bfloat16 ones widened first).
"""

from __future__ import annotations

import threading

import numpy as np

_held: dict = {}
_lock = threading.Lock()


def _session():
    with _lock:
        if "session" not in _held:
            import onnxruntime as ort
            from onnx import TensorProto, helper

            logits = helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["rows", "vocab"])
            count = helper.make_tensor_value_info("k", TensorProto.INT64, [1])
            outputs = [helper.make_tensor_value_info("logprobs", TensorProto.FLOAT, ["rows", "vocab"]),
                       helper.make_tensor_value_info("top", TensorProto.FLOAT, ["rows", "k"]),
                       helper.make_tensor_value_info("ids", TensorProto.INT64, ["rows", "k"])]
            graph = helper.make_graph([helper.make_node("LogSoftmax", ["logits"], ["logprobs"], axis=-1),
                                       helper.make_node("TopK", ["logprobs", "k"], ["top", "ids"], axis=-1)],
                                      "scores", [logits, count], outputs)
            model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
            options = ort.SessionOptions()
            options.intra_op_num_threads = 1    # (a few rows: a pool's hand-offs would cost more)
            options.inter_op_num_threads = 1
            _held["session"] = ort.InferenceSession(model.SerializeToString(), options,
                                                    providers=["CPUExecutionProvider"])
        return _held["session"]


class Scores:
    """The log-softmax of rows of logits and each row's ``count`` most likely ids."""

    def __init__(self, logits: np.ndarray, count: int):
        rows = np.ascontiguousarray(np.asarray(logits).reshape(-1, np.shape(logits)[-1]), dtype=np.float32)
        self.count = max(0, min(int(count), rows.shape[1]))
        self.logprobs, self.top, self.ids = _session().run(
            None, {"logits": rows, "k": np.array([max(self.count, 1)], dtype=np.int64)})

    def of(self, row: int, token: int, count: int) -> tuple[int, float, list[tuple[int, float]]]:
        """``(token, its log-probability, the count most likely (id, log-probability)s)`` at ``row``."""
        count = min(count, self.count)
        top = [(int(i), float(v)) for i, v in zip(self.ids[row, :count], self.top[row, :count])]
        return int(token), float(self.logprobs[row, token]), top


class TopScores:
    """``Scores`` of rows whose log-softmax and top k were computed where the logits are
    (``JobStepper.score``): the top log-probabilities and their ids, [..., k], one row per
    position (flattened in order). A token scored must be among its row's top k: the greedy
    choice is the first."""

    def __init__(self, top: np.ndarray, ids: np.ndarray):
        self.top = np.asarray(top).reshape(-1, np.shape(top)[-1])
        self.ids = np.asarray(ids).reshape(-1, np.shape(ids)[-1])
        self.count = self.top.shape[1]

    def of(self, row: int, token: int, count: int) -> tuple[int, float, list[tuple[int, float]]]:
        """As ``Scores.of``."""
        found = np.flatnonzero(self.ids[row] == token)
        if not len(found):
            raise ValueError(f"token {token} is not among the {self.count} most likely of its position")
        count = min(count, self.count)
        top = [(int(i), float(v)) for i, v in zip(self.ids[row, :count], self.top[row, :count])]
        return int(token), float(self.top[row, found[0]]), top
