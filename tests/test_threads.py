"""The onnxruntime threads of a rank (``runtime.threads``): alone on a machine it takes every
core it may run on and spins; ranks sharing a machine's cores divide them and do not spin;
ranks the launcher bound to cores of their own keep those cores and spin; ranks the launcher
left unbound bind themselves to a share of the machine's physical cores where each gets two
or more; a rank with cores of its own pins each thread to one of them. A job says what each
rank got (``meshplan run``, ``generate``, ``doctor``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace

import pytest

from meshplan.runtime import threads
from meshplan.runtime.threads import ThreadChoice, choose_threads, physical_cores, plan_threads
from tests.conftest import run_cli, run_mpi


def test_alone_takes_its_cores_and_spins():
    choice = choose_threads(1, cores={0, 1, 2, 3}, machine_cores=16)
    assert (choice.threads, choice.spinning) == (4, True)
    assert "alone on its 4 core(s)" in choice.describe()


def test_shared_cores_are_divided_without_spinning():
    choice = choose_threads(4, cores=set(range(16)), machine_cores=16, others=[set(range(16))] * 3)
    assert (choice.threads, choice.spinning) == (4, False)
    assert choice.why == "16 core(s) shared by 4 working ranks"
    assert choose_threads(3, cores={0, 1}, machine_cores=2).threads == 1   # never below one thread
    # more working ranks than cores: they take turns (meshplan run warns)
    assert choose_threads(4, cores={0, 1}, machine_cores=2).oversubscribed
    assert not choose_threads(2, cores={0, 1}, machine_cores=2).oversubscribed


def test_own_cores_from_the_launcher_take_every_core_without_spinning():
    choice = choose_threads(2, cores={0, 1, 2, 3}, machine_cores=8, others=[{4, 5, 6, 7}])
    assert (choice.threads, choice.spinning, choice.bound) == (4, False, True)
    # overlapping bindings are shared cores
    overlap = choose_threads(2, cores={0, 1, 2, 3}, machine_cores=8, others=[{3, 4, 5, 6}])
    assert (overlap.threads, overlap.spinning) == (2, False)


def test_a_row_reads_back():
    choice = choose_threads(2, cores={0, 1, 2, 3}, machine_cores=4, others=[{0, 1, 2, 3}])
    assert ThreadChoice.from_row(choice.row()) == choice
    bound, _ = plan_threads([set(range(8))] * 2, 1, 8, groups=[[c] for c in range(8)])
    assert ThreadChoice.from_row(bound.row()) == bound and bound.self_bound


def test_unbound_ranks_bind_themselves_to_shares_of_physical_cores():
    machine = set(range(16))
    one_each = [[c] for c in range(16)]
    shares = [plan_threads([machine] * 2, i, 16, groups=one_each) for i in range(2)]
    assert [share for _, share in shares] == [set(range(8)), set(range(8, 16))]
    choice = shares[0][0]
    assert (choice.threads, choice.spinning, choice.bound, choice.self_bound) == (8, False, True, True)
    assert "bound by meshplan to 8 core(s) of its own" in choice.describe()
    # hyperthreads: siblings stay together, one thread per physical core
    siblings = [[c, c + 8] for c in range(8)]
    choice, share = plan_threads([machine] * 2, 1, 16, groups=siblings)
    assert share == {4, 5, 6, 7, 12, 13, 14, 15} and choice.threads == 4 and choice.cores == 8
    # three ranks: equal shares, the cores left over stay free
    assert [plan_threads([machine] * 3, i, 16, groups=one_each)[1] for i in range(3)] == \
        [set(range(0, 5)), set(range(5, 10)), set(range(10, 15))]


def test_binding_only_where_it_pays_and_is_wanted(monkeypatch):
    # one physical core per rank: nothing to spin, the old rule (shared, no spinning, nothing pinned)
    choice, share = plan_threads([{0, 1}] * 2, 0, 2, groups=[[0], [1]])
    assert share is None and (choice.threads, choice.spinning, choice.self_bound, choice.pinned) == (1, False, False, False)
    # the launcher bound them: its binding stands
    choice, share = plan_threads([{0, 1, 2, 3}, {4, 5, 6, 7}], 0, 8, groups=[[c] for c in range(8)])
    assert share is None and choice.bound and not choice.self_bound and choice.threads == 4
    # alone: all its cores
    choice, share = plan_threads([set(range(8))], 0, 8, groups=[[c] for c in range(8)])
    assert share is None and choice.threads == 8
    # --no-bind-cores: nothing bound, nothing pinned, whatever the commands ask
    monkeypatch.setattr(threads, "_binding", [False])
    monkeypatch.setattr(threads, "_pinning", [False])
    monkeypatch.setattr(threads, "_own_process", [False])
    choice, share = plan_threads([set(range(16))] * 2, 0, 16, groups=[[c] for c in range(16)], pin=True)
    assert share is None and (choice.threads, choice.spinning, choice.pinned) == (8, False, False)
    choice, _ = plan_threads([set(range(8))], 0, 8, groups=[[c] for c in range(8)])
    assert not choice.pinned and choice.pool_affinities() is None
    threads.set_binding(True, pin=True)
    assert threads._pinning == [True]
    threads.set_binding(False, pin=True)      # --no-bind-cores on a command: its process is still its own
    assert threads._pinning == [False] and threads._own_process == [True]


def test_a_job_in_someone_elses_process_pins_nothing(monkeypatch):
    """Only the commands pin (their process is the rank's own): by default a rank bound by
    meshplan, or alone, keeps its thread on all its cores."""
    monkeypatch.setattr(threads, "_pinning", [False])
    choice, share = plan_threads([set(range(16))] * 2, 0, 16, groups=[[c] for c in range(16)])
    assert share == set(range(8)) and choice.self_bound and not choice.pinned and choice.pins == ()
    choice, _ = plan_threads([set(range(8))], 0, 8, groups=[[c] for c in range(8)])
    assert not choice.pinned and not threads.pin_calling_thread(choice)


def test_threads_pinned_one_core_each_where_the_cores_are_the_ranks():
    # bound by meshplan, hyperthread siblings: the calling thread on the first core, the pool
    # threads on the others, in onnxruntime's numbering (from 1)
    siblings = [[c, c + 8] for c in range(8)]
    choice, _ = plan_threads([set(range(16))] * 2, 1, 16, groups=siblings, pin=True)
    assert choice.pinned and choice.pins == ((4, 12), (5, 13), (6, 14), (7, 15))
    assert choice.pool_affinities() == "6,14;7,15;8,16"
    assert "4 onnxruntime thread(s), one core each" in choice.describe()
    # alone on the machine: one CPU a thread
    choice, _ = plan_threads([{2, 3, 5}], 0, 8, groups=[[c] for c in range(8)], pin=True)
    assert choice.pins == ((2,), (3,), (5,)) and choice.pool_affinities() == "4;6"
    # the launcher's binding stands: nothing pinned
    choice, _ = plan_threads([{0, 1, 2, 3}, {4, 5, 6, 7}], 0, 8, groups=[[c] for c in range(8)], pin=True)
    assert not choice.pinned
    assert ThreadChoice.from_row(choice.row()).pinned is False


def test_the_calling_thread_pinned_and_the_pool_where_onnxruntime_puts_it():
    """In a process of its own: a session made with the pool's affinities runs its pool
    thread on the second CPU, and the calling thread, pinned, on the first."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        cpus = cpus * 2     # one CPU: both on it
    code = f"""
import os, sys, numpy as np, onnx
from onnx import helper, TensorProto
from meshplan.runtime.threads import ThreadChoice, pin_calling_thread
from meshplan.runtime.sessions import StageSession
x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [4096])
y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [4096])
model = helper.make_model(helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g", [x], [y]),
                          opset_imports=[helper.make_opsetid("", 17)])
model.ir_version = 10
choice = ThreadChoice(2, True, 2, 1, False, False, True, (({cpus[0]},), ({cpus[1]},)))
before = {{t: os.sched_getaffinity(int(t)) for t in os.listdir("/proc/self/task")}}
session = StageSession(model.SerializeToString(), ["CPUExecutionProvider"], 2, affinities=choice.pool_affinities())
assert pin_calling_thread(choice)
session.run({{"x": np.ones(4096, np.float32)}})
made = {{t: sorted(os.sched_getaffinity(int(t))) for t in os.listdir("/proc/self/task") if t not in before}}
print(sorted(os.sched_getaffinity(0)), sorted(made.values()))
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=str(threads.__file__).rsplit("/meshplan/", 1)[0])
    assert done.returncode == 0, done.stderr
    main, pool = done.stdout.strip().split(" ", 1)
    assert main == f"[{cpus[0]}]"
    assert f"[{cpus[1]}]" in pool


def test_physical_cores_keep_hyperthread_siblings_together(tmp_path):
    # 8 logical CPUs, siblings (i, i + 4) as Linux numbers them; CPU 7's topology unreadable
    for cpu in range(7):
        topology = tmp_path / f"cpu{cpu}" / "topology"
        topology.mkdir(parents=True)
        (topology / "thread_siblings_list").write_text(f"{cpu % 4},{cpu % 4 + 4}\n")
    (tmp_path / "cpu0" / "topology" / "core_cpus_list").write_text("0,4\n")   # newer kernels' name first
    assert physical_cores(set(range(8)), str(tmp_path)) == [[0, 4], [1, 5], [2, 6], [3], [7]]
    # only some CPUs allowed: a core is what of it the rank may use
    assert physical_cores({1, 5, 2}, str(tmp_path)) == [[1, 5], [2]]
    assert threads._cpu_list("0-3,8-11") == {0, 1, 2, 3, 8, 9, 10, 11} and threads._cpu_list("5\n") == {5}


def test_physical_cores_of_this_machine_cover_its_cpus():
    cpus = os.sched_getaffinity(0)
    groups = physical_cores(cpus)
    assert sorted(c for g in groups for c in g) == sorted(cpus)
    assert all(len(g) >= 1 for g in groups)


def test_binding_holds_for_threads_made_afterwards():
    """A rank binds itself before onnxruntime makes its pool threads: they inherit it."""
    one = min(os.sched_getaffinity(0))
    code = ("import os, threading; from meshplan.runtime.threads import bind_to; "
            f"bind_to({{{one}}}); seen = []; t = threading.Thread(target=lambda: seen.append(os.sched_getaffinity(0))); "
            "t.start(); t.join(); print(sorted(os.sched_getaffinity(0)), sorted(seen[0]))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.split() == [f"[{one}]", f"[{one}]"]


def test_a_refused_binding_keeps_the_cores():
    before = os.sched_getaffinity(0)
    assert not threads.bind_to({100_000})          # no such CPU: the system refuses
    assert os.sched_getaffinity(0) == before
    # the job then takes the shared rule, as if binding were off
    choice, share = plan_threads([set(range(16))] * 2, 0, 16, groups=[[c] for c in range(16)], bind=False)
    assert share is None and (choice.threads, choice.spinning, choice.self_bound) == (8, False, False)


def test_doctor_reports_threads():
    done = run_cli("doctor", "--json")
    facts = json.loads(done.stdout)["ranks"]
    assert len(facts) == 1 and "onnxruntime thread(s)" in facts[0]["threads"] and facts[0]["cores"]


def mlp_on_1x2(tmp_path):
    """The sample MLP planned on 1x2 (both devices working) and an inputs file for it."""
    from meshplan.cost.cluster import make_cluster
    from meshplan.inter.pipeline import PlanOptions
    from meshplan.make_plan import make_plan
    from sample_models import SAMPLE_DIR, make_inputs
    import onnx
    from tests.conftest import save_npz

    model = SAMPLE_DIR / "mlp.onnx"
    dims = {"batch": 8}
    make_plan(model, make_cluster((1, 2), "cpu"), dims, tmp_path / "plan", PlanOptions(all_devices=True))
    return tmp_path / "plan", save_npz(tmp_path / "in.npz", make_inputs(onnx.load(str(model)), dims, seed=0))


@pytest.mark.mpi
def test_run_says_what_each_rank_got(tmp_path):
    plan, inputs = mlp_on_1x2(tmp_path)
    done = run_mpi(2, "run", plan, "--inputs", inputs, "--no-bind-cores")
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stdout.splitlines() if line.startswith("rank ")]
    assert len(lines) == 2 and all("spinning off (" in line and "shared by 2 working ranks" in line for line in lines), \
        done.stdout
    # by default the ranks (unbound by mpiexec) bind themselves where each gets two physical cores
    done = run_mpi(2, "run", plan, "--inputs", inputs)
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stdout.splitlines() if line.startswith("rank ")]
    expected = "bound by meshplan to" if len(physical_cores(os.sched_getaffinity(0))) >= 4 else "shared by 2 working ranks"
    assert len(lines) == 2 and all(expected in line for line in lines), done.stdout


@pytest.mark.mpi
def test_unbound_ranks_bind_themselves_in_a_job(tmp_path):
    """The job's own binding, on a topology of four physical cores per CPU here."""
    from tests.conftest import run_mpi_script

    plan, inputs = mlp_on_1x2(tmp_path)
    lines = run_mpi_script("bind_case.py", ranks=2, args=[plan, inputs])
    assert len(lines) == 3


def test_spinning_can_be_set_from_the_environment(monkeypatch):
    alone = [{0, 1, 2, 3}]                      # alone on its machine: spinning on by the rule
    own = [{0, 1, 2, 3}, {4, 5, 6, 7}]          # bound by the launcher, beside another rank: off
    assert plan_threads(alone, 0, 4, bind=False, pin=False)[0].spinning
    assert not plan_threads(own, 0, 8, bind=False, pin=False)[0].spinning
    monkeypatch.setenv(threads.SPINNING, "0")
    choice = plan_threads(alone, 0, 4, bind=False, pin=False)[0]
    assert not choice.spinning and choice.threads == 4
    monkeypatch.setenv(threads.SPINNING, "1")
    choice = plan_threads(own, 1, 8, bind=False, pin=False)[0]
    assert choice.spinning and choice.threads == 4 and choice.bound
    monkeypatch.setenv(threads.SPINNING, "maybe")   # anything else leaves the rule's choice
    assert not plan_threads(own, 0, 8, bind=False, pin=False)[0].spinning
    assert plan_threads(alone, 0, 4, bind=False, pin=False)[0].spinning


def test_a_rank_with_cores_of_its_own_spins_on_one_pool(monkeypatch):
    monkeypatch.delenv(threads.SPINNING, raising=False)
    monkeypatch.setattr(threads, "_own_process", [False])
    own = [{0, 1, 2, 3}, {4, 5, 6, 7}]
    bound, _ = plan_threads(own, 0, 8, bind=False, pin=False)
    assert bound.bound and not bound.spinning
    # one session: its own pool spins
    one = threads.one_pool(bound, 1)
    assert one.spinning and not one.shared_pool and one.threads == 4
    # several sessions in a process that is not the rank's: pools of their own, not spinning
    assert threads.one_pool(bound, 6) == bound
    # ... in the rank's own process (the commands'): the process's one pool, its threads unpinned
    monkeypatch.setattr(threads, "_own_process", [True])
    pinned = replace(bound, pinned=True, pins=tuple((c,) for c in range(4)))
    shared = threads.one_pool(pinned, 6)
    assert (shared.spinning, shared.shared_pool, shared.pinned, shared.pins) == (True, True, False, ())
    assert "one pool for all its sessions, spinning on" in shared.describe()
    assert ThreadChoice.from_row(shared.row()) == shared
    # alone on its machine: the same
    alone, _ = plan_threads([{0, 1, 2, 3}], 0, 4, bind=False, pin=False)
    assert threads.one_pool(alone, 3).shared_pool
    # shared cores, a single thread, or spinning set from the environment: as chosen
    crowded = choose_threads(2, cores={0, 1, 2, 3}, machine_cores=4, others=[{0, 1, 2, 3}])
    assert threads.one_pool(crowded, 6) == crowded and not crowded.spinning
    single = replace(bound, threads=1)
    assert threads.one_pool(single, 6) == single
    monkeypatch.setenv(threads.SPINNING, "0")
    assert threads.one_pool(bound, 6) == bound
    # a process that has a pool already (onnxruntime sizes it once): its sessions run on it
    held = threads.one_pool(crowded, 1, existing=8)
    assert (held.threads, held.spinning, held.shared_pool) == (8, True, True)


@pytest.mark.mpi
def test_a_job_shares_one_pool_between_its_segments(tmp_path):
    """A 1x2 tensor-parallel plan (its programs cut at their collectives into several
    sessions), in processes that are the ranks' own, on a topology of four cores per CPU."""
    from meshplan.cost.cluster import make_cluster
    from meshplan.inter.pipeline import PlanOptions
    from meshplan.make_plan import make_plan
    from sample_models import SAMPLE_DIR, make_inputs
    import onnx
    from tests.conftest import run_mpi_script, save_npz

    model, dims = SAMPLE_DIR / "mlp.onnx", {"batch": 8}
    make_plan(model, make_cluster((1, 2), "cpu"), dims, tmp_path / "plan", PlanOptions(policy="megatron", max_stages=1))
    inputs = save_npz(tmp_path / "in.npz", make_inputs(onnx.load(str(model)), dims, seed=0))
    lines = run_mpi_script("pool_case.py", ranks=2, args=[tmp_path / "plan", inputs])
    assert len(lines) == 5
