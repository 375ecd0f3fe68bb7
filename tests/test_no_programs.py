"""Plans without programs (``meshplan plan --no-programs`` / ``--shapes-only``): plan.json,
the report and the timeline, no per-device program, and not a byte of the weights read —
a model whose external data is a sparse file plans, one whose data files are missing plans
with --shapes-only; ``meshplan run`` on such a plan is one error line."""

from __future__ import annotations

import builtins
import json
from pathlib import Path

import numpy as np
import pytest

from meshplan.cost.cluster import make_cluster
from meshplan.errors import ModelError, PlanError
from meshplan.inter.pipeline import PlanOptions
from meshplan.make_plan import make_plan
from meshplan.model.inputs import random_inputs
from meshplan.plan_format import read_plan, require_programs
from meshplan.runtime.inprocess import compare_outputs, reference_outputs, run_in_process
from sample_models.large_llama import write_large_llama
from tests.conftest import run_cli, run_mpi, save_npz

DIMS = {"batch": 2, "seq": 8}
SHAPE = dict(layers=2, hidden=256, heads=8, kv_heads=2, ffn=512, vocab=1000)


def _one_error_line(result, *fragments):
    assert result.returncode == 1, (result.returncode, result.stdout, result.stderr)
    assert "Traceback" not in result.stderr
    ours = [line for line in result.stderr.splitlines() if line.startswith("meshplan: error:")]
    assert len(set(ours)) == 1 and len(ours) >= 1, result.stderr
    for fragment in fragments:
        assert fragment in ours[0], ours[0]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """The same grouped-query decoder twice: with real weights, and with a sparse data file."""
    root = tmp_path_factory.mktemp("no_programs")
    (root / "real").mkdir()
    (root / "sparse").mkdir()
    real = write_large_llama(root / "real" / "model.onnx", **SHAPE)
    sparse = write_large_llama(root / "sparse" / "model.onnx", **SHAPE, sparse=True)
    return root, real, sparse


def test_sparse_file_has_no_blocks(models):
    root, real, sparse = models
    data = Path(sparse["data"])
    assert data.stat().st_size == real["weight_bytes"] == sparse["weight_bytes"]
    assert data.stat().st_blocks * 512 < data.stat().st_size / 10   # (almost) nothing on disk
    assert (root / "sparse" / "model.onnx").read_bytes() != b""


def test_grouped_query_attention_runs_sharded(models, tmp_path):
    """The generator's grouped-query attention (key/value heads repeated by Expand) plans
    with programs and computes what the model computes."""
    root, real, _ = models
    plan = make_plan(real["path"], make_cluster((1, 2), "cpu"), DIMS, tmp_path / "plan", PlanOptions())
    assert plan.programs and any(stage.strategies for stage in plan.stages)
    import onnx

    inputs = random_inputs(onnx.load(real["path"], load_external_data=False), DIMS)
    expected = reference_outputs(plan, inputs)
    for check in compare_outputs(run_in_process(plan, tmp_path / "plan", inputs), expected):
        assert check.ok, check


def _opened_paths(monkeypatch) -> list[str]:
    opened: list[str] = []
    real_open = builtins.open

    def spy(file, *args, **kwargs):
        opened.append(str(file))
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", spy)
    return opened


def test_plan_without_programs_reads_no_weight(models, tmp_path, monkeypatch):
    root, real, sparse = models
    cluster = make_cluster((2, 2), "h100-80g")
    with_programs = make_plan(real["path"], cluster, DIMS, tmp_path / "full", PlanOptions(microbatches=2))
    opened = _opened_paths(monkeypatch)
    plan = make_plan(sparse["path"], cluster, DIMS, tmp_path / "plan", PlanOptions(microbatches=2), programs=False)
    monkeypatch.undo()
    assert not any(path.endswith(".data") for path in opened), opened
    # annotated.onnx needs no weight byte: it refers to the model's own data file
    assert sorted(p.name for p in (tmp_path / "plan").iterdir()) == ["annotated.onnx", "plan.json", "report.txt",
                                                                    "schedule.json", "timeline.svg"]
    assert plan.programs == [] and read_plan(tmp_path / "plan").programs == []
    _same_annotations(tmp_path / "plan", tmp_path / "full", Path(sparse["path"]).parent)
    # the same plan as with programs (the emitter's collective lists aside)
    strip = [{k: v for k, v in json.loads(json.dumps(s.__dict__)).items() if k != "collectives"} for s in plan.stages]
    full = [{k: v for k, v in json.loads(json.dumps(s.__dict__)).items() if k != "collectives"}
            for s in with_programs.stages]
    assert strip == full
    assert plan.estimate == with_programs.estimate
    assert "programs: none written" in (tmp_path / "plan" / "report.txt").read_text()
    with pytest.raises(PlanError, match="no programs"):
        require_programs(plan, tmp_path / "plan")


def _same_annotations(plan_dir: Path, full_dir: Path, model_dir: Path) -> None:
    """The annotations of a plan without programs are those of the same plan with them, and
    the file passes onnx's full checker beside the model whose data file it refers to."""
    import shutil

    import onnx

    from meshplan.emit.annotate import ANNOTATED_FILE

    lean = onnx.load(str(plan_dir / ANNOTATED_FILE), load_external_data=False)
    full = onnx.load(str(full_dir / ANNOTATED_FILE), load_external_data=False)
    assert [list(n.device_configurations) for n in lean.graph.node] == \
        [list(n.device_configurations) for n in full.graph.node]
    assert any(len(n.device_configurations) for n in lean.graph.node)
    external = [t for t in lean.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL]
    assert external and {e.value for t in external for e in t.external_data if e.key == "location"} == \
        {"model.onnx.data"}
    beside = model_dir / ANNOTATED_FILE
    shutil.copy(plan_dir / ANNOTATED_FILE, beside)
    try:
        onnx.checker.check_model(str(beside), full_check=True)
    finally:
        beside.unlink()


