"""LLMs as onnxruntime-genai's model builder writes them plan and run across devices.

The builder's Llama (8 query / 2 key-value heads), Qwen2 (8 / 4, biased QKV, tied int4
embedding) and Phi3 (8 / 8), in float32 and int4 (``sample_models/genai``), at a prefill
shape (8 tokens into a cache buffer of 16) and a decode shape (1 token after 8, the same
buffer): each loads, plans on 1x2, 1x4 and 2x2 and matches onnxruntime on the model, in
process and under mpiexec (one job per rank count). With ``--policy megatron``, and on
1x4 devices too small for a long key/value cache, GroupQueryAttention is split by heads; each
rank's key/value cache is its heads' share of the whole (a key/value head shared by two
ranks counts on both).
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import onnx
import pytest

from meshplan.cost.cluster import make_cluster
from meshplan.emit.kv_cache import kv_cache_bytes
from meshplan.inter.pipeline import PlanOptions
from meshplan.make_plan import make_plan
from meshplan.runtime.inprocess import reference_with_bounds, run_in_process
from sample_models import SAMPLE_DIR
from tests.conftest import assert_close, run_mpi_script, save_npz

MODELS = ["llama_fp32", "llama_int4", "qwen2_fp32", "qwen2_int4", "phi3_fp32", "phi3_int4"]
MESHES = [(1, 2), (1, 4), (2, 2)]
# (new tokens, cache capacity, total length): the builder's past and present share a buffer
SHAPES = {"prefill": (8, 16, 8), "decode": (1, 16, 9)}
LONG = (1, 1024, 1000)   # a decode step into a long cache, which then outweighs the weights
VOCAB, HEAD_SIZE = 320, 16


def expected_of(plan, feeds) -> tuple[dict, dict]:
    """onnxruntime's outputs and their quantization bounds (``meshplan verify``'s rule): the
    int4 models quantize activations to int8 inside MatMulNBits (the builder's accuracy_level
    4), so a last-bit difference upstream moves a logit by a quantization step on whichever
    CPU's kernels round that element the other way; the float32 models have no bound."""
    return reference_with_bounds(plan, feeds)


def model_path(name: str) -> Path:
    return SAMPLE_DIR / "genai" / name / "model.onnx"


def dims(shape: str) -> dict[str, int]:
    seq, capacity, total = LONG if shape == "long" else SHAPES[shape]
    return {"batch_size": 1, "sequence_length": seq, "past_sequence_length": capacity,
            "total_sequence_length": total, "kv_cache_dim": HEAD_SIZE}


def kv_heads(name: str) -> int:
    model = onnx.load(str(model_path(name)), load_external_data=False)
    return next(d.dim_value for d in model.graph.input[2].type.tensor_type.shape.dim if d.dim_value)


def inputs(name: str, shape: str, seed: int = 0) -> dict[str, np.ndarray]:
    seq, capacity, total = LONG if shape == "long" else SHAPES[shape]
    rng = np.random.default_rng(seed)
    model = onnx.load(str(model_path(name)), load_external_data=False)
    feeds = {"input_ids": rng.integers(0, VOCAB, (1, seq)).astype(np.int64),
             "attention_mask": np.ones((1, total), np.int64)}
    for value in model.graph.input[2:]:
        feeds[value.name] = rng.standard_normal((1, kv_heads(name), capacity, HEAD_SIZE)).astype(np.float32)
    return feeds


def attention_strategies(plan) -> list[str]:
    """The planned strategy of every GroupQueryAttention on a sharded stage (empty when none
    is on one); a replicated one is absent from plan.json, so it counts as replicated."""
    found = []
    for stage in plan.stages:
        if len(stage.devices) > 1:
            found += [stage.strategies.get(op, "R") for op in stage.operators if op.endswith("GroupQueryAttention")]
    return found


def by_heads(strategy: str) -> bool:
    """The output (first spec after ->) split on its last dim."""
    output = strategy.split("->")[1].split(",")[0] if "->" in strategy else "R"
    return output.endswith(("S0", "S1", "S01"))


