"""The lock (uv.lock) is what `make` installs: it must cover every dependency that
pyproject.toml names — the extras included — at versions inside pyproject's ranges, be
made from this pyproject (so `uv sync --locked` accepts it), close over the indirect
dependencies, and pin each file by its hash."""

from __future__ import annotations

import sys

import pytest
from packaging.markers import Marker
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import Version

from tests.conftest import REPO

if sys.version_info >= (3, 11):
    import tomllib
else:   # pytest brings tomli on Python 3.10
    import tomli as tomllib


@pytest.fixture(scope="module")
def project():
    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]


@pytest.fixture(scope="module")
def lock():
    return tomllib.loads((REPO / "uv.lock").read_text())


def _named(project) -> list[Requirement]:
    named = [Requirement(text) for text in project["dependencies"]]
    for texts in project.get("optional-dependencies", {}).values():
        named.extend(Requirement(text) for text in texts)
    return named


def _locked(lock) -> dict[str, list[dict]]:
    packages: dict[str, list[dict]] = {}
    for package in lock["package"]:
        packages.setdefault(canonicalize_name(package["name"]), []).append(package)
    return packages


def test_every_named_dependency_is_locked_inside_its_range(project, lock):
    locked = _locked(lock)
    named = _named(project)
    assert {"onnx", "onnxruntime-gpu", "mip", "mpi4py", "pytest", "mpich"} <= {canonicalize_name(r.name) for r in named}
    for requirement in named:
        versions = [Version(p["version"]) for p in locked.get(canonicalize_name(requirement.name), [])]
        assert versions, f"{requirement.name} is not in uv.lock: run `make lock`"
        outside = [str(v) for v in versions if not requirement.specifier.contains(v, prereleases=True)]
        assert not outside, f"uv.lock has {requirement.name} {outside}, outside {requirement.specifier}"


def test_the_lock_was_made_from_this_pyproject(project, lock):
    """The project's entry in the lock records the requirements it was resolved from."""
    (entry,) = _locked(lock)[canonicalize_name(project["name"])]

    def key(name, extras, specifier, marker) -> tuple:
        return (canonicalize_name(name), tuple(sorted(extras)), str(SpecifierSet(specifier)),
                str(Marker(marker)) if marker else "")

    recorded = {key(i["name"], i.get("extras", []), i.get("specifier", ""), i.get("marker"))
                for i in entry["metadata"]["requires-dist"]}

    def wanted_key(text: str, extra: str | None) -> tuple:
        r = Requirement(text)
        markers = [f"({r.marker})"] if r.marker and extra else [str(r.marker)] if r.marker else []
        if extra:
            markers.append(f"extra == '{extra}'")
        return key(r.name, r.extras, str(r.specifier), " and ".join(markers))

    wanted = {wanted_key(t, None) for t in project["dependencies"]}
    for extra, texts in project.get("optional-dependencies", {}).items():
        wanted |= {wanted_key(t, extra) for t in texts}
    assert recorded == wanted, "pyproject.toml changed since uv.lock was made: run `make lock`"


def test_the_lock_is_closed_and_hashed(lock):
    locked = _locked(lock)
    for package in lock["package"]:
        for dependency in package.get("dependencies", []):
            assert canonicalize_name(dependency["name"]) in locked, (package["name"], dependency["name"])
        if package.get("source", {}).get("registry"):
            files = package.get("wheels", []) + ([package["sdist"]] if "sdist" in package else [])
            assert files and all(f.get("hash", "").startswith("sha256:") for f in files), package["name"]


def test_the_lock_is_for_the_supported_pythons_on_linux_x86_64(lock):
    markers = " ".join(lock.get("supported-markers", []))
    assert "sys_platform == 'linux'" in markers and "platform_machine == 'x86_64'" in markers
    assert lock["requires-python"] == ">=3.10"
    assert "python_full_version < '3.14'" in markers
