"""A session's runs with its tensors kept in onnxruntime's buffers (``StageSession.keep_on``,
``runtime.resident``): the path a GPU runs, here on OrtValues in host memory.

The jobs that run it end to end (generation on 1x2 with the cache and the tensors between
segments kept so, rows of the cache bound by address) are in ``test_generate.py`` and
``test_serve.py``; these check the session's own bookkeeping."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from meshplan.errors import RunError
from meshplan.runtime.buffers import DeviceBuffers, DeviceTensor
from meshplan.runtime.resident import MAX_GRAPHS
from meshplan.runtime.sessions import GRAPH_ID, StageSession


def _model_bytes() -> bytes:
    """y = x + 1 (kept on the device), z = y * 2 (to the host), c2 = c + x[:, :1] (a cache the
    caller owns, updated in place: an Add whose output the session may write into c)."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", "n"])
    c = helper.make_tensor_value_info("c", TensorProto.FLOAT, ["b", 1])
    nodes = [helper.make_node("Add", ["x", "one"], ["y"]), helper.make_node("Mul", ["y", "two"], ["z"]),
             helper.make_node("Slice", ["x", "zero", "one_i", "one_i"], ["first"]),
             helper.make_node("Add", ["c", "first"], ["c2"])]
    weights = [helper.make_tensor("one", TensorProto.FLOAT, [], [1.0]),
               helper.make_tensor("two", TensorProto.FLOAT, [], [2.0]),
               helper.make_tensor("zero", TensorProto.INT64, [1], [0]),
               helper.make_tensor("one_i", TensorProto.INT64, [1], [1])]
    outputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("y", "z", "c2")]
    graph = helper.make_graph(nodes, "resident", [x, c], outputs, weights)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8).SerializeToString()


@pytest.fixture
def session():
    found = StageSession(_model_bytes(), ["CPUExecutionProvider"], threads=1, in_place={"c2": "c"})
    found.keep_on(DeviceBuffers("cpu", 0, ["CPUExecutionProvider"]), to_host={"z"})
    return found


def test_outputs_stay_or_come_back_and_buffers_are_kept(session):
    device = session.device
    cache = device.from_host(np.zeros((2, 1), np.float32))
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    out = session.run({"x": x, "c": cache}, writable={"c"})
    assert isinstance(out["y"], DeviceTensor) and isinstance(out["z"], np.ndarray)
    assert np.array_equal(out["y"].numpy(), x + 1) and np.array_equal(out["z"], (x + 1) * 2)
    assert out["c2"] is cache and np.array_equal(cache.numpy(), x[:, :1])     # written where it lies
    addresses = (out["y"].address, session._resident.feeds[("x", (2, 3), "<f4")].address)
    again = session.run({"x": x + 10, "c": cache}, writable={"c"})
    assert (again["y"].address, session._resident.feeds[("x", (2, 3), "<f4")].address) == addresses
    assert np.array_equal(again["y"].numpy(), x + 11) and np.array_equal(cache.numpy(), 2 * x[:, :1] + 10)
    # another shape: other buffers, the right values; the cache not writable: a new output
    other = session.run({"x": np.ones((2, 5), np.float32), "c": cache})
    assert other["c2"] is not cache and np.array_equal(other["c2"].numpy(), cache.numpy() + 1)
    assert np.array_equal(other["y"].numpy(), np.full((2, 5), 2.0))


