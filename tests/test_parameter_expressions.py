"""Parameter expressions: weights computed from initializers through Transpose, Reshape,
Cast, DequantizeLinear, Slice and Tile chains are planned as weights — sharded by the
strategy rules, budgeted by their source initializers' bytes, and emitted as slices of
the sources with the chain replayed on the device — and a tied embedding (a Gather on
the table at the input, a MatMul with its transpose at the output) is stored once per
device."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from meshplan.cost.cluster import load_cluster_file
from meshplan.inter.pipeline import PlanOptions
from meshplan.emit.shard import shard_program
from meshplan.make_plan import make_plan, small_constants
from meshplan.model.load import fix_dims, infer_shapes
from meshplan.model.graph import build_graph
from meshplan.intra.strategies import derive, node_strategies, tied_sources, tied_spec
from meshplan.sharding import LogicalMesh, ShardingSpec
from tests.conftest import check_against_onnxruntime

WIDTH, HIDDEN = 64, 512   # the middle weight (HIDDEN x HIDDEN) is too large for folding
CHAINS = ("transpose", "reshape", "cast", "dequantize", "tile_slice")


def _const(inits: list, name: str, values, dtype=np.int64) -> str:
    inits.append(numpy_helper.from_array(np.array(values, dtype=dtype), name))
    return name


def _chained_weight(kind: str, name: str, weight: np.ndarray, nodes: list, inits: list, rng) -> str:
    """Nodes computing ``weight`` ([in, out] float32) from initializers through a ``kind`` chain."""
    out = f"{name}/w"
    rows, cols = weight.shape
    if kind == "transpose":     # stored [out, in], as a framework's Linear
        inits.append(numpy_helper.from_array(np.ascontiguousarray(weight.T), name))
        nodes.append(helper.make_node("Transpose", [name], [out], perm=[1, 0]))
    elif kind == "reshape":     # stored [in, heads, head size]
        inits.append(numpy_helper.from_array(weight.reshape(rows, cols // 16, 16), name))
        nodes.append(helper.make_node("Reshape", [name, _const(inits, f"{name}/shape", [rows, cols])], [out]))
    elif kind == "cast":        # stored float16, computed in float32
        inits.append(numpy_helper.from_array(weight.astype(np.float16), name))
        nodes.append(helper.make_node("Cast", [name], [out], to=TensorProto.FLOAT))
    elif kind == "dequantize":  # int8 [out, in] with a scale per input channel, then transposed
        scale = (np.abs(weight).max(axis=1) / 127).astype(np.float32)
        quantized = np.clip(np.round(weight.T / scale), -127, 127).astype(np.int8)
        inits.append(numpy_helper.from_array(quantized, name))
        _const(inits, f"{name}/scale", scale, np.float32)
        _const(inits, f"{name}/zero", np.zeros(rows), np.int8)
        nodes.append(helper.make_node("DequantizeLinear", [name, f"{name}/scale", f"{name}/zero"], [f"{out}/t"], axis=1))
        nodes.append(helper.make_node("Transpose", [f"{out}/t"], [out], perm=[1, 0]))
    elif kind == "tile_slice":  # the left half of a wider stored weight, tiled twice along out
        half = weight[:, : cols // 2]
        extra = rng.standard_normal((rows, 8)).astype(np.float32)
        inits.append(numpy_helper.from_array(np.concatenate([half, extra], axis=1), name))
        bounds = [_const(inits, f"{name}/{key}", value) for key, value in
                  (("starts", [0]), ("ends", [cols // 2]), ("axes", [1]))]
        nodes.append(helper.make_node("Slice", [name, *bounds], [f"{out}/half"]))
        nodes.append(helper.make_node("Tile", [f"{out}/half", _const(inits, f"{name}/repeats", [1, 2])], [out]))
    else:
        raise ValueError(kind)
    return out


def chained_mlp(kind: str, seed: int = 0) -> onnx.ModelProto:
    """x [batch, WIDTH] → three MatMuls (WIDTH→HIDDEN→HIDDEN→WIDTH) whose weights come
    through ``kind`` chains; the middle weight holds most of the parameters."""
    rng = np.random.default_rng(seed)
    nodes, inits = [], []
    x = "x"
    for i, (rows, cols) in enumerate([(WIDTH, HIDDEN), (HIDDEN, HIDDEN), (HIDDEN, WIDTH)]):
        weight = (rng.standard_normal((rows, cols)) / np.sqrt(rows)).astype(np.float32)
        w = _chained_weight(kind, f"l{i}.weight", weight, nodes, inits, rng)
        nodes.append(helper.make_node("MatMul", [x, w], [f"l{i}/mm"]))
        x = "y" if i == 2 else f"l{i}/relu"
        nodes.append(helper.make_node("Relu" if i < 2 else "Identity", [f"l{i}/mm"], [x]))
    graph = helper.make_graph(nodes, f"mlp_{kind}", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", WIDTH])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", WIDTH])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)


VOCAB, GPT_HIDDEN = 2048, 128


def tied_gpt2(layers: int = 2, hidden: int = GPT_HIDDEN, heads: int = 4, vocab: int = VOCAB, seq: int = 16,
              seed: int = 0) -> onnx.ModelProto:
    """A GPT-2-style decoder with tied embeddings: ``Gather(wte, ids)`` plus learned
    positions at the input, pre-norm attention (fused QKV, causal mask) and a GELU MLP per
    layer, a final LayerNorm, and ``MatMul(h, Transpose(wte))`` as the LM head."""
    rng = np.random.default_rng(seed)
    nodes, inits = [], []
    f32 = np.float32

    def param(name, shape, std=0.02, value=None):
        data = value if value is not None else rng.standard_normal(shape) * std
        inits.append(numpy_helper.from_array(np.asarray(data, dtype=f32), name))
        return name

    def op(op_type, inputs, out, **attrs):
        nodes.append(helper.make_node(op_type, inputs, [out], name=out, **attrs))
        return out

    def norm(x, name):
        return op("LayerNormalization", [x, param(f"{name}.weight", [hidden], value=np.ones(hidden)),
                                         param(f"{name}.bias", [hidden], value=np.zeros(hidden))], f"{name}/ln", axis=-1)

    def linear(x, name, rows, cols):
        mm = op("MatMul", [x, param(f"{name}.weight", [rows, cols])], f"{name}/mm")
        return op("Add", [mm, param(f"{name}.bias", [cols])], f"{name}/add")

    head = hidden // heads
    split_heads = _const(inits, "shape.heads", [0, seq, heads, head])
    merge_heads = _const(inits, "shape.merge", [0, seq, hidden])
    qkv_split = _const(inits, "split.qkv", [hidden] * 3)
    mask = param("causal_mask", [seq, seq], value=np.triu(np.full((seq, seq), -1e4), 1))
    scale = param("attn_scale", [], value=np.array(1 / np.sqrt(head)))
    half, root2, one = (param(f"gelu.{n}", [], value=np.array(v)) for n, v in
                        (("half", 0.5), ("root2", np.sqrt(2.0)), ("one", 1.0)))
    wte = param("wte", [vocab, hidden])
    x = op("Add", [op("Gather", [wte, "input_ids"], "embed/tok", axis=0), param("wpe", [seq, hidden])], "embed/add")
    for i in range(layers):
        p = f"h{i}"
        qkv = linear(norm(x, f"{p}.ln_1"), f"{p}.attn.c_attn", hidden, 3 * hidden)
        nodes.append(helper.make_node("Split", [qkv, qkv_split], [f"{p}/q", f"{p}/k", f"{p}/v"], name=f"{p}/split", axis=-1))
        q, k, v = (op("Transpose", [op("Reshape", [f"{p}/{r}", split_heads], f"{p}/{r}/heads")], f"{p}/{r}/t",
                      perm=[0, 2, 1, 3]) for r in "qkv")
        k_t = op("Transpose", [k], f"{p}/k/tt", perm=[0, 1, 3, 2])
        scores = op("Add", [op("Mul", [op("MatMul", [q, k_t], f"{p}/scores"), scale], f"{p}/scaled"), mask], f"{p}/masked")
        context = op("MatMul", [op("Softmax", [scores], f"{p}/probs", axis=-1), v], f"{p}/context")
        merged = op("Reshape", [op("Transpose", [context], f"{p}/context/t", perm=[0, 2, 1, 3]), merge_heads], f"{p}/merged")
        x = op("Add", [x, linear(merged, f"{p}.attn.c_proj", hidden, hidden)], f"{p}/residual1")
        up = linear(norm(x, f"{p}.ln_2"), f"{p}.mlp.c_fc", hidden, 4 * hidden)
        erf = op("Erf", [op("Div", [up, root2], f"{p}/gelu/scaled")], f"{p}/gelu/erf")
        gelu = op("Mul", [op("Mul", [up, half], f"{p}/gelu/half"), op("Add", [erf, one], f"{p}/gelu/plus1")], f"{p}/gelu")
        x = op("Add", [x, linear(gelu, f"{p}.mlp.c_proj", 4 * hidden, hidden)], f"{p}/residual2")
    final = norm(x, "ln_f")
    op("MatMul", [final, op("Transpose", [wte], "lm_head/wte_t", perm=[1, 0])], "logits")
    graph = helper.make_graph(
        nodes, "gpt2_tied", [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", seq])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", seq, vocab])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


# --- helpers -------------------------------------------------------------------------------

def parameter_bytes(model: onnx.ModelProto) -> int:
    return sum(numpy_helper.to_array(t).nbytes for t in model.graph.initializer)


def cluster_holding(fraction: float, total: int, tmp_path: Path, mesh=(1, 4)):
    path = tmp_path / "cluster.toml"
    path.write_text(f"hosts = {mesh[0]}\ndevices_per_host = {mesh[1]}\n[device]\npreset = 'h100-80g'\n"
                    f"memory_gb = {fraction * total / 1024**3!r}\n")
    return load_cluster_file(path)


def stored(plan_dir: Path, program) -> dict[str, int]:
    """Initializer name → bytes in one rank's program (external data read)."""
    model = onnx.load(str(plan_dir / program.file), load_external_data=True)
    return {t.name: numpy_helper.to_array(t).nbytes for t in model.graph.initializer}


