"""The host ↔ rank layout check, and the measured link figures a plan takes from a profile."""

from __future__ import annotations

import pytest

from meshplan.cost.cluster import make_cluster
from meshplan.profile.comm import LINK, CommFit, fit_link
from meshplan.profile.document import Profile
from meshplan.profile.measured import with_measured_links
from meshplan.rank_layout import RankLayout, launch_advice, layout_mismatch


def layout(machines: list[int], names: dict[int, str] | None = None) -> RankLayout:
    names = names or {}
    return RankLayout(tuple(machines), tuple(names.get(m, f"node{m}") for m in machines), 0, machines.count(machines[0]))


@pytest.mark.parametrize("machines, hosts, per_host", [
    ([0, 0, 2, 2], 2, 2),            # as planned
    ([0, 0, 0, 0], 2, 2),            # both planned hosts on one machine: allowed
    ([0, 0, 0, 0, 4, 4, 4, 4], 4, 2),  # two planned hosts per machine
    ([0, 1, 2, 3], 4, 1),
    ([0, 0, 0, 0], 1, 4),
])
def test_layouts_that_match(machines, hosts, per_host):
    assert layout_mismatch(layout(machines), hosts, per_host) is None


@pytest.mark.parametrize("machines, hosts, per_host, host, spread", [
    ([0, 1, 0, 1], 2, 2, 0, "rank 0 on node0; rank 1 on node1"),     # round robin
    ([0, 0, 0, 3], 2, 2, 1, "rank 2 on node0; rank 3 on node3"),     # 3 + 1
    ([0, 0, 2, 2], 1, 4, 0, "ranks 0-1 on node0; ranks 2-3 on node2"),   # a one-host plan on two machines
    ([0, 0, 0, 0, 0, 5, 5, 5], 2, 4, 1, "rank 4 on node0; ranks 5-7 on node5"),
])
def test_layouts_that_do_not_match(machines, hosts, per_host, host, spread):
    message = layout_mismatch(layout(machines), hosts, per_host)
    assert message is not None and "\n" not in message
    assert f"planned host {host}" in message and spread in message
    assert f"{hosts} host(s) x {per_host} device(s)" in message


def test_rank_count_mismatch_is_left_to_the_count_check():
    assert layout_mismatch(layout([0, 0, 0]), 2, 2) is None


def test_launch_advice_names_every_launcher():
    advice = launch_advice(4)
    assert "mpiexec -ppn 4" in advice and "ppr:4:node" in advice and "--ntasks-per-node=4" in advice


def _profile(fits: list[CommFit]) -> Profile:
    return Profile(model={}, mesh=[2, 2], device="cpu", hardware="x", provider="CPUExecutionProvider",
                   onnxruntime="1", threads=1, ranks=4, operators={}, communication=fits,
                   communication_source="measured", cuda_aware_mpi={"value": None, "method": ""})


def test_measured_links_replace_the_described_ones():
    cluster = make_cluster((2, 2), "cpu")
    fits = [CommFit(LINK, 0, 2, 40e-6, 24e6, "measured"), CommFit(LINK, 1, 2, 5e-6, 6e9, "measured"),
            CommFit("send_recv", 0, 2, 1e-6, 1e6, "measured")]
    updated, links = with_measured_links(cluster, _profile(fits))
    assert updated.inter_host.bandwidth == 24e6 and updated.inter_host.latency == 40e-6
    assert updated.intra_host.bandwidth == 6e9 and updated.intra_host.latency == 5e-6
    assert set(links) == {"inter_host", "intra_host"}
    assert updated.device == cluster.device


def test_a_profile_without_link_fits_keeps_the_cluster():
    cluster = make_cluster((2, 2), "cpu")
    fits = [CommFit(LINK, 0, 2, 40e-6, 24e6, "cluster"), CommFit("send_recv", 1, 2, 1e-6, 1e6, "measured")]
    updated, links = with_measured_links(cluster, _profile(fits))
    assert updated == cluster and links == {}


def test_link_fit_follows_the_large_messages():
    # A shaped link: small messages pass in a burst at memory speed, large ones at 24 MB/s.
    rate = 24e6
    points = [[1024, 40e-6], [4096, 50e-6], [16384, 300e-6], [65536, 65536 / rate],
              [262144, 262144 / rate], [1048576, 1048576 / rate]]
    latency, bandwidth, _ = fit_link(points)
    assert bandwidth == pytest.approx(rate, rel=0.02)
    assert latency >= 0
    # A plain link: latency + bytes / bandwidth exactly.
    points = [[n, 20e-6 + n / 1e9] for n in (1024, 4096, 16384, 65536, 262144, 1048576)]
    latency, bandwidth, error = fit_link(points)
    assert bandwidth == pytest.approx(1e9, rel=1e-6) and latency == pytest.approx(20e-6, rel=1e-3)
    assert error < 1e-6


def test_no_mpi_library_is_one_line(tmp_path):
    import os
    import subprocess

    from conftest import REPO, meshplan_command

    env = dict(os.environ, PYTHONPATH=str(REPO), MPI4PY_LIBMPI=str(tmp_path / "libmpi-missing.so"), PMI_RANK="0",
               PMI_SIZE="1")
    done = subprocess.run([*meshplan_command(), "run", str(tmp_path), "--inputs", str(tmp_path / "in.npz")],
                          capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 1, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("meshplan: error: mpi4py cannot load an MPI library"), done.stderr
    assert "meshplan[mpi]" in lines[0]
