"""Annotations read back as hints: ``meshplan plan MODEL --hints ANNOTATED`` (or annotations
MODEL carries) keeps each annotated node's stage and layouts and plans the rest around them.
Re-planning with a plan's own annotations gives the same plan.json, byte for byte; a hint
keeping a weight replicated, one forcing a stage cut and one splitting attention heads each
show in the new plan, which still computes what onnxruntime computes (in-process and under
mpiexec); a hint that cannot hold is one line naming the node, exit 1."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import onnx
import pytest

from meshplan.emit.annotate import ANNOTATED_FILE
from meshplan.errors import HintError
from meshplan.inter import hints as stage_hints
from meshplan.make_plan import make_plan
from meshplan.model.hints import read_hints
from meshplan.sharding import ShardingSpec
from meshplan.show import show_plan
from tests.conftest import ANNOTATED_CASES, check_against_onnxruntime, run_cli

CASE_IDS = [f"{name}-{mesh[0]}x{mesh[1]}" for name, mesh in ANNOTATED_CASES]


# --- building hint files from a plan's annotations ---------------------------------------------

def hints_file(annotated: Path, out: Path, edits: dict) -> Path:
    """``annotated`` keeping the annotations of the nodes ``edits`` names only, each changed
    by its function (None: kept as planned)."""
    model = onnx.load(str(annotated), load_external_data=False)
    found = set()
    for node in model.graph.node:
        if node.name in edits:
            found.add(node.name)
            if edits[node.name] is not None:
                edits[node.name](node)
        else:
            del node.device_configurations[:]
    assert found == set(edits), set(edits) - found
    onnx.save(model, str(out))
    return out


def layout_of(tensor: str, devices: list[int], axis: int | None = None, size: int = 0, shards: int = 1):
    """Keep only ``tensor``'s spec: whole on ``devices``, or split along ``axis`` in ``shards``
    pieces over them (devices in order, each piece held by len(devices) / shards of them)."""
    def edit(node: onnx.NodeProto) -> None:
        config = node.device_configurations[0]
        del config.sharding_spec[:]
        spec = config.sharding_spec.add()
        spec.tensor_name = tensor
        per = len(devices) // shards
        for k in range(shards):
            group = devices[k * per:(k + 1) * per]
            if len(group) == 1:
                spec.device.append(group[0])
            else:
                spec.device.append(-(k + 1))
                entry = spec.index_to_device_group_map.add()
                entry.key = -(k + 1)
                entry.value.extend(group)
        if axis is not None:
            dim = spec.sharded_dim.add()
            dim.axis = axis
            simple = dim.simple_sharding.add()
            simple.dim_value = size
            simple.num_shards = shards
    return edit


def in_stage(stage: int):
    def edit(node: onnx.NodeProto) -> None:
        node.device_configurations[0].pipeline_stage = stage
        del node.device_configurations[0].sharding_spec[:]
    return edit


def both(*edits):
    def edit(node):
        for one in edits:
            one(node)
    return edit


def stage_of(plan, name: str):
    return next(s for s in plan.stages if name in s.operators)


def strategy_of(plan, name: str) -> list[str]:
    """The node's specs, inputs then outputs ("R…" where plan.json lists no strategy)."""
    stage = stage_of(plan, name)
    text = stage.strategies.get(name)
    return text.replace("->", ",").split(",") if text else []


# --- re-planning with a plan's own annotations --------------------------------------------------