def layouts_of(names, source: str) -> list[str]:
    """The layouts a program stores ``source`` in (its local names ``source`` or ``source@SPEC``)."""
    return [n for n in names if n == source or (n.startswith(source + "@") and "/" not in n[len(source):])]


def _plan(model: onnx.ModelProto, fraction: float, tmp_path: Path, dims: dict, microbatches: int = 2):
    path = tmp_path / "model.onnx"
    onnx.save(model, path)
    total = parameter_bytes(model)
    plan_dir = tmp_path / "plan"
    plan = make_plan(path, cluster_holding(fraction, total, tmp_path), dims, plan_dir, PlanOptions(microbatches=microbatches))
    return plan, plan_dir, total


# --- the planner's view --------------------------------------------------------------------

@pytest.mark.parametrize("kind", CHAINS)
def test_chain_results_are_parameters_computed_from_their_sources(kind):
    graph = build_graph(onnx.shape_inference.infer_shapes(chained_mlp(kind)))
    middle = graph.tensors["l1.weight/w"]
    assert middle.is_param and middle.shape == (HIDDEN, HIDDEN) and middle.sources[0] == "l1.weight"
    assert "l1.weight/w" in graph.chains
    assert [node.op_type for node in graph.nodes] == ["MatMul", "Relu", "MatMul", "Relu", "MatMul", "Identity"]
    matmul = graph.nodes[2]
    assert graph.params_of(2) == list(middle.sources) and matmul.inputs[1] == "l1.weight/w"
    # stored bytes count each initializer once, never the chain's result
    assert graph.param_bytes == sum(graph.tensors[n].nbytes for n in graph.tensors
                                    if graph.tensors[n].is_param and not graph.tensors[n].is_derived)


