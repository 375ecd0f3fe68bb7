"""Each rank's instruction list (``emit.schedule``): written with the plan, checked when read
(it must hold what the plan moves, in an order that cannot deadlock), printed by ``meshplan
show --schedule``, and carried out as written by the runtime's interpreter."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from meshplan.cost.cluster import make_cluster
from meshplan.emit.schedule import SCHEDULE_FILE, Instruction, Schedule, forward_schedule, read_schedule
from meshplan.errors import PlanError
from meshplan.inter.pipeline import PlanOptions
from meshplan.make_plan import make_plan
from meshplan.plan_format import OUTPUT_COLLECTOR
from meshplan.runtime.buffers import HOST
from meshplan.runtime.interpreter import CallRecord, Interpreter
from sample_models import SAMPLES, make_inputs
from tests.conftest import check_against_onnxruntime, run_cli, save_npz
from tests.test_cli_errors import _one_error_line


@pytest.fixture(scope="module")
def two_stages(tmp_path_factory):
    """The MLP sample in two stages on 1x2, two microbatches: a resharding between the
    stages and the logits collected from rank 1."""
    plan_dir = tmp_path_factory.mktemp("schedule") / "plan"
    plan = make_plan(SAMPLES["mlp"].path, make_cluster((1, 2), "cpu"), dict(SAMPLES["mlp"].dims), plan_dir,
                     PlanOptions(microbatches=2, stages=2))
    assert len(plan.stages) == 2 and plan.reshardings
    return plan, plan_dir


def _copy(plan_dir, tmp_path):
    target = tmp_path / "plan"
    shutil.copytree(plan_dir, target)
    return target


def _rewrite(plan_dir, change) -> None:
    """schedule.json with ``change(ranks)`` applied to its lists (the checksum kept)."""
    path = plan_dir / SCHEDULE_FILE
    data = json.loads(path.read_text())
    change(data["ranks"])
    path.write_text(json.dumps(data))


def test_written_schedule_is_the_forward_pipeline(two_stages):
    plan, plan_dir = two_stages
    schedule = read_schedule(plan, plan_dir)
    assert schedule == forward_schedule(plan)
    B = plan.microbatches
    for rank, instructions in enumerate(schedule.ranks):
        stage = plan.stage_of_rank(rank)
        runs = [i for i, item in enumerate(instructions) if item.op == "run"]
        assert [instructions[i].mb for i in runs] == list(range(B))
        for item in instructions:   # each resharding's part on the stage's side of it
            if item.resharding is not None:
                r = plan.reshardings[item.resharding]
                assert stage.index == (r.dst_stage if item.op == "receive" else r.src_stage)
    # rank 0 collects every output rank 1 computes, once per microbatch, after its own runs
    collected = [(i.transfer, i.mb) for i in schedule.ranks[0] if i.op == "collect"]
    outputs = [k for k, t in enumerate(plan.transfers) if t.dst_stage == OUTPUT_COLLECTOR and t.src_rank != 0]
    assert sorted(collected) == sorted((k, mb) for k in outputs for mb in range(B)) and outputs


def test_show_schedule_prints_each_ranks_list(two_stages):
    plan, plan_dir = two_stages
    result = run_cli("show", plan_dir, "--schedule")
    assert result.returncode == 0, result.stderr
    text = result.stdout
    assert "schedule: forward, 2 microbatch(es), 2 rank(s) (schedule.json)" in text
    for rank in (0, 1):
        assert f"rank {rank} (stage {rank}):" in text
    tensor = plan.reshardings[0].tensor
    assert f"send {tensor} mb 1 to stage 1" in text and f"receive {tensor} mb 0 from stage 0" in text
    assert "run forward mb 1" in text and "collect " in text
    only = run_cli("show", plan_dir, "--schedule", "--stage", "1")
    assert "rank 1 (stage 1)" in only.stdout and "rank 0 (stage 0)" not in only.stdout


def _move_collect_first(ranks):
    collect = next(i for i, item in enumerate(ranks[0]) if item["op"] == "collect")
    ranks[0].insert(0, ranks[0].pop(collect))


@pytest.mark.parametrize("change,message", [
    (_move_collect_first, "would deadlock: rank 0 waits at 'collect"),
    (lambda ranks: ranks[1].pop(), "leaves out or repeats"),
    (lambda ranks: ranks[1].append(dict(ranks[1][-1])), "leaves out or repeats"),
    (lambda ranks: ranks[0].reverse(), "does not run each microbatch once, in order"),
    (lambda ranks: ranks[0].insert(0, ranks[0].pop(1)), "out of its run's order"),
    (lambda ranks: ranks[0].__setitem__(0, {"op": "jump", "mb": 0}), "malformed instruction"),
], ids=["deadlock", "missing", "repeated", "runs-reversed", "send-before-run", "unknown-op"])
def test_bad_schedule_is_one_error_line(two_stages, tmp_path, change, message):
    plan, plan_dir = two_stages
    copy = _copy(plan_dir, tmp_path)
    _rewrite(copy, change)
    with pytest.raises(PlanError, match=message.replace("(", r"\(").replace(")", r"\)")):
        read_schedule(plan, copy)
    _one_error_line(run_cli("show", copy, "--schedule"), message)
    # verify checks what a job of the plan would carry out
    inputs = save_npz(tmp_path / "in.npz", make_inputs("mlp", SAMPLES["mlp"].dims, seed=4))
    _one_error_line(run_cli("verify", copy, "--inputs", inputs), message)


def test_schedule_of_another_plan_is_refused(two_stages, tmp_path):
    plan, plan_dir = two_stages
    other = tmp_path / "other"
    make_plan(SAMPLES["mlp"].path, make_cluster((1, 2), "cpu"), dict(SAMPLES["mlp"].dims), other,
              PlanOptions(microbatches=4, stages=2))
    copy = _copy(plan_dir, tmp_path)
    shutil.copy(other / SCHEDULE_FILE, copy / SCHEDULE_FILE)
    _one_error_line(run_cli("show", copy, "--schedule"), "belongs to another plan.json")


@pytest.mark.mpi
def test_runtime_follows_the_written_order(two_stages, tmp_path):
    """A valid order of its own (rank 0 collects each microbatch's logits right after
    sending it on, not at the end) runs under mpiexec and gives onnxruntime's outputs; a plan
    directory without schedule.json (an older one) runs on the schedule built from plan.json."""
    plan, plan_dir = two_stages
    copy = _copy(plan_dir, tmp_path)

    def interleave(ranks):
        collects = [item for item in ranks[0] if item["op"] == "collect"]
        rest = [item for item in ranks[0] if item["op"] != "collect"]
        ranks[0][:] = []
        for item in rest:
            ranks[0].append(item)
            if item["op"] == "send":
                ranks[0].extend(c for c in collects if c["mb"] == item["mb"])

    _rewrite(copy, interleave)
    schedule = read_schedule(plan, copy)
    assert schedule != forward_schedule(plan)
    assert [i.op for i in schedule.ranks[0]][:3] == ["run", "send", "collect"]
    inputs = make_inputs("mlp", SAMPLES["mlp"].dims, seed=3)
    check_against_onnxruntime(plan, copy, inputs, tmp_path)
    (copy / SCHEDULE_FILE).unlink()
    assert "built from plan.json" in run_cli("show", copy, "--schedule").stdout
    (tmp_path / "old").mkdir()
    check_against_onnxruntime(plan, copy, inputs, tmp_path / "old")


class _Transport:
    """Records what the interpreter asks of it, in order."""

    def __init__(self, log):
        self.log = log

    def reshard(self, index, value):
        self.log.append(("reshard", index, value is not None))
        return None if value is not None else np.zeros((2, 2), np.float32)

    def recv_with_shape(self, ndim, dtype, source, shape_tag, tag):
        self.log.append(("recv", tag, source))
        return np.zeros((2,) * ndim, np.float32)

    def post_with_shape(self, array, dest, shape_tag, tag):
        self.log.append(("post", tag, dest))

    def finish_posted(self):
        self.log.append(("finish",))

    def collective(self, step, tensor):
        return tensor


class _Session:
    kept_on = None

    def __init__(self, log, outputs):
        self.log, self.outputs = log, outputs

    def run(self, feeds, collective, buffers, **options):
        self.log.append(("run",))
        return {name: np.ones((2, 2), np.float32) for name in self.outputs}


@pytest.mark.parametrize("rank", [0, 1])
def test_interpreter_carries_out_the_list_in_its_order(two_stages, rank):
    """Each instruction becomes its transport call or run, in the list's order, whatever the
    order is (here: rank 0's collects moved between its runs)."""
    plan, _ = two_stages
    schedule = forward_schedule(plan)
    if rank == 0:   # an order of its own
        collects = [i for i in schedule.ranks[0] if i.op == "collect"]
        rest = [i for i in schedule.ranks[0] if i.op != "collect"]
        schedule.ranks[0] = rest[:2] + collects[:1] + rest[2:] + collects[1:]
    stage = plan.stage_of_rank(rank)
    log: list = []
    wanted = {t.name: () for t in plan.outputs}
    interpreter = Interpreter(plan, rank, schedule, _Transport(log), _Session(log, stage.outputs), HOST,
                              CallRecord(), {}, {})
    micro = [{} for _ in range(plan.microbatches)]
    results = interpreter.run(micro, wanted, 0.0)
    expected = []
    for item in schedule.ranks[rank]:
        if item.op == "run":
            expected.append(("run",))
        elif item.resharding is not None:
            expected.append(("reshard", item.resharding, item.op == "send"))
        elif item.op in ("receive", "collect"):
            expected.append(("recv", item.transfer, plan.transfers[item.transfer].src_rank))
        elif item.op == "send":
            expected.append(("post", item.transfer, plan.transfers[item.transfer].dst_rank))
    assert log == expected + [("finish",)]
    if rank == 0:
        assert [sorted(r) for r in results] == [sorted(wanted)] * plan.microbatches


class _Links:
    """A pipelined step's links that record what the interpreter asks of them."""

    def __init__(self, log):
        self.log = log

    def post(self, crossing, mb, value):
        self.log.append(("post", crossing, value))

    def receive(self, crossing, mb):
        self.log.append(("receive", crossing, mb))
        return f"brought {crossing}"

    def summed(self, array):
        return array

    def finish(self):
        self.log.append(("finish",))


class _Stage:
    """A stage runner that records its runs and what it is given."""

    def __init__(self, log):
        self.log = log

    def run(self, part, mb, links):
        self.log.append(("run", part, mb))

    def take(self, crossing, mb):
        return f"made {crossing} {mb}"

    def give(self, crossing, mb, value):
        self.log.append(("give", crossing, mb, value))

    def reduce(self, links):
        self.log.append(("reduce", links.summed(1)))


@pytest.mark.parametrize("kind", ["1f1b", "gpipe"])
def test_interpreter_carries_out_a_training_step_in_its_order(kind):
    """A pipelined training list runs through the same interpreter: each run on the stage's
    runner, each send posted with what the runner gives up, each receive handed to it, the
    replicas' sum once, the posted sends finished at the end; every run and the sum timed."""
    ins = [Instruction("run", 0, part="forward"), Instruction("send", 0, crossing=0),
           Instruction("run", 1, part="forward"), Instruction("receive", 0, crossing=1),
           Instruction("run", 0, part="backward"), Instruction("send", 1, crossing=0),
           Instruction("receive", 1, crossing=1), Instruction("run", 1, part="backward"),
           Instruction("reduce", 1), Instruction("run", 1, part="update")]
    log: list = []
    record = CallRecord()
    interpreter = Interpreter(None, 1, Schedule(kind, 2, [[], ins]), _Links(log), _Stage(log), record=record)
    interpreter.step(0.0)
    assert log == [("run", "forward", 0), ("post", 0, "made 0 0"), ("run", "forward", 1), ("receive", 1, 0),
                   ("give", 1, 0, "brought 1"), ("run", "backward", 0), ("post", 0, "made 0 1"), ("receive", 1, 1),
                   ("give", 1, 1, "brought 1"), ("run", "backward", 1), ("reduce", 1), ("run", "update", 1),
                   ("finish",)]
    assert [(e[0], e[4]) for e in record.trace] == [("forward", 0), ("forward", 1), ("backward", 0),
                                                    ("backward", 1), ("reduce", 1), ("update", 1)]
    assert record.program_seconds == pytest.approx(sum(e[3] for e in record.trace))
    with pytest.raises(Exception, match="forward and training schedules"):
        Interpreter(None, 0, Schedule("zigzag", 2, [[]]), _Links(log), _Stage(log))


def test_instruction_round_trips_and_refuses_unknown_fields():
    item = Instruction("run", 3, part="forward")
    assert item.to_dict() == {"op": "run", "mb": 3, "part": "forward"}
    assert Instruction.from_dict(item.to_dict()) == item
    with pytest.raises(PlanError, match="malformed"):
        Instruction.from_dict({"op": "run", "mb": 0, "colour": "red"})
    assert Schedule("forward", 1, [[item]]).to_dict("x")["ranks"] == [[item.to_dict()]]