def test_two_shapes_taking_turns_keep_their_outputs_while_small(session, monkeypatch):
    """A prompt and a decode step take turns (two shapes, no graph): each finds the outputs
    its shape had the time before and onnxruntime allocates nothing again; the values are
    each run's own. Outputs of more than ``_OUTPUTS_KEPT`` bytes are let go, as is a third
    shape's older one."""
    from meshplan.runtime import resident

    cache = session.device.from_host(np.zeros((2, 1), np.float32))
    prompt, step = np.arange(8, dtype=np.float32).reshape(2, 4), np.ones((2, 1), np.float32)
    first = {shape: session.run({"x": x, "c": cache}, writable={"c"})["y"].address
             for shape, x in (("prompt", prompt), ("step", step))}
    allocated = []
    original = session._resident.binding.bind_output
    monkeypatch.setattr(session._resident.binding, "bind_output", lambda *a: (allocated.append(a), original(*a))[1])
    for turn in range(3):
        out = session.run({"x": prompt + turn, "c": cache}, writable={"c"})
        assert out["y"].address == first["prompt"] and np.array_equal(out["y"].numpy(), prompt + turn + 1)
        out = session.run({"x": step * turn, "c": cache}, writable={"c"})
        assert out["y"].address == first["step"] and np.array_equal(out["y"].numpy(), step * turn + 1)
    assert allocated == []
    session.run({"x": np.ones((2, 3), np.float32), "c": cache}, writable={"c"})   # a third shape
    assert set(session._resident.outputs) == {((2, 1), (2, 1)), ((2, 3), (2, 1))}
    monkeypatch.setattr(resident, "_OUTPUTS_KEPT", 8)   # now every output set is too large to keep
    session.run({"x": prompt, "c": cache}, writable={"c"})
    assert set(session._resident.outputs) == {((2, 4), (2, 1))}


def test_rows_of_a_device_tensor_are_bound_by_address(session):
    cache = session.device.from_host(np.array([[1.0], [2.0], [3.0]], np.float32))
    rows = cache[1:3]
    assert not rows.whole and rows.shape == (2, 1) and np.array_equal(rows.numpy(), [[2.0], [3.0]])
    out = session.run({"x": np.full((2, 4), 5.0, np.float32), "c": rows}, writable={"c"})
    assert out["c2"] is rows
    assert np.array_equal(cache.numpy(), [[1.0], [7.0], [8.0]])   # row 0 untouched, rows 1 and 2 updated


def test_a_call_that_repeats_its_shapes_and_addresses_gets_a_graph(session):
    """The bookkeeping of CUDA graphs (onnxruntime's CPU provider ignores the run option): the
    second run of the same shapes and addresses is given a graph id, replayed from then on; a
    new address (another cache) is another graph; at most MAX_GRAPHS."""
    session.graphs = True
    session._plain_run = ort.RunOptions()
    session._plain_run.add_run_config_entry(GRAPH_ID, "-1")
    resident = session._resident
    cache = session.device.from_host(np.zeros((1, 1), np.float32))
    x = np.ones((1, 1), np.float32)
    for step in range(4):
        out = session.run({"x": x * step, "c": cache}, writable={"c"})
        assert np.array_equal(out["z"], (x * step + 1) * 2)
        assert session.graph_count == (0 if step == 0 else 1)
    assert np.array_equal(cache.numpy(), [[0.0 + 1 + 2 + 3]])
    caches = [session.device.from_host(np.zeros((1, 1), np.float32)) for _ in range(2 * MAX_GRAPHS)]
    for _ in range(2):
        for other in caches:
            session.run({"x": x, "c": other}, writable={"c"})
    assert session.graph_count == MAX_GRAPHS
    assert all(np.array_equal(c.numpy(), [[2.0]]) for c in caches)
    assert resident.pinned == {((1, 1), (1, 1))}


def test_a_prompt_taking_turns_with_decode_steps_gets_no_graph(session):
    """With graphs, a decode step's shapes repeated get one; a prompt that comes back after
    decode steps finds its outputs kept (the run before's of another shape) but is not
    captured: the prompt runs without a graph, however often its shape comes back."""
    session.graphs = True
    session._plain_run = ort.RunOptions()
    session._plain_run.add_run_config_entry(GRAPH_ID, "-1")
    cache = session.device.from_host(np.zeros((1, 1), np.float32))
    prompt, step = np.ones((1, 4), np.float32), np.ones((1, 1), np.float32)
    for turn in range(4):
        session.run({"x": prompt * turn, "c": cache}, writable={"c"})
        for _ in range(3):
            out = session.run({"x": step * turn, "c": cache}, writable={"c"})
            assert np.array_equal(out["z"], (step * turn + 1) * 2)
    assert session.graph_count == 1 and session._resident.pinned == {((1, 1), (1, 1))}
    assert ((1, 4), (1, 1)) in session._resident.outputs     # kept, and still no graph


