"""Every ONNX backend node case the installed onnxruntime passes, planned on 1x2 and 2x2
meshes, run in process and under mpiexec (one job per mesh for all cases), and compared
with the case's reference outputs. The default run takes an evenly spaced sample; the
slow suite takes them all. The cases meshplan does not support yet are listed with their
reason in docs/backend_cases.md: each must still fail with that one error line, from the
library and from the command line (exit 1, no traceback)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.backend_cases import MESHES, all_cases, dims_of, passing_cases, plan_and_run, sample, write_case
from tests.conftest import REPO, run_cli, run_mpi_script

SAMPLE_SIZE = 48
DOC = REPO / "docs" / "backend_cases.md"


def unsupported() -> dict[str, tuple[str, str]]:
    """docs/backend_cases.md's unsupported cases: name → (its section, the words its error must contain)."""
    listed, section, words = {}, None, None
    for line in DOC.read_text().splitlines():
        if line.startswith("### "):
            section, words = line[4:].strip(), None
        elif line.startswith("Error: `"):
            words = line[len("Error: `"):line.rindex("`")]
        elif section and line.lstrip("- ").startswith("`test_"):     # a bullet or its continuation
            assert words, f"section {section!r} of {DOC.name} names no error words"
            for name in re.findall(r"`(test_[A-Za-z0-9_]+)`", line):
                listed[name] = (section, words)
    return listed


def _plan_all(cases, root: Path) -> list:
    return [plan_and_run(case, root / case.name, mesh) for case in cases for mesh in MESHES]


def _check_in_process(outcomes) -> None:
    """Listed cases fail with their words and a MeshplanError; every other case passes."""
    listed = unsupported()
    wrong = []
    for o in outcomes:
        if o.name in listed:
            words = listed[o.name][1]
            if o.ok or not o.expected_error or words not in o.message:
                wrong.append(f"{o.name} {o.mesh}: listed as unsupported ({words!r}) but "
                             f"{'passed' if o.ok else 'failed: ' + o.message}")
        elif not o.ok:
            wrong.append(f"{o.name} {o.mesh}: {o.stage}: {o.message}")
    assert not wrong, "\n".join(wrong)


def _check_under_mpiexec(outcomes, mesh, root: Path, timeout: float) -> None:
    """One mpiexec job runs every case planned on ``mesh``: each must match its reference."""
    by_name = {case.name: case for case in passing_cases()}
    entries = []
    for o in outcomes:
        if o.ok and o.mesh == mesh and by_name[o.name].tensors_only:
            case = by_name[o.name]
            assert o.ranks == mesh[0] * mesh[1], (o.name, o.ranks)
            entries.append({"name": o.name, "plan_dir": str(o.plan_dir), "inputs": str(o.plan_dir.parent / "inputs.npz"),
                            "expected": str(o.plan_dir.parent / "expected.npz"), "rtol": case.rtol, "atol": case.atol})
    assert entries
    manifest = root / f"manifest_{mesh[0]}x{mesh[1]}.json"
    manifest.write_text(json.dumps(entries))
    lines = run_mpi_script("backend_cases_case.py", ranks=mesh[0] * mesh[1], timeout=timeout, args=[manifest])
    assert len(lines) == len(entries)


@pytest.fixture(scope="module")
def sampled(tmp_path_factory):
    root = tmp_path_factory.mktemp("backend_sample")
    return root, _plan_all(sample(passing_cases(), SAMPLE_SIZE), root)


@pytest.fixture(scope="module")
def everything(tmp_path_factory):
    root = tmp_path_factory.mktemp("backend_all")
    return root, _plan_all(passing_cases(), root)


def test_cases_are_generated_and_onnxruntime_passes_most():
    cases, passing = all_cases(), passing_cases()
    assert len(cases) > 1000 and len(passing) > len(cases) // 2
    assert len({case.name for case in cases}) == len(cases)


def test_sample_in_process(sampled):
    root, outcomes = sampled
    assert len(outcomes) == 2 * SAMPLE_SIZE
    _check_in_process(outcomes)


@pytest.mark.mpi
@pytest.mark.parametrize("mesh", MESHES, ids=lambda m: f"{m[0]}x{m[1]}")
def test_sample_under_mpiexec(sampled, mesh):
    root, outcomes = sampled
    _check_under_mpiexec(outcomes, mesh, root, timeout=300)


@pytest.mark.slow
def test_all_in_process(everything):
    root, outcomes = everything
    _check_in_process(outcomes)


@pytest.mark.slow
@pytest.mark.mpi
@pytest.mark.parametrize("mesh", MESHES, ids=lambda m: f"{m[0]}x{m[1]}")
def test_all_under_mpiexec(everything, mesh):
    root, outcomes = everything
    _check_under_mpiexec(outcomes, mesh, root, timeout=1800)


def test_unsupported_list_is_accurate(tmp_path):
    """Every listed case is one onnxruntime passes, and still fails with its words."""
    listed = unsupported()
    assert listed
    by_name = {case.name: case for case in passing_cases()}
    stale = sorted(set(listed) - set(by_name))
    assert not stale, f"listed in {DOC.name} but not a case onnxruntime passes: {stale}"
    _check_in_process(_plan_all([by_name[name] for name in listed], tmp_path))


def _fails_with_one_line(listed: dict, tmp_path: Path) -> None:
    """Each case through ``meshplan plan``: exit 1, one ``meshplan: error:`` line with its
    section's words, no traceback, no plan directory."""
    by_name = {case.name: case for case in passing_cases()}
    for name, (section, words) in listed.items():
        case = by_name[name]
        path = write_case(case, tmp_path / name)
        dims = [arg for key, value in dims_of(case).items() for arg in ("--dim", f"{key}={value}")]
        result = run_cli("plan", path, "--mesh", "2x2", "--device", "cpu", *dims, "-o", tmp_path / name / "plan")
        assert result.returncode == 1, (section, name, result.stdout, result.stderr)
        assert "Traceback" not in result.stderr, result.stderr
        lines = [line for line in result.stderr.splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith("meshplan: error:") and words in lines[0], (section, result.stderr)
        assert not (tmp_path / name / "plan").exists()


def test_each_unsupported_kind_fails_with_one_line(tmp_path):
    """The first case of each section of docs/backend_cases.md."""
    firsts = {}
    for name, (section, words) in unsupported().items():
        firsts.setdefault(section, name)
    _fails_with_one_line({name: unsupported()[name] for name in firsts.values()}, tmp_path)


@pytest.mark.slow
def test_every_unsupported_case_fails_with_one_line(tmp_path):
    _fails_with_one_line(unsupported(), tmp_path)
