"""Devices that share their host (``Cluster.host_shares``, ``meshplan plan --shared-host``):
the ranks of a job on one CPU machine divide its cores and memory bandwidth, so a plan leaves
devices idle where splitting would not pay; and a plan's idle ranks take no core from the
ranks that work beside them (they sleep until a call they take part in)."""

from __future__ import annotations

import json
import textwrap

import numpy as np
import onnx
import pytest

from meshplan.cost.cluster import Cluster, load_cluster_file, make_cluster
from meshplan.errors import ClusterError
from meshplan.inter.pipeline import PlanOptions
from meshplan.make_plan import make_plan
from sample_models.gpt import make_gpt
from meshplan.plan_format import read_plan
from tests.conftest import check_against_onnxruntime, run_cli, run_mpi, run_mpi_script, save_npz

# a batch-1 decode step bound by reading its weights (117 MB of float32): the planner splits it
# over devices of their own, where each reads half through its own memory
DECODE_STEP = dict(layers=2, hidden=1024, heads=16, vocab=2048, max_seq=64)


@pytest.fixture(scope="module")
def decode_step(tmp_path_factory):
    """The decode step's graph, its weights left out (the plans here read none)."""
    folder = tmp_path_factory.mktemp("step")
    path = folder / "step.onnx"
    onnx.save_model(make_gpt(**DECODE_STEP), str(path), save_as_external_data=True, location="step.data")
    (folder / "step.data").unlink()
    return path


def _plan(path, mesh, shared, out, **options):
    return make_plan(path, make_cluster(mesh, "cpu", shared_host=shared), {"batch": 1, "seq": 1}, out,
                     PlanOptions(solver="highs", **options), shapes_only=True)


# --- the cluster -----------------------------------------------------------------------------

def test_work_scale_gives_idle_shares_to_working_devices():
    own = make_cluster((2, 4), "cpu")
    shared = make_cluster((2, 4), "cpu", shared_host=True)
    assert own.host_shares == 0 and shared.host_shares == 4
    assert [own.work_scale(d) for d in (1, 2, 4, 8)] == [1.0, 1.0, 1.0, 1.0]
    # one device of four working takes the host; a submesh over two hosts has four on each
    assert [shared.work_scale(d) for d in (1, 2, 4, 8)] == [0.25, 0.5, 1.0, 1.0]
    # a region of the mesh planned as a cluster of its own keeps the host's shares
    region = Cluster(1, 2, shared.device, shared.intra_host, shared.inter_host, shared.host_shares)
    assert region.work_scale(2) == 0.5
    # several microbatches in flight: every stage works at once, no share is free
    assert shared.costed(2).host_shares == 0 and shared.costed(1) is shared


def test_host_shares_round_trip_and_old_records():
    shared = make_cluster((1, 4), "cpu", shared_host=True)
    assert Cluster.from_dict(json.loads(json.dumps(shared.to_dict()))) == shared
    record = make_cluster((1, 4), "cpu").to_dict()
    assert "host_shares" not in record            # a plan of devices of their own reads as before
    assert Cluster.from_dict(record).host_shares == 0