def test_an_output_whose_shape_follows_from_values_drops_its_graph():
    """NonZero's output has as many columns as the input has non-zeros: the buffer kept for the
    input's shape stops fitting, the run is made again on a new buffer, and the graph those
    shapes had is dropped (its buffers kept: a graph holds their addresses)."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])
    y = helper.make_tensor_value_info("y", TensorProto.INT64, None)
    graph = helper.make_graph([helper.make_node("NonZero", ["x"], ["y"])], "nonzero", [x], [y])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    session = StageSession(model.SerializeToString(), ["CPUExecutionProvider"], threads=1)
    session.keep_on(DeviceBuffers("cpu", 0, ["CPUExecutionProvider"]), to_host={"y"})
    session.graphs = True
    session._plain_run = ort.RunOptions()
    session._plain_run.add_run_config_entry(GRAPH_ID, "-1")
    two = np.array([1, 0, 2, 0], np.float32)
    for _ in range(3):
        assert session.run({"x": two})["y"].tolist() == [[0, 2]]
    assert session.graph_count == 1
    three = np.array([1, 5, 2, 0], np.float32)
    assert session.run({"x": three})["y"].tolist() == [[0, 1, 2]]
    assert session.graph_count == 0 and len(session._resident.retired) == 1
    for _ in range(3):   # these shapes are given no graph again
        assert session.run({"x": two})["y"].tolist() == [[0, 2]]
    assert session.graph_count == 0


def test_a_run_that_repeats_the_run_before_binds_nothing_again(session, monkeypatch):
    """A decode step: the same device tensors, numpy feeds of the same shapes: the numpy feeds
    are copied into their buffers and the session runs, nothing bound or looked up again; any
    change (another cache, another shape, another dtype) takes the checked path."""
    resident = session._resident
    checked = []
    graph_options = resident._graph_options
    monkeypatch.setattr(resident, "_graph_options", lambda *a: checked.append(1) or graph_options(*a))
    cache = session.device.from_host(np.zeros((2, 1), np.float32))
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    total = np.zeros((2, 1), np.float32)
    for step in range(4):
        out = session.run({"x": x + step, "c": cache}, writable={"c"})
        total += (x + step)[:, :1]
        assert np.array_equal(out["z"], (x + step + 1) * 2) and out["c2"] is cache
        assert np.array_equal(out["y"].numpy(), x + step + 1) and np.array_equal(cache.numpy(), total)
    assert len(checked) == 1   # the first run alone was checked
    other = session.device.from_host(np.ones((2, 1), np.float32))
    out = session.run({"x": x, "c": other}, writable={"c"})          # another cache: checked
    assert len(checked) == 2 and np.array_equal(other.numpy(), 1 + x[:, :1]) and np.array_equal(cache.numpy(), total)
    out = session.run({"x": x[:1], "c": other[:1]}, writable={"c"})   # other shapes: checked
    assert len(checked) == 3 and np.array_equal(out["z"], (x[:1] + 1) * 2)
    with pytest.raises(RunError, match="data type"):   # another dtype: checked, and refused
        session.run({"x": x[:1].astype(np.float64), "c": other[:1]}, writable={"c"})
    assert len(checked) == 5   # (tried once more on new output buffers, as a value-shaped output is)
    session.run({"x": x[:1], "c": other[:1]}, writable={"c"})
    out = session.run({"x": x[:1] + 1, "c": other[:1]}, writable={"c"})   # repeats: not checked
    assert len(checked) == 6 and np.array_equal(out["z"], (x[:1] + 2) * 2)


def test_a_repeated_run_with_graphs_is_checked_until_its_graph_is_settled(session, monkeypatch):
    session.graphs = True
    session._plain_run = ort.RunOptions()
    session._plain_run.add_run_config_entry(GRAPH_ID, "-1")
    resident = session._resident
    checked = []
    graph_options = resident._graph_options
    monkeypatch.setattr(resident, "_graph_options", lambda *a: checked.append(1) or graph_options(*a))
    cache = session.device.from_host(np.zeros((1, 1), np.float32))
    for step in range(5):
        out = session.run({"x": np.full((1, 1), step, np.float32), "c": cache}, writable={"c"})
        assert np.array_equal(out["z"], [[(step + 1) * 2]])
    assert len(checked) == 2 and session.graph_count == 1   # a plain run, then the graph's: replayed after
    assert np.array_equal(cache.numpy(), [[0 + 1 + 2 + 3 + 4]])
