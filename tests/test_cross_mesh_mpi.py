"""Cross-mesh resharding under a real ``mpiexec -n 4``: broadcast, send/recv, all-gather
and rearrangement cases (tests/mpi_scripts/reshard_case.py), each rank checking its
slice; the runtime's collectives; a planned rearrangement end to end."""

from __future__ import annotations

import pytest

from tests.conftest import run_mpi_script


@pytest.mark.mpi
def test_reshard_cases_under_mpiexec():
    lines = run_mpi_script("reshard_case.py")
    assert len(lines) == 14, lines
    for case in ("1x2->1x2", "1x2->2x1", "1x1->1x3 bcast", "1x1->1x3 local allgather"):
        assert any(case in line for line in lines), lines


@pytest.mark.mpi
def test_reshard_with_rearrangement_in_the_source_mesh_under_mpiexec():
    """Forced send specs: the source ranks run the prepare steps (all-to-all along each
    axis, all-gather, slice) over their axis communicators, then the tasks; every
    destination rank gets exactly its slice, the same as the in-memory executor."""
    lines = [line for line in run_mpi_script("reshard_case.py") if " prepare " in f" {line} "]
    assert len(lines) == 5, lines
    for kind in ("all_to_all(axis=0", "all_to_all(axis=1", "all_gather(axis=1", "slice(axis=1"):
        assert any(kind in line for line in lines), lines


@pytest.mark.mpi
def test_runtime_collectives_match_in_memory_semantics():
    """AllReduce / AllGather / ReduceScatter / AllToAll over each mesh axis under mpiexec
    equal the in-memory executor the in-process runs use."""
    assert len(run_mpi_script("collectives_case.py")) == 60   # float64 and float16; all-reduces in place too


@pytest.mark.mpi
def test_planned_rearrangement_runs_under_mpiexec(tmp_path):
    """A plan whose resharding rearranges the tensor inside the source stage first (a
    1x2 stage's batch-split output all-gathered inside the stage before it is sent):
    in-process and under mpiexec, the outputs equal onnxruntime's."""
    import onnx

    from meshplan.cost.cluster import load_cluster_file
    from meshplan.make_plan import make_plan
    from meshplan.inter.pipeline import PlanOptions
    from sample_models import make_gpt, make_inputs
    from tests.conftest import check_against_onnxruntime

    model = tmp_path / "gpt.onnx"
    onnx.save(make_gpt(layers=2, hidden=256, heads=8, vocab=1024, max_seq=64), str(model))
    cluster = tmp_path / "cluster.toml"
    cluster.write_text("hosts = 2\ndevices_per_host = 2\n[device]\npreset = 'h100-80g'\nmemory_gb = 0.004\n")
    dims = {"batch": 2, "seq": 32}
    plan = make_plan(model, load_cluster_file(cluster), dims, tmp_path / "plan", PlanOptions(max_stages=3))
    prepared = [r for r in plan.reshardings if r.transfer.get("prepare")]
    assert prepared, "no resharding of this plan rearranges inside its source mesh any more: pick another case"
    assert all(r.transfer["send_spec"] != r.src_spec for r in prepared)
    check_against_onnxruntime(plan, tmp_path / "plan", make_inputs(onnx.load(str(model)), dims, seed=3), tmp_path)