@pytest.fixture(scope="module")
def planned(tmp_path_factory):
    """Every model × mesh × shape planned (automatic policy, every device holding a stage:
    the samples are small enough that the automatic plan would leave devices idle); its
    inputs and onnxruntime's outputs saved beside the plan."""
    root = tmp_path_factory.mktemp("genai")
    cases = []
    for name in MODELS:
        for mesh in MESHES:
            for shape in SHAPES:
                case = root / f"{name}_{mesh[0]}x{mesh[1]}_{shape}"
                plan = make_plan(model_path(name), make_cluster(mesh, "cpu"), dims(shape), case / "plan",
                                 PlanOptions(all_devices=True))
                feeds = inputs(name, shape, seed=len(cases))
                save_npz(case / "inputs.npz", feeds)
                expected, bounds = expected_of(plan, feeds)
                assert bool(bounds) == name.endswith("int4") and all(v > 0 for v in bounds.values()), bounds
                save_npz(case / "expected.npz", expected)
                cases.append((f"{name} {mesh[0]}x{mesh[1]} {shape}", mesh, plan, case, bounds))
    return cases


def test_builder_models_match_onnxruntime_in_process(planned):
    assert len(planned) == len(MODELS) * len(MESHES) * len(SHAPES)
    for label, _, plan, case, bounds in planned:
        feeds = dict(np.load(case / "inputs.npz"))
        expected = dict(np.load(case / "expected.npz"))
        assert set(expected) == {"logits"} | {f"present.{i}.{kv}" for i in range(2) for kv in ("key", "value")}
        try:
            assert_close(run_in_process(plan, case / "plan", feeds), expected, bounds=bounds)
        except AssertionError as exc:
            raise AssertionError(f"{label}: {exc}") from None


@pytest.mark.mpi
@pytest.mark.parametrize("ranks", [2, 4])
def test_builder_models_under_mpiexec(planned, ranks, tmp_path):
    entries = [{"name": label, "plan_dir": str(case / "plan"), "inputs": str(case / "inputs.npz"),
                "expected": str(case / "expected.npz"), "rtol": 0.0, "atol": 0.0, "bounds": bounds}
               for label, mesh, _, case, bounds in planned if mesh[0] * mesh[1] == ranks]
    manifest = tmp_path / "manifest.json"
    manifest.write_text(json.dumps(entries))
    lines = run_mpi_script("backend_cases_case.py", ranks=ranks, timeout=600, args=[manifest])
    assert len(lines) == len(entries)


@pytest.mark.parametrize("name", MODELS)
def test_megatron_splits_group_query_attention_by_heads(name, tmp_path):
    for mesh in [(1, 4), (2, 2)]:
        shape = "decode" if mesh == (1, 4) else "prefill"
        plan = make_plan(model_path(name), make_cluster(mesh, "cpu"), dims(shape), tmp_path / "plan",
                         PlanOptions(policy="megatron", max_stages=1))
        strategies = attention_strategies(plan)
        assert len(strategies) == 2 and all(by_heads(s) for s in strategies), strategies
        feeds = inputs(name, shape, seed=3)
        expected, bounds = expected_of(plan, feeds)
        assert_close(run_in_process(plan, tmp_path / "plan", feeds), expected, bounds=bounds)


def _parameter_bytes(path: Path) -> int:
    model = onnx.load(str(path), load_external_data=False)
    return sum(int(np.prod(t.dims)) * onnx.helper.tensor_dtype_to_np_dtype(t.data_type).itemsize
               for t in model.graph.initializer)


@pytest.mark.parametrize("name, fraction", [("llama_fp32", 0.35), ("qwen2_fp32", 0.4)])
def test_memory_bound_plans_split_attention_by_heads(name, fraction, tmp_path):
    """A decode step into a cache of 1024 positions on 1x4 devices that hold ``fraction`` of
    the weights and caches, in at most two stages (so that each stage spans two devices: on
    models this small the cost model's per-operator overheads make four single-device
    stages the fastest, each holding its layers' caches whole): the caches are state
    (counted once, with the weights, in the layout each device holds), and the attention
    of every multi-device stage is split by heads, the cache with it: each state is held by
    heads where it is made, and the plan records the key/value heads' segments where
    devices share a head."""
    seq, capacity, total = LONG
    cache = 2 * 2 * kv_heads(name) * capacity * HEAD_SIZE * 4   # 2 layers, key and value, float32
    limit = fraction * (_parameter_bytes(model_path(name)) + cache)
    cluster = make_cluster((1, 4), "cpu")
    cluster = replace(cluster, device=replace(cluster.device, memory_bytes=limit))
    plan = make_plan(model_path(name), cluster, dims("long"), tmp_path / "plan", PlanOptions(max_stages=2))
    assert all(stage.memory_bytes <= limit for stage in plan.stages)
    assert all(len(stage.devices) == 2 for stage in plan.stages)
    strategies = attention_strategies(plan)
    assert len(strategies) == 2 and all(by_heads(s) for s in strategies), strategies
    assert len(plan.state) == 4 and all(entry["spec"] == "RS1RR" for entry in plan.state), plan.state
    feeds = inputs(name, "long", seed=4)
    expected, bounds = expected_of(plan, feeds)
    assert_close(run_in_process(plan, tmp_path / "plan", feeds), expected, bounds=bounds)