@pytest.mark.parametrize("case_id", CASE_IDS)
def test_replanning_with_its_own_annotations_gives_the_same_plan(case_id, annotated_cases, tmp_path):
    case = annotated_cases[case_id]
    again = tmp_path / "again"
    if case_id == "gpt-2x2":   # through the command line, the plan directory as --hints
        mesh = f"{case.mesh[0]}x{case.mesh[1]}"
        dims = [arg for name, size in case.dims.items() for arg in ("--dim", f"{name}={size}")]
        done = run_cli("plan", case.model, "--mesh", mesh, "--device", "h100-80g", *dims, "--microbatches", "2",
                       "--hints", case.plan_dir, "-o", again)
        assert done.returncode == 0, done.stderr
        assert "the free plan keeps them" in done.stdout
    else:
        plan = make_plan(case.model, case.cluster, case.dims, again, case.options,
                         hints=case.plan_dir / ANNOTATED_FILE)
        assert any("the free plan keeps them" in note for note in plan.notes)
    assert (again / "plan.json").read_bytes() == (case.plan_dir / "plan.json").read_bytes()
    assert (again / ANNOTATED_FILE).read_bytes() == (case.plan_dir / ANNOTATED_FILE).read_bytes()


@pytest.mark.parametrize("case_id", ["gpt-2x2", "llama-1x4"])
def test_the_pinned_search_finds_the_same_plan(case_id, annotated_cases, tmp_path, monkeypatch):
    """With every operator pinned and every stage forced, the search itself (not the free
    plan kept) lands on the plan the annotations describe."""
    case = annotated_cases[case_id]
    checked = stage_hints.StageHints.violations
    calls = []

    def free_plan_refused(self, plan, shardings):
        calls.append(1)
        return ["(refused for the test)"] if len(calls) == 1 else checked(self, plan, shardings)

    monkeypatch.setattr(stage_hints.StageHints, "violations", free_plan_refused)
    plan = make_plan(case.model, case.cluster, case.dims, tmp_path / "pinned", case.options,
                     hints=case.plan_dir / ANNOTATED_FILE)
    assert len(calls) == 2 and any("planned around them" in note for note in plan.notes)
    want = json.loads((case.plan_dir / "plan.json").read_text())
    got = json.loads((tmp_path / "pinned" / "plan.json").read_text())
    # (the layout a stage's inputs arrive in is not an operator's and not in the annotations:
    # where a replicated and a batch-split arrival cost the same, either may be chosen)
    keys = ("operators", "devices", "submesh", "logical_mesh", "strategies", "output_specs")
    assert [{k: s[k] for k in keys} for s in got["stages"]] == [{k: s[k] for k in keys} for s in want["stages"]]
    assert got["estimate"]["latency_seconds"] == pytest.approx(want["estimate"]["latency_seconds"])


# --- hints that change the plan ---------------------------------------------------------------

@pytest.mark.mpi
def test_a_hint_keeps_a_weight_replicated(annotated_cases, tmp_path):
    case = annotated_cases["llama-1x4"]
    node, weight = "layer2/mlp/gate_proj/matmul", "layers.2.mlp.gate_proj.weight"
    stage = stage_of(case.plan, node)
    split = strategy_of(case.plan, node)
    assert len(stage.devices) > 1 and split and split[1] != "RR"       # the free plan splits it
    hints = hints_file(case.plan_dir / ANNOTATED_FILE, tmp_path / "hints.onnx",
                       {node: layout_of(weight, stage.devices)})
    plan = make_plan(case.model, case.cluster, case.dims, tmp_path / "plan", case.options, hints=hints)
    held = stage_of(plan, node)
    assert len(held.devices) == len(stage.devices)
    specs = strategy_of(plan, node)
    assert not specs or specs[1] == "RR", specs       # the weight whole on every device (no entry: all whole)
    # meshplan show says a hint decided, where the free plan's says why the search did
    pinned = rf"{re.escape(node)} \(MatMul\): [^\n]*\n\s+why: a hint pins its layouts"
    assert re.search(pinned, show_plan(tmp_path / "plan", operators=0))
    assert not re.search(pinned, show_plan(case.plan_dir, operators=0))
    check_against_onnxruntime(plan, tmp_path / "plan", case.inputs(), tmp_path)