ROWS, COLS = ShardingSpec(("S1", "R")), ShardingSpec(("R", "S1"))   # the [in, out] weight split on 1x4


@pytest.mark.parametrize("kind, rows, cols", [
    ("transpose", ("R", "S1"), ("S1", "R")),            # stored [out, in]
    ("cast", ("S1", "R"), ("R", "S1")),
    ("reshape", ("S1", "R", "R"), ("R", "S1", "R")),    # stored [in, heads, 16]: out splits by heads
    ("tile_slice", ("S1", "R"), None),                  # out is sliced and tiled: only in splits
    ("dequantize", ("R", "S1"), ("S1", "R")),           # int8 [out, in], then transposed
])
def test_a_split_of_the_result_is_a_split_of_the_source(kind, rows, cols):
    model = onnx.shape_inference.infer_shapes(chained_mlp(kind))
    graph, constants = build_graph(model), small_constants(model)
    mesh = LogicalMesh((1, 4), (0, 1, 2, 3))
    for spec, expected in ((ROWS, rows), (COLS, cols)):
        steps = derive(graph, "l1.weight/w", spec, mesh, constants)
        if expected is None:
            assert steps is None
            continue
        assert steps[-1][1].outputs[0] == spec
        first = next(strategy for node, strategy in steps if node.inputs[0] == "l1.weight")
        assert first.inputs[0].dims == expected