def test_missing_weights_need_shapes_only(models, tmp_path):
    root, _, sparse = models
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "model.onnx").write_bytes(Path(sparse["path"]).read_bytes())    # no data file beside it
    cluster = make_cluster((1, 2), "h100-80g")
    with pytest.raises(ModelError, match="--shapes-only"):
        make_plan(bare / "model.onnx", cluster, DIMS, tmp_path / "plan", programs=False)
    assert not (tmp_path / "plan").exists()
    plan = make_plan(bare / "model.onnx", cluster, DIMS, tmp_path / "plan", shapes_only=True)
    assert plan.programs == [] and (tmp_path / "plan" / "plan.json").is_file()
    # annotated.onnx is written from the graph alone: it refers to the data file the model names
    import onnx

    annotated = onnx.load(str(tmp_path / "plan" / "annotated.onnx"), load_external_data=False)
    assert any(len(n.device_configurations) for n in annotated.graph.node)
    locations = {e.value for t in annotated.graph.initializer for e in t.external_data if e.key == "location"}
    assert locations == {"model.onnx.data"}


def test_cli_no_programs_and_run_is_one_line(models, tmp_path):
    root, _, sparse = models
    result = run_cli("plan", sparse["path"], "--mesh", "1x2", "--dim", "batch=2", "--dim", "seq=8",
                     "--no-programs", "-o", tmp_path / "plan")
    assert result.returncode == 0, result.stderr
    assert "no programs" in result.stdout and "programs: none written" in result.stdout
    save_npz(tmp_path / "in.npz", {"input_ids": np.zeros((2, 8), dtype=np.int64)})
    _one_error_line(run_cli("run", tmp_path / "plan", "--inputs", tmp_path / "in.npz"), "has no programs")
    mpi = run_mpi(2, "run", tmp_path / "plan", "--inputs", tmp_path / "in.npz")
    _one_error_line(mpi, "has no programs")
    assert len([line for line in mpi.stderr.splitlines() if line.startswith("meshplan: error:")]) == 1
    _one_error_line(run_cli("verify", tmp_path / "plan", "--inputs", tmp_path / "in.npz"), "has no programs")


def test_ranged_plan_with_state_without_programs(tmp_path, monkeypatch):
    """A plan for ranges of sizes with state (plan format 2) plans without programs from an
    external data file it never opens: the same stages, sizes and state as with programs;
    the resident job (``meshplan run`` under mpiexec), verify and ``run_in_process``
    refuse it in one line."""
    import onnx

    from meshplan.model.sizes import parse_size
    from tests.conftest import REPO

    model = onnx.load(str(REPO / "sample_models" / "llama_optimum.onnx"))
    (tmp_path / "m").mkdir()
    path = tmp_path / "m" / "model.onnx"
    onnx.save_model(model, str(path), save_as_external_data=True, location="model.onnx.data")
    assert (tmp_path / "m" / "model.onnx.data").stat().st_size > 100_000
    dims = {"batch_size": parse_size("1:4"), "sequence_length": parse_size("1:64"),
            "past_sequence_length": parse_size("0:63")}
    cluster = make_cluster((1, 2), "cpu")
    options = PlanOptions(max_stages=1, all_devices=True)
    full = make_plan(path, cluster, dims, tmp_path / "full", options)
    opened = _opened_paths(monkeypatch)
    plan = make_plan(path, cluster, dims, tmp_path / "plan", options, programs=False)
    monkeypatch.undo()
    assert not any(name.endswith(".data") for name in opened), opened
    written = read_plan(tmp_path / "plan")
    assert written.format_version == 2 and written.is_ranged and len(written.state) == 4 and written.programs == []
    assert (written.sizes, written.state) == (full.sizes, full.state)
    assert any(stage.strategies for stage in plan.stages)
    strip = [{k: v for k, v in json.loads(json.dumps(s.__dict__)).items() if k != "collectives"} for s in plan.stages]
    assert strip == [{k: v for k, v in json.loads(json.dumps(s.__dict__)).items() if k != "collectives"}
                     for s in full.stages]
    assert plan.estimate == full.estimate
    feeds = {"input_ids": np.zeros((1, 2), np.int64), "attention_mask": np.ones((1, 2), np.int64),
             "position_ids": np.arange(2, dtype=np.int64)[None]}
    save_npz(tmp_path / "in.npz", feeds)
    with pytest.raises(PlanError, match="no programs"):
        run_in_process(written, tmp_path / "plan", feeds)
    mpi = run_mpi(2, "run", tmp_path / "plan", "--inputs", tmp_path / "in.npz")
    _one_error_line(mpi, "has no programs")
    assert len([line for line in mpi.stderr.splitlines() if line.startswith("meshplan: error:")]) == 1
    _one_error_line(run_cli("verify", tmp_path / "plan", "--inputs", tmp_path / "in.npz"), "has no programs")