@pytest.mark.parametrize("name, heads", [("llama_fp32", 2), ("qwen2_fp32", 4), ("llama_int4", 2)])
def test_kv_cache_per_rank_is_its_heads_share(name, heads, tmp_path):
    """On 1x4, tensor parallel: 2 key/value heads are held in pairs (each rank one head,
    half the cache), 4 are one a rank (a quarter)."""
    assert kv_heads(name) == heads
    plan = make_plan(model_path(name), make_cluster((1, 4), "cpu"), dims("decode"), tmp_path / "plan",
                     PlanOptions(policy="megatron", max_stages=1))
    layers, capacity = 2, SHAPES["decode"][1]
    total = layers * 2 * heads * capacity * HEAD_SIZE * 4          # key and value, float32
    held = kv_cache_bytes(plan, tmp_path / "plan")
    assert sorted(held) == [0, 1, 2, 3]
    for rank, program in enumerate(plan.programs):
        model = onnx.load(str(tmp_path / "plan" / program.file), load_external_data=False)
        rank_heads = {onnx.helper.get_attribute_value(a) for n in model.graph.node
                      if n.op_type == "GroupQueryAttention" for a in n.attribute if a.name == "kv_num_heads"}
        assert rank_heads == {max(1, heads // 4)}
        assert held[rank] == total * max(1, heads // 4) // heads, (rank, held[rank], total)
    assert sum(held.values()) == total * (2 if heads == 2 else 1)   # a shared head counts on both its ranks


@pytest.mark.parametrize("mesh", [(1, 2), (1, 4)])
def test_plain_op_attention_under_megatron(mesh, tmp_path):
    """Attention written in plain ops (``sample_models.llama``: Reshape to heads, MatMul,
    Softmax), one sequence: under megatron the Q, K and V projections are column-parallel
    (they are reshaped into heads, whether they widen or not), the output projection
    row- or column-parallel, every attention operator can split by heads, and the plan
    matches onnxruntime."""
    from meshplan.intra.strategies import node_strategies
    from meshplan.model.graph import build_graph
    from meshplan.model.load import canonicalize
    from meshplan.sharding import LogicalMesh
    from sample_models import make_inputs
    from sample_models.llama import make_llama

    path = tmp_path / "llama.onnx"
    onnx.save(make_llama(), str(path))
    dims_ = {"batch": 1, "seq": 8}
    plan = make_plan(path, make_cluster(mesh, "cpu"), dims_, tmp_path / "plan", PlanOptions(policy="megatron", max_stages=1))
    chosen = {op: s for stage in plan.stages for op, s in stage.strategies.items()}
    for layer in range(2):
        for role in "qkv":
            assert chosen[f"layer{layer}/attn/{role}_proj/matmul"] == "RRR,RS1->RRS1"
    graph = build_graph(canonicalize(path, dims_, tmp_path / "canonical").model)
    logical = LogicalMesh(mesh, tuple(range(mesh[0] * mesh[1])))
    for node in graph.nodes:
        if node.name.endswith(("attn/softmax", "attn/scores", "attn/context")):
            assert any(str(s).split("->")[1].startswith("RS1") for s in node_strategies(node, graph, logical)), node.name
    feeds = make_inputs(onnx.load(str(path)), dims_, seed=5)
    expected, bounds = expected_of(plan, feeds)
    assert not bounds
    assert_close(run_in_process(plan, tmp_path / "plan", feeds), expected)