def test_a_tied_table_takes_one_layout_every_reader_can_use():
    graph = build_graph(onnx.shape_inference.infer_shapes(tied_gpt2(layers=1)))
    assert set(tied_sources(graph)["wte"]) == {"wte", "lm_head/wte_t"}
    mesh = LogicalMesh((1, 4), (0, 1, 2, 3))
    # Gather splits the table only along hidden, so the head is row-parallel on the same slice
    assert tied_spec(graph, "wte", mesh) == ShardingSpec(("R", "S1"))
    head = next(node for node in graph.nodes if "lm_head/wte_t" in node.inputs)
    specs = {s.inputs[1] for s in node_strategies(head, graph, mesh)}
    assert specs == {ShardingSpec(("R", "R")), ShardingSpec(("S1", "R"))}


def test_a_table_needed_whole_and_split_is_stored_whole_and_sliced_on_the_device():
    """Gather reads the table whole, the head its hidden split: the program stores the
    table once, whole, and cuts the head's layout from it with a Slice."""
    model = infer_shapes(fix_dims(tied_gpt2(layers=1), {"batch": 2}))
    graph, constants = build_graph(model), small_constants(model)
    mesh = LogicalMesh((1, 4), (0, 1, 2, 3))
    head = next(node for node in graph.nodes if "lm_head/wte_t" in node.inputs)
    row_parallel = next(s for s in node_strategies(head, graph, mesh, constants) if s.inputs[1] == ROWS)
    program = shard_program(model, graph, {head.name: row_parallel}, mesh, 1,
                            {"input_ids": ShardingSpec(("R", "R"))}, {"logits": ShardingSpec(("R", "R", "R"))})
    assert layouts_of([t.name for t in program.graph.initializer], "wte") == ["wte"]
    cut = [node for node in program.graph.node if node.op_type == "Slice" and node.input[0] == "wte"]
    assert [node.output[0] for node in cut] == ["wte@RS1"]
    transpose = next(node for node in program.graph.node if node.op_type == "Transpose" and node.input[0] == "wte@RS1")
    assert transpose.output[0] == "lm_head/wte_t@S1R"


def test_a_chain_reading_a_graph_input_is_no_parameter():
    nodes = [helper.make_node("Transpose", ["x"], ["x_t"]), helper.make_node("Transpose", ["w"], ["w_t"]),
             helper.make_node("MatMul", ["x_t", "w_t"], ["y"])]
    w = numpy_helper.from_array(np.ones((300, 300), np.float32), "w")
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [300, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 300])], [w])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    found = build_graph(onnx.shape_inference.infer_shapes(model))
    assert set(found.chains) == {"w_t"} and found.tensors["w_t"].sources == ("w",)
    assert not found.tensors["x_t"].is_param and [n.op_type for n in found.nodes] == ["Transpose", "MatMul"]


# --- plans under mpiexec ------------------------------------------------------------------

@pytest.mark.mpi
@pytest.mark.parametrize("kind", CHAINS)
def test_chained_weights_on_devices_holding_40_percent(kind, tmp_path):
    plan, plan_dir, total = _plan(chained_mlp(kind), 0.4, tmp_path, {"batch": 8})
    for program in plan.programs:
        held = stored(plan_dir, program)
        assert sum(held.values()) <= 0.6 * total, (program.file, held, total)
        assert len(layouts_of(held, "l1.weight")) == 1, held      # the source, sliced, never its chain's result
        assert not any(name.startswith("l1.weight/w") for name in held), held
    inputs = {"x": np.random.default_rng(1).standard_normal((8, WIDTH)).astype(np.float32)}
    check_against_onnxruntime(plan, plan_dir, inputs, tmp_path)


@pytest.mark.mpi
def test_tied_gpt2_on_devices_holding_30_percent(tmp_path):
    model = tied_gpt2()
    table = VOCAB * GPT_HIDDEN * 4
    plan, plan_dir, total = _plan(model, 0.3, tmp_path, {"batch": 4})
    stage = next(s for s in plan.stages if any(op.startswith("embed/") for op in s.operators))
    assert len(stage.devices) > 1, [s.devices for s in plan.stages]   # tensor-parallel
    for program in plan.programs:
        held = stored(plan_dir, program)
        layouts = layouts_of(held, "wte")
        assert len(layouts) <= 1, (program.file, layouts)            # the table once per device
        assert sum(held[n] for n in layouts) <= table / len(stage.devices), (program.file, layouts)
        assert sum(held.values()) <= 0.3 * total, (program.file, sum(held.values()), total)
    rng = np.random.default_rng(2)
    inputs = {"input_ids": rng.integers(0, VOCAB, size=(4, 16), dtype=np.int64)}
    check_against_onnxruntime(plan, plan_dir, inputs, tmp_path)