@pytest.mark.mpi
def test_a_hint_forces_a_stage_cut(annotated_cases, tmp_path):
    case = annotated_cases["gpt-1x4"]
    before, after = "layer0/attn_residual", "layer0/ln2"
    assert stage_of(case.plan, before) is stage_of(case.plan, after)   # the free plan keeps them together
    first = stage_of(case.plan, before).index
    hints = hints_file(case.plan_dir / ANNOTATED_FILE, tmp_path / "hints.onnx",
                       {before: in_stage(first), after: in_stage(first + 1)})
    plan = make_plan(case.model, case.cluster, case.dims, tmp_path / "plan", case.options, hints=hints)
    assert stage_of(plan, before).index == first and stage_of(plan, after).index == first + 1
    assert stage_of(plan, after).operators[0] == after                 # nothing between them to place
    check_against_onnxruntime(plan, tmp_path / "plan", case.inputs(), tmp_path)


@pytest.mark.mpi
def test_a_hint_splits_attention_heads_over_a_hosts_devices(annotated_cases, tmp_path):
    case = annotated_cases["gpt-2x2"]
    node = "layer0/attn/scores"        # [batch, 4 heads, seq, seq]
    assert all(p == "R" * 4 for p in strategy_of(case.plan, node)) or not strategy_of(case.plan, node)
    host = [0, 1]
    edits = {node: both(in_stage(0), layout_of(node, host, axis=1, size=4, shards=2))}
    hints = hints_file(case.plan_dir / ANNOTATED_FILE, tmp_path / "hints.onnx", edits)
    plan = make_plan(case.model, case.cluster, case.dims, tmp_path / "plan", case.options, hints=hints)
    stage = stage_of(plan, node)
    assert stage.index == 0 and stage.devices == host
    out = ShardingSpec.parse(strategy_of(plan, node)[-1])
    assert out.dims[1] != "R" and all(p == "R" for k, p in enumerate(out.dims) if k != 1)   # split by heads
    check_against_onnxruntime(plan, tmp_path / "plan", case.inputs(), tmp_path)


def test_a_forced_cut_inside_a_layer_becomes_a_layer_boundary(annotated_cases, tmp_path):
    """With 4 coarse layers the hinted cut falls inside one: the layering gets a cut there."""
    from dataclasses import replace

    case = annotated_cases["gpt-1x4"]
    options = replace(case.options, num_layers=4)
    free = make_plan(case.model, case.cluster, case.dims, tmp_path / "free", options)
    before, after = "layer1/attn/q_proj/add", "layer1/attn/q_reshape"
    assert stage_of(free, before) is stage_of(free, after)
    first = stage_of(free, before).index
    hints = hints_file(tmp_path / "free" / ANNOTATED_FILE, tmp_path / "hints.onnx",
                       {before: in_stage(first), after: in_stage(first + 1)})
    plan = make_plan(case.model, case.cluster, case.dims, tmp_path / "plan", options, hints=hints)
    assert stage_of(plan, after).index == stage_of(plan, before).index + 1
    assert plan.solver["layers"] == free.solver["layers"] + 1


def test_annotations_inside_the_model_are_hints(annotated_cases, tmp_path):
    """A model that carries annotations is planned with them (unless told not to); the
    programs it is cut into carry none."""
    case = annotated_cases["gpt-2x2"]
    node = "layer0/attn/scores"
    hinted = hints_file(case.plan_dir / ANNOTATED_FILE, tmp_path / "h.onnx",
                        {node: both(in_stage(0), layout_of(node, [0, 1], axis=1, size=4, shards=2))})
    source = onnx.load(str(hinted), load_external_data=False)
    model = onnx.load(str(case.model))
    model.configuration.extend(source.configuration)
    (annotation,) = [n for n in source.graph.node if n.name == node][0].device_configurations
    [n for n in model.graph.node if n.name == node][0].device_configurations.append(annotation)
    model.ir_version = max(model.ir_version, 11)
    path = tmp_path / "annotated_gpt.onnx"
    onnx.save(model, str(path))
    plan = make_plan(path, case.cluster, case.dims, tmp_path / "plan", case.options)
    assert ShardingSpec.parse(strategy_of(plan, node)[-1]).dims[1] != "R"
    assert any("the annotations of annotated_gpt.onnx" in note for note in plan.notes)
    for program in plan.programs:
        emitted = onnx.load(str(tmp_path / "plan" / program.file), load_external_data=False)
        assert not emitted.configuration and not any(n.device_configurations for n in emitted.graph.node)
    free = make_plan(path, case.cluster, case.dims, tmp_path / "free", case.options, model_hints=False)
    assert [s.devices for s in free.stages] == [s.devices for s in case.plan.stages]


