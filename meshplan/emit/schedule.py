"""Each rank's instruction list: the schedule of a plan's job, as data.

A plan's job is one interpreter of such lists (``runtime.interpreter``): what a rank does in
a call, in which order, for which microbatch, is written here once, next to the plan, and
the runtime only carries it out. An instruction is one of

- ``receive``: before a run, this rank's part of a cross-mesh resharding (``resharding``:
  its index in ``plan.reshardings``) or a whole tensor from an earlier stage (``transfer``:
  its index in ``plan.transfers``) for microbatch ``mb``;
- ``run``: the rank's program (its ``part``, ``forward``) on microbatch ``mb``, fed with what
  was received for it, the call's inputs its stage reads and the state it holds;
- ``send``: after the run, this rank's part of a resharding, or a whole tensor to a later
  stage's rank or, for a model output, to rank 0 (sent only when the call asks for it);
- ``keep``: a state output the run made, kept on this rank as the next call's ``state``
  input;
- ``output``: a model output rank 0 computed itself, taken as the call's result;
- ``collect``: on rank 0, a model output another rank sends (when the call asks for it).

The inference schedule (``forward_schedule``) is the microbatch pipeline: each rank takes
its microbatches in order, receiving, running and sending each before the next, and rank 0
collects the outputs at the end (the sends are posted without waiting, so a stage goes on
with its next microbatch while the next stage works on this one). Instructions that two
ranks share (a resharding's source and destination ranks, a transfer's two ends) come in
the same order on both, so the lists cannot wait on each other in a cycle
(``check_schedule``).

``schedule.json`` in the plan directory holds the lists and the checksum of the plan they
belong to; a plan directory from before the lists were written has its schedule built from
``plan.json`` when it is read (``read_schedule``).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from meshplan.errors import PlanError
from meshplan.files import atomic_write_bytes, read_json
from meshplan.plan_format import OUTPUT_COLLECTOR, PLAN_FILE, Plan

SCHEDULE_FILE = "schedule.json"
SCHEDULE_FORMAT = 1
KINDS = ("forward",)   # the schedules written: the forward-only pipeline of inference
OPS = ("receive", "run", "send", "keep", "output", "collect", "reduce")   # reduce: a pipelined training step's
FORWARD = "forward"


@dataclass(frozen=True)
class Instruction:
    op: str                          # one of OPS
    mb: int                          # the microbatch
    resharding: int | None = None    # receive/send: index in plan.reshardings
    transfer: int | None = None      # receive/send/output/collect: index in plan.transfers
    state: str | None = None         # keep: the state input the output becomes
    part: str | None = None          # run: the program's part (forward; a training step's phases)
    crossing: int | None = None      # receive/send in a pipelined training step (``emit.train_schedule``)

    def to_dict(self) -> dict:
        return {k: v for k, v in asdict(self).items() if v is not None}

    @classmethod
    def from_dict(cls, data: dict) -> "Instruction":
        if not isinstance(data, dict) or data.get("op") not in OPS or not isinstance(data.get("mb"), int):
            raise PlanError(f"{SCHEDULE_FILE} has a malformed instruction: {data!r}")
        try:
            return cls(**data)
        except TypeError:
            raise PlanError(f"{SCHEDULE_FILE} has a malformed instruction: {data!r}") from None

    def text(self, plan: Plan) -> str:
        """One line for a person (``meshplan show --schedule``)."""
        if self.op == "run":
            return f"run {self.part} mb {self.mb}"
        if self.crossing is not None:
            return f"{self.op} crossing {self.crossing} mb {self.mb}"
        if self.resharding is not None:
            r = plan.reshardings[self.resharding]
            where = f"from stage {r.src_stage}" if self.op == "receive" else f"to stage {r.dst_stage}"
            return f"{self.op} {r.tensor} mb {self.mb} {where} (resharding {self.resharding}: {r.src_spec} -> {r.dst_spec})"
        if self.transfer is not None:
            t = plan.transfers[self.transfer]
            if self.op in ("receive", "collect"):
                where = f"from rank {t.src_rank}"
            elif self.op == "output":
                where = "(rank 0's own)"
            else:
                where = "to rank 0 (a model output)" if t.dst_stage == OUTPUT_COLLECTOR else f"to rank {t.dst_rank}"
            return f"{self.op} {t.tensor} mb {self.mb} {where}"
        return f"keep {self.state} mb {self.mb}"


@dataclass
class Schedule:
    kind: str                                  # one of KINDS
    microbatches: int
    ranks: list[list[Instruction]]             # per rank (an idle rank's is empty)

    def to_dict(self, plan_checksum: str) -> dict:
        return {"format": SCHEDULE_FORMAT, "plan_checksum": plan_checksum, "kind": self.kind,
                "microbatches": self.microbatches,
                "ranks": [[i.to_dict() for i in rank] for rank in self.ranks]}


def forward_schedule(plan: Plan) -> Schedule:
    """The inference schedule of ``plan`` (see the module)."""
    ranks: list[list[Instruction]] = [[] for _ in range(plan.num_ranks)]
    B = plan.microbatches
    for stage in plan.stages:
        s = stage.index
        arriving = [i for i, r in enumerate(plan.reshardings) if r.dst_stage == s]
        leaving = [i for i, r in enumerate(plan.reshardings) if r.src_stage == s]
        kept = [e["input"] for e in plan.state if e["stage"] == s]
        for rank in stage.devices:
            whole = [i for i, t in enumerate(plan.transfers) if t.dst_rank == rank and t.dst_stage == s]
            sent = [i for i, t in enumerate(plan.transfers) if t.src_rank == rank and t.dst_rank != rank]
            own = [i for i, t in enumerate(plan.transfers)
                   if t.dst_stage == OUTPUT_COLLECTOR and t.src_rank == rank == t.dst_rank]
            out = ranks[rank]
            for mb in range(B):
                out += [Instruction("receive", mb, resharding=i) for i in arriving]
                out += [Instruction("receive", mb, transfer=i) for i in whole]
                out.append(Instruction("run", mb, part=FORWARD))
                out += [Instruction("send", mb, resharding=i) for i in leaving]
                out += [Instruction("keep", mb, state=name) for name in kept]
                out += [Instruction("send", mb, transfer=i) for i in sent]
                out += [Instruction("output", mb, transfer=i) for i in own]
    collected = [i for i, t in enumerate(plan.transfers) if t.dst_stage == OUTPUT_COLLECTOR and t.src_rank != 0]
    for mb in range(B):
        ranks[0] += [Instruction("collect", mb, transfer=i) for i in collected]
    return Schedule(FORWARD, B, ranks)


def check_schedule(plan: Plan, schedule: Schedule) -> None:
    """A schedule that fits ``plan`` and cannot deadlock: each rank's list holds what
    ``forward_schedule`` gives it, no more and no less, in an order of its own in which the
    rank runs its microbatches in turn, receives what a run needs before it and sends what
    the run made before the next one (a run's outputs are held until the next run); and
    the lists, each rank going on until it waits on a peer, all come to their end."""
    if schedule.microbatches != plan.microbatches or len(schedule.ranks) != plan.num_ranks:
        raise PlanError(f"{SCHEDULE_FILE} does not fit the plan (its microbatches or ranks differ)",
                        hint="re-run meshplan plan")
    whole = forward_schedule(plan)
    for rank, instructions in enumerate(schedule.ranks):
        stage = None if plan.is_idle(rank) else plan.stage_of_rank(rank)
        runs = [i.mb for i in instructions if i.op == "run"]
        if (stage is None and instructions) or (stage is not None and runs != list(range(plan.microbatches))):
            raise PlanError(f"{SCHEDULE_FILE}: rank {rank} does not run each microbatch once, in order",
                            hint="re-run meshplan plan")
        if sorted(instructions, key=_order) != sorted(whole.ranks[rank], key=_order):
            raise PlanError(f"{SCHEDULE_FILE}: rank {rank}'s list leaves out or repeats what the plan moves",
                            hint="re-run meshplan plan")
        ran = None    # the microbatch of the last run: what a send, keep or output acts on
        for item in instructions:
            if item.op == "run":
                ran = item.mb
            elif item.op in ("send", "keep", "output") and item.mb != ran \
                    or item.op == "receive" and ran is not None and item.mb <= ran:
                raise PlanError(f"{SCHEDULE_FILE}: rank {rank} acts on microbatch {item.mb} out of its run's order "
                                f"({item.to_dict()})", hint="re-run meshplan plan")
    _check_progress(plan, schedule)


def _order(item: Instruction) -> tuple:
    return tuple("" if v is None else str(v) for v in (item.op, item.mb, item.resharding, item.transfer, item.state))


def _check_progress(plan: Plan, schedule: Schedule) -> None:
    """Play the lists: a rank goes on while its next instruction can complete. A resharding
    completes on all its ranks together once each of them has reached it; a send of a whole
    tensor is posted without waiting, its receive completes once the send was posted. The
    lists deadlock where no rank can go on before all have ended."""
    position = [0] * len(schedule.ranks)
    posted: set[tuple[int, int]] = set()     # (transfer, mb) sent
    members = {i: set(plan.stages[r.src_stage].devices) | set(plan.stages[r.dst_stage].devices)
               for i, r in enumerate(plan.reshardings)}
    while True:
        moved = False
        for rank, instructions in enumerate(schedule.ranks):
            while position[rank] < len(instructions):
                item = instructions[position[rank]]
                if item.resharding is not None:
                    waiting = [m for m in members[item.resharding]
                               if position[m] >= len(schedule.ranks[m])
                               or schedule.ranks[m][position[m]] != _peer(item, m, plan)]
                    if waiting:
                        break
                    for m in members[item.resharding]:
                        position[m] += 1
                    moved = True
                    continue
                if item.op in ("receive", "collect") and (item.transfer, item.mb) not in posted:
                    break
                if item.op == "send" and item.transfer is not None:
                    posted.add((item.transfer, item.mb))
                position[rank] += 1
                moved = True
        if all(p == len(i) for p, i in zip(position, schedule.ranks)):
            return
        if not moved:
            stuck = next(r for r, i in enumerate(schedule.ranks) if position[r] < len(i))
            raise PlanError(f"{SCHEDULE_FILE} would deadlock: rank {stuck} waits at "
                            f"'{schedule.ranks[stuck][position[stuck]].text(plan)}'", hint="re-run meshplan plan")


def _peer(item: Instruction, rank: int, plan: Plan) -> Instruction:
    """The instruction a resharding's other member ``rank`` makes at the same point."""
    r = plan.reshardings[item.resharding]
    op = "send" if rank in plan.stages[r.src_stage].devices else "receive"
    return Instruction(op, item.mb, resharding=item.resharding)


def write_schedule(plan: Plan, directory: Path, schedule: Schedule | None = None) -> Path:
    """``schedule.json`` of ``plan`` (written after ``plan.json``, whose checksum it holds)."""
    schedule = schedule or forward_schedule(plan)
    check_schedule(plan, schedule)
    path = Path(directory) / SCHEDULE_FILE
    atomic_write_bytes(path, (json.dumps(schedule.to_dict(plan.to_dict()["checksum"])) + "\n").encode())
    return path


def read_schedule(plan: Plan, directory: Path) -> Schedule:
    """The schedule of the plan in ``directory``: its ``schedule.json``, which must belong to
    this ``plan.json``; built from the plan where the directory has none (an older plan)."""
    path = Path(directory) / SCHEDULE_FILE
    if not path.is_file():
        return forward_schedule(plan)
    schedule = read_lists(path, plan.to_dict()["checksum"], KINDS)
    check_schedule(plan, schedule)
    return schedule


def read_lists(path: Path, plan_checksum: str, kinds, microbatches: int | None = None) -> Schedule:
    """``schedule.json`` at ``path`` as written, not yet checked against its plan: it must be
    one of ``kinds`` (of ``microbatches``, where given) and belong to the plan.json whose
    checksum is ``plan_checksum``; else one ``PlanError``."""
    data = read_json(path, str(path), PlanError)
    if not isinstance(data, dict) or data.get("format") != SCHEDULE_FORMAT or data.get("kind") not in kinds \
            or not isinstance(data.get("ranks"), list) or not isinstance(data.get("microbatches"), int) \
            or microbatches not in (None, data["microbatches"]) \
            or not all(isinstance(rank, list) for rank in data["ranks"]):
        raise PlanError(f"{path} is not a schedule this meshplan reads for this plan", hint="re-run meshplan plan")
    if data.get("plan_checksum") != plan_checksum:
        raise PlanError(f"{path} belongs to another {PLAN_FILE}", hint="re-run meshplan plan")
    ranks = [[Instruction.from_dict(item) for item in rank] for rank in data["ranks"]]
    return Schedule(data["kind"], data["microbatches"], ranks)