@pytest.mark.parametrize("memory", [80e9, None], ids=["roomy", "tight"])
def test_chain_tables_of_every_start_equal_each_stages_own_chain(memory):
    """The stage DP's tables come from one chain pass over the layers with every start
    layer as a row (``chain_tables``); each entry equals the chain of that one stage
    (``IntraOpPass.stage``), the tied table's slices counted once along each path, and
    on devices too small for the fastest layouts the memory-lean ones (tight: a memory
    between the smallest and the largest stage's fastest weights)."""
    from dataclasses import replace

    from meshplan.cost.analytic import CostModel
    from meshplan.cost.cluster import make_cluster
    from meshplan.intra.intra_op import IntraOpPass
    from meshplan.model.layers import cluster_layers

    model = infer_shapes(fix_dims(tied_gpt2(layers=3), {"batch": 4}))
    graph, constants = build_graph(model), small_constants(model)
    cluster = make_cluster((1, 4), "cpu")
    cost_model = CostModel(cluster)
    layering = cluster_layers(graph, cost_model.graph_seconds(graph), 8)
    L = layering.num_layers
    roomy = IntraOpPass(graph, layering, cost_model, cluster, constants)
    seconds, weights = roomy.stage_tables((1, 4), (1, 4), 80e9)
    assert any(roomy._solutions((1, 4), (1, 4), False)(layer, "R", "R").slices for layer in range(L))   # the tie
    if memory is None:
        memory = float(np.median(weights[np.isfinite(weights)]))
    intra = IntraOpPass(graph, layering, cost_model, replace(cluster, device=replace(cluster.device, memory_bytes=memory)),
                        constants)
    seconds, weights = intra.stage_tables((1, 4), (1, 4))
    lean = 0
    for i in range(L):
        assert np.all(np.isinf(seconds[i, :i])) and np.all(np.isinf(weights[i, :i]))
        for j in range(i, L):
            want = intra.stage(i, j + 1, (1, 4), (1, 4))
            assert (seconds[i, j], weights[i, j]) == (want.seconds + want.arrival, want.param_bytes), (i, j)
            lean += want.lean
    assert bool(lean) == (memory < 80e9)


def test_layers_of_one_form_split_their_weights_as_each_alone():
    """A layer's weight slices (``IntraOpPass._split_weights``) are worked out once per
    form of layer (``_weights_form``) and renamed for the others: every layer's bytes and
    tied slices equal those worked out for it alone, on every boundary pair, fast and lean."""
    from meshplan.cost.analytic import CostModel
    from meshplan.cost.cluster import make_cluster
    from meshplan.intra.intra_op import BOUNDARY_KINDS, IntraOpPass
    from meshplan.model.layers import cluster_layers

    model = infer_shapes(fix_dims(tied_gpt2(layers=4), {"batch": 4}))
    graph, constants = build_graph(model), small_constants(model)
    cluster = make_cluster((1, 4), "cpu")
    cost_model = CostModel(cluster)
    layering = cluster_layers(graph, cost_model.graph_seconds(graph), 12)

    def split_all(alone: bool):
        intra = IntraOpPass(graph, layering, cost_model, cluster, constants)
        calls = [0]
        slices = intra.ilp.costs.param_slices

        def counted(*args):
            calls[0] += 1
            return slices(*args)

        intra.ilp.costs.param_slices = counted
        if alone:     # every layer a form of its own
            forms = intra._weights_form
            intra._weights_form = lambda layer: ((layer,) + forms(layer)[0], forms(layer)[1])
        found = {}
        for view in [((1, 4), (1, 4)), ((1, 4), (2, 2))]:
            for layer in range(layering.num_layers):
                for b_in in BOUNDARY_KINDS:
                    for b_out in BOUNDARY_KINDS:
                        for lean in (False, True):
                            got = intra._split_weights(layer, *view, b_in, b_out, lean)
                            found[(view, layer, b_in, b_out, lean)] = (got.param_bytes, got.slices, got.seconds)
        return found, calls[0], intra

    shared, calls_shared, intra = split_all(False)
    alone, calls_alone, _ = split_all(True)
    assert shared == alone
    assert calls_shared < calls_alone       # the forms were shared
    forms = [intra._weights_form(layer)[0] for layer in range(layering.num_layers)]
    assert len(set(forms)) < len(forms)
    assert any(slices for _, slices, _ in shared.values())      # the tie's slices, renamed