# --- hints that cannot hold -----------------------------------------------------------------------

def _rename(name: str):
    def edit(node):
        node.name = name
    return edit


IMPOSSIBLE = {
    "split-does-not-divide": ({"layer0/mlp/fc1/matmul": layout_of("layer0.mlp.fc1.weight", [0, 1, 2], axis=1,
                                                                    size=512, shards=3)},
                              "layer0/mlp/fc1/matmul", "does not split into 3 pieces"),
    "stage-goes-back": ({"layer0/ln1": in_stage(1), "layer0/ln2": in_stage(0)},
                        "layer0/ln2", "comes after stage 1"),
    "no-such-node": ({"layer0/ln1": _rename("layer9/ln1")}, "layer9/ln1", "no such operator"),
    "not-a-submesh": ({"layer0/ln1": layout_of("layer0/ln1", [0, 1, 2])}, "layer0/ln1", "3 devices"),
    "not-its-tensor": ({"layer0/ln1": layout_of("layer0/ln2", [0])}, "layer0/ln1", "not an input or output"),
    "no-such-strategy": ({"layer0/attn/softmax": layout_of("layer0/attn/softmax", [0, 1], axis=3, size=32,
                                                           shards=2)},
                         "layer0/attn/softmax", "no strategy of this Softmax"),
}


@pytest.mark.parametrize("kind", sorted(IMPOSSIBLE))
def test_a_hint_that_cannot_hold_names_the_node(kind, annotated_cases, tmp_path):
    case = annotated_cases["gpt-1x4"]
    edits, node, fragment = IMPOSSIBLE[kind]
    hints = hints_file(case.plan_dir / ANNOTATED_FILE, tmp_path / "bad.onnx", edits)
    with pytest.raises(HintError) as caught:
        make_plan(case.model, case.cluster, case.dims, tmp_path / "plan", case.options, hints=hints)
    message = str(caught.value)
    assert message.startswith(f"hint for node '{node}' in ") and fragment in message and "\n" not in message, message
    assert not (tmp_path / "plan").exists()


def test_on_the_command_line_it_is_one_line_and_exit_1(annotated_cases, tmp_path):
    case = annotated_cases["gpt-1x4"]
    edits, node, fragment = IMPOSSIBLE["split-does-not-divide"]
    hints = hints_file(case.plan_dir / ANNOTATED_FILE, tmp_path / "bad.onnx", edits)
    done = run_cli("plan", case.model, "--mesh", "1x4", "--dim", "batch=4", "--dim", "seq=32", "--microbatches", "2",
                   "--hints", hints, "-o", tmp_path / "plan")
    assert done.returncode == 1, done.stdout + done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"meshplan: error: hint for node '{node}'"), done.stderr
    assert fragment in lines[0] and "Traceback" not in done.stdout + done.stderr
    assert not (tmp_path / "plan").exists()


def test_hints_that_are_not_there_or_say_nothing(annotated_cases, tmp_path):
    case = annotated_cases["gpt-1x4"]
    with pytest.raises(HintError, match="hints file not found"):
        make_plan(case.model, case.cluster, case.dims, tmp_path / "p", case.options, hints=tmp_path / "missing.onnx")
    with pytest.raises(HintError, match="no multi-device annotations"):
        make_plan(case.model, case.cluster, case.dims, tmp_path / "p", case.options, hints=case.model)
    model = onnx.load(str(annotated_cases["gpt-2x2"].plan_dir / ANNOTATED_FILE), load_external_data=False)
    with pytest.raises(HintError, match="the mesh has 8 devices"):
        read_hints(model, "x", 8)
