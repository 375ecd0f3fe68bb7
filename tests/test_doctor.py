"""``meshplan doctor``: what this machine has, what is missing (one line each, exit 1),
as text and JSON, alone and under mpiexec with a plan's layout."""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess

import pytest

from meshplan.doctor import Facts, diagnose
from sample_models import SAMPLES
from tests.conftest import REPO, meshplan_command, mpiexec_path, run_cli


def _doctor(*args, env_extra=None, timeout=120) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO), **(env_extra or {}))
    for name in ("PMI_SIZE", "PMI_RANK", "OMPI_COMM_WORLD_SIZE", "PMIX_SIZE", "MV2_COMM_WORLD_SIZE", "SLURM_NTASKS"):
        env.pop(name, None)
    return subprocess.run([*meshplan_command(), "doctor", *map(str, args)], capture_output=True, text=True,
                          env=env, timeout=timeout, cwd=REPO)


def _errors(done) -> list[str]:
    assert "Traceback" not in done.stderr + done.stdout
    return [line for line in done.stderr.splitlines() if line.startswith("meshplan: error:")]


def test_doctor_reports_this_machine():
    done = _doctor()
    assert done.returncode == 0, done.stdout + done.stderr
    assert _errors(done) == []
    ort = importlib.metadata.version("onnxruntime-gpu")
    assert f"onnxruntime-gpu {ort}" in done.stdout
    assert f"onnx {importlib.metadata.version('onnx')}" in done.stdout
    lines = done.stdout.splitlines()
    assert any(line.split() == ["CPU", "ok"] for line in lines), done.stdout
    assert any(line.split()[:2] == ["CBC", "ok"] for line in lines), done.stdout
    assert any(line.split()[:2] == ["HiGHS", "ok"] for line in lines), done.stdout
    assert any(line.strip().startswith("library") and "MPICH" in line for line in lines), done.stdout
    assert lines[-1].startswith("PASSED |") and lines[-1].endswith("meshplan doctor")


