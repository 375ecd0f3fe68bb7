"""Runs across hosts emulated with network namespaces (meshplan.testing.emulated_cluster).

Each emulated host is a namespace with its own hostname; hosts are joined by links
rate-limited with tc. These tests need root (CI runs as root); elsewhere they skip and
say why. The rank-layout rules themselves are tested without namespaces in
test_rank_layout.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import REPO, load_npz, meshplan_command, run_cli
from meshplan.testing.emulated_cluster import EmulatedCluster, unavailable_reason

pytestmark = [pytest.mark.mpi, pytest.mark.serial]

_REASON = unavailable_reason()
needs_namespaces = pytest.mark.skipif(_REASON is not None, reason=f"no emulated cluster here: {_REASON}")

_ENV = {"PYTHONPATH": str(REPO), "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
GPT = REPO / "sample_models" / "gpt.onnx"
DIMS = ("--dim", "batch=8", "--dim", "seq=32")


@pytest.fixture(scope="module")
def cluster():
    with EmulatedCluster(hosts=2, slots=2, rate="1gbit") as emulated:
        yield emulated


def _bytes_sent(namespace: str) -> int:
    done = subprocess.run(["ip", "-n", namespace, "-s", "-j", "link", "show", "eth0"], capture_output=True, text=True,
                          check=True)
    return int(json.loads(done.stdout)[0]["stats64"]["tx"]["bytes"])


@pytest.fixture(scope="module")
def gpt_plan(tmp_path_factory):
    work = tmp_path_factory.mktemp("gpt2x2")
    done = run_cli("plan", GPT, "--mesh", "2x2", "--device", "cpu", *DIMS, "--microbatches", "2", "-o", work / "plan")
    assert done.returncode == 0, done.stderr
    done = run_cli("inputs", GPT, *DIMS, "-o", work / "in.npz")
    assert done.returncode == 0, done.stderr
    plan = json.loads((work / "plan" / "plan.json").read_text())
    return work, plan


@needs_namespaces
def test_gpt_on_two_emulated_hosts_matches_onnxruntime(cluster, gpt_plan):
    work, plan = gpt_plan
    # The plan must put its stages on different hosts, so that the run crosses the link.
    hosts_of_stages = {tuple(sorted({rank // 2 for rank in stage["devices"]})) for stage in plan["stages"]}
    assert len(hosts_of_stages) > 1 or any(len(h) > 1 for h in hosts_of_stages), plan["stages"]
    before = [_bytes_sent(ns) for ns in cluster.namespaces]
    done = cluster.run([*meshplan_command(), "run", str(work / "plan"), "--inputs", str(work / "in.npz"),
                        "--output", str(work / "out.npz")], env=_ENV, cwd=REPO)
    assert done.returncode == 0, done.stdout + done.stderr
    sent = [_bytes_sent(ns) - b for ns, b in zip(cluster.namespaces, before)]
    # The activations between the stages went over the links (more than the MPI set-up chatter).
    boundary = sum(int(np.prod(t["shape"])) * np.dtype(t["dtype"]).itemsize for t in _boundary(plan))
    print("bytes sent by each host:", sent, "boundary tensors:", boundary, "x", plan["microbatches"])
    assert max(sent) >= boundary * plan["microbatches"], (sent, boundary)

    import onnxruntime as ort

    inputs = load_npz(work / "in.npz")
    expected = ort.InferenceSession(str(GPT), providers=["CPUExecutionProvider"]).run(None, inputs)
    actual = load_npz(work / "out.npz")
    np.testing.assert_allclose(actual["logits"], expected[0], rtol=1e-3, atol=1e-4)


def _boundary(plan: dict) -> list[dict]:
    """The tensors that travel from the first stage to the next: the resharded activations."""
    return [{"shape": r["shape"], "dtype": r["dtype"]} for r in plan["reshardings"]] or [{"shape": [0], "dtype": "float32"}]




@needs_namespaces
def test_wrong_layout_fails_with_one_line_on_every_rank(cluster, gpt_plan):
    work, _ = gpt_plan
    command = " ".join(meshplan_command()) + f" run {work / 'plan'} --inputs {work / 'in.npz'}"
    wrapped = ["sh", "-c", f'{command}; code=$?; echo "rank $PMI_RANK exit $code"; exit $code']
    # One rank per host in turn (round robin): ranks 0 and 1, planned on host 0, land on two hosts.
    done = cluster.run(wrapped, per_host=1, env=_ENV, cwd=REPO)
    assert done.returncode != 0
    exits = sorted(line for line in done.stdout.splitlines() if line.startswith("rank "))
    assert exits == [f"rank {r} exit 1" for r in range(4)], done.stdout + done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("meshplan: error:")]
    assert len(errors) == 1, done.stderr
    assert "not laid out as planned" in errors[0] and "planned host 0" in errors[0]
    assert "-ppn 2" in errors[0] and "ppr:2:node" in errors[0] and "--ntasks-per-node=2" in errors[0]
    assert "Traceback" not in done.stderr


@needs_namespaces
def test_profile_measures_the_inter_host_link_apart_and_plan_uses_it(tmp_path):
    # A slow link (200 Mbit/s = 25 MB/s) that the profile must find, far below the
    # shared-memory link inside a host.
    with EmulatedCluster(hosts=2, slots=2, rate="200mbit") as slow:
        done = slow.run([*meshplan_command(), "profile", str(GPT), "--mesh", "2x2", "--device", "cpu", *DIMS,
                         "--comm-max", "256K", "--comm-budget-ms", "5", "--budget-ms", "2", "--cache", str(tmp_path / "cache.sqlite"),
                         "-o", str(tmp_path / "profile.json")],
                        env=_ENV, cwd=REPO, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    profile = json.loads((tmp_path / "profile.json").read_text())
    fits = {f["axis"]: f for f in profile["communication"] if f["collective"] == "link"}
    inter, intra = fits[0]["bandwidth"], fits[1]["bandwidth"]
    assert 0.5 * 25e6 < inter < 1.2 * 25e6, fits[0]
    assert intra > 10 * inter, (intra, inter)

    done = run_cli("plan", GPT, "--mesh", "2x2", *DIMS, "--microbatches", "2", "--profile", tmp_path / "profile.json",
                   "-o", tmp_path / "plan")
    assert done.returncode == 0, done.stderr
    assert "links: inter-host" in done.stdout and "links: intra-host" in done.stdout
    cluster = json.loads((tmp_path / "plan" / "plan.json").read_text())["cluster"]
    assert cluster["inter_host"]["bandwidth"] == pytest.approx(inter)
    assert cluster["intra_host"]["bandwidth"] == pytest.approx(intra)