def test_cluster_file_shared_host(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text(textwrap.dedent("""
        hosts = 1
        devices_per_host = 4
        shared_host = true
        device = "cpu"
    """))
    assert load_cluster_file(path).host_shares == 4
    path.write_text("hosts = 1\ndevices_per_host = 4\nshared_host = 1\n")
    with pytest.raises(ClusterError, match="shared_host must be true or false"):
        load_cluster_file(path)
    path.write_text("hosts = 1\ndevices_per_host = 4\n")
    assert load_cluster_file(path).host_shares == 0


# --- the plans -------------------------------------------------------------------------------

def test_decode_step_split_over_own_devices_one_device_on_a_shared_host(decode_step, tmp_path):
    own = _plan(decode_step, (1, 2), False, tmp_path / "own")
    assert [len(s.devices) for s in own.stages] == [2] and own.idle_ranks == []
    shared = _plan(decode_step, (1, 2), True, tmp_path / "shared")
    assert [s.devices for s in shared.stages] == [[0]] and shared.idle_ranks == [1]
    assert "uses all 2 devices is estimated at" in shared.idle["reason"]
    assert shared.cluster["host_shares"] == 2
    # the working device has the host to itself: its step is about half a share's
    alone = _plan(decode_step, (1, 1), False, tmp_path / "one")
    assert shared.estimate["latency_seconds"] < 0.6 * alone.estimate["latency_seconds"]
    eight = _plan(decode_step, (1, 8), True, tmp_path / "eight")
    assert [s.devices for s in eight.stages] == [[0]] and eight.idle_ranks == list(range(1, 8))


def test_shared_hosts_still_split_across_hosts(decode_step, tmp_path):
    """Each host has its own memory: a 2x2 mesh of shared hosts splits the step over both."""
    plan = _plan(decode_step, (2, 2), True, tmp_path / "p")
    hosts = {rank // 2 for stage in plan.stages for rank in stage.devices}
    assert hosts == {0, 1}


def test_pipelined_microbatches_plan_as_devices_of_their_own(decode_step, tmp_path):
    dims = {"batch": 4, "seq": 1}
    shared = make_plan(decode_step, make_cluster((1, 2), "cpu", shared_host=True), dims, tmp_path / "s",
                       PlanOptions(solver="highs", microbatches=2), shapes_only=True)
    own = make_plan(decode_step, make_cluster((1, 2), "cpu"), dims, tmp_path / "o",
                    PlanOptions(solver="highs", microbatches=2), shapes_only=True)
    assert [s.devices for s in shared.stages] == [s.devices for s in own.stages]
    assert shared.estimate["latency_seconds"] == pytest.approx(own.estimate["latency_seconds"])
    assert shared.cluster["host_shares"] == 2    # the plan records the cluster as described


# --- the command and the job -----------------------------------------------------------------

@pytest.fixture(scope="module")
def small_step(tmp_path_factory):
    folder = tmp_path_factory.mktemp("small")
    path = folder / "gpt.onnx"
    onnx.save_model(make_gpt(layers=2, hidden=128, heads=4, vocab=256, max_seq=16), str(path))
    return path, {"input_ids": np.array([[3], [7]], dtype=np.int64)}


def test_plan_shared_host_idles_and_the_job_computes_the_model(small_step, tmp_path):
    model, inputs = small_step
    done = run_cli("plan", model, "--mesh", "1x2", "--device", "cpu", "--shared-host", "--dim", "batch=2",
                   "--dim", "seq=1", "--solver", "highs", "-o", tmp_path / "plan")
    assert done.returncode == 0, done.stderr
    plan = read_plan(tmp_path / "plan")
    assert plan.cluster["host_shares"] == 2 and plan.idle_ranks == [1]
    printed = check_against_onnxruntime(plan, tmp_path / "plan", inputs, tmp_path, "--repeat", "3")
    assert "rank 1: " in printed and "idle" in printed


def _idle_rank_script(script: str, small_step, tmp_path) -> list[str]:
    """``script``'s ok lines, run on a shared-host 1x2 plan of the small step (rank 1 idle)."""
    model, inputs = small_step
    make_plan(model, make_cluster((1, 2), "cpu", shared_host=True), {"batch": 2, "seq": 1}, tmp_path / "plan",
              PlanOptions(solver="highs"))
    return run_mpi_script(script, ranks=2, args=[tmp_path / "plan", save_npz(tmp_path / "in.npz", inputs)])


def test_idle_ranks_sleep_through_the_calls_they_take_no_part_in(small_step, tmp_path):
    assert len(_idle_rank_script("idle_rank_case.py", small_step, tmp_path)) == 3


def test_run_points_split_cpu_ranks_of_one_machine_to_shared_host_plans(small_step, tmp_path):
    model, inputs = small_step
    in_path = save_npz(tmp_path / "in.npz", inputs)
    for shared in (False, True):
        folder = tmp_path / ("shared" if shared else "own")
        make_plan(model, make_cluster((1, 2), "cpu", shared_host=shared), {"batch": 2, "seq": 1}, folder,
                  PlanOptions(solver="highs", policy="megatron", all_devices=True))
        done = run_mpi(2, "run", folder, "--inputs", in_path)
        assert done.returncode == 0, done.stdout + done.stderr
        assert ("meshplan plan --shared-host" in done.stderr) == (not shared)
    # pipelined microbatches: the stages work at once whatever the plan says of the host
    folder = tmp_path / "pipelined"
    plan = make_plan(model, make_cluster((1, 2), "cpu"), {"batch": 2, "seq": 1}, folder,
                     PlanOptions(solver="highs", microbatches=2, all_devices=True))
    assert plan.microbatches == 2 and not plan.idle_ranks
    done = run_mpi(2, "run", folder, "--inputs", in_path)
    assert done.returncode == 0 and "--shared-host" not in done.stderr, done.stdout + done.stderr


def test_working_ranks_take_the_cores_a_launcher_bound_idle_ranks_to(small_step, tmp_path):
    assert len(_idle_rank_script("idle_cores_case.py", small_step, tmp_path)) == 4


def test_idle_cores_split_by_physical_core_over_the_working_ranks():
    from meshplan.runtime.threads import with_idle_cores

    # a launcher bound each of four ranks to a core (two CPUs each); ranks 1 and 3 idle
    groups = [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert with_idle_cores([{0, 4}, {2, 6}], [{1, 5}, {3, 7}], groups) == [{0, 1, 4, 5}, {2, 3, 6, 7}]
    # three spare cores over two working ranks: the first takes one more
    assert with_idle_cores([{0}], [{1}, {2}, {3}], [[0], [1], [2], [3]]) == [{0, 1, 2, 3}]
    assert with_idle_cores([{0}, {1}], [{2}, {3}, {4}], [[c] for c in range(5)]) == [{0, 2, 3}, {1, 4}]
    # no launcher binding: every rank may run everywhere, nothing is spare
    every = set(range(4))
    assert with_idle_cores([every, every], [every], groups) == [every, every]
    assert with_idle_cores([{0}], [], groups) == [{0}]


def test_generate_on_a_shared_host_plan_says_which_rank_idles(tmp_path):
    from sample_models import SAMPLE_DIR

    done = run_cli("plan", SAMPLE_DIR / "genai" / "llama_fp32" / "model.onnx", "--mesh", "1x2", "--device", "cpu", "--shared-host",
                   "--generate", "--max-length", "64", "--solver", "highs", "-o", tmp_path / "plan")
    assert done.returncode == 0, done.stderr
    ran = run_mpi(2, "generate", tmp_path / "plan", "--prompt", "hello there", "--max-new-tokens", "8")
    assert ran.returncode == 0, ran.stdout + ran.stderr
    assert "rank 1: idle (no program in the plan)" in ran.stdout and "rank 0: weights" in ran.stdout