def test_doctor_json_is_for_scripts():
    done = _doctor("--json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["ok"] is True and report["problems"] == [] and report["launched"] is False
    (rank,) = report["ranks"]
    assert rank["versions"]["onnx"] == importlib.metadata.version("onnx")
    assert rank["versions"]["mpi4py"] == importlib.metadata.version("mpi4py")
    assert rank["solvers"] == {"cbc": None, "highs": None}
    assert rank["providers"]["CPU"] is None
    assert isinstance(rank["providers"]["CUDA"], (str, type(None)))
    assert rank["mpi"]["vendor"].startswith("MPICH") and rank["mpi"]["cuda_aware"] in (True, False, None)
    assert rank["mpiexec"]["path"].endswith("mpiexec")


def test_doctor_missing_highs_is_a_warning_not_a_failure():
    """HiGHS is only needed for --solver highs: listed with its reason and remedy, exit 0."""
    done = _doctor("--json", env_extra={"PMIP_HIGHS_LIBRARY": "/nonexistent/libhighs.so"})
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    why = report["ranks"][0]["solvers"]["highs"]
    assert why.startswith("the HiGHS solver does not load") and "--solver cbc" in why
    assert any(w.startswith("the HiGHS solver does not load") for w in report["warnings"])


def test_doctor_missing_cbc_is_one_line_and_exit_1():
    done = _doctor(env_extra={"PMIP_CBC_LIBRARY": "/nonexistent/libCbc.so"})
    assert done.returncode == 1, done.stdout + done.stderr
    (line,) = _errors(done)
    assert "the CBC solver does not load" in line and "--solver highs" in line
    assert done.stdout.splitlines()[-1].startswith("FAILED (1 problem(s))")


def test_doctor_without_mpi_is_one_line_and_exit_1(tmp_path):
    done = _doctor(env_extra={"MPI4PY_LIBMPI": str(tmp_path / "libmpi-missing.so")})
    assert done.returncode == 1, done.stdout + done.stderr
    (line,) = _errors(done)
    assert "mpi4py cannot load an MPI library" in line and "meshplan[mpi]" in line
    assert "library     none" in done.stdout


@pytest.fixture(scope="module")
def plan_1x2(tmp_path_factory):
    out = tmp_path_factory.mktemp("doctor") / "plan"
    done = run_cli("plan", SAMPLES["mlp"].path, "--mesh", "1x2", "--device", "cpu", "--dim", "batch=4", "-o", out)
    assert done.returncode == 0, done.stderr
    return out


def _mpi_doctor(ranks: int, *args) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run([mpiexec_path(), "-n", str(ranks), *meshplan_command(), "doctor", *map(str, args)],
                          capture_output=True, text=True, env=env, timeout=180, cwd=REPO)


@pytest.mark.mpi
def test_doctor_under_mpiexec_reports_every_rank_and_the_plan_fit(plan_1x2):
    done = _mpi_doctor(2, "--json", "--plan", plan_1x2)
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(done.stdout)   # rank 0 alone prints
    assert report["launched"] is True
    assert [r["rank"] for r in report["ranks"]] == [0, 1]
    assert [r["local_rank"] for r in report["ranks"]] == [0, 1]
    assert all(r["host"] for r in report["ranks"])
    assert report["plan"]["ranks"] == 2 and report["plan"]["checked"] and report["plan"]["fits"]


@pytest.mark.mpi
def test_doctor_under_mpiexec_with_the_wrong_rank_count_for_the_plan(plan_1x2):
    done = _mpi_doctor(3, "--plan", plan_1x2)
    assert done.returncode == 1, done.stdout + done.stderr
    (line,) = _errors(done)
    assert "the plan needs 2 rank(s)" in line and "this job has 3" in line
    assert "ranks (3):" in done.stdout and "the ranks do NOT fit" in done.stdout


def test_doctor_plan_without_mpiexec_says_how_to_check(plan_1x2):
    done = _doctor("--plan", plan_1x2)
    assert done.returncode == 0, done.stderr
    assert "not checked (run under mpiexec)" in done.stdout
    assert "mpiexec -n 2 meshplan doctor --plan" in done.stdout


def test_doctor_bad_plan_directory_is_one_line(tmp_path):
    done = _doctor("--plan", tmp_path / "nope")
    assert done.returncode == 1
    assert len(_errors(done)) == 1


def _facts(rank: int, **changes) -> Facts:
    facts = Facts(rank=rank, host="node0", versions={"meshplan": "1", "onnxruntime-gpu": "1.31.1", "onnx": "1.23",
                                                      "mpi4py": "4.1"},
                  providers={"CPU": None, "CUDA": "no NVIDIA driver here"},
                  mpi={"library": "MPICH 5", "size": 2}, mpiexec={"path": "/bin/mpiexec", "version": "5"},
                  solvers={"cbc": None, "highs": None})
    for key, value in changes.items():
        setattr(facts, key, value)
    return facts


def test_diagnose_finds_ranks_that_run_different_software():
    diagnosis = diagnose([_facts(0), _facts(1, versions={"meshplan": "1", "onnxruntime-gpu": "1.30.0",
                                                         "onnx": "1.23", "mpi4py": "4.1"})], launched=True)
    assert diagnosis.problems == ["ranks run different onnxruntime-gpu versions: 1.30.0, 1.31.1"]
    diagnosis = diagnose([_facts(0), _facts(1, mpi={"library": "Open MPI 4.1.6", "size": 2})], launched=True)
    assert diagnosis.problems == ["ranks loaded different MPI libraries: MPICH 5; Open MPI 4.1.6"]


def test_diagnose_names_the_rank_that_lacks_a_solver_and_warns_of_unusable_gpus():
    diagnosis = diagnose([_facts(0), _facts(1, solvers={"cbc": "the CBC solver does not load: x", "highs": None},
                                            gpus=["NVIDIA H100"])], launched=True)
    assert diagnosis.problems == ["the CBC solver does not load: x (rank 1)"]
    assert diagnosis.warnings == ["GPU(s) seen but not usable by onnxruntime: no NVIDIA driver here (rank 1)"]


def test_diagnose_sees_an_mpiexec_of_another_mpi(monkeypatch):
    """The launcher started 4 ranks, but each process's MPI sees a job of one: mpiexec and
    mpi4py's library do not belong together (every rank thinks it is rank 0)."""
    monkeypatch.setenv("PMI_SIZE", "4")
    diagnosis = diagnose([_facts(0, mpi={"library": "MPICH 5", "size": 1})], launched=True)
    assert len(diagnosis.problems) == 1 and "mpiexec and mpi4py belong to different MPI libraries" in diagnosis.problems[0]


@pytest.mark.parametrize("mps", [False, True])
def test_ranks_sharing_a_gpu_are_told_of_cuda_mps_where_it_does_not_run(mps):
    needs = {"ranks": 2, "hosts": 1, "devices_per_host": 2, "directory": "plan"}
    facts = [_facts(rank, gpus=["NVIDIA H200"], providers={"CPU": None, "CUDA": None}, mps=mps) for rank in (0, 1)]
    diagnosis = diagnose(facts, launched=True, plan_needs=needs)
    shared = [w for w in diagnosis.warnings if w.startswith("2 ranks share 1 GPU(s) on node0")]
    assert len(shared) == 1 and ("nvidia-cuda-mps-control -d" in shared[0]) == (not mps)


def test_mps_is_seen_by_its_control_pipe(tmp_path, monkeypatch):
    from meshplan.doctor import mps_running

    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", str(tmp_path))
    assert not mps_running()
    (tmp_path / "control").touch()
    assert mps_running()


@pytest.mark.parametrize("shared", [False, True])
def test_cpu_ranks_sharing_a_machine_are_told_of_shared_host_plans(shared):
    needs = {"ranks": 2, "hosts": 1, "devices_per_host": 2, "directory": "plan", "shared_host": shared}
    diagnosis = diagnose([_facts(rank) for rank in (0, 1)], launched=True, plan_needs=needs)
    told = [w for w in diagnosis.warnings if "meshplan plan --shared-host" in w]
    assert len(told) == (0 if shared else 1)
    assert not told or told[0].startswith("2 ranks share the cores and memory of node0")
    pipelined = diagnose([_facts(rank) for rank in (0, 1)], launched=True, plan_needs={**needs, "microbatches": 4})
    assert not [w for w in pipelined.warnings if "--shared-host" in w]   # the same plan either way


def test_plan_needs_says_whether_the_plan_shares_hosts(tmp_path):
    from meshplan.cost.cluster import make_cluster
    from meshplan.doctor import plan_needs
    from meshplan.inter.pipeline import PlanOptions
    from meshplan.make_plan import make_plan
    from sample_models import SAMPLE_DIR

    model = SAMPLE_DIR / "mlp.onnx"
    for shared in (False, True):
        make_plan(model, make_cluster((1, 2), "cpu", shared_host=shared), {"batch": 4}, tmp_path / str(shared),
                  PlanOptions(solver="highs"), programs=False)
        assert plan_needs(tmp_path / str(shared))["shared_host"] is shared
