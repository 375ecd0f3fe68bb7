"""``meshplan show``: per stage and layer the sharding of the heaviest operators and weights in
R/S notation, what each rank holds and the cost terms that decided; one line and exit 1
for a plan it cannot read."""

from __future__ import annotations

import json
import re
import shutil

from meshplan.emit.annotate import ANNOTATED_FILE
from meshplan.show import show_plan
from tests.conftest import run_cli


def test_show_prints_stages_layers_strategies_weights_ranks_and_why(annotated_cases):
    case = annotated_cases["llama-1x4"]        # a stage sharded over two devices, the others whole
    text = show_plan(case.plan_dir)
    sharded = next(s for s in case.plan.stages if len(s.devices) > 1)
    for stage in case.plan.stages:
        assert f"stage {stage.index}: layers {stage.layers[0]}-{stage.layers[1] - 1}" in text
    block = text.split(f"stage {sharded.index}: ")[1]
    for layer in range(*sharded.layers):
        assert f"layer {layer}: " in block
    # a heavy operator with its chosen strategy in R/S notation, and why
    name, strategy = next((n, s) for n, s in sharded.strategies.items() if n.endswith("matmul"))
    assert re.search(rf"{re.escape(name)} \(MatMul\): {re.escape(strategy)}, ", block)
    assert "why: chosen " in block and "compute " in block and "resharding in " in block
    # a split weight with each rank's slice; every rank of the stage
    split = re.search(r"as RS1 \(read by [^)]*\)\n\s+rank (\d+) \[:, 0:(\d+)\]; rank (\d+) \[:, \2:\d+\]", block)
    assert split and [int(split.group(1)), int(split.group(3))] == sharded.devices
    for rank in sharded.devices:
        assert re.search(rf"rank {rank}: .* estimated .*; program rank{rank}.onnx: ", block)
    one = show_plan(case.plan_dir, operators=1, weights=1, stage=sharded.index)
    assert "stage 0:" not in one and len(one) < len(text)


def test_show_on_the_command_line(annotated_cases, tmp_path):
    case = annotated_cases["gpt-2x2"]
    done = run_cli("show", case.plan_dir, "--stage", "0", "--operators", "2")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("plan: ") and "stage 0:" in done.stdout and "stage 1:" not in done.stdout
    bad = run_cli("show", case.plan_dir, "--stage", "9")
    assert bad.returncode == 1 and bad.stderr.strip() == "meshplan: error: the plan has no stage 9 (it has " \
        f"{len(case.plan.stages)})"
    missing = run_cli("show", tmp_path / "nothing")
    assert missing.returncode == 1 and len(missing.stderr.strip().splitlines()) == 1
    assert "plan directory not found" in missing.stderr


def test_show_without_annotations_shows_the_plan_alone(annotated_cases, tmp_path):
    case = annotated_cases["llama-2x2"]
    copy = tmp_path / "plan"
    shutil.copytree(case.plan_dir, copy)
    (copy / ANNOTATED_FILE).unlink()
    text = show_plan(copy)
    assert "note: no annotated.onnx" in text and "stage 0:" in text
    stranger = tmp_path / "other"          # annotations of another plan are not trusted
    shutil.copytree(case.plan_dir, stranger)
    shutil.copy(annotated_cases["llama-1x4"].plan_dir / ANNOTATED_FILE, stranger / ANNOTATED_FILE)
    assert "describes another plan" in show_plan(stranger)
    data = json.loads((case.plan_dir / "plan.json").read_text())
    assert f"latency" in text and str(len(data["stages"])) in text.splitlines()[0]
